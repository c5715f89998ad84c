"""The address a process is reached at by the other hosts of a run, and reaching theirs.

Every service of a run finds its peers through their registry entries, so the one address a
service must get right is its own. `advertise_address`: STREAMRL_ADVERTISE when set (``streamrl
join --advertise``), else the address of this host's interface that routes to the run's Redis (a
run whose Redis is on loopback is a one-host run: loopback is right), else the address this
host's name resolves to.
`reach` is the start-up check of an address a role needs (Redis, the trainer's rendezvous): it
fails within its deadline naming the address and the host it was tried from.
"""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlsplit

ADVERTISE_ENV = "STREAMRL_ADVERTISE"


class Unreachable(RuntimeError):
    """An address a role needs did not answer within its deadline."""


def this_host() -> str:
    """This host's name, for messages."""
    return socket.gethostname()


def host_port(url: str, default_port: int = 6379) -> tuple[str, int]:
    """(host, port) of a URL such as ``redis://:pw@10.0.0.1:6379/0``, or of ``HOST:PORT``."""
    parts = urlsplit(url if "://" in url else f"//{url}")
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host")
    return parts.hostname, parts.port or default_port


def route_address(host: str, port: int) -> str:
    """The local address of the interface the kernel routes to ``host`` through (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    infos = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        address: str = s.getsockname()[0]
        return address


def _own_address() -> str:
    """The address this host's name resolves to (loopback when it does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertise_address(redis_url: str | None = None) -> str:
    """The address this process's services are reached at (see the module's docstring)."""
    given = os.environ.get(ADVERTISE_ENV, "").strip()
    if given:
        return given
    url = redis_url or os.environ.get("REDIS_URL")
    if url:
        try:
            return route_address(*host_port(url))
        except (OSError, ValueError):
            pass
    return _own_address()


def reach(host: str, port: int, *, what: str, deadline_s: float) -> None:
    """Until a TCP connection to ``host:port`` opens; `Unreachable`, naming the address and this
    host, when none has within ``deadline_s``."""
    end = time.monotonic() + deadline_s
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.5, end - time.monotonic()))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= end:
            break
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
    raise Unreachable(f"cannot reach {what} at {host}:{port} from host {this_host()} within {deadline_s:.0f}s: {last}")
