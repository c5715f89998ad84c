"""A `streamrl up` supervisor's scaling loop over fake workers, for the local scale backend's tests:
the real `ScaleChannel` and `WorkerPool`s, ticking in a thread, with pool members that are real
child processes (a small HTTP worker that answers /ready and drains half a second on SIGTERM;
``stubborn`` never finishes its drain, ``crash`` exits at start)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import redis

from shared import keys as K
from shared.protocol import RunFile, write_run_file
from streamrl.redis_server import free_port
from streamrl.supervisor import Child
from streamrl.worker_pool import ScaleChannel, WorkerPool

WORKER = """
import signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

port, name, mode, marks = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
if mode == "crash":
    print("cannot load the model", flush=True)
    sys.exit(3)

class Ready(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", port), Ready)

def on_term(sig, frame):
    (marks / name).write_text("sigterm")
    if mode != "stubborn":  # a stubborn worker never finishes its drain
        threading.Thread(target=lambda: (time.sleep(0.5), server.shutdown())).start()

signal.signal(signal.SIGTERM, on_term)
server.serve_forever()
"""


class Rig:
    """A supervisor's scaling loop over fake workers, ticking in a thread like `streamrl up`."""

    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        modes: dict[int, str] | None = None,
        stop_timeout_s: float = 10.0,
        run_id: str | None = None,
    ):
        self.tmp, self.modes = tmp, modes or {}
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        (tmp / "marks").mkdir()
        self.run_id = run_id or f"scale-{uuid.uuid4().hex[:6]}"
        self.pool = WorkerPool("generator", self._child, stop_timeout_s=stop_timeout_s, ready_timeout_s=20.0)
        gateways = WorkerPool("gym-gateway", self._child, stop_timeout_s=stop_timeout_s, ready_timeout_s=20.0)
        for pool in (self.pool, gateways):
            pool.start_initial(1)
        self.channel = ScaleChannel(
            redis.Redis.from_url(redis_url), K.RunKeys(self.run_id), {"generator": self.pool, "gym-gateway": gateways}
        )
        write_run_file(tmp, RunFile(run_id=self.run_id, redis_url=redis_url, trainer_url="http://127.0.0.1:1"))
        self.stopped = threading.Event()
        self.turns = 0  # supervisor turns (`ScaleChannel.tick`) taken so far
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20  # `streamrl up` answers scale requests once its workers are up
        while self.channel._published is None or self.channel._published.phase != "done":
            assert time.monotonic() < deadline, "the initial workers did not come up"
            time.sleep(0.05)

    def _child(self, index: int) -> Child:
        port = free_port()
        mode = self.modes.get(index, "ok")
        args = [str(self.script), str(port), f"w{index}", mode, str(self.tmp / "marks")]
        return Child(f"w{index}", args, self.tmp / f"w{index}.log", port)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            self.channel.tick()
            self.turns += 1
            time.sleep(0.1)

    def wait_turns(self, n: int, timeout_s: float = 60.0) -> None:
        """Return once the supervisor has taken ``n`` more turns."""
        until = self.turns + n
        deadline = time.monotonic() + timeout_s
        while self.turns < until:
            assert time.monotonic() < deadline, f"the supervisor did not take {n} turns in {timeout_s:.0f}s"
            time.sleep(0.05)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        for pool in self.channel.pools.values():
            for c in pool.children():
                c.kill()

    def marked(self) -> set[str]:
        return {p.name for p in (self.tmp / "marks").iterdir()}
