"""Shared keys: ``colobus keygen PATH`` writes one, :func:`load_key` reads one."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from ._errors import AuthenticationError

__all__ = [
    "KEY_ENV",
    "generate_key",
    "load_curve_allow",
    "load_curve_keypair",
    "load_curve_public",
    "load_key",
    "write_curve_keypair",
    "write_key",
]

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


# -- CurveZMQ key pairs (optional encryption) ------------------------------------------

CURVE_PUBLIC_SUFFIX = ".pub"

_CURVE_SECRET_TEMPLATE = """\
#   colobus CurveZMQ SECRET key pair: keep it private (mode 0600).
#   Its public half is in {pub_name}; give that file to the other side.
curve
    public-key = "{public}"
    secret-key = "{secret}"
"""

_CURVE_PUBLIC_TEMPLATE = """\
#   colobus CurveZMQ public key: safe to share.
curve
    public-key = "{public}"
"""


def write_curve_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """Write a new CurveZMQ key pair: ``path`` (secret, mode 0600), ``path.pub`` (public).

    Both files use ZeroMQ's certificate format (``zmq.auth.load_certificate``
    reads them). Returns ``(public, secret)``, Z85-encoded.
    """
    import zmq

    public, secret = zmq.curve_keypair()
    p = Path(path)
    pub = Path(str(p) + CURVE_PUBLIC_SUFFIX)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, _CURVE_SECRET_TEMPLATE.format(
            pub_name=pub.name, public=public.decode(), secret=secret.decode()).encode())
    finally:
        os.close(fd)
    pub.write_text(_CURVE_PUBLIC_TEMPLATE.format(public=public.decode()))
    return public, secret


def _z85_key(value: bytes | str) -> bytes | None:
    """``value`` as a Z85 key (40 characters), if it is one (or a raw 32-byte key)."""
    from zmq.utils import z85

    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) == 40:
        try:
            if len(z85.decode(raw)) == 32:
                return raw
        except Exception:
            return None
    if len(raw) == 32 and isinstance(value, bytes):
        return z85.encode(raw)
    return None


def load_curve_keypair(source: bytes | str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` (Z85) from a secret key file or a Z85 / raw secret key.

    Raises:
        AuthenticationError: not a CurveZMQ secret key.
    """
    import zmq
    import zmq.auth

    if isinstance(source, bytes) or (isinstance(source, str) and not os.path.exists(source)):
        secret = _z85_key(source)
        if secret is None:
            raise AuthenticationError(
                f"{source!r:.60} is neither a CurveZMQ secret key file nor a Z85 key")
        return zmq.curve_public(secret), secret
    p = Path(source)
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise AuthenticationError(f"{p}: not a CurveZMQ key file ({exc})") from None
    if secret is None:
        raise AuthenticationError(
            f"{p} holds only a public key; give the secret key file "
            f"(`colobus keygen --curve {p}` writes both)")
    if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        import logging

        logging.getLogger("colobus.keys").warning(
            "CurveZMQ secret key file %s is readable by others; chmod 600 it", p)
    return public, secret


def load_curve_public(source: bytes | str | os.PathLike[str]) -> bytes:
    """A Z85 public key from a key file (public or secret) or a Z85 / raw key.

    Raises:
        AuthenticationError: not a CurveZMQ key.
    """
    import zmq.auth

    if isinstance(source, bytes) or (isinstance(source, str) and not os.path.exists(source)):
        key = _z85_key(source)
        if key is None:
            raise AuthenticationError(
                f"{source!r:.60} is neither a CurveZMQ key file nor a Z85 public key")
        return key
    p = Path(source)
    try:
        public, _ = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise AuthenticationError(f"{p}: not a CurveZMQ key file ({exc})") from None
    return public


def load_curve_allow(entries: Iterable[bytes | str | os.PathLike[str]]) -> set[bytes]:
    """Z85 public keys from keys, key files and directories of ``*.pub``/``*.key`` files."""
    keys: set[bytes] = set()
    for entry in entries:
        if not isinstance(entry, bytes) and os.path.isdir(entry):
            for f in sorted(Path(entry).iterdir()):
                if f.suffix in (CURVE_PUBLIC_SUFFIX, ".key"):
                    keys.add(load_curve_public(f))
        else:
            keys.add(load_curve_public(entry))
    return keys
