"""Loopback ports a test keeps taken until it needs them.

``free_port()`` only names a port that was free a moment ago: a server started later in the same
test (the gateway, a helper app) may be handed the same port, and a "dead" URL then answers, or a
helper app finds its port in use. A socket bound but never listening keeps the port taken, and the
kernel refuses every connection to it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable, Iterator


def _bound(host: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    return s


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port nothing else gets and that refuses connections while the block runs."""
    with _bound(host) as s:
        yield s.getsockname()[1]


class HeldPorts:
    """Ports for servers a test starts later: each stays taken until ``release`` hands it over."""

    def __init__(self, names: Iterable[str], host: str = "127.0.0.1") -> None:
        self._sockets = {name: _bound(host) for name in names}
        self.ports = {name: s.getsockname()[1] for name, s in self._sockets.items()}

    def release(self, name: str) -> int:
        """Free the port just before its server binds it."""
        self._sockets.pop(name).close()
        return self.ports[name]

    def close(self) -> None:
        for s in self._sockets.values():
            s.close()
        self._sockets.clear()
