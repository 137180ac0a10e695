"""Keys on disk: ``colobus keygen PATH`` writes one, :func:`load_key` reads one.

Key files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (an
existing file or a symlink at the path is never written through), and refused
when the group or others may read them. MAC keys are at least
:data:`MIN_KEY_BYTES` long wherever one enters colobus. CurveZMQ secret keys
are read from files only, never from a value that could sit on a command line.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import secrets
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import AuthenticationError

if TYPE_CHECKING:
    import zmq

__all__ = [
    "announce_private_key", "curve_server_config",
    "KEY_ENV", "MIN_KEY_BYTES", "RELAY_KEY_ENV", "check_key", "generate_key", "key_file_of",
    "key_id",
    "load_curve_allow", "load_curve_keypair", "load_curve_public", "load_key", "note_key_file",
    "catch_sigterm", "is_private_key_file", "parse_key_text", "remove_private_key",
    "start_curve_server", "write_curve_keypair", "write_key", "write_private_key",
]

KEY_ENV = "COLOBUS_KEY_FILE"
RELAY_KEY_ENV = "COLOBUS_RELAY_KEY_FILE"  # `colobus relay`'s relay key (Controller(relay_key=))
KEY_BYTES = 32
MIN_KEY_BYTES = 32


def generate_key() -> bytes:
    """A fresh random key."""
    return secrets.token_bytes(KEY_BYTES)


def check_key(key: bytes, source: str) -> bytes:
    """``key`` if it is long enough to be a MAC key.

    Raises:
        AuthenticationError: shorter than :data:`MIN_KEY_BYTES` (naming its length).
    """
    if not isinstance(key, bytes | bytearray):
        raise AuthenticationError(f"{source}: a key is bytes, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise AuthenticationError(
            f"{source}: the key is {len(key)} bytes; colobus keys must be at least "
            f"{MIN_KEY_BYTES} bytes (make one with `colobus keygen PATH`)")
    return bytes(key)


def _create_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a new file: never over an existing one, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


def write_key(path: str | os.PathLike[str], key: bytes | None = None) -> bytes:
    """Write ``key`` (default: a new one) as hex to a new file ``path``, mode 0600.

    Raises:
        FileExistsError: something (a file, a symlink) is already at ``path``.
        AuthenticationError: ``key`` is too short.
    """
    key = generate_key() if key is None else check_key(key, "write_key")
    _create_private(Path(path), key.hex().encode() + b"\n")
    return key


_key_files: dict[bytes, str] = {}  # key -> the file load_key read it from


def key_file_of(key: bytes) -> str | None:
    """The file :func:`load_key` read ``key`` from (for messages), if it did."""
    return _key_files.get(key)


def note_key_file(key: bytes, path: str) -> None:
    """Remember that ``key`` is in ``path`` (a file colobus wrote), for messages."""
    _key_files[key] = path


def key_id(key: bytes) -> str:
    """A short name for ``key`` that can be shown and compared, never reversed.

    Both sides log it, so a worker and a driver can tell whether they hold the
    same key without showing it: the first 8 hex digits of a SHA-256 of the key.
    """
    if not key:
        return "none"
    return hashlib.sha256(b"colobus key id\0" + key).hexdigest()[:8]


def _make_one(path: Path) -> str:
    """How to make the key file ``path`` that is missing."""
    if str(path).startswith("/run/secrets/"):  # inside a container: a secret not given
        return ("the key reaches containers as a secret: run `colobus keygen colobus.key` "
                "beside docker-compose.yml (see docs/containers.md)")
    return f"make one with `colobus keygen {path}`"


def parse_key_text(text: str, source: str) -> bytes:
    """A key from its hex text (a key file's content, or stdin for ``--key-file -``)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise AuthenticationError(
            f"{source} is not a colobus key (expected hex); make one with "
            "`colobus keygen PATH`") from None
    return check_key(key, source)


def load_key(path: str | os.PathLike[str]) -> bytes:
    """Read a key file written by ``colobus keygen``.

    Raises:
        AuthenticationError: the file is not a colobus key, its key is shorter
            than 32 bytes, or the group or others may read it.
        OSError: the file cannot be read (``FileNotFoundError``: there is no
            such file); the message says how to make one.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError as exc:
        raise type(exc)(f"cannot read key file {p} ({exc.strerror}); {_make_one(p)}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(f"key file {p} is a directory; {_make_one(p)}")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthenticationError(
                f"key file {p} can be read by others (mode {mode & 0o777:o}); "
                f"run `chmod 600 {p}`")
        with os.fdopen(os.dup(fd), "r") as f:
            text = f.read(1 << 16)
    finally:
        os.close(fd)
    key = parse_key_text(text, str(p))
    _key_files[key] = str(p)
    return key


# The key files controllers made for themselves (write_private_key), removed when they
# close, at interpreter exit, and on SIGTERM: a driver stopped with `kill` (a batch
# system's, a service manager's) leaves no copy of a key behind.
_private_files: set[str] = set()
_private_lock = threading.RLock()  # (re-entered by the SIGTERM handler on the main thread)
_armed: list[bool] = [False]


def write_private_key(key: bytes) -> Path:
    """Write ``key`` to a new file in a fresh private (0700) directory; its path.

    The file goes with :func:`remove_private_key`, at interpreter exit, or on SIGTERM
    (where SIGTERM still has its default action, which then follows: the process ends
    as it would have).
    """
    directory = Path(tempfile.mkdtemp(prefix="colobus-key-"))
    path = directory / "key"
    write_key(path, key)
    with _private_lock:
        _private_files.add(str(path))
        arm = not _armed[0]
        _armed[0] = True
    if arm:
        atexit.register(_remove_private_files)
    catch_sigterm()  # (a controller on a loop thread of its own armed it as it was made)
    return path


def announce_private_key(key: bytes, address: str) -> str:
    """A controller's generated ``key`` written (:func:`write_private_key`), noted for
    messages, and the command that joins a standalone worker logged; the file's path."""
    path = str(write_private_key(key))
    note_key_file(key, path)
    log.info("no key given: wrote a fresh key to %s (removed when this controller "
             "closes); standalone workers join with `colobus worker --connect %s "
             "--key-file %s`", path, address, path)
    return path


def is_private_key_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a key file a controller made for itself (removed as it closes)."""
    return os.fspath(path) in _private_files


def remove_private_key(path: str | os.PathLike[str]) -> None:
    """Remove a file made by :func:`write_private_key`, and its directory."""
    p = Path(path)
    with _private_lock:
        _private_files.discard(str(p))
    try:
        p.unlink()
        p.parent.rmdir()
    except OSError:
        pass


def _remove_private_files() -> None:
    for path in list(_private_files):
        remove_private_key(path)


def catch_sigterm() -> None:
    """Remove the private key files on SIGTERM, then let SIGTERM do what it would have.

    Only where SIGTERM has its default action (a handler of the program's own runs
    instead, and its exit runs the atexit removal) and only from the main thread
    (where Python sets handlers; a driver's `with` or `async with` runs there).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        return


def _on_sigterm(signum: int, frame: Any) -> None:
    _remove_private_files()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the default action: the process ends by SIGTERM


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
    _create_private(p, _CURVE_SECRET_TEMPLATE.format(
        pub_name=pub.name, public=public.decode(), secret=secret.decode()).encode())
    _create_private(pub, _CURVE_PUBLIC_TEMPLATE.format(public=public.decode()).encode(), 0o644)
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


def load_curve_keypair(source: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` (Z85) from a secret key file (``colobus keygen --curve PATH``).

    Secrets come from files only: a value that could be a key itself is never
    accepted (it would sit on command lines and in logs), nor echoed in errors.

    Raises:
        AuthenticationError: not a readable, private CurveZMQ secret key file.
    """
    import zmq.auth

    if not isinstance(source, str | os.PathLike):
        raise AuthenticationError(
            "CurveZMQ secret keys are read from files only: give the path of a secret key "
            "file from `colobus keygen --curve PATH`")
    p = Path(source)
    if not p.is_file():
        raise AuthenticationError(
            "no CurveZMQ secret key file at the path given (secret keys are read from files "
            "only; make one with `colobus keygen --curve PATH`)")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise AuthenticationError(f"{p}: not a CurveZMQ key file ({exc})") from None
    if secret is None:
        raise AuthenticationError(
            f"{p} holds only a public key; give the secret key file "
            f"(`colobus keygen --curve {p}` writes both)")
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthenticationError(
            f"CurveZMQ secret key file {p} can be read by others (mode {mode & 0o777:o}); "
            f"run `chmod 600 {p}`")
    return public, secret


def parse_curve_secret_text(text: str, source: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` (Z85) from a Z85 secret key's text (a launcher writes it to a
    worker's stdin for ``--curve-key-file -``; never a command line).

    Raises:
        AuthenticationError: not a Z85 CurveZMQ secret key (the text is not echoed).
    """
    import zmq

    secret = _z85_key(text.strip())
    if secret is None:
        raise AuthenticationError(f"{source} is not a Z85 CurveZMQ secret key")
    return zmq.curve_public(secret), secret


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
                "the CurveZMQ public key given is neither a key file nor a Z85 public key")
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


# CurveZMQ on the controller's socket: the server key pair and the client allow-list.
log = logging.getLogger("colobus.controller")


class _CurveAllowList:
    """ZAP credentials provider: a CurveZMQ client key must be on the list."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.allowed
        if not ok and key not in self.refused and len(self.refused) < 1024:
            self.refused.add(key)  # it retries: log each key once
            log.warning("refused a CurveZMQ client with key %s (not in curve_allow)",
                        key.decode(errors="replace"))
        return ok


def start_curve_server(ctx: zmq.Context[Any], sock: zmq.Socket[Any], public: bytes,
                       secret: bytes, allowed: set[bytes] | None) -> Any:
    """Make ``sock`` a CurveZMQ server; a ZAP thread checks the allow-list.

    Returns the authenticator, to ``stop()`` when the socket closes.
    """
    import zmq
    from zmq.auth import CURVE_ALLOW_ANY
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("colobus.auth"))
    auth.start()
    if allowed is None:
        auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
    else:
        auth.configure_curve_callback(domain="*", credentials_provider=_CurveAllowList(allowed))
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    log.info("CurveZMQ on: server key %s, %s", public.decode(),
             "any client key" if allowed is None else f"{len(allowed)} allowed client keys")
    return auth


def curve_server_config(secret_key: str | os.PathLike[str] | None, public_key: bytes | None,
                        allow: Iterable[bytes | str | os.PathLike[str]] | None
                        ) -> tuple[tuple[bytes, bytes] | None, set[bytes] | None]:
    """A controller's CurveZMQ set-up from its options: ``((public, secret), allowed)``.

    Raises:
        ValueError: ``allow`` without ``secret_key``.
        AuthenticationError: a key file is not valid.
    """
    if secret_key is None:
        if allow is not None:
            raise ValueError("curve_allow needs curve_secret_key (the server's key pair)")
        return None, None
    public, secret = load_curve_keypair(secret_key)
    return (public_key or public, secret), (load_curve_allow(allow) if allow is not None else None)
