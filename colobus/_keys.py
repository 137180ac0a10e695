"""Shared keys: ``colobus keygen PATH`` writes one, :func:`load_key` reads one."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ._errors import AuthenticationError

__all__ = ["KEY_ENV", "generate_key", "load_key", "write_key"]

KEY_ENV = "COLOBUS_KEY_FILE"
KEY_BYTES = 32


def generate_key() -> bytes:
    """A fresh random key."""
    return secrets.token_bytes(KEY_BYTES)


def write_key(path: str | os.PathLike[str], key: bytes | None = None) -> bytes:
    """Write ``key`` (default: a new one) as hex to ``path`` with mode 0600."""
    key = generate_key() if key is None else key
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.hex().encode() + b"\n")
    finally:
        os.close(fd)
    return key


def load_key(path: str | os.PathLike[str]) -> bytes:
    """Read a key file written by ``colobus keygen``.

    Raises:
        AuthenticationError: the file is not a colobus key.
        FileNotFoundError: there is no such file.
    """
    p = Path(path)
    text = p.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise AuthenticationError(
            f"{p} is not a colobus key file (expected hex); make one with `colobus keygen {p}`"
        ) from None
    if len(key) < 16:
        raise AuthenticationError(f"{p}: key too short ({len(key)} bytes; need 16 or more)")
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        import logging

        logging.getLogger("colobus.keys").warning(
            "key file %s is readable by others (mode %o); chmod 600 it", p, mode & 0o777)
    return key
