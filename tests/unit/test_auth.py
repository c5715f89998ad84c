"""Control-plane auth pieces on their own: where the token comes from, the bind rule, the bearer
check (401 vs 403, constant-time comparison), and secrets kept out of config dumps and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import shared.http
from shared.auth import check_bind, client_headers, load_api_token, redact_text, redact_url
from shared.config import load, to_yaml
from shared.config_error import ConfigError
from shared.http import HTTPError, verify_bearer
from shared.run_config import RunConfig

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-3f9a1c7e5b2d4a68"


def test_token_from_the_environment_or_a_file(tmp_path):
    assert load_api_token({}) is None
    assert load_api_token({"STREAMRL_API_TOKEN": TOKEN}) == TOKEN
    f = tmp_path / "token"
    f.write_text(f"  {TOKEN}\n")  # secrets mounted as files often end with a newline
    assert load_api_token({"STREAMRL_API_TOKEN_FILE": str(f)}) == TOKEN


@pytest.mark.parametrize(
    "env, named",
    [
        ({"STREAMRL_API_TOKEN": TOKEN, "STREAMRL_API_TOKEN_FILE": "/x"}, "set only one"),
        ({"STREAMRL_API_TOKEN_FILE": "/no/such/token"}, "STREAMRL_API_TOKEN_FILE: cannot read"),
        ({"STREAMRL_API_TOKEN": "two words"}, "STREAMRL_API_TOKEN: the token must be one printable word"),
    ],
)
def test_unusable_token_settings_name_the_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        load_api_token(env)


def test_an_empty_token_file_is_an_error(tmp_path):
    f = tmp_path / "token"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_api_token({"STREAMRL_API_TOKEN_FILE": str(f)})


def test_open_control_plane_only_on_loopback():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.1.1"):
        check_bind(host, "trainer.host", None, False)
    with pytest.raises(ConfigError, match=r"trainer.host is '0.0.0.0' but no API token is set: set STREAMRL_API_TOKEN"):
        check_bind("0.0.0.0", "trainer.host", None, False)
    check_bind("0.0.0.0", "trainer.host", TOKEN, False)
    check_bind("10.0.0.5", "generator.host", None, True)  # auth.allow_open_bind


@pytest.mark.parametrize("service", ["generator", "gym_gateway", "trainer"])
def test_a_service_without_token_refuses_a_public_bind(tmp_path, service):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"policy: {{model_name: m}}\ndata: {{train_path: t.jsonl}}\n{service}: {{host: 0.0.0.0}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_API_TOKEN")}
    out = subprocess.run(
        [sys.executable, "-m", f"services.{service}", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 2
    assert f"{service}.host is '0.0.0.0' but no API token is set" in out.stderr


def test_bearer_check_distinguishes_missing_from_wrong():
    for header in (None, "", f"Basic {TOKEN}", "Bearer", "Bearer   "):
        with pytest.raises(HTTPError) as err:
            verify_bearer(header, TOKEN)
        assert err.value.status == 401 and err.value.headers["WWW-Authenticate"].startswith("Bearer")
    with pytest.raises(HTTPError) as err:
        verify_bearer("Bearer not-the-token", TOKEN)
    assert err.value.status == 403 and "not-the-token" not in err.value.message
    verify_bearer(f"Bearer {TOKEN}", TOKEN)
    verify_bearer(f"bearer {TOKEN}", TOKEN)  # the scheme is case-insensitive


def test_tokens_are_compared_in_constant_time(monkeypatch):
    calls = []
    real = shared.http.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(shared.http.hmac, "compare_digest", spy)
    with pytest.raises(HTTPError):
        verify_bearer("Bearer wrong", TOKEN)
    verify_bearer(f"Bearer {TOKEN}", TOKEN)
    assert calls == [(b"wrong", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


def test_client_headers():
    assert client_headers(None) == {}
    assert client_headers(TOKEN) == {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:s3cr%2Ft@h:6379/0", "redis://:***@h:6379/0"),
        (
            "rediss://app:s3cret@redis.internal:6380/1?ssl_ca_certs=/ca.pem",
            "rediss://app:***@redis.internal:6380/1?ssl_ca_certs=/ca.pem",
        ),
        ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_text_masks_urls_inside_messages():
    assert redact_text("cannot reach redis://app:pw@h:1/0 now") == "cannot reach redis://app:***@h:1/0 now"


def test_config_dump_hides_the_redis_password(tmp_path):
    cfg = load(
        RunConfig,
        None,
        ["policy.model_name=m", "data.train_path=t"],
        env={"REDIS_URL": "redis://app:hunter2-secret@redis:6379/0"},
    )
    assert cfg.redis.url.endswith("@redis:6379/0") and "hunter2-secret" in cfg.redis.url  # the service gets it
    dumped = to_yaml(cfg)
    assert "hunter2-secret" not in dumped and "redis://app:***@redis:6379/0" in dumped


@pytest.mark.parametrize("command", [["config", "check"], ["config", "explain"]])
def test_cli_config_output_hides_secrets(tmp_path, command):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("policy: {model_name: m}\ndata: {train_path: t.jsonl}\n")
    args = [*command, str(cfg)] if command[1] == "check" else command
    env = {**os.environ, "REDIS_URL": "redis://app:hunter2-secret@redis:6379/0", "STREAMRL_API_TOKEN": TOKEN}
    out = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout + out.stderr and TOKEN not in out.stdout + out.stderr
    if command[1] == "check":
        assert "redis://app:***@redis:6379/0" in out.stdout
    else:
        assert "auth.protect_agent_routes" in out.stdout


def test_log_lines_mask_url_passwords_and_the_token(monkeypatch):
    import logging

    from shared.logs import RedactingFormatter

    monkeypatch.setenv("STREAMRL_API_TOKEN", TOKEN)
    fmt = RedactingFormatter("%(message)s")
    record = logging.LogRecord(
        "x", logging.ERROR, __file__, 1, "redis rediss://app:%s@h:1/0 refused %s", ("pw-42", TOKEN), None
    )
    line = fmt.format(record)
    assert line == "redis rediss://app:***@h:1/0 refused ***"
