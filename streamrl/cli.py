"""The ``streamrl`` command line.

    streamrl up CONFIG [key=value ...]     run a job on this machine (embedded Valkey unless REDIS_URL)
    streamrl join ROLE CONFIG [key=value]  run one role (redis, trainer, generator, gym-gateway) of a run
                                           on this host, joining the others by the run's Redis URL
    streamrl demo                          build + warm-start the tiny model, then a short async GRPO run
    streamrl status                        services, queues and step of a run, from Redis
    streamrl pause|resume|validate         talk to a running trainer's REST API
    streamrl report RUN_DIR                plot reward, validation, staleness, timing and the pipeline to
                                           PNG; print where each step's time went
    streamrl model init DIR [--arch A]     build a tiny model (qwen3, qwen3_5_moe) + tokenizer
    streamrl data make ENV OUT             write a JSONL dataset of a built-in environment
    streamrl config check|explain          validate a config / list every key with its description
    streamrl bench [--only SECTION]        run the benchmarks and rewrite BENCHMARKS.md (or one section:
                                           generator, gateway, trainer, pipeline, refit, demo_variants,
                                           openhands)
    streamrl scale generator=N gym-gateway=M  resize a run's workers (--backend local|compose|k8s|slurm)

Heavy libraries are imported inside the commands, so ``streamrl --help`` is instant. Calls to
control routes send ``Authorization: Bearer`` with the API token when STREAMRL_API_TOKEN or
STREAMRL_API_TOKEN_FILE is set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer

if TYPE_CHECKING:
    from msgspec import Struct

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="streamrl: asynchronous GRPO over Redis Streams")
model_app = typer.Typer(no_args_is_help=True, help="tiny model tools")
data_app = typer.Typer(no_args_is_help=True, help="datasets of the built-in environments")
config_app = typer.Typer(no_args_is_help=True, help="config validation and documentation")
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")
app.add_typer(config_app, name="config")


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(msg, fg="red", err=True)
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="run config YAML"),
    no_progress: bool = typer.Option(False, help="no live display"),
) -> None:
    """Run generator(s), gateway worker(s) and the trainer on this machine until the run ends."""
    from shared.config_error import ConfigError
    from streamrl.supervisor import JobFailed, Supervisor

    try:
        sup = Supervisor(str(config), list(ctx.args), progress=not no_progress)
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    try:
        code = sup.run()
    except JobFailed as exc:
        _fail(f"job failed: {exc}", 1)
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def join(
    ctx: typer.Context,
    role: str = typer.Argument(..., help="redis, trainer, generator or gym-gateway"),
    config: Path = typer.Argument(..., help="run config YAML (the same on every host)"),
    redis_url: str | None = typer.Option(None, help="the run's Redis (default REDIS_URL, else redis.url)"),
    advertise: str | None = typer.Option(
        None, help="address the other hosts reach this one at (default: the interface that reaches Redis)"
    ),
    count: int = typer.Option(1, help="generator, gym-gateway: workers on this host"),
    port: int = typer.Option(6379, help="redis: the port"),
    url_file: Path | None = typer.Option(None, help="redis: write the run's Redis URL (with its password) here"),
    password_file: Path | None = typer.Option(None, help="redis: the password the run's Redis requires"),
    connect_timeout: float = typer.Option(60.0, help="seconds to reach the run's Redis before failing"),
) -> None:
    """Run one role of a run on this host, joining the others by the run's Redis URL."""
    from shared.config_error import ConfigError
    from shared.netaddr import Unreachable
    from streamrl.join import Joined, JoinOptions
    from streamrl.supervisor import JobFailed

    opts = JoinOptions(
        role, config, list(ctx.args), redis_url, advertise, count, port, url_file, password_file, connect_timeout
    )
    try:
        raise typer.Exit(Joined(opts).run())
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    except Unreachable as exc:
        _fail(str(exc), 1)
    except JobFailed as exc:
        _fail(f"job failed: {exc}", 1)


@app.command()
def demo(
    overrides: list[str] = typer.Argument(
        None, help="config overrides key=value for the run, e.g. trainer.nproc_per_node=2"
    ),
    out: Path = typer.Option(None, help="output folder (runs/demo; runs/demo-ARCH for another --arch)"),
    steps: int = typer.Option(None, help="override grpo.max_num_steps"),
    no_progress: bool = typer.Option(False, help="no live display"),
    prepare_only: bool = typer.Option(False, help="only build model, data and warm-started policy in OUT"),
    arch: str = typer.Option("qwen3", help="the tiny model's family: qwen3 (dense) or qwen3_5_moe (hybrid MoE)"),
) -> None:
    """Build the tiny model if missing, warm-start it, and run a short async GRPO job that learns."""
    from streamrl.demo import default_out, prepare, run_demo
    from streamrl.model_builder import ARCHS

    if arch not in ARCHS:
        _fail(f"--arch {arch!r} is not one of {', '.join(ARCHS)}", 2)
    out = out or default_out(arch)
    if prepare_only:
        prepare(out, arch)
        raise typer.Exit(0)
    raise typer.Exit(run_demo(out, steps=steps, progress=not no_progress, overrides=overrides or [], arch=arch))


def _trainer_url(url: str | None, run_dir: Path | None) -> str:
    if url:
        return url.rstrip("/")
    if os.environ.get("STREAMRL_TRAINER_URL"):
        return os.environ["STREAMRL_TRAINER_URL"].rstrip("/")
    from shared.protocol import RUN_FILE, ProtocolError, read_run_file

    for d in [run_dir] if run_dir else [Path("runs/demo"), *sorted(Path("runs").glob("*"))]:
        f = Path(d) / RUN_FILE
        if f.is_file():
            try:
                return read_run_file(f).trainer_url
            except ProtocolError as exc:
                _fail(str(exc), 1)
    return "http://127.0.0.1:8300"


def _call(
    method: str, path: str, url: str | None, run_dir: Path | None, answer: type[T], body: Struct | None = None
) -> T:
    """Call a trainer control route with ``body`` (a `shared.records` Struct) as JSON; its answer
    decoded as ``answer`` (a `shared.records` Struct)."""
    import httpx
    import msgspec

    from shared.auth import client_headers, load_api_token
    from shared.config_error import ConfigError

    base = _trainer_url(url, run_dir)
    try:
        headers = client_headers(load_api_token())
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    try:
        if body is not None:
            headers = {**headers, "content-type": "application/json"}
        content = None if body is None else msgspec.json.encode(body)
        r = httpx.request(method, f"{base}{path}", content=content, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the trainer at {base}: {exc}", 1)
    if r.status_code >= 400:
        _fail(f"{r.status_code}: {r.text}", 1)
    try:
        return msgspec.json.decode(r.content, type=answer)
    except msgspec.DecodeError as exc:
        _fail(f"the trainer at {base} answered {path} with something unexpected: {exc}", 1)
        raise


def _echo(answer: object) -> None:
    import msgspec

    typer.echo(msgspec.json.encode(answer).decode())


URL = typer.Option(None, "--url", help="trainer URL (default: run.json of --run-dir, or STREAMRL_TRAINER_URL)")
RUN_DIR = typer.Option(None, "--run-dir", help="output folder of a `streamrl up` job")


@app.command()
def status(
    redis_url: str | None = typer.Option(
        None, "--redis-url", help="Redis of the run (default: REDIS_URL, then run.json)"
    ),
    run_id: str | None = typer.Option(None, "--run-id", help="run id (default: run.json, or the only run in Redis)"),
    run_dir: Path | None = RUN_DIR,
    url: str | None = URL,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Services (state, weight version, in flight, heartbeat age), queues and the step, from Redis
    (with only a trainer URL: the trainer's own view)."""
    from shared.config_error import ConfigError
    from streamrl.status import StatusError, run_status

    try:
        text = run_status(redis_url, run_id, run_dir, as_json, trainer_url=url)
    except (StatusError, ConfigError) as exc:
        _fail(str(exc), 1)
    if text is not None:
        typer.echo(text)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="output folder of a run (holds metrics.jsonl)"),
    out: Path | None = typer.Option(None, help="folder for the PNG files (default: RUN_DIR/report)"),
    rows: int = typer.Option(50, min=0, help="steps in the printed pipeline table (the last N; 0: all)"),
) -> None:
    """Plot reward, validation, staleness, timing and pipeline figures of a run to PNG files (their
    paths printed), then print where each step's time went, its MFU and the workers."""
    from streamrl.report import ReportError, build_report, pipeline_text

    try:
        written, skipped = build_report(run_dir, out)
        table = pipeline_text(run_dir, rows)
    except ReportError as exc:
        _fail(str(exc), 1)
    for path in written.values():
        typer.echo(str(path))
    for name in skipped:
        typer.echo(f"{name}: no data in this run, skipped", err=True)
    if "pipeline" in written:
        typer.echo(f"\npipeline per step, in seconds (drawn in {written['pipeline'].name}):\n{table}")


@app.command()
def pause(url: str | None = URL, run_dir: Path | None = RUN_DIR) -> None:
    """Stop launching rollouts and hold training at the next step boundary."""
    from shared.records import PauseAnswer

    _echo(_call("POST", "/pause", url, run_dir, PauseAnswer))


@app.command()
def resume(
    epoch: int | None = typer.Option(None, help="the pause epoch to end"),
    url: str | None = URL,
    run_dir: Path | None = RUN_DIR,
) -> None:
    """End a pause (the active one, or the one with --epoch)."""
    from shared.records import ResumeAnswer, ResumeRequest

    _echo(_call("POST", "/resume", url, run_dir, ResumeAnswer, ResumeRequest(epoch=epoch)))


@app.command()
def validate(
    url: str | None = URL,
    run_dir: Path | None = RUN_DIR,
    wait: bool = typer.Option(False, "--wait", help="wait for the result and print it"),
    timeout: float = typer.Option(3600.0, help="seconds to wait with --wait"),
) -> None:
    """Run a validation at the next step boundary, or before the run ends (its result: GET
    /validations/<id>; with --wait, exit 0 once it is done, 1 if it failed or was dropped)."""
    from shared.records import ValidationAccepted, ValidationStatus

    queued = _call("POST", "/validate", url, run_dir, ValidationAccepted)
    if not wait:
        _echo(queued)
        return
    import time

    deadline = time.monotonic() + timeout
    while True:
        entry = _call("GET", f"/validations/{queued.validation_id}", url, run_dir, ValidationStatus)
        if entry.status in ("done", "failed", "dropped"):
            _echo(entry)
            raise typer.Exit(0 if entry.status == "done" else 1)
        if time.monotonic() > deadline:
            _fail(f"validation {queued.validation_id} still {entry.status} after {timeout:.0f}s", 1)
        time.sleep(1.0)


@app.command(name="scale")
def scale_cmd(
    targets: list[str] | None = typer.Argument(None, help="SERVICE=COUNT, SERVICE: generator or gym-gateway"),
    backend: str = typer.Option("local", help="local (a `streamrl up` job), compose, k8s or slurm"),
    run_dir: Path | None = RUN_DIR,
    redis_url: str | None = typer.Option(None, help="local: the run's Redis (default REDIS_URL, else run.json)"),
    timeout: float = typer.Option(900.0, help="seconds to wait for new workers to be ready and removed ones gone"),
    show: bool = typer.Option(False, "--show", help="only print the current counts"),
    compose_file: Path = typer.Option(Path("docker-compose.yml"), help="compose: the project's compose file"),
    project_name: str | None = typer.Option(None, help="compose: project name (default: compose's own)"),
    compose_bin: str | None = typer.Option(None, help="compose: 'docker compose' or a docker-compose binary"),
    namespace: str | None = typer.Option(
        None, help="k8s: namespace (default: the kubeconfig context's, or in-cluster)"
    ),
    kubeconfig: str | None = typer.Option(
        None, help="k8s: kubeconfig (default: in-cluster, else KUBECONFIG or ~/.kube/config)"
    ),
    context: str | None = typer.Option(None, help="k8s: kubeconfig context"),
    selector: str = typer.Option("app.kubernetes.io/name=streamrl", help="k8s: labels of the run's Deployments"),
    generator_deployment: str | None = typer.Option(None, help="k8s: generator Deployment (default: found by label)"),
    gateway_deployment: str | None = typer.Option(None, help="k8s: gateway Deployment (default: found by label)"),
    job: str | None = typer.Option(None, help="slurm: the run's job id (the job's comment names its run folder)"),
) -> None:
    """Scale a run's generators and gym-gateway workers; waits until new ones are ready and removed ones drained."""
    from streamrl.scale import ScaleError, make_backend, parse_targets

    deployments = {k: v for k, v in (("generator", generator_deployment), ("gym-gateway", gateway_deployment)) if v}
    try:
        be = make_backend(
            backend,
            run_dir=run_dir or _find_run_dir(),
            redis_url=redis_url,
            compose_file=compose_file,
            project_name=project_name,
            compose_bin=compose_bin,
            namespace=namespace,
            kubeconfig=kubeconfig,
            context=context,
            selector=selector,
            deployments=deployments,
            job=job,
        )
        if show:
            typer.echo(", ".join(f"{k}: {v}" for k, v in be.counts().items()))
            return
        wanted = parse_targets(targets or [])
        typer.echo(f"scaling ({be.name}): " + ", ".join(f"{k}={v}" for k, v in wanted.items()))
        result = be.scale(wanted, timeout_s=timeout)
    except ScaleError as exc:
        _fail(str(exc), 1)
    typer.echo(result.describe())


def _find_run_dir() -> Path:
    for d in [Path("runs/demo"), *sorted(Path("runs").glob("*"))]:
        if (d / "run.json").is_file():
            return d
    return Path("runs/demo")


@model_app.command("init")
def model_init(
    out: Path,
    seed: int = typer.Option(0, help="seed of tokenizer corpus and weights"),
    arch: str = typer.Option("qwen3", help="qwen3 (dense) or qwen3_5_moe (hybrid attention, routed experts, MTP)"),
) -> None:
    """Build a tiny model of ARCH and its BPE tokenizer into OUT."""
    from streamrl.model_builder import ARCHS, build_tiny_model, tiny_spec

    if arch not in ARCHS:
        _fail(f"--arch {arch!r} is not one of {', '.join(ARCHS)}", 2)
    build_tiny_model(out, tiny_spec(arch, seed))
    typer.echo(f"tiny {arch} model written to {out}")


@data_app.command("make")
def data_make(env: str, out: Path, n: int = typer.Option(1000, "--n"), seed: int = typer.Option(0)) -> None:
    """Write N instances of a built-in environment as JSONL."""
    from services.gym_gateway.envs import UnknownEnvironment, get_env

    try:
        e = get_env(env)
    except UnknownEnvironment as exc:
        _fail(str(exc))
    from shared.jsonl import write_jsonl

    write_jsonl(out, [{"env": env, "instance": inst} for inst in e.make_instances(n, seed)])
    typer.echo(f"{n} {env} instances written to {out}")


@config_app.command("check", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def config_check(
    ctx: typer.Context,
    config: Path,
    service: str = typer.Option("all", help="check what one service requires: generator, gym_gateway, trainer"),
) -> None:
    """Load CONFIG strictly (with overrides after it), check what its services require, and print
    the resolved tree."""
    from shared.config import load, to_yaml
    from shared.config_error import ConfigError
    from shared.run_config import SERVICES, RunConfig

    if service != "all" and service not in SERVICES:
        _fail(f"--service must be all or one of: {', '.join(SERVICES)}")
    try:
        cfg = load(RunConfig, config, list(ctx.args))
        for name in SERVICES if service == "all" else [s for s in SERVICES if s == service]:
            cfg.check_service(name)
        if service in ("all", "generator"):
            from services.generator.vllm_args import check_vllm_cfg

            check_vllm_cfg(cfg)  # the engine arguments, with vLLM's own argument types
    except ConfigError as exc:
        _fail(f"config error: {exc}")
    typer.echo(to_yaml(cfg))


@config_app.command("explain")
def config_explain() -> None:
    """Every config key with its type and one-line description."""
    from shared.run_config import explain

    for key, tp, desc in explain():
        typer.echo(f"{key:55s} {tp:22s} {desc}")


@app.command()
def bench(
    out: Path = typer.Option(Path("BENCHMARKS.md"), help="file to (re)write"),
    only: str | None = typer.Option(
        None, help="run one section and rewrite only it in OUT (generator, gateway, trainer, pipeline, refit, ...)"
    ),
    render: bool = typer.Option(False, "--render", help="rewrite OUT from the stored results; measure nothing"),
    results: Path = typer.Option(Path("benchmarks"), help="folder of each section's stored results (JSON)"),
) -> None:
    """Run the benchmarks and write their tables to BENCHMARKS.md."""
    from streamrl.bench.suite import SECTIONS, run_benchmarks, write_report

    if render:
        if only is not None:
            _fail("--render measures nothing: drop --only")
        write_report(results, out)
        return
    if only is not None and only not in SECTIONS:
        _fail(f"--only must be one of: {', '.join(SECTIONS)}")
    raise typer.Exit(run_benchmarks(out, only=only, results_dir=results))


def main() -> None:
    app(prog_name="streamrl")


if __name__ == "__main__":
    main()
