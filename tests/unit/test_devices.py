"""`streamrl up` deals this node's GPUs (or CPU cores) to its processes: the trainer's ranks
first, then one slot per generator of its engine's parallel size; slots are held while a member
lives and a scale-up beyond them fails by name."""

import time

import pytest

from shared.config import load
from shared.config_error import ConfigError
from shared.run_config import RunConfig
from streamrl.devices import CPU_ENV, GPU_ENV, NoFreeDevices, node_gpus, plan_devices
from streamrl.worker_pool import CannotStart, Member, WorkerPool


def cfg(*overrides: str) -> RunConfig:
    return load(RunConfig, None, ["policy.model_name=m", *overrides], env={})


GPUS = [str(i) for i in range(8)]
TP = "policy.generation.vllm_cfg.tensor_parallel_size"


def test_the_trainer_takes_its_ranks_gpus_and_generators_share_the_rest():
    layout = plan_devices(cfg("trainer.nproc_per_node=2", f"{TP}=2"), GPUS, [])
    assert layout is not None and layout.env_var == GPU_ENV
    assert layout.trainer_env == {GPU_ENV: "0,1"}
    assert layout.slots == ("2,3", "4,5", "6,7")
    pp = 'policy.generation.vllm_cfg.vllm_kwargs={"pipeline_parallel_size": 2}'
    assert plan_devices(cfg(f"{TP}=2", pp), GPUS, []).slots == ("1,2,3,4",)


def test_explicit_generator_gpus_leave_the_trainer_alone():
    layout = plan_devices(cfg("generator.gpus=4,5,6,7", f"{TP}=2"), GPUS, [])
    assert layout is not None and layout.slots == ("4,5", "6,7") and layout.trainer_env == {}


def test_a_node_too_small_to_split_is_shared_with_a_warning(caplog):
    assert plan_devices(cfg("trainer.nproc_per_node=4", f"{TP}=8"), GPUS, []) is None
    assert "this node has 8 GPU(s), fewer than the trainer's 4" in caplog.text
    assert plan_devices(cfg(), ["0"], []) is None  # one GPU: the demo's trainer and generator share it


def test_a_layout_that_cannot_fit_is_refused():
    with pytest.raises(ConfigError, match=r"generator.cpu_cores_per_worker \(3\) must be a multiple of the engine's"):
        plan_devices(cfg("generator.cpu_cores_per_worker=3", f"{TP}=2"), [], [0, 1, 2])


def test_cpu_nodes_bind_each_generator_to_its_own_cores_only_when_asked():
    assert plan_devices(cfg(), [], list(range(6))) is None  # vLLM's own binding
    layout = plan_devices(cfg("generator.cpu_cores_per_worker=2"), [], [5, 4, 3, 2, 1, 0])
    assert layout is not None and layout.env_var == CPU_ENV and layout.slots == ("0,1", "2,3", "4,5")
    tp2 = plan_devices(cfg("generator.cpu_cores_per_worker=4", f"{TP}=2"), [], list(range(8)))
    assert tp2 is not None and tp2.slots == ("0,1|2,3", "4,5|6,7")  # one core list per engine rank


def test_node_gpus_follow_the_visible_devices():
    assert node_gpus({GPU_ENV: "2,3"}) == ["2", "3"]
    assert node_gpus({GPU_ENV: ""}) == [] and node_gpus({GPU_ENV: "-1"}) == []


def test_generators_take_the_first_free_slot_and_keep_it_while_they_live(tmp_path):
    from streamrl.supervisor import Supervisor

    config = tmp_path / "run.yaml"
    config.write_text(f"policy:\n  model_name: m\ndata:\n  train_path: {tmp_path / 't.jsonl'}\n")
    sup = Supervisor(str(config), [], progress=False)
    sup.redis_url = "redis://127.0.0.1:1"  # set once Redis is up; no process starts here
    sup.devices = plan_devices(sup.cfg, ["0", "1", "2"], [])  # trainer 0, generators 1 and 2
    pool = sup.pools["generator"]
    first = sup._generator(0)
    assert first.env[GPU_ENV] == "1"
    pool.members.append(Member(first, "ready", time.monotonic()))
    second = sup._generator(1)
    assert second.env[GPU_ENV] == "2"
    pool.members.append(Member(second, "stopping", time.monotonic()))  # draining: still holds its GPU
    with pytest.raises(NoFreeDevices, match=r"generator-2 cannot start: all 2 device slot\(s\)"):
        sup._generator(2)
    pool.members.remove(pool.members[0])  # generator-0 exited
    assert sup._generator(3).env[GPU_ENV] == "1"


def test_more_generators_than_slots_are_refused_before_anything_starts(tmp_path):
    from streamrl.supervisor import Supervisor

    config = tmp_path / "run.yaml"
    config.write_text(f"policy:\n  model_name: m\ndata:\n  train_path: {tmp_path / 't.jsonl'}\n")
    with pytest.raises(ConfigError, match=r"generator.cpu_cores_per_worker: \d+ available, one generator needs 4096"):
        Supervisor(str(config), ["generator.cpu_cores_per_worker=4096"], progress=False)


def test_a_scale_up_without_free_slots_fails_the_request_not_the_supervisor():
    def no_room(index: int):
        raise NoFreeDevices(f"generator-{index} cannot start: all 1 device slot(s) are held")

    pool = WorkerPool("generator", no_room, stop_timeout_s=1.0, ready_timeout_s=1.0)
    pool.target = 1
    assert pool.tick(time.monotonic())
    assert isinstance(NoFreeDevices("x"), CannotStart)
    assert pool.error is not None and "cannot start" in pool.error and not pool.members
