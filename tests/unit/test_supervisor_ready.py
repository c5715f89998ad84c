"""`streamrl up` waits for each service's /ready, but not for one that reports it has failed: a
generator whose first weights cannot load answers ``"state": "failed"`` and would never become
ready, so the job stops at once with its error instead of after the start-up timeout. An answer
that is no readiness report at all (`shared.admin_api.Readiness`) stops it too, naming the service."""

from __future__ import annotations

import time

import pytest

from streamrl.redis_server import free_port
from streamrl.supervisor import Child, JobFailed, wait_ready

pytestmark = pytest.mark.unit

SERVER = """
import http.server, json, sys
state = sys.argv[2]
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = state == "ready"
        body = json.dumps({"ready": ok, "state": state, "error": None if ok else "weights file missing"}).encode()
        if state == "garbled":
            body = b"<html>Service Unavailable</html>"
        self.send_response(200 if ok else 503)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


def _service(tmp_path, state: str) -> Child:
    port = free_port()
    child = Child(f"svc-{state}", ["-c", SERVER, str(port), state], tmp_path / f"{state}.log", port)
    child.start()
    return child


@pytest.mark.parametrize("state", ["ready", "failed", "loading"])
def test_start_up_waits_for_ready_and_stops_at_a_failed_service(tmp_path, state):
    child = _service(tmp_path, state)
    try:
        t0 = time.monotonic()
        if state == "ready":
            wait_ready([child], timeout_s=60)
        elif state == "failed":
            with pytest.raises(JobFailed, match="svc-failed failed during start-up: .*weights file missing"):
                wait_ready([child], timeout_s=60)
            # The requirement: it stops at the failed service instead of waiting out timeout_s (60 s).
            assert time.monotonic() - t0 < 30
        else:  # still loading: waited for until the timeout
            with pytest.raises(JobFailed, match="svc-loading not ready within 3s"):
                wait_ready([child], timeout_s=3)
    finally:
        child.proc.kill()
        child.proc.wait()


def test_an_answer_that_is_no_readiness_report_stops_the_start_up_naming_the_service(tmp_path):
    child = _service(tmp_path, "garbled")
    try:
        with pytest.raises(JobFailed, match=r"svc-garbled answered /ready \(503\) with something that is not"):
            wait_ready([child], timeout_s=60)
    finally:
        child.proc.kill()
        child.proc.wait()
