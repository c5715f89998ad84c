"""``streamrl bench --only routing_replay``: the trainer-vs-engine logprob mismatch at equal weights
on the MoE demo's policy (the tiny Qwen3.5-MoE, warm-started as ``streamrl demo --arch
qwen3_5_moe`` does), with MoE routing replay off and on, side by side.

A generator samples ``SAMPLES`` first turns of the crossing task (temperature 0.8, up to
``MAX_TOKENS`` tokens) and returns their tokens, logprobs and routes; the torch backend (float32,
the run's trainer) then scores the same tokens twice on the same weights: routing each token
itself (replay off) and to the generator's experts (replay on). Reported per engine precision:
``token_mult_prob_error`` (mean over generated tokens of exp|logp_gen - logp_train|, 1.0 = equal)
and ``gen_kl_error`` (mean of w - log w - 1, w = p_train / p_gen), the step record's figures, and
the share of (token, MoE layer) pairs where the trainer's own top-k experts are the generator's.

The generator is the transformers engine: it returns routes on CPU, and in bfloat16 it differs
from the float32 trainer as a GPU engine does (vLLM returns routes only on GPUs: its Model Runner
V2 needs Triton). The float32 engine is the control: the same forward pass, so both figures are
1.0 and 0.0 either way. Rendered by ``templates/routing_replay.md.jinja``; called by
`streamrl.bench.suite`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from streamrl.bench.report import Results, render

SAMPLES = 64
MAX_TOKENS = 32
TEMPERATURE = 0.8
ENGINE_DTYPES = ("bfloat16", "float32")


class Mismatch(msgspec.Struct):
    token_mult_prob_error: float
    gen_kl_error: float
    max_abs_logprob_diff: float


class EngineRun(msgspec.Struct):
    dtype: str  # the generator's precision
    tokens: int  # generated tokens scored
    own_routes_agree: float  # share of (token, MoE layer) pairs whose top-k the trainer chose as the generator did
    replay_off: Mismatch
    replay_on: Mismatch


class RoutingReplayResults(Results):
    machine: str
    model: str
    samples: int
    runs: list[EngineRun]
    seconds: float


def _prompts(tokenizer: Any) -> list[list[int]]:
    from services.gym_gateway.envs.crossing import LOOK_TOOL, PROMPT

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tools=[LOOK_TOOL], add_generation_prompt=True, tokenize=False
    )
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [ids] * SAMPLES


async def _sample(policy: Path, dtype: str, prompts: list[list[int]]) -> list[Any]:
    """(prompt ids, choice) per sample from the transformers engine with routes on."""
    from services.generator.engine import GenerationParams, build_engine
    from shared.config import load
    from shared.run_config import RunConfig

    cfg = load(
        RunConfig,
        None,
        [
            f"policy.model_name={policy}",
            "data.train_path=t.jsonl",
            "policy.moe_routing_replay=true",
            "policy.generation.backend=transformers",
            f"policy.generation.vllm_cfg.dtype={dtype}",
        ],
        env={},
    )
    engine = build_engine(cfg)
    await engine.start()
    try:
        out = []
        for i, prompt in enumerate(prompts):
            params = GenerationParams(temperature=TEMPERATURE, top_p=1.0, max_tokens=MAX_TOKENS, seed=i, routes_from=0)
            [choice] = await engine.generate(prompt, params, f"bench-{i}")
            out.append((prompt, choice))
        return out
    finally:
        await engine.aclose()


def _mismatch(gen: np.ndarray, train: np.ndarray) -> Mismatch:
    log_w = train.astype(np.float64) - gen  # float64: w - log w - 1 is ~log_w**2 / 2, below float32's reach
    return Mismatch(
        token_mult_prob_error=float(np.exp(np.abs(log_w)).mean()),
        gen_kl_error=float((np.exp(log_w) - log_w - 1.0).mean()),
        max_abs_logprob_diff=float(np.abs(log_w).max()),
    )


def _score(policy: Path, samples: list[Any], dtype: str) -> EngineRun:
    import torch

    from services.trainer.backends import build_backend
    from services.trainer.backends.routing_replay import RouteRecorder
    from services.trainer.batch import Row
    from shared.config import load
    from shared.run_config import RunConfig

    overrides = [
        f"policy.model_name={policy}",
        "data.train_path=t.jsonl",
        "policy.moe_routing_replay=true",
        f"policy.generation.temperature={TEMPERATURE}",  # the trainer scores the distribution sampled from
    ]
    backend = build_backend(load(RunConfig, None, overrides, env={}))
    recorder = RouteRecorder(backend.model)
    gen_lp, off, on, agree = [], [], [], []
    for k, (prompt, c) in enumerate(samples):
        ids = np.array(prompt + c.token_ids, np.int64)
        mask = np.zeros(len(ids), np.float32)
        mask[len(prompt) :] = 1.0
        lps = np.zeros(len(ids), np.float32)
        lps[len(prompt) :] = c.logprobs
        routes = np.zeros((len(ids), *c.routes.shape[1:]), np.int64)
        routes[: len(c.routes)] = c.routes
        rows = {
            replay: Row(f"t{k}", "g", ids, mask, lps, reward=0.0, routes=routes if replay else None)
            for replay in (False, True)
        }
        with torch.no_grad():
            recorder.clear()
            own = backend.logprobs([rows[False]])[0].numpy()
            [chosen] = recorder.routes()
            replayed = backend.logprobs([rows[True]])[0].numpy()
        gen = mask > 0
        gen_lp.append(lps[gen])
        off.append(own[gen])
        on.append(replayed[gen])
        theirs = np.sort(c.routes, axis=-1)
        mine = np.sort(chosen.numpy()[: len(c.routes)], axis=-1)
        agree.append((theirs == mine).all(axis=-1).ravel())
    g = np.concatenate(gen_lp)
    return EngineRun(
        dtype=dtype,
        tokens=int(g.size),
        own_routes_agree=float(np.concatenate(agree).mean()),
        replay_off=_mismatch(g, np.concatenate(off)),
        replay_on=_mismatch(g, np.concatenate(on)),
    )


def routing_replay_benchmark(work: Path, machine: str) -> RoutingReplayResults:
    from transformers import AutoTokenizer

    from streamrl.demo import prepare

    t0 = time.perf_counter()
    policy = prepare(work / "demo", "qwen3_5_moe")
    prompts = _prompts(AutoTokenizer.from_pretrained(str(policy)))
    runs = []
    for dtype in ENGINE_DTYPES:
        samples = asyncio.run(_sample(policy, dtype, prompts))
        runs.append(_score(policy, samples, dtype))
        print(f"routing replay, {dtype} engine: {runs[-1]}", flush=True)
    return RoutingReplayResults(
        machine=machine,
        model="tiny Qwen3.5-MoE",
        samples=SAMPLES,
        runs=runs,
        seconds=time.perf_counter() - t0,
    )


def render_section(r: RoutingReplayResults) -> str:
    return render("routing_replay", r=r, max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
