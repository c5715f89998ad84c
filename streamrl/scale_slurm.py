"""The ``slurm`` scale backend: adds and drains the worker job steps of a running Slurm job
(deploy/slurm/streamrl.sbatch).

    --job JOBID: the job's comment (``streamrl:RUN_DIR``, set by the batch script) names the run's
    folder; else --run-dir -> RUN_DIR/slurm.json (job id, run id, the Redis URL's file)
    -> the same request and status keys as the local backend (`streamrl.scale_local`): the
       process that owns the worker steps (`streamrl.slurm_workers`) starts new steps or drains
       removed ones (``scancel --signal=TERM``) and reports "done" once they are ready or ended
    -> ``squeue -s``: the job runs exactly the steps that status says, per service (new ones
       listed, drained ones gone), within CONFIRM_S

The Redis URL: --redis-url, else REDIS_URL, else the file slurm.json names (the one ``streamrl
join redis --url-file`` wrote, readable by the job's owner only). Runs where the Slurm client
commands reach the job's controller (a login node, or inside the job).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import msgspec
import redis

from shared import keys as K
from streamrl.scale import SERVICES, ScaleError, ScaleResult
from streamrl.scale_local import LocalBackend
from streamrl.slurm_workers import SLURM_FILE, job_steps, read_slurm_file, step_service

COMMENT_PREFIX = "streamrl:"
CONFIRM_S = 30.0


def comment_run_dir(scontrol_out: str) -> Path | None:
    """The run folder a job's comment names (``scontrol show job -o`` output); None without one."""
    for field in scontrol_out.split():
        key, _, value = field.partition("=")
        if key == "Comment" and value.startswith(COMMENT_PREFIX):
            return Path(value[len(COMMENT_PREFIX) :])
    return None


def step_counts(steps: dict[str, str]) -> dict[str, int]:
    """{step name: id} -> worker steps per service."""
    counts = dict.fromkeys(SERVICES, 0)
    for name in steps:
        service = step_service(name)
        if service is not None:
            counts[service] += 1
    return counts


def _slurm(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ScaleError(f"{' '.join(cmd)}: {exc} (are the Slurm client commands installed here?)") from None
    if done.returncode != 0:
        raise ScaleError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


class SlurmBackend(LocalBackend):
    name = "slurm"

    def __init__(self, *, job: str | None = None, run_dir: Path | None = None, redis_url: str | None = None) -> None:
        if job:
            run_dir = comment_run_dir(_slurm(["scontrol", "show", "job", "-o", job])) or run_dir
        if run_dir is None or not (Path(run_dir) / SLURM_FILE).is_file():
            where = f"job {job}'s comment names no run folder and " if job else ""
            raise ScaleError(
                f"{where}no {SLURM_FILE} in {run_dir}: is the run's batch job (deploy/slurm/streamrl.sbatch) running? "
                "(--job JOBID or --run-dir RUN_DIR)"
            )
        try:
            run = read_slurm_file(Path(run_dir))
        except (OSError, msgspec.DecodeError) as exc:
            raise ScaleError(f"unreadable {Path(run_dir) / SLURM_FILE}: {exc}") from None
        if job and job != run.job_id:
            raise ScaleError(f"{run_dir} holds job {run.job_id}'s run, not job {job}'s")
        self.job_id = run.job_id
        self.run_id = run.run_id
        self.keys = K.RunKeys(self.run_id)
        url = redis_url or os.environ.get("REDIS_URL")
        if not url and run.redis_url_file:
            try:
                url = Path(run.redis_url_file).read_text().strip()
            except OSError as exc:
                raise ScaleError(f"cannot read the run's Redis URL ({exc}); set REDIS_URL or --redis-url") from None
        self.redis = redis.Redis.from_url(url or run.redis_url, socket_timeout=10.0)

    def steps(self) -> dict[str, int]:
        """Worker steps per service that the job runs now, as ``squeue`` lists them."""
        try:
            return step_counts(job_steps(self.job_id))
        except RuntimeError as exc:
            raise ScaleError(str(exc)) from None

    def scale(self, targets: dict[str, int], timeout_s: float) -> ScaleResult:
        result = super().scale(targets, timeout_s)
        wanted = {s: result.after.get(s, 0) for s in targets}
        deadline = time.monotonic() + CONFIRM_S
        while (listed := {s: n for s, n in self.steps().items() if s in wanted}) != wanted:
            if time.monotonic() > deadline:
                raise ScaleError(f"scaled to {wanted}, but job {self.job_id} runs worker steps {listed} (squeue -s)")
            time.sleep(1.0)
        return result
