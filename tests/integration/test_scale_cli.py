"""`streamrl scale` on the command line: its options reach the compose and k8s backends (the
backends run against their fakes), it prints the counts before and after, and a bad argument or an
unreachable platform exits 1 with the reason. (The local backend's command line runs in
tests/e2e/test_scale_e2e.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from streamrl.cli import app
from tests.support.fakes.docker import FakeEngine
from tests.support.fakes.kube import FakeKubeAPI

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_k8s_options_reach_the_backend(tmp_path):
    fake = FakeKubeAPI(token="tok", namespace="ml")
    fake.add_deployment("gen", "generator", 1, part_of="other")
    fake.add_deployment("gw", "gym-gateway", 1, part_of="other")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "k", "cluster": {"server": fake.start()}}],
                "users": [{"name": "u", "user": {"token": "tok"}}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            }
        )
    )
    try:
        out = CliRunner().invoke(
            app,
            [
                "scale",
                "--backend",
                "k8s",
                "--kubeconfig",
                str(kubeconfig),
                "--namespace",
                "ml",
                "--selector",
                "app.kubernetes.io/name=other",
                "gym-gateway=3",
                "--timeout",
                "30",
            ],
        )
        assert out.exit_code == 0, out.output
        assert "generator: 1 -> 1, gym-gateway: 1 -> 3" in out.output
        assert [c.path for c in fake.patches()] == ["/apis/apps/v1/namespaces/ml/deployments/gw/scale"]
        shown = CliRunner().invoke(
            app,
            [
                "scale",
                "--backend",
                "k8s",
                "--kubeconfig",
                str(kubeconfig),
                "--namespace",
                "ml",
                "--generator-deployment",
                "gen",
                "--gateway-deployment",
                "gw",
                "--show",
            ],
        )
        assert shown.exit_code == 0 and "generator: 1, gym-gateway: 3" in shown.output
    finally:
        fake.stop()


def test_compose_options_reach_the_backend(monkeypatch):
    sock = Path("/tmp") / f"fake-docker-cli-{os.getpid()}.sock"
    fake = FakeEngine(sock)
    monkeypatch.setenv("DOCKER_HOST", fake.start())
    try:
        out = CliRunner().invoke(
            app,
            [
                "scale",
                "--backend",
                "compose",
                "--compose-file",
                str(ROOT / "docker-compose.yml"),
                "--project-name",
                "cli",
                "generator=2",
                "gym-gateway=1",
                "--timeout",
                "60",
            ],
        )
        assert out.exit_code == 0, out.output
        assert "generator: 0 -> 2, gym-gateway: 0 -> 1" in out.output
        assert [c.name for c in fake.service("generator")] == ["cli-generator-1", "cli-generator-2"]
    finally:
        fake.stop()
        sock.unlink(missing_ok=True)


def test_errors_exit_1_with_the_reason(tmp_path):
    bad = CliRunner().invoke(app, ["scale", "--backend", "k8s", "--kubeconfig", str(tmp_path / "none"), "generator=2"])
    assert bad.exit_code == 1 and "no Kubernetes access" in bad.output
    no_run = CliRunner().invoke(app, ["scale", "--run-dir", str(tmp_path), "generator=2"])
    assert no_run.exit_code == 1 and "run.json" in no_run.output
    wrong = CliRunner().invoke(app, ["scale", "--backend", "nomad", "generator=2"])
    assert wrong.exit_code == 1 and "--backend must be local, compose, k8s or slurm" in wrong.output
