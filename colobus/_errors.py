"""The colobus exception tree.

::

    ColobusError
    ├── NoControllerError       no default controller is running
    ├── ControllerClosedError   the controller was closed (by you)
    │   └── (ClusterClosedError: both of the above: no controller is running because the one
    │        the code used was closed; not public, catch either base)
    ├── HostLostError           a host went silent or died (the peer)
    ├── RemoteError             a host raised an exception whose type cannot be rebuilt here
    ├── SerializationError      code or arguments cannot be pickled; nothing was sent
    ├── ProtocolError           a peer speaks another protocol version or broke the protocol
    └── AuthenticationError     a key does not match

JAX-compatible misuse errors are plain ``ValueError`` with JAX's texts, and
timeouts raise the built-in ``TimeoutError``.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ClusterClosedError",
    "ColobusError",
    "ControllerClosedError",
    "HostLostError",
    "NoControllerError",
    "ProtocolError",
    "RemoteError",
    "SerializationError",
]


class ColobusError(Exception):
    """Base class of every error colobus raises itself."""


class NoControllerError(ColobusError):
    """Raised when an operation needs the default controller and none is running."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "No colobus controller is running. Start one with `with cb.local_cluster(hosts=2):`"
            " (or `async with`), `cb.init(hosts=2)`, or `cb.Controller(bind=..., hosts=N)`."
        )


class ControllerClosedError(ColobusError):
    """Raised when the controller was closed before or during an operation."""


class ClusterClosedError(NoControllerError, ControllerClosedError):
    """No controller is running because the one in use was closed (its ``with`` ended).

    A call made then is both: there is no default controller (SPEC: a call without one
    raises ``NoControllerError``), and the cluster its code, objects and arrays used was
    closed (``ControllerClosedError``). Its message leads with the second, which is the
    mistake to fix.
    """

    def __init__(self, closed: str) -> None:
        ColobusError.__init__(
            self,
            f"The colobus cluster in use here, {closed}, was closed (its `with` block ended, "
            "or cb.shutdown() ran): colocated functions and objects run, and cb.Arrays live, "
            "only while their cluster runs. Call them inside the `with` block, or start a "
            "new cluster (`with cb.local_cluster(hosts=2):`, `cb.init(hosts=2)`, "
            "`cb.Controller(bind=..., hosts=N)`) and put the arrays on it again.")


class HostLostError(ColobusError):
    """Raised when a host that an operation needs was declared lost."""

    def __init__(self, message: str, host: int | None = None) -> None:
        super().__init__(message)
        self.host = host

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.host))


class RemoteError(ColobusError):
    """An exception raised on a host whose type cannot be rebuilt here (never unpickled).

    Attributes:
        type_name: qualified name of the remote exception type.
        remote_traceback: the formatted traceback from the host.
        host: the host index it was raised on.
    """

    def __init__(
        self, type_name: str, message: str, remote_traceback: str = "", host: int | None = None
    ) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        self.host = host

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.type_name, self.message, self.remote_traceback, self.host))


class SerializationError(ColobusError):
    """Raised when a function or an argument cannot be pickled; nothing was sent."""


class ProtocolError(ColobusError):
    """Raised when a peer speaks another protocol version or breaks the protocol."""


class AuthenticationError(ColobusError):
    """Raised when a key does not authenticate a peer."""
