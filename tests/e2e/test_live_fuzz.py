"""Schema fuzzing of the live services while a `streamrl up` job trains: the gym gateway and the
trainer, as the job runs them (processes, over HTTP, with the job's API token), get valid and
invalid requests for every operation of their OpenAPI schema. No answer may be a 5xx or break the
schema it documents (status code, content type, body), and the job must still finish with every
step trained once.

The test holds the job with a user pause while it fuzzes (so that it cannot end first, however
fast the machine): a fuzzed /resume that lifts it is followed at once by a new pause, so at most
one step boundary per such case passes, far fewer than the job's steps. Pauses a fuzzed /pause
makes are undone, and requested validations run on the job's small validation set. The gateway's
per-session routes get generated session ids (unknown ones: the rollouts the job runs stay the
job's). The in-process fuzz of every service, with a live session, is
tests/integration/test_fuzz_http.py.
"""

from __future__ import annotations

import json
import os
import secrets
import signal

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.runs import assert_every_step_trained_once, batch, output_dir, write_run_config
from tests.support.services import start_job, wait_job_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, PROMPTS, GENS = 30, 2, 2
EXAMPLES = int(os.environ.get("STREAMRL_FUZZ_EXAMPLES", "5"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class Hold:
    """The test's user pause on the trainer, taken again whenever a fuzzed call lifted it."""

    def __init__(self, trainer_url: str, headers: dict[str, str]) -> None:
        self.url, self.headers = trainer_url, headers
        self.epoch = self.take()
        self.retaken = 0

    def take(self) -> int:
        return int(httpx.post(f"{self.url}/pause", headers=self.headers, timeout=30).json()["epoch"])

    def keep(self) -> None:
        status = httpx.get(f"{self.url}/status", headers=self.headers, timeout=30).json()
        if "user" not in status["pause"]:
            self.epoch, self.retaken = self.take(), self.retaken + 1

    def release(self) -> None:
        httpx.post(f"{self.url}/resume", headers=self.headers, json={"epoch": self.epoch}, timeout=30)


def _fuzz(base_url: str, headers: dict[str, str], hold: Hold, paused_by_case: list[int]) -> list[str]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers)

    def check(case) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        if case.path == "/pause" and response.status_code == 200 and response.json()["epoch"] != hold.epoch:
            paused_by_case.append(response.json()["epoch"])
            httpx.post(f"{base_url}/resume", headers=headers, json={"epoch": response.json()["epoch"]}, timeout=30)
        hold.keep()
        if case.path == "/ready":  # a readiness probe answers 503 by design while the service cannot work
            assert response.status_code in (200, 503), response.text
            return
        case.validate_response(response, checks=CHECKS, headers=headers)

    run_settings = settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    failures = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                run_settings(given(op.as_strategy(mode))(check))()
            except Unsatisfiable:  # nothing to make invalid: no parameters and no body
                continue
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - schemathesis' failure groups too; reported together below
                failures.append(f"{base_url} {op.method.upper()} {op.path} ({mode.value}): {exc}")
    return failures


@pytest.fixture(scope="module")
def fuzzed_job(tmp_path_factory, tiny_model_dir, redis_url):
    tmp = tmp_path_factory.mktemp("live-fuzz")
    overrides = {**batch(STEPS, PROMPTS, GENS), "grpo.max_val_samples": 2}
    config = write_run_config(tmp, tiny_model_dir, redis_url, f"live-fuzz-{os.getpid()}", overrides)
    out = output_dir(config)
    token = secrets.token_hex(16)  # the job's services read it from the environment
    sup = start_job(config, tmp / "up.log", env={**os.environ, "STREAMRL_API_TOKEN": token})
    paused: list[int] = []
    try:
        run = wait_job_up(sup, out, tmp / "up.log", "/ready")
        headers = {"Authorization": f"Bearer {token}"}
        hold = Hold(run["trainer_url"], headers)
        urls = [run["children"]["gateway-0"]["url"], run["trainer_url"]]
        failures = [f for url in urls for f in _fuzz(url, headers, hold, paused)]
        hold.release()
        code = sup.wait(900)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(120)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"failures": failures, "code": code, "records": records, "paused": paused, "log": tmp / "up.log"}


def test_live_gateway_and_trainer_answer_every_fuzzed_request_within_their_schema(fuzzed_job):
    assert not fuzzed_job["failures"], "\n\n".join(fuzzed_job["failures"])
    assert fuzzed_job["paused"], "no fuzzed /pause reached the trainer"


def test_the_fuzzed_job_still_finishes_with_every_step_trained_once(fuzzed_job):
    assert fuzzed_job["code"] == 0, fuzzed_job["log"].read_text()[-4000:]
    assert_every_step_trained_once(fuzzed_job["records"], STEPS, PROMPTS * GENS)
