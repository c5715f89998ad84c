"""The weight-transport contract, run against every transport (``refit.transport``): a real
learner (the torch backend on the tiny model; for the collective transport the megatron backend
too, whose weights leave megatron-core's layout on the way) publishes through `WeightPublisher` to
generator services running in-process (the transformers engine) over a real Valkey.

Every transport must: bring each generator to exactly the trainer's weights and make it serve the
new version; let a generator that starts after a refit reach the current version (filesystem: the
newest announcement; collective: the newest snapshot) and include it in the next refit; and fail a
refit by name when a generator cannot load. vLLM engines take the same collective path in
tests/integration/test_generator_engine_contract.py (child process) and the end-to-end run;
a generator killed mid-transfer is in tests/faults/test_refit_generator_kill.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import pytest
import torch

from services.generator.app import build_app
from services.trainer.backends import build_backend
from services.trainer.learner import LocalLearner
from services.trainer.refit import RefitError, WeightPublisher
from services.trainer.refit_probe import build_probe
from services.trainer.weight_transport import build_transport
from shared.config import decode_tree
from shared.keys import RunKeys
from shared.pause import PauseControl
from shared.run_config import RunConfig
from shared.streams import StreamClient, connect

pytestmark = pytest.mark.integration

# (transport, training backend, refit.collective.method): the torch backend's collective refits
# follow a resharding plan by default (every rank sends its own rows); megatron's broadcast
RIGS = [
    ("filesystem", "torch", "auto"),
    ("collective", "torch", "auto"),
    ("collective", "torch", "broadcast"),
    ("collective", "megatron", "auto"),
]


def run_config(
    tiny_model_dir, redis_url, config_tree, transport: str, run_id: str, method: str = "auto", trainer: str = "torch"
) -> RunConfig:
    tree = config_tree(tiny_model_dir, run_id=run_id, redis_url=redis_url, backend="transformers")
    collective = {"master_address": "127.0.0.1", "bucket_mb": 1, "method": method}
    tree["refit"] = {"transport": transport, "collective": collective}
    tree["policy"]["precision"] = "float32"
    tree["data"] = {"train_path": "unused.jsonl"}
    # bounds the transfer group too: a broadcast to a generator that stopped taking part ends then
    tree["trainer"] = {"refit_timeout_s": 20.0, "torch_threads": 1, "backend": trainer}
    return decode_tree(tree, RunConfig)


@contextlib.asynccontextmanager
async def generator(cfg: RunConfig, worker_id: str):
    app = build_app(cfg, worker_id=worker_id, port=0)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gen") as client:
            for _ in range(600):
                if (await client.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            yield app, client


@pytest.fixture(params=RIGS, ids=["-".join(r).removesuffix("-auto") for r in RIGS])
async def rig(request, tiny_model_dir, redis_url, generator_config_tree, tmp_path):
    """(cfg, learner, publisher) for one transport on a fresh run; the learner's policy is nudged
    away from the generators' initial weights, as a training step would."""
    transport, backend, method = request.param
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
        request.addfinalizer(_leave_megatron_groups)
    run_id = f"wt-{uuid.uuid4().hex[:6]}"
    cfg = run_config(tiny_model_dir, redis_url, generator_config_tree, transport, run_id, method, backend)
    learner = LocalLearner(lambda: build_backend(cfg))
    await learner.start()
    nudge(learner.backend.model, seed=1)
    redis = connect(redis_url)
    keys = RunKeys(cfg.run.run_id)
    streams = StreamClient(redis, keys, "trainer")
    transport = build_transport(cfg, learner, tmp_path / "weights", redis, keys)
    pub = WeightPublisher(
        streams,
        PauseControl(redis, keys),
        transport,
        timeout_s=60.0,
        in_flight_updates=False,
        max_attempts=2,
        probe=build_probe(cfg, learner.probe),  # every refit verified: each generator scores the probe
    )
    yield cfg, learner, pub
    await learner.close()
    await redis.aclose()


def _leave_megatron_groups() -> None:
    """The megatron backend joined a one-rank process group and Megatron's groups in this process;
    later tests start from none."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def nudge(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def assert_same_weights(learner: LocalLearner, app) -> None:
    trainer = {name: t.float() for name, t in learner.backend.weight_tensors()}
    served = app.state.runtime.engine._model.state_dict()
    assert set(trainer) <= set(served)
    for name, t in trainer.items():
        assert torch.equal(served[name], t), name


async def served_version(client: httpx.AsyncClient) -> int:
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    return int(r.json()["weight_version"])


async def test_every_generator_serves_the_trainers_weights(rig):
    cfg, learner, pub = rig
    async with generator(cfg, "gen-a") as (a, ca), generator(cfg, "gen-b") as (b, cb):
        report = await pub.refit(1)
        assert report.transport == cfg.refit.transport and report.generators == ["gen-a", "gen-b"]
        assert report.num_bytes > 0 and report.attempts == 1
        assert report.probe_error is not None and report.probe_error < 1e-3  # float32 on both sides
        for app, client in ((a, ca), (b, cb)):
            assert_same_weights(learner, app)
            assert await served_version(client) == 1
        # The next version: the learner moved on, the same generators follow.
        nudge(learner.backend.model, seed=2)
        await pub.refit(2)
        for app in (a, b):
            assert_same_weights(learner, app)


async def test_a_generator_that_starts_later_reaches_the_current_version(rig):
    cfg, learner, pub = rig
    async with generator(cfg, "gen-a"):
        await pub.refit(1)
        async with generator(cfg, "gen-late") as (late, client):
            assert late.state.runtime.weight_version == 1
            assert_same_weights(learner, late)
            nudge(learner.backend.model, seed=3)
            report = await pub.refit(2)  # the newcomer is part of the next refit (a new group)
            assert report.generators == ["gen-a", "gen-late"]
            assert_same_weights(learner, late)
            assert await served_version(client) == 2


async def test_a_generator_that_computes_with_other_weights_fails_the_probe_by_name(rig):
    """The bytes arrive intact (checksums agree), but the engine does not compute with them (as
    when a loader puts a slice in the wrong place): the probe catches it, naming generator and
    version."""
    cfg, _, pub = rig
    async with generator(cfg, "gen-ok"), generator(cfg, "gen-bad") as (bad, _):
        engine = bad.state.runtime.engine
        loaded, received = engine.load_weights, engine.receive_weights

        def spoil() -> None:
            with torch.no_grad():
                for p in engine._model.parameters():
                    p.mul_(1.2)

        async def load_then_spoil(*args, **kwargs):
            await loaded(*args, **kwargs)
            spoil()

        async def receive_then_spoil(*args, **kwargs):
            checksum = await received(*args, **kwargs)
            spoil()
            return checksum

        engine.load_weights, engine.receive_weights = load_then_spoil, receive_then_spoil
        with pytest.raises(RefitError, match="gen-bad at weight version 1 scores the probe"):
            await pub.refit(1)


async def test_a_generator_that_cannot_load_fails_the_refit_by_name(rig):
    cfg, _, pub = rig
    async with generator(cfg, "gen-ok"), generator(cfg, "gen-bad") as (bad, _):
        engine = bad.state.runtime.engine

        async def broken(*args, **kwargs):
            raise RuntimeError("device on fire")

        engine.load_weights = broken
        engine.receive_weights = broken
        with pytest.raises(RefitError, match="gen-bad.*device on fire"):
            await pub.refit(1)
        assert await pub.pause.reasons() == {}  # the launch gate is open again
