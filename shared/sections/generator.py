"""The generator service's sections: its server and deadlines (``generator``), and how it samples
(``policy.generation``) on which engine (``policy.generation.vllm_cfg``).

Read by the generator (`services.generator`); the trainer reads ``policy.generation`` too (the
sampling it scores tokens under), ``streamrl up`` the generator's workers and devices.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from shared.protocol import SamplingParams
from shared.sections.base import D, Section


class GeneratorSection(Section):
    host: Annotated[str, D("bind address")] = "127.0.0.1"
    port: Annotated[int, D("port of the first generator (more get the next ports); 0: any free port")] = 8100
    num_workers: Annotated[int, D("generator processes started by `streamrl up`")] = 1
    turn_terminator: Annotated[str | None, D("token that ends a chat turn; null: the tokenizer's EOS")] = None
    weight_load_timeout_s: Annotated[float, D("deadline for loading one weight version")] = 120.0
    drain_timeout_s: Annotated[
        float, D("deadline to finish in-flight requests before a drained refit, and for the drain at SIGTERM")
    ] = 60.0
    drain_session_idle_s: Annotated[
        float,
        D(
            "at SIGTERM the generator keeps serving sessions it already has (new ones go elsewhere) until none has "
            "called for this long; raise it for agents whose tools run long between turns"
        ),
    ] = 3.0
    max_concurrent_requests: Annotated[int, D("requests admitted at once; more wait (backpressure)")] = 512
    gpus: Annotated[
        str | None,
        D(
            "GPU ids of this node dealt to the generators `streamrl up` starts (comma-separated), each its "
            "vllm_cfg parallel size of them; null: the node's GPUs after the trainer's first nproc_per_node"
        ),
    ] = None
    cpu_cores_per_worker: Annotated[
        int | None,
        D(
            "on a node without GPUs, bind each generator `streamrl up` starts to this many cores of its own "
            "(VLLM_CPU_OMP_THREADS_BIND); null: vLLM's own binding (every engine on the same cores)"
        ),
    ] = None


class VllmSection(Section):
    dtype: Annotated[
        str,
        D(
            "engine dtype (float32 on CPU for exact logprobs); auto: vLLM's choice, and bfloat16 for a model with "
            "Gated DeltaNet layers on CPU (Qwen3.5, Qwen3-Next: vLLM's CPU kernels run nothing else; another dtype is "
            "refused)"
        ),
    ] = "auto"
    enforce_eager: Annotated[bool, D("skip torch.compile/graph capture (fast start on CPU)")] = False
    max_model_len: Annotated[int | None, D("engine context length; null: the model's")] = None
    kv_cache_memory_bytes: Annotated[int | None, D("KV cache size in bytes (required on CPU)")] = None
    gpu_memory_utilization: Annotated[float, D("GPU memory fraction for weights+KV (GPU only)")] = 0.9
    max_num_seqs: Annotated[int, D("max sequences batched together by the engine")] = 256
    enable_prefix_caching: Annotated[
        bool | None,
        D(
            "prefix caching; null: the engine's default, except off on CPU for a model with recurrent-state layers "
            "(Gated DeltaNet, Mamba), which vLLM caches only with chunked prefill (on CPU: no per-request seeds)"
        ),
    ] = None
    enable_chunked_prefill: Annotated[
        bool | None,
        D(
            "split long prompts across engine steps; null: the engine's default on GPUs, off on CPUs (vLLM's CPU "
            "sampler cannot rewind a seeded request's generator after a partial prefill) unless prefix caching of a "
            "model with recurrent-state layers needs it; on, on CPU, per-request seeds are ignored"
        ),
    ] = None
    max_num_batched_tokens: Annotated[int | None, D("token budget of one engine step; null: the engine's default")] = (
        None
    )
    tensor_parallel_size: Annotated[int, D("tensor parallel degree of each engine")] = 1
    enable_expert_parallel: Annotated[
        bool, D("shard MoE experts across the engine's ranks (expert parallel size = tensor_parallel_size)")
    ] = False
    load_format: Annotated[
        str | None,
        D(
            "how the engine loads its first weights (vLLM's load_format); null: dummy (random, nothing read) when "
            "refit.transport is collective, vLLM's auto otherwise. With dummy the generator serves nothing until a "
            "refit or snapshot brings real weights (the trainer's first refit does at start-up)"
        ),
    ] = None
    vllm_kwargs: Annotated[
        dict[str, Any],
        D(
            "any other vLLM engine argument by its AsyncEngineArgs name (moe_backend, pipeline_parallel_size, "
            "data_parallel_size, kv_cache_dtype, compilation_config, ...), checked with vLLM's own argument types "
            "when the generator starts and by `streamrl config check`"
        ),
    ] = msgspec.field(default_factory=dict)

    def initial_load_format(self, transport: str) -> str:
        """The load_format the engine starts with under ``refit.transport`` = ``transport``."""
        if self.load_format is not None:
            return self.load_format
        return "dummy" if transport == "collective" else "auto"

    def devices_per_engine(self) -> int:
        """Accelerators one engine spans: tensor x pipeline x data parallel sizes."""
        kw = self.vllm_kwargs
        sizes = (kw.get("pipeline_parallel_size", 1), kw.get("data_parallel_size", 1))
        n = self.tensor_parallel_size
        for size in sizes:
            n *= size if isinstance(size, int) and size > 0 else 1
        return n


class GenerationSection(Section):
    backend: Annotated[Literal["vllm", "transformers"], D("generation engine")] = "vllm"
    temperature: Annotated[float, D("training sampling temperature")] = 1.0
    top_p: Annotated[float, D("training nucleus sampling")] = 1.0
    top_k: Annotated[int | None, D("training top-k; must stay null (on-policy gate)")] = None
    max_new_tokens: Annotated[int, D("cap on generated tokens per model call")] = 512
    val_temperature: Annotated[float | None, D("validation temperature; null: the training value")] = None
    val_top_p: Annotated[float | None, D("validation top-p; null: the training value")] = None
    vllm_cfg: VllmSection = msgspec.field(default_factory=VllmSection)

    def sampling(self, kind: Literal["train", "validation"]) -> SamplingParams:
        if kind == "validation":
            return SamplingParams(
                temperature=self.temperature if self.val_temperature is None else self.val_temperature,
                top_p=self.top_p if self.val_top_p is None else self.val_top_p,
                top_k=None,
                max_tokens=self.max_new_tokens,
                kind="validation",
            )
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_new_tokens
        )
