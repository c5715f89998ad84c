"""The engine interface every generation backend implements, and the factory that picks one.

Callers: `services.generator.serving` (generate), `services.generator.weights` (pause, load,
reset the prefix cache, resume) and the app's lifespan (start, aclose). Backends:
`vllm_engine.VllmEngine` (the real one, ``policy.generation.backend: vllm``) and
`hf_engine.HfEngine` (a light transformers fallback, ``backend: transformers``). Both serve the
same HTTP surface; the contract test in tests/integration runs against either.

Token-level contract: ``generate`` takes prompt token ids (never text) and returns, per choice,
the generated ids *including* the terminating stop token when the model produced one (or the token
that completed a stop string), and the
log-probability of each generated id under the processed distribution the token was sampled
from (temperature-scaled, top-p-masked), so the trainer's importance weights are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from shared.routes import RouteShape
from shared.run_config import RunConfig

FinishReason = Literal["stop", "length", "abort"]
# drain: running requests finish first; keep: they freeze and go on when resumed; interrupt: they
# end at once with what they generated (finish reason "abort"), for the caller to continue.
PauseMode = Literal["drain", "keep", "interrupt"]


@dataclass(frozen=True)
class GenerationParams:
    """Sampling parameters of one engine call (already checked by the sampling gate)."""

    temperature: float
    top_p: float
    max_tokens: int
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Text stops: generation ends with the token that completes one of these in the decoded
    # output (the token is kept: it was sampled); the response text is cut before the stop.
    stop_strings: tuple[str, ...] = ()
    # Alternatives reported per position besides the sampled token; 0: only the sampled token.
    top_logprobs: int = 0
    # MoE routes (``policy.moe_routing_replay``): return the experts of every position from this
    # one on that the engine ran through the model; None: no routes.
    routes_from: int | None = None


@dataclass
class ChoiceOutput:
    """One sampled continuation."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    # Per position: (token id, logprob) of the most likely tokens, best first; None if not asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # (first token index, weight version) per segment when a refit split the choice
    # (`services.generator.partial`); empty: every token came from one version.
    version_spans: tuple[tuple[int, int], ...] = ()
    # [positions, MoE layers, top_k] expert ids of positions routes_from .. prompt + generated - 2
    # (the last sampled token never ran through the model); None when routes were asked and the
    # engine has none for this choice (vLLM: a preempted request), or were not asked.
    routes: Any = None
    routes_start: int = 0  # the position of routes[0]: the request's routes_from


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time view of the engine's load."""

    running: int
    waiting: int
    generated_tokens_total: int


@dataclass
class EngineInfo:
    """Facts about a started engine."""

    name: str
    model: str
    max_model_len: int
    extra: dict[str, str] = field(default_factory=dict)
    random_weights: bool = False  # started without real weights (vLLM load_format dummy): serves after a load
    route_shape: RouteShape | None = None  # the model's MoE routes when the engine returns them


@runtime_checkable
class Engine(Protocol):
    """A started engine generates concurrently; pause/load/resume are called by one refit at a time."""

    @property
    def info(self) -> EngineInfo:
        """Name, model and context length; valid after ``start``."""
        ...

    @property
    def prefix_caching_enabled(self) -> bool:
        """Whether prefix caching is effectively on (as the engine resolved it, not as configured)."""
        ...

    @property
    def errored(self) -> bool:
        """True once the engine died and cannot generate any more."""
        ...

    async def start(self) -> None:
        """Load the model; return when the engine can generate."""
        ...

    async def generate(self, prompt_ids: list[int], params: GenerationParams, request_id: str) -> list[ChoiceOutput]:
        """Sample ``params.n`` continuations of ``prompt_ids``; choices are sorted by index."""
        ...

    async def load_weights(self, path: str) -> None:
        """Replace the weights in place from a folder of safetensors files (engine paused)."""
        ...

    async def join_weight_group(self, init_info: dict[str, Any]) -> None:
        """Join a weight-transfer group (vLLM's ``init_weight_transfer_engine``); blocks until every
        member joined. Replaces any group joined before."""
        ...

    async def receive_weights(self, update_info: dict[str, Any]) -> str | None:
        """Receive a whole version over the joined group into the model (engine paused); the
        transfer's checksum when the engine reports one."""
        ...

    async def weight_checksum(self) -> str | None:
        """One digest of the engine's per-parameter weight checksums (None: not computed)."""
        ...

    async def score(self, token_ids: list[int]) -> list[float]:
        """Each token's logprob given the tokens before it (``len(token_ids) - 1`` of them), from
        the raw logits (temperature 1, no truncation): what a refit's probe compares."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block; the engine's own answer (False: refused)."""
        ...

    async def pause(self, mode: PauseMode) -> None:
        """Stop scheduling. ``drain``: return once in-flight requests finished; ``keep``: freeze
        them; ``interrupt``: end them now, each returning the tokens it generated so far with
        finish reason ``abort`` (requests not started yet return none)."""
        ...

    async def resume(self) -> None:
        """Undo ``pause``; frozen requests continue."""
        ...

    def stats(self) -> EngineStats: ...

    async def aclose(self) -> None:
        """Stop the engine and its processes."""
        ...


def build_engine(cfg: RunConfig) -> Engine:
    """The engine ``policy.generation.backend`` names, not yet started (heavy imports happen here)."""
    backend = cfg.policy.generation.backend
    if backend == "vllm":
        from services.generator.vllm_engine import VllmEngine

        return VllmEngine(cfg)
    if backend == "transformers":
        from services.generator.hf_engine import HfEngine

        return HfEngine(cfg)
    raise ValueError(f"policy.generation.backend {backend!r} is not one of: vllm, transformers")
