"""The Slurm layout's pure parts: step names, ``squeue``/``scontrol`` output as Slurm 22.05 prints
it, where a new worker step goes, the srun command of a worker step, slurm.json, the `slurm` scale
backend's set-up, and the batch script (its syntax, and that the settings its header documents are
the ones it reads). tests/slurm runs them all on a real cluster."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from shared.config_error import ConfigError
from streamrl.scale import ScaleError, make_backend
from streamrl.scale_slurm import SlurmBackend, comment_run_dir, step_counts
from streamrl.slurm_workers import (
    Layout,
    SlurmRunFile,
    StepChild,
    StepInfo,
    parse_steps,
    place,
    read_slurm_file,
    step_name,
    step_service,
    write_slurm_file,
)
from streamrl.worker_pool import CannotStart

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "streamrl.sbatch"

SQUEUE = """7.0 streamrl-redis
7.1 streamrl-trainer
7.2 streamrl-generator-0
7.3 streamrl-gym-gateway-0
7.4 streamrl-gym-gateway-1
7.batch batch
"""


def test_step_names_name_their_service():
    assert step_service(step_name("generator", 0)) == "generator"
    assert step_service(step_name("gym-gateway", 12)) == "gym-gateway"
    for other in ("streamrl-trainer", "streamrl-redis", "batch", "streamrl-gym-gateway-x", "gym-gateway-1"):
        assert step_service(other) is None, other


def test_squeue_steps_parse_and_count():
    steps = parse_steps(SQUEUE)
    assert steps["streamrl-gym-gateway-1"] == "7.4" and steps["batch"] == "7.batch"
    assert step_counts(steps) == {"generator": 1, "gym-gateway": 2}
    assert step_counts(parse_steps("")) == {"generator": 0, "gym-gateway": 0}


def test_a_new_worker_goes_where_its_service_is_not_and_the_fewest_workers_are():
    nodes = ["h2", "h1", "h3"]
    assert place("generator", nodes, {}) == "h2"  # the first listed on a tie
    assert place("gym-gateway", nodes, {"generator": ["h2"]}) == "h1"
    # h1 and h3 are free of gateways; h3 has fewer workers
    assert place("gym-gateway", nodes, {"generator": ["h2", "h1"], "gym-gateway": ["h2"]}) == "h3"
    # a node whose worker of the service is still draining is not free
    assert place("gym-gateway", ["h1", "h2"], {"gym-gateway": ["h1"]}) == "h2"
    with pytest.raises(CannotStart, match=r"every worker node \(h1, h2\) runs a gym-gateway already"):
        place("gym-gateway", ["h1", "h2"], {"gym-gateway": ["h2", "h1"]})


def test_the_start_up_counts_must_fit_the_worker_nodes():
    Layout("7", ["h1", "h2"], {"generator": 2, "gym-gateway": 1}).check()
    with pytest.raises(ConfigError, match=r"3 generator on 2 worker node\(s\) \(h1, h2\)"):
        Layout("7", ["h1", "h2"], {"generator": 3, "gym-gateway": 1}).check()
    with pytest.raises(ConfigError, match="worker node"):
        Layout("7", [], {"generator": 1, "gym-gateway": 1}).check()


def test_a_worker_step_is_one_overlapping_task_on_its_node(tmp_path):
    child = StepChild(
        "streamrl-generator-3",
        ["-m", "streamrl.cli", "join", "generator", "run.yaml", "--count", "1", "generator.port=8100"],
        tmp_path / "g.log",
        8100,
        job_id="7",
        node="h2",
        srun_args=["--gpus-per-task=1"],
    )
    argv = child.argv()
    python = argv.index("--gpus-per-task=1") + 1
    assert argv[:python] == [
        "srun",
        "--jobid=7",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=h2",
        "--job-name=streamrl-generator-3",
        "--gpus-per-task=1",
    ]
    assert argv[python + 1 :] == child.args
    assert child.url == "http://h2:8100"  # probed on its node, not here
    assert not child.alive()
    child.terminate()  # not started: nothing to signal
    assert not child.signalled


def test_the_slurm_file_round_trips(tmp_path):
    run = SlurmRunFile(
        "7", "demo", "redis://:***@h0:6379/0", None, {"streamrl-generator-0": StepInfo("generator", "h2", 8100)}
    )
    write_slurm_file(tmp_path, run)
    assert read_slurm_file(tmp_path) == run


def test_the_job_comment_names_the_run_folder():
    line = "JobId=7 JobName=streamrl UserId=root(0) Comment=streamrl:/shared/runs/demo Priority=1 Nice=0"
    assert comment_run_dir(line) == Path("/shared/runs/demo")
    assert comment_run_dir("JobId=7 JobName=x Comment=(null) Priority=1") is None
    assert comment_run_dir("JobId=7 Comment=other-tool:/x") is None


def test_the_backend_finds_the_run_and_its_redis_url_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(ScaleError, match="no slurm.json"):
        make_backend("slurm", run_dir=tmp_path)
    url_file = tmp_path / "redis-url"
    url_file.write_text("redis://:s3cret@10.0.0.1:6390/0\n")
    write_slurm_file(tmp_path, SlurmRunFile("7", "demo", "redis://:***@10.0.0.1:6390/0", str(url_file), {}))
    be = make_backend("slurm", run_dir=tmp_path)
    assert isinstance(be, SlurmBackend) and be.name == "slurm"
    assert (be.job_id, be.run_id) == ("7", "demo")
    kwargs = be.redis.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["password"]) == ("10.0.0.1", 6390, "s3cret")
    be = SlurmBackend(run_dir=tmp_path, redis_url="redis://:other@10.0.0.2:6379/0")
    assert be.redis.connection_pool.connection_kwargs["password"] == "other"


def test_the_batch_script_parses_and_reads_the_settings_it_documents():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    header, _, body = text.partition("set -euo pipefail")
    documented = set(re.findall(r"STREAMRL_[A-Z_]+", header))
    read = set(re.findall(r"\$\{?(STREAMRL_[A-Z_]+)", body))
    assert documented == read, documented ^ read
    # sbatch reads #SBATCH lines only before the first command
    lines = [ln for ln in header.splitlines() if ln.strip()]
    assert all(ln.startswith("#") for ln in lines) and any(ln.startswith("#SBATCH --nodes") for ln in lines)
