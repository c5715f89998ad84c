"""Hosts simulated on one machine: network namespaces on a bridge, for the multi-host tests and
the multi-host benchmark.

    switch namespace: bridge br0 --- veth --- host namespace "h0": eth0 10.77.0.1/24, hostname h0
                                  \\-- veth --- host namespace "h1": eth0 10.77.0.2/24, hostname h1 ...

Every host has its own loopback, address and (per process, through a UTS namespace) hostname, and
an /etc/hosts naming every host (``ip netns exec`` mounts /etc/netns/NS/hosts over it). The bridge
lives in a namespace of its own, so no address or route of the machine's own network changes:
traffic stays between the simulated hosts. The file system is shared, as a cluster's shared
storage is. A host's processes are the processes in its namespace (``ip netns pids``), so a host
can be killed whole; its link can be cut and restored, and shaped (a rate on both directions, by a
token bucket; a one-way delay too where the kernel has netem).

Needs root (``ip netns``). `SimCluster` is a context manager: leaving it kills every process of
every host and deletes the namespaces and their /etc/netns entries.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no ``ip``)."""


def available() -> str | None:
    """None when simulated hosts can be made here; otherwise why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, util-linux)"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise HostsUnavailable(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@dataclass
class Host:
    name: str
    ns: str
    address: str
    port: str  # the bridge's end of this host's link, in the switch namespace
    switch: str

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run on this host: in its network namespace, under its hostname."""
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", script, self.name, *cmd]

    def popen(
        self, cmd: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` on this host, its output appended to ``log`` (else discarded)."""
        out: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = open(log, "ab")
        try:
            return subprocess.Popen(
                self.argv(cmd),
                env={**os.environ, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()

    def run(self, cmd: Sequence[str], *, timeout_s: float = 60.0, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout_s, **kw)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread inside this host's network namespace: the sockets it opens are this
        host's (names still resolve as the calling process's do: use addresses)."""
        result: list[Any] = []

        def inside() -> None:
            try:
                with open(f"/run/netns/{self.ns}") as f:
                    if _libc().setns(f.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.ns}")
                result.append((True, fn()))
            except BaseException as exc:  # re-raised on the caller's thread
                result.append((False, exc))

        thread = threading.Thread(target=inside, name=f"in-{self.name}")
        thread.start()
        thread.join()
        ok, value = result[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def pids(self) -> list[int]:
        proc = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, timeout=30)
        return [int(p) for p in proc.stdout.split()]

    def kill_all(self) -> int:
        """SIGKILL every process of this host at once (the host lost power); how many there were."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def link(self, up: bool) -> None:
        """Cut (``up=False``) or restore this host's only link."""
        _ip("-n", self.switch, "link", "set", self.port, "up" if up else "down")

    def shape(self, rate_mbit: float, delay_ms: float = 0.0) -> None:
        """``rate_mbit`` (a token bucket) on both directions of this host's link, and ``delay_ms`` one
        way when the kernel has netem (HostsUnavailable when a delay is asked for and it has not)."""
        burst = max(int(rate_mbit * 1e6 / 8 / 100), 64 * 1024)  # 10 ms of the rate, at least 64 KiB
        if delay_ms > 0:
            qdisc = ["netem", "rate", f"{rate_mbit}mbit", "delay", f"{delay_ms}ms", "limit", "100000"]
        else:
            qdisc = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        for ns, dev in ((self.ns, "eth0"), (self.switch, self.port)):
            proc = subprocess.run(
                ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *qdisc], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise HostsUnavailable(f"tc {qdisc[0]} on {self.name}'s link: {proc.stderr.strip()}")


class SimCluster:
    """``names`` as hosts on one bridge; ``SimCluster(["h0", "h1"])["h1"].popen([...])``."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not 0 < len(names) < 250:
            raise ValueError(f"host names must be distinct, 1 to 249 of them: {names}")
        why = available()
        if why is not None:
            raise HostsUnavailable(why)
        tag = uuid.uuid4().hex[:5]  # interface names are at most 15 characters
        self.switch = f"sr{tag}-sw"
        self.hosts = {
            name: Host(name, f"sr{tag}-{i}", f"{SUBNET}.{i + 1}", f"sr{tag}p{i}", self.switch)
            for i, name in enumerate(names)
        }
        self._made: list[str] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> SimCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{h.address} {h.name}" for h in self.hosts.values()]
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for h in self.hosts.values():
            _ip("netns", "add", h.ns)
            self._made.append(h.ns)
            etc = Path("/etc/netns") / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.hosts_file())
            _ip("link", "add", h.port, "type", "veth", "peer", "name", f"{h.port}e")
            _ip("link", "set", h.port, "netns", self.switch)
            _ip("link", "set", f"{h.port}e", "netns", h.ns)
            _ip("-n", h.ns, "link", "set", f"{h.port}e", "name", "eth0")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", h.port, "master", "br0")
            _ip("-n", self.switch, "link", "set", h.port, "up")

    def stop(self) -> None:
        for h in self.hosts.values():
            if h.ns in self._made:
                h.kill_all()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(h.pids() for h in self.hosts.values() if h.ns in self._made):
            time.sleep(0.1)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._made.clear()
