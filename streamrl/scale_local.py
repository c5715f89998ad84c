"""The ``local`` scale backend: asks a running ``streamrl up`` to change its worker counts.

    run.json (run id, Redis URL) -> read ScaleStatus (counts before) -> SET scale:request
    -> poll scale:status until the supervisor reports this request "done" (new workers answer
       /ready, removed ones drained and exited) or "failed", the run ends, or the deadline passes

The supervisor's end of the channel, and why it is a Redis key, is in `streamrl.worker_pool`.
The Redis URL: ``--redis-url``, else REDIS_URL, else run.json (which holds it without password).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import redis

from shared import keys as K
from shared.protocol import RUN_FILE, ProtocolError, ScaleRequest, ScaleStatus, decode, encode, read_run_file
from shared.redis_replies import as_bytes
from streamrl.scale import ScaleError, ScaleResult

POLL_S = 0.5


class LocalBackend:
    name = "local"

    def __init__(self, run_dir: Path, redis_url: str | None = None) -> None:
        run_file = Path(run_dir) / RUN_FILE
        if not run_file.is_file():
            raise ScaleError(f"no {run_file}: is `streamrl up` running with run.output_dir={run_dir}? (--run-dir)")
        try:
            run = read_run_file(run_file)
        except ProtocolError as exc:
            raise ScaleError(str(exc)) from None
        self.run_id = run.run_id
        self.keys = K.RunKeys(self.run_id)
        url = redis_url or os.environ.get("REDIS_URL") or run.redis_url
        self.redis = redis.Redis.from_url(url, socket_timeout=10.0)

    def status(self) -> ScaleStatus:
        try:
            raw = self.redis.get(self.keys.scale_status)
        except redis.RedisError as exc:
            raise ScaleError(f"cannot read the run's Redis ({exc}); set REDIS_URL or --redis-url") from exc
        if raw is None:
            raise ScaleError(
                f"run {self.run_id!r} has no supervisor answering scale requests (is `streamrl up` running?)"
            )
        try:
            return decode(as_bytes(raw), ScaleStatus)
        except ProtocolError as exc:
            raise ScaleError(f"unreadable scale status of run {self.run_id!r}: {exc}") from exc

    def counts(self) -> dict[str, int]:
        return dict(self.status().ready)

    def request(self, targets: dict[str, int]) -> str:
        request_id = uuid.uuid4().hex[:12]
        self.redis.set(self.keys.scale_request, encode(ScaleRequest(request_id=request_id, targets=dict(targets))))
        return request_id

    def scale(self, targets: dict[str, int], timeout_s: float) -> ScaleResult:
        before = self.counts()
        request_id = self.request(targets)
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if st.request_id == request_id and st.phase == "done":
                return ScaleResult(before, dict(st.ready))
            if st.request_id == request_id and st.phase == "failed":
                raise ScaleError(f"scaling failed: {st.error}")
            if self.redis.exists(self.keys.stop):
                raise ScaleError(f"run {self.run_id!r} ended before scaling finished")
            if time.monotonic() > deadline:
                raise ScaleError(
                    f"not done within {timeout_s:.0f}s: ready {st.ready}, starting {st.starting}, "
                    f"stopping {st.stopping} "
                    "(the supervisor keeps going; check again with `streamrl scale --show`)"
                )
            time.sleep(POLL_S)
