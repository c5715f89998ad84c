"""SWE container runtime: the exact engine command lines (a fake ``docker``/``podman`` on PATH
records its argv and runs the command on the host, so the whole flow runs), engine failures as
sandbox errors, the deadline removing the container; and a real run where an engine works here.

The real run needs a working engine (``docker info`` or ``podman info`` succeeds) and a local
image. It uses STREAMRL_TEST_SWE_IMAGE when set (an image with bash, python3 and pytest: the gold
patch is then rewarded inside the container), else builds ``localhost/streamrl-swe-busybox`` from
a static busybox when one is installed (shell-only checks). Nothing is ever pulled.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from services.gym_gateway.envs.base import SandboxError
from services.gym_gateway.envs.swe import apply_patch, evaluate, load_instances, make_runtime
from services.gym_gateway.envs.swe.agent import SHIPPED_INSTANCES
from services.gym_gateway.envs.swe.container import engine_problem
from shared.sections.env_swe import SweSection

pytestmark = pytest.mark.integration

CALC = {i.instance_id: i for i in load_instances(SHIPPED_INSTANCES)}["calc-divide-by-zero"]

# Records its argv; ``run`` executes the command on the host in the mounted folder, ``rm`` is
# recorded only. The image "missing:image" fails the way engines do (exit 125).
FAKE_ENGINE = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    argv = sys.argv
    with open({log!r}, "a") as f:
        f.write(json.dumps([os.path.basename(argv[0])] + argv[1:]) + "\\n")
    if "run" not in argv:
        sys.exit(0)
    args = argv[argv.index("run") + 1:]
    image_at = next(i for i, a in enumerate(args) if not a.startswith("-") and args[i - 1] not in
                    ("--name", "--network", "--ulimit", "-v", "-w", "-e", "--pull"))
    if args[image_at] == "missing:image":
        print("Error: missing:image: image not known", file=sys.stderr)
        sys.exit(125)
    if args[image_at] == "oci:fail":
        print("Error: runc: runc create failed: error setting rlimit type 7: OCI permission denied", file=sys.stderr)
        sys.exit(126)
    host = next(a for i, a in enumerate(args) if args[i - 1] == "-v").split(":")[0]
    shell, _, cmd = args[image_at + 1:]
    os.chdir(host)
    os.execvp(shell, [shell, "-c", cmd])
""")


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """A fake engine named ``docker`` and ``podman`` first on PATH; yields the argv log reader."""
    bin_dir, log = tmp_path / "bin", tmp_path / "engine.log"
    bin_dir.mkdir()
    for name in ("docker", "podman"):
        exe = bin_dir / name
        exe.write_text(FAKE_ENGINE.format(python=sys.executable, log=str(log)))
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("engine,engine_args", [("docker", []), ("podman", ["--runtime", "runc"])])
async def test_command_line_of_a_container(fake_engine, engine, engine_args):
    runtime = make_runtime(
        SweSection(runtime=engine, image="localhost/py:1", command_timeout_s=20, container_engine_args=engine_args)
    )
    assert runtime.kind == engine
    async with runtime.workspace(CALC) as ws:
        res = await ws.run("echo hi > out.txt; echo done; exit 4")
        assert ws.workdir == "/testbed" and (ws.path / "out.txt").read_text() == "hi\n"
    assert res.exit_code == 4 and res.output.strip() == "done"
    [argv] = fake_engine()
    name = argv[argv.index("--name") + 1]
    assert name.startswith("streamrl-swe-")
    assert argv == [
        engine,
        *engine_args,
        "run",
        "--rm",
        "--pull",
        "never",
        "--name",
        name,
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        "-v",
        f"{ws.path}:/testbed",
        "-w",
        "/testbed",
        "-e",
        "PYTHONDONTWRITEBYTECODE=1",
        "-e",
        "PYTHONUNBUFFERED=1",
        "localhost/py:1",
        "bash",
        "-c",
        "echo hi > out.txt; echo done; exit 4",
    ]


async def test_reward_run_goes_through_the_engine_with_the_instance_image(fake_engine):
    runtime = make_runtime(SweSection(runtime="podman", image="localhost/default:1", container_ulimits=[]))
    inst = msgspec.structs.replace(CALC, image="localhost/calc:2")
    async with runtime.workspace(inst) as ws:
        apply_patch(ws.path, inst.gold_patch)
        result = await evaluate(inst, ws)
    assert result.reward == 1.0
    [argv] = fake_engine()
    mount = argv[argv.index("-v") + 1]
    assert "--ulimit" not in argv and argv[argv.index("bash") - 1] == "localhost/calc:2"  # the row's image wins
    assert argv[-1] == inst.test_command and not mount.startswith(f"{ws.path}:")  # a fresh copy, not the agent's


async def test_engine_failures_are_sandbox_errors(fake_engine, tmp_path, monkeypatch):
    async with make_runtime(SweSection(runtime="docker", image="missing:image")).workspace(CALC) as ws:
        with pytest.raises(SandboxError, match="docker could not run the command's container: .*image not known"):
            await ws.run("true")
    async with make_runtime(SweSection(runtime="podman", image="oci:fail")).workspace(CALC) as ws:
        with pytest.raises(SandboxError, match="podman could not run the command's container: .*OCI permission denied"):
            await ws.run("true")
    async with make_runtime(SweSection(runtime="podman", image="localhost/py:1")).workspace(CALC) as ws:
        # a command the shell cannot find is the agent's problem, not the engine's
        res = await ws.run("no-such-command-here")
        assert res.exit_code == 127 and "not found" in res.output
    async with make_runtime(SweSection(runtime="docker")).workspace(CALC) as ws:
        with pytest.raises(SandboxError, match="names no docker_image and env.swe.image is empty"):
            await ws.run("true")
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        with pytest.raises(SandboxError, match="no 'docker' executable on PATH"):
            await ws.run("true")


async def test_deadline_removes_the_container(fake_engine):
    runtime = make_runtime(SweSection(runtime="docker", image="localhost/py:1"))
    async with runtime.workspace(CALC) as ws:
        res = await ws.run("sleep 300", timeout_s=1.0)
    assert res.timed_out and res.duration_s < 60  # cut at its 1 s limit, far short of the sleep
    # On a loaded machine the deadline can fall before the engine client has logged its argv (it
    # is killed first); the removal is then the only entry, and it names the container all the same.
    *run, rm = fake_engine()
    assert rm[:3] == ["docker", "rm", "-f"] and rm[3].startswith(f"streamrl-swe-{os.getpid()}-")
    if run:
        assert rm[3] == run[0][run[0].index("--name") + 1]


# ---- a real engine, where one works here ------------------------------------------------------

BUSYBOX_TAG = "localhost/streamrl-swe-busybox:1"


def _busybox_image(engine: str, engine_args: list[str], tmp_path: Path) -> bool:
    busybox = shutil.which("busybox")
    if busybox is None:
        return False
    ctx = tmp_path / "image"
    (ctx / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(busybox, ctx / "bin" / "busybox")
    (ctx / "Containerfile").write_text(
        'FROM scratch\nCOPY bin/busybox /bin/busybox\nRUN ["/bin/busybox", "--install", "-s", "/bin"]\n'
    )
    build = subprocess.run(
        [
            engine,
            *engine_args,
            "build",
            "--network",
            "none",
            "-t",
            BUSYBOX_TAG,
            "-f",
            str(ctx / "Containerfile"),
            str(ctx),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0:
        return False
    # a cached build runs nothing: check that a container starts with these engine flags
    run = subprocess.run(
        [
            engine,
            *engine_args,
            "run",
            "--rm",
            "--network",
            "none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            BUSYBOX_TAG,
            "true",
        ],
        capture_output=True,
        timeout=120,
    )
    return run.returncode == 0


@pytest.fixture
async def real_engine(tmp_path):
    """(engine, engine args, image, whether the image has python3 and pytest)."""
    problems = {}
    for engine in ("podman", "docker"):
        problems[engine] = await engine_problem(engine)
        if problems[engine] is not None:
            continue
        # podman on cgroup-v1 hosts needs runc (crun refuses hybrid cgroups)
        choices = [[]] + ([["--runtime", "runc"]] if engine == "podman" and shutil.which("runc") else [])
        if os.environ.get("STREAMRL_TEST_SWE_IMAGE"):
            yield engine, choices[-1], os.environ["STREAMRL_TEST_SWE_IMAGE"], True
            return
        for args in choices:
            if _busybox_image(engine, args, tmp_path):
                yield engine, args, BUSYBOX_TAG, False
                subprocess.run([engine, *args, "rmi", "-f", BUSYBOX_TAG], capture_output=True, timeout=120)
                return
        pytest.skip(f"{engine} works but builds no image here: set STREAMRL_TEST_SWE_IMAGE or install busybox")
    pytest.skip("no working container engine here: " + "; ".join(f"{e}: {p}" for e, p in problems.items()))


async def test_real_container_run(real_engine):
    engine, engine_args, image, has_python = real_engine
    runtime = make_runtime(
        SweSection(
            runtime=engine,
            image=image,
            shell="bash" if has_python else "sh",
            container_engine_args=engine_args,
            command_timeout_s=60,
        )
    )
    async with runtime.workspace(CALC) as ws:
        res = await ws.run("pwd; ls /sys/class/net; echo made > made.txt; ls")
        timed = await ws.run("sleep 300", timeout_s=2.0)
        failed = await ws.run("exit 7")
        assert (ws.path / "made.txt").read_text() == "made\n"
        if has_python:
            apply_patch(ws.path, CALC.gold_patch)
            assert (await evaluate(CALC, ws)).reward == 1.0
    lines = res.output.split()
    assert res.exit_code == 0 and lines[0] == "/testbed" and lines[1:2] == ["lo"], res.output  # no network
    assert "calc" in lines and "hidden_tests" not in lines
    assert timed.timed_out and timed.duration_s < 60 and failed.exit_code == 7  # cut at 2 s, far short of the sleep
    left = subprocess.run([engine, *engine_args, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    assert "streamrl-swe-" not in left.stdout
