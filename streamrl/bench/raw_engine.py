"""The raw side of the generator's throughput benchmark: vLLM's ``AsyncLLM`` fed directly, in a
process of its own (`streamrl.bench.throughput` starts it)::

    python -m streamrl.bench.raw_engine CONFIG OUT

One block: the engine built from the served engine's own builders, warmed up, then every round of
`round_plan` at its concurrency; the rounds are written to OUT as JSON (`RawRound`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from streamrl.bench.throughput import (
    CONCURRENCY,
    MAX_TOKENS,
    WARM_REQUESTS,
    BenchRequest,
    RawRound,
    check_no_chunked_prefill,
    closed_loop,
    make_requests,
    request_count,
    round_plan,
)

if TYPE_CHECKING:
    from shared.run_config import RunConfig


class RawEngine:
    """vLLM's AsyncLLM with the served engine's args and sampling parameters, called directly."""

    def __init__(self, cfg: RunConfig, stops: tuple[int, ...]) -> None:
        from services.generator.vllm_engine import VllmEngine

        # The served engine's own builders, so the baseline cannot drift from what is served.
        self._served = VllmEngine(cfg)
        self._cfg = cfg
        self._stops = stops
        self.llm: Any = None

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, self._served._engine_args())

    async def one(self, req: BenchRequest) -> int:
        from services.generator.engine import GenerationParams
        from services.generator.vllm_engine import vllm_request_types

        TokensPrompt = vllm_request_types()[2]  # imported as the served engine imports it
        gen = self._cfg.policy.generation
        params = GenerationParams(
            temperature=gen.temperature,
            top_p=gen.top_p,
            max_tokens=MAX_TOKENS,
            n=1,
            seed=req.seed,
            stop_token_ids=self._stops,
            top_logprobs=0,
        )
        sp = self._served._sampling_params(params)
        tokens = 0
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=req.prompt_ids), sp, request_id=f"raw-{uuid.uuid4().hex}"
        ):
            tokens = sum(len(c.token_ids) for c in out.outputs)
        return tokens

    async def aclose(self) -> None:
        llm, self.llm = self.llm, None
        await asyncio.to_thread(llm.shutdown)


async def _raw_block(config: Path) -> list[RawRound]:
    from services.generator.app import build_renderer, freeze_startup_heap
    from shared.config import load
    from shared.run_config import RunConfig

    cfg = load(RunConfig, config, env={})
    renderer = build_renderer(cfg)
    raw = RawEngine(cfg, tuple(sorted(renderer.turn_stop_ids)))  # what the generator adds to every chat request
    await raw.start()
    try:
        freeze_startup_heap()  # what the generator does once it is up, so both sides collect alike
        budget = int(raw.llm.vllm_config.scheduler_config.max_num_batched_tokens)
        warm = make_requests(renderer, WARM_REQUESTS, seed=1)
        check_no_chunked_prefill(warm, max(CONCURRENCY), budget)
        await closed_loop(warm, max(CONCURRENCY), raw.one)
        rounds = []
        for rnd, c, seed in round_plan():
            reqs = make_requests(renderer, request_count(c), seed)
            check_no_chunked_prefill(reqs, c, budget)
            cpu0 = time.process_time()
            tokens, seconds = await closed_loop(reqs, c, raw.one)
            cpu_s = time.process_time() - cpu0
            rounds.append(RawRound(rnd, c, len(reqs), tokens, seconds, cpu_s, os.getloadavg()[0]))
        return rounds
    finally:
        await raw.aclose()


def main(argv: list[str]) -> int:
    """``python -m streamrl.bench.raw_engine CONFIG OUT``: one raw block, its rounds as JSON in OUT."""
    from services.generator.vllm_env import apply_env_defaults

    apply_env_defaults()  # before anything imports vLLM
    config, out = Path(argv[0]), Path(argv[1])
    out.write_bytes(msgspec.json.encode(asyncio.run(_raw_block(config))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
