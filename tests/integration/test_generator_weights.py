"""Weight versions through the real streams: announcement -> checksum -> load -> ack, with the
transformers engine in-process and a real Valkey. Failures mark the generator failed."""

import asyncio
import uuid

import httpx
import msgspec
import pytest

from services.generator.app import build_app
from services.generator.hf_engine import HfEngine
from shared.keys import RunKeys
from shared.openai_api import ChatCompletionResponse
from shared.protocol import WeightAck, WeightAnnouncement
from shared.registry import live_workers
from shared.streams import StreamClient, connect
from shared.weights_format import checksum_dir, dir_num_bytes

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "Name a fruit."}


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir, tmp_path_factory, perturbed_model):
    return perturbed_model(tiny_model_dir, tmp_path_factory.mktemp("weights-v1"), scale=0.05, seed=1)


@pytest.fixture
async def streams(redis_url):
    redis = connect(redis_url)
    yield lambda run_id: StreamClient(redis, RunKeys(run_id), "test-trainer")
    await redis.aclose()


def announcement(path, version: int, *, checksum: str | None = None, mode: str = "drain") -> WeightAnnouncement:
    return WeightAnnouncement(
        version=version,
        path=str(path),
        checksum=checksum or checksum_dir(path),
        num_bytes=dir_num_bytes(path),
        mode=mode,
    )


async def wait_ack(sc: StreamClient, version: int, timeout_s: float = 30.0) -> WeightAck:
    cursor = "0-0"
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for d in await sc.read_after(sc.keys.weight_acks, cursor, WeightAck, block_ms=200):
            cursor = d.entry_id
            if d.msg is not None and d.msg.version == version:
                return d.msg
    raise TimeoutError(f"no ack for weight version {version}")


async def wait_acks(sc: StreamClient, count: int, timeout_s: float = 30.0) -> list[WeightAck]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        acks = [d.msg for d in await sc.read_after(sc.keys.weight_acks, "0-0", WeightAck, block_ms=100)]
        if len(acks) >= count or asyncio.get_running_loop().time() > deadline:
            return acks
        await asyncio.sleep(0.05)


async def wait_state(app, state: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while app.state.runtime.state != state:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"state {app.state.runtime.state!r} (error {app.state.runtime.error}), wanted {state!r}"
            )
        await asyncio.sleep(0.05)


async def wait_heartbeat(sc: StreamClient, check, timeout_s: float = 10.0):
    """The generator's registry record once ``check`` holds (records refresh every second)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        records = await live_workers(sc.redis, sc.keys, "generator")
        if len(records) == 1 and check(records[0]):
            return records[0]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"registry records {records} never matched")
        await asyncio.sleep(0.05)


async def chat(gen, **body) -> ChatCompletionResponse:
    r = await gen.client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=ChatCompletionResponse)


async def test_announcement_is_loaded_acked_and_served(
    hf_generator, streams, new_weights, tiny_model_dir, logprob_reference
):
    async with hf_generator() as gen:
        sc = streams(gen.cfg.run.run_id)
        temperature = gen.cfg.policy.generation.temperature
        await sc.publish(sc.keys.weights, announcement(new_weights, 1))
        ack = await wait_ack(sc, 1)
        assert ack.ok and ack.error is None and ack.worker_id == gen.runtime.worker_id and ack.load_s > 0
        assert ack.cache_reset is False  # the transformers engine has no prefix cache
        state = (await gen.client.get("/admin/state")).json()
        assert state["weight_version"] == 1 and state["state"] == "ready"
        out = await chat(gen)
        assert out.weight_version == out.weight_version_end == 1
        m = out.choices[0].message
        new = logprob_reference(new_weights, out.prompt_token_ids, m.generation_token_ids, temperature)
        old = logprob_reference(tiny_model_dir, out.prompt_token_ids, m.generation_token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(new, m.generation_log_probs, strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(old, m.generation_log_probs, strict=True)) > 1e-3
        # The served version again with the same checksum: acked ok, nothing reloaded.
        await sc.publish(sc.keys.weights, announcement(new_weights, 1))
        acks = await wait_acks(sc, 2)
        assert acks[1].version == 1 and acks[1].ok and acks[1].load_s == 0.0
        out2 = await chat(gen)
        m2 = out2.choices[0].message
        new2 = logprob_reference(new_weights, out2.prompt_token_ids, m2.generation_token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(new2, m2.generation_log_probs, strict=True)) < 1e-4


async def test_an_older_version_rolls_back(hf_generator, streams, new_weights, tiny_model_dir, logprob_reference):
    """A trainer that resumed from an earlier checkpoint re-announces an older version: generators
    that went further in the abandoned run load it, so no sample comes from discarded weights."""
    async with hf_generator() as gen:
        sc = streams(gen.cfg.run.run_id)
        await sc.publish(sc.keys.weights, announcement(new_weights, 3))
        assert (await wait_ack(sc, 3)).ok
        await sc.publish(sc.keys.weights, announcement(tiny_model_dir, 2))
        ack = await wait_ack(sc, 2)
        assert ack.ok and ack.load_s > 0
        out = await chat(gen)
        assert out.weight_version == 2
        m = out.choices[0].message
        ref = logprob_reference(tiny_model_dir, out.prompt_token_ids, m.generation_token_ids, 0.8)
        assert max(abs(a - b) for a, b in zip(ref, m.generation_log_probs, strict=True)) < 1e-4


async def test_latest_announcement_is_loaded_at_startup(streams, new_weights, write_config, tiny_model_dir, redis_url):
    # A run id chosen before the generator starts, so the announcement is already there.
    run_id = f"gen-{uuid.uuid4().hex[:8]}"
    sc = streams(run_id)
    await sc.publish(sc.keys.weights, announcement(new_weights, 3))
    _, cfg = write_config(tiny_model_dir, redis_url=redis_url, run_id=run_id)
    app = build_app(cfg, worker_id="gen-startup", port=0)
    async with app.router.lifespan_context(app):
        await wait_state(app, "ready")
        assert app.state.runtime.weight_version == 3
        assert (await wait_ack(sc, 3)).ok
        await wait_heartbeat(sc, lambda hb: hb.weight_version == 3 and hb.state == "ready")


async def test_bad_checksum_fails_the_generator_until_a_good_load(hf_generator, streams, new_weights):
    async with hf_generator() as gen:
        sc = streams(gen.cfg.run.run_id)
        await sc.publish(sc.keys.weights, announcement(new_weights, 1, checksum="0" * 64))
        ack = await wait_ack(sc, 1)
        assert not ack.ok and "checksum mismatch" in ack.error
        ready = await gen.client.get("/ready")
        assert ready.status_code == 503 and "checksum mismatch" in ready.json()["error"]
        r = await gen.client.post("/v1/chat/completions", json={"messages": [USER]})
        assert r.status_code == 503 and "checksum mismatch" in r.json()["error"]["message"]
        hb = await wait_heartbeat(sc, lambda hb: hb.state == "failed")
        assert "checksum mismatch" in hb.error and hb.weight_version == -1
        assert gen.app.state.lifecycle.exit_code is None  # a failed load leaves the process up to recover
        # The admin route takes the same path and recovers the generator.
        r = await gen.client.post(
            "/admin/load_weights", json={"version": 2, "path": str(new_weights), "checksum": checksum_dir(new_weights)}
        )
        assert r.status_code == 200 and r.json()["ok"], r.text
        assert (await wait_ack(sc, 2)).ok
        assert (await gen.client.get("/ready")).status_code == 200
        assert (await chat(gen)).weight_version == 2


async def test_keep_mode_refit_continues_a_running_request_on_the_new_version(
    hf_generator, streams, new_weights, until_generating, tiny_model_dir, logprob_reference
):
    """An in-flight weight update interrupts the running request and continues it on the new
    weights with its prefix encoded again: each token's logprob is exactly one version's, and
    the response says which tokens came from which version."""
    async with hf_generator(max_new_tokens=300) as gen:
        sc = streams(gen.cfg.run.run_id)
        engine = gen.runtime.engine
        temperature = gen.cfg.policy.generation.temperature
        # Seeded so the old weights' sample cannot stop at an end-of-sequence token before the refit.
        running = asyncio.create_task(chat(gen, max_tokens=300, seed=7))
        await until_generating(engine, running)
        await sc.publish(sc.keys.weights, announcement(new_weights, 1, mode="keep"))
        assert (await wait_ack(sc, 1)).ok
        out = await asyncio.wait_for(running, 120)
        assert (out.weight_version, out.weight_version_end) == (-1, 1)
        assert gen.runtime.interrupts == 1
    c = out.choices[0]
    ids, lps = c.message.generation_token_ids, c.message.generation_log_probs
    assert c.weight_version_spans is not None, "the request finished before the refit"
    [[first, old_version], [cut, new_version]] = c.weight_version_spans
    assert (first, old_version, new_version) == (0, -1, 1) and 0 < cut < len(ids)
    assert len(ids) == len(lps) and (c.finish_reason != "length" or len(ids) == 300)
    prompt = out.prompt_token_ids
    old = logprob_reference(tiny_model_dir, prompt, ids[:cut], temperature)
    new = logprob_reference(new_weights, prompt + ids[:cut], ids[cut:], temperature)
    assert max(abs(a - b) for a, b in zip(old, lps[:cut], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(new, lps[cut:], strict=True)) < 1e-4


async def test_drain_mode_refit_waits_for_the_running_request(hf_generator, streams, new_weights, until_generating):
    async with hf_generator(max_new_tokens=200) as gen:
        sc = streams(gen.cfg.run.run_id)
        engine = gen.runtime.engine
        running = asyncio.create_task(chat(gen, max_tokens=200, seed=7))
        await until_generating(engine, running)
        await sc.publish(sc.keys.weights, announcement(new_weights, 1, mode="drain"))
        ack = await wait_ack(sc, 1)
        # The load waited for the running request, which finished wholly on the old weights.
        assert ack.ok and running.done()
        out = await running
        assert (out.weight_version, out.weight_version_end) == (-1, -1)
        after = await chat(gen, max_tokens=2)
        assert (after.weight_version, after.weight_version_end) == (1, 1)


class _RefusingCacheEngine(HfEngine):
    """An engine whose prefix cache is on but refuses to reset (e.g. blocks still held)."""

    @property
    def prefix_caching_enabled(self) -> bool:
        return True

    async def reset_prefix_cache(self) -> bool:
        return False


async def test_refused_prefix_cache_reset_fails_the_refit(
    streams, new_weights, write_config, tiny_model_dir, redis_url
):
    _, cfg = write_config(tiny_model_dir, redis_url=redis_url)
    app = build_app(cfg, worker_id="gen-refuse", port=0, engine=_RefusingCacheEngine(cfg))
    sc = streams(cfg.run.run_id)
    async with app.router.lifespan_context(app):
        await wait_state(app, "ready")
        await sc.publish(sc.keys.weights, announcement(new_weights, 1))
        ack = await wait_ack(sc, 1)
        assert not ack.ok and "prefix cache" in ack.error
        assert app.state.runtime.state == "failed" and app.state.runtime.weight_version == -1
        # Out of service until a later load succeeds: generation is refused, /ready says why.
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://generator") as client:
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503 and "prefix cache" in r.json()["error"]["message"]
            ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["state"] == "failed"
        # A failed load is not a dead task: the process stays up for the next load.
        assert app.state.lifecycle.exit_code is None and not app.state.lifecycle.failed


class _RandomStartEngine(HfEngine):
    """Starts on random weights, as vLLM does with ``load_format: dummy``."""

    async def start(self) -> None:
        import dataclasses

        import torch

        await super().start()
        with torch.no_grad():
            for p in self._model.parameters():
                p.uniform_(-0.1, 0.1)
        self._info = dataclasses.replace(self._info, random_weights=True)


async def test_a_generator_on_random_weights_serves_only_after_a_version_loads(
    streams, new_weights, write_config, tiny_model_dir, redis_url, logprob_reference
):
    """With nothing announced yet it is up (/ready 200, so the trainer's first refit can reach
    it) but refuses generation, and the registry says so: gateways route nothing to it, the
    refit waits for it. The first version that loads puts it in service."""
    from services.trainer.refit import refit_members

    _, cfg = write_config(tiny_model_dir, redis_url=redis_url)
    app = build_app(cfg, worker_id="gen-random", port=0, engine=_RandomStartEngine(cfg))
    sc = streams(cfg.run.run_id)
    async with app.router.lifespan_context(app):
        await wait_state(app, "awaiting_weights")
        await wait_heartbeat(sc, lambda hb: hb.state == "awaiting_weights" and hb.weight_version == -1)
        assert await refit_members(sc) == {"gen-random"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://generator") as client:
            r = await client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 4})
            assert r.status_code == 503 and "no weights yet" in r.json()["error"]["message"]
            ready = await client.get("/ready")
            assert ready.status_code == 200 and ready.json()["state"] == "awaiting_weights"
            await sc.publish(sc.keys.weights, announcement(new_weights, 0))
            assert (await wait_ack(sc, 0)).ok
            await wait_state(app, "ready")
            r = await client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 6})
            assert r.status_code == 200, r.text
        out = msgspec.json.decode(r.content, type=ChatCompletionResponse)
        m = out.choices[0].message
        ref = logprob_reference(
            new_weights, out.prompt_token_ids, m.generation_token_ids, cfg.policy.generation.temperature
        )
        assert out.weight_version == 0
        assert max(abs(a - b) for a, b in zip(ref, m.generation_log_probs, strict=True)) < 1e-4
