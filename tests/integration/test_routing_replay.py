"""MoE routing replay (policy.moe_routing_replay) on the tiny Qwen3.5-MoE, transformers engine and
torch backend: the generator returns the routes a forward pass of the same weights takes, a later
call returns only the positions asked for, the trainer's forward routes a row's tokens to the
generator's experts (not its own), in the policy and in the frozen reference, and a model
without experts fails at start (the trainer on either backend). The megatron backend's replay:
tests/unit/test_megatron_moe.py, and its steps against the torch backend's:
tests/integration/test_backend_contract.py."""

import msgspec
import numpy as np
import pytest
import torch

from services.trainer.backends import build_backend
from services.trainer.backends.routing_replay import RouteRecorder
from services.trainer.batch import Row
from shared import routes as routes_wire
from shared.config import decode_tree, load
from shared.config_error import ConfigError
from shared.openai_api import ChatCompletionResponse
from shared.run_config import RunConfig
from tests.support.generator import in_process_generator

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "Name a fruit and a colour."}


def _replaying(tree: dict) -> RunConfig:
    tree["policy"]["moe_routing_replay"] = True
    return decode_tree(tree, RunConfig)


async def _chat(gen, **body) -> ChatCompletionResponse:
    r = await gen.client.post("/v1/chat/completions", json={"messages": [USER], **body})
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=ChatCompletionResponse)


def _own_routes(model_dir, ids: list[int]) -> np.ndarray:
    """[len(ids), layers, top_k]: the experts a float32 forward pass of ``model_dir`` picks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    recorder = RouteRecorder(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]))
    [routes] = recorder.routes()
    return routes.numpy()


async def test_the_generator_returns_the_routes_of_every_position_it_ran(tiny_hybrid_moe_dir, generator_config_tree):
    tree = generator_config_tree(tiny_hybrid_moe_dir, run_id="routes", redis_url=None, backend="transformers")
    async with in_process_generator(_replaying(tree)) as gen:
        out = await _chat(gen, n=2, max_tokens=8, seed=3)
        shape = out.route_shape
        assert shape == routes_wire.RouteShape(layers=4, top_k=2, num_experts=8)
        for c in out.choices:
            ids = out.prompt_token_ids + c.message.generation_token_ids
            routes = routes_wire.unpack(routes_wire.from_text(c.routes), shape)
            assert c.routes_start == 0 and routes.shape == (len(ids) - 1, 4, 2)  # the last token never ran
            # The same weights in float32 route every position the same way.
            assert np.array_equal(routes, _own_routes(tiny_hybrid_moe_dir, ids)[:-1])
        # A later call asks only for the positions it has not had.
        first = out.choices[0]
        later = await _chat(gen, n=1, max_tokens=4, seed=3, routes_from=5)
        tail = routes_wire.unpack(routes_wire.from_text(later.choices[0].routes), shape)
        assert later.choices[0].routes_start == 5
        assert np.array_equal(
            tail[: len(out.prompt_token_ids) - 5], _own_routes(tiny_hybrid_moe_dir, out.prompt_token_ids)[5:]
        )
        assert first.routes is not None
        r = await gen.client.post("/v1/chat/completions", json={"messages": [USER], "routes_from": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "routes_from"


async def test_a_model_without_experts_fails_the_generator_at_start(tiny_model_dir, generator_config_tree):
    tree = generator_config_tree(tiny_model_dir, run_id="routes-dense", redis_url=None, backend="transformers")
    with pytest.raises(Exception, match="moe_routing_replay"):
        async with in_process_generator(_replaying(tree)):
            pass


def _backend(model_dir, replay: bool, backend: str = "torch", *extra: str):
    overrides = [
        f"policy.model_name={model_dir}",
        "data.train_path=t.jsonl",
        f"trainer.backend={backend}",
        f"policy.moe_routing_replay={'true' if replay else 'false'}",
        "run.seed=0",
        "trainer.torch_threads=1",
        *extra,
    ]
    return build_backend(load(RunConfig, None, overrides, env={}))


def test_the_trainer_routes_each_token_to_the_generators_experts(tiny_hybrid_moe_dir):
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 800, size=24).astype(np.int64)
    tmask = np.zeros(24, np.float32)
    tmask[12:] = 1.0
    own = _own_routes(tiny_hybrid_moe_dir, ids.tolist())
    # Routes no forward pass of these weights takes: every token to two other experts.
    replayed = (own + 3) % 8
    replayed[:, :, 1] = np.where(replayed[:, :, 0] == replayed[:, :, 1], (replayed[:, :, 1] + 1) % 8, replayed[:, :, 1])
    row = Row("t0", "g0", ids, tmask, np.zeros(24, np.float32), reward=1.0, advantage=1.0, routes=replayed)
    plain = Row("t1", "g0", ids, tmask, np.zeros(24, np.float32), reward=1.0, advantage=1.0, routes=None)

    # with a reference policy: the policy and the frozen reference both replay
    backend = _backend(tiny_hybrid_moe_dir, True, "torch", "loss_fn.reference_policy_kl_penalty=0.1")
    recorder, reference = RouteRecorder(backend.model), RouteRecorder(backend.ref_model)
    with torch.no_grad():
        with_routes = backend.logprobs([row])
        [used] = recorder.routes()
        recorder.clear()
        without = backend.logprobs([plain])
        [chosen] = recorder.routes()
        backend.logprobs([row], reference=True)
        [used_by_reference] = reference.routes()
    assert np.array_equal(used.numpy(), replayed)  # every position, every MoE layer
    assert np.array_equal(chosen.numpy(), own)  # a row without routes: the trainer's own routing
    assert not torch.allclose(with_routes, without)
    assert np.array_equal(used_by_reference.numpy(), replayed)


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_model_without_experts_fails_the_trainer_at_start(tiny_model_dir, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    with pytest.raises(ConfigError, match="moe_routing_replay is on, but the model .* has no routed experts"):
        _backend(tiny_model_dir, replay=True, backend=backend)
