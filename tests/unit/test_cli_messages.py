"""What the command line and the `streamrl up` supervisor read from the services and from each
other, typed: the run file (`shared.protocol.RunFile`), a service's ``/ready`` body
(`shared.admin_api.Readiness`) and the body of the trainer's ``POST /resume``
(`shared.records.ResumeRequest`). Each round-trips, and one that is not what it should be is
refused with a message naming it."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.admin_api import Readiness
from shared.protocol import RUN_FILE, ProtocolError, RunChild, RunFile, read_run_file, write_run_file
from shared.records import ResumeRequest

pytestmark = pytest.mark.unit


def test_the_run_file_round_trips_and_stays_readable_json(tmp_path):
    run = RunFile(
        run_id="r1",
        trainer_url="http://127.0.0.1:8300",
        redis_url="redis://app:***@h:6379/0",
        children={"generator-0": RunChild(pid=41, url="http://127.0.0.1:8100", log="logs/generator-0.log")},
        restarts={"generator": 1},
    )
    write_run_file(tmp_path, run)
    assert read_run_file(tmp_path / RUN_FILE) == run
    text = (tmp_path / RUN_FILE).read_text()
    assert json.loads(text)["children"]["generator-0"]["pid"] == 41 and "\n  " in text  # indented for people


def test_a_run_file_of_an_older_job_with_fields_it_no_longer_writes_still_reads(tmp_path):
    old = {"run_id": "r1", "trainer_url": "http://t", "redis_url": "redis://h", "scale": {"request_key": "k"}}
    (tmp_path / RUN_FILE).write_text(json.dumps(old))
    assert read_run_file(tmp_path / RUN_FILE) == RunFile(run_id="r1", trainer_url="http://t", redis_url="redis://h")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "malformed"),
        (json.dumps({"run_id": "r1", "trainer_url": "http://t"}), "redis_url"),
        (json.dumps({"run_id": 7, "trainer_url": "http://t", "redis_url": "redis://h"}), "run_id"),
    ],
    ids=["not json", "a field missing", "a field of the wrong type"],
)
def test_a_file_that_is_no_run_file_is_refused_naming_the_file_and_the_field(tmp_path, text, named):
    (tmp_path / RUN_FILE).write_text(text)
    with pytest.raises(ProtocolError, match="is not the run file") as err:
        read_run_file(tmp_path / RUN_FILE)
    assert str(tmp_path / RUN_FILE) in str(err.value) and named in str(err.value).lower()


def test_readiness_round_trips_and_a_body_that_is_none_is_refused():
    body = Readiness(ready=False, state="failed", error="weights file missing")
    assert msgspec.json.decode(msgspec.json.encode(body), type=Readiness) == body
    with pytest.raises(msgspec.ValidationError, match="state"):
        msgspec.json.decode(b'{"ready": false}', type=Readiness)


def test_the_resume_body_is_empty_without_an_epoch_and_strict():
    assert msgspec.json.encode(ResumeRequest()) == b"{}"  # what `streamrl resume` sends without --epoch
    assert msgspec.json.decode(msgspec.json.encode(ResumeRequest(epoch=3)), type=ResumeRequest).epoch == 3
    with pytest.raises(msgspec.ValidationError, match="epochs"):
        msgspec.json.decode(b'{"epochs": 3}', type=ResumeRequest)
