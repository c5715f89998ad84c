"""megatron-core on a machine without CUDA: what the megatron backend sets up so that the same
model, DDP and training code run on CPU ranks (gloo), where CI runs them.

megatron-core assumes a GPU in a few places that no setting reaches (checked with 0.16; 0.19
still has them):

* ``torch.cuda.current_device()`` is called unconditionally for the device of new tensors (the
  rotary table on the first forward, attention buffers, tensor-parallel communication buffers,
  DDP's gradient buffers). Without CUDA it is made to answer the CPU device: every such tensor
  lands where the model is.
* The RNG tracker: attention always forks the model-parallel CUDA RNG state
  (``get_cuda_rng_tracker().fork()``), and seeding it (``model_parallel_cuda_manual_seed``) needs
  CUDA. Without CUDA the tracker is megatron's inference tracker, whose fork does nothing: the
  backend trains without dropout (Qwen's attention and hidden dropout are 0), so no stream is lost.
  On GPUs the tracker is seeded per model-parallel rank as megatron expects.
* The default causal mask is built on ``"cuda"``: on CPU the backend passes the mask itself
  (`causal_mask`).
* Two element-wise fusions megatron-core compiles with ``torch.compile`` run eagerly
  (`_eager_fusions`): compiling them on CPU costs seconds and gains nothing.

Everything else (fused kernels, Transformer Engine, apex) is off by configuration already (the
local layer spec, no fusions). Mixture-of-experts models and pipeline stages need a few more.

`apply` is the one place the process is changed: the megatron adapter calls it once, when it is
built on a machine without CUDA, before megatron-core seeds its RNG (`seed_rng`) or builds a
model; nothing it changes is touched where CUDA is present. What the router needs without
Transformer Engine (on any machine) is not a CPU patch: `without_transformer_engine`, called where
the model is built (`megatron_setup.build_gpt_model`); nor are Gated DeltaNet's kernels without
flash-linear-attention (`gated_delta_net_kernels`, called there too).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

log = logging.getLogger(__name__)

_on_cpu = False


def apply(*, moe: bool, pipeline: bool) -> None:
    """Let megatron-core run without CUDA: device lookups answer the CPU, and with ``moe`` the
    alltoall dispatcher, with ``pipeline`` the schedule, run without CUDA streams. Idempotent."""
    global _on_cpu
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.apply is for machines without CUDA")
    if not _on_cpu:
        torch.cuda.current_device = _cpu_device
        _eager_fusions()
        _on_cpu = True
        log.info("megatron-core on CPU: CUDA device lookups answer the CPU, RNG tracker without forks")
    if moe:
        _moe_without_cuda()
    if pipeline:
        _pipeline_without_cuda()


# megatron-core's ``jit_fuser`` is ``torch.compile``: the small element-wise functions it decorates
# are compiled on their first call. Two are on the Qwen3.5 path (the attention output gate,
# ``Attention._apply_output_gate``, and Gated DeltaNet's gated norm, ``_apply_gated_norm``); on CPU
# inductor builds C++ for them, about 15 s per process before the first step, for no gain at
# these sizes. Without CUDA they run as written (the function ``torch.compile`` wraps).


def _eager_fusions() -> None:
    """The CPU's megatron-core fusions run eagerly (see above)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import Attention

    for cls, name in ((Attention, "_apply_output_gate"), (GatedDeltaNet, "_apply_gated_norm")):
        compiled = cls.__dict__[name]
        setattr(cls, name, getattr(compiled, "_torchdynamo_orig_callable", compiled))


def seed_rng(seed: int) -> None:
    """Seed megatron's model-parallel RNG tracker: per model-parallel rank on GPUs, megatron's
    inference tracker (whose fork does nothing) on CPU, after `apply`."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def causal_mask(length: int, device: torch.device) -> torch.Tensor | None:
    """The attention mask megatron's attention takes on CPU ([1, 1, T, T], True where a position
    may not attend); None on GPUs, where megatron builds its default causal mask itself."""
    if device.type != "cpu":
        return None
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


# Mixture-of-experts models (`services.trainer.backends.megatron_moe`) reach two more places:
#
# * The router's gating GEMM (``moe_utils.RouterGatingLinearFunction``) tests the module global
#   ``te_general_gemm``, which is only bound when Transformer Engine imports: without it every
#   MoE forward fails with a NameError, on GPUs too. Binding it to None selects megatron's own
#   torch fallback (``torch.mm``), the branch written for that case.
# * The alltoall token dispatcher creates a ``torch.cuda.Stream`` in ``__init__`` unless the class
#   attribute ``cuda_dtoh_stream`` is already set, and its ``_maybe_dtoh_and_synchronize`` copies
#   the all-to-all split sizes to the host on that stream and waits on a CUDA event. On CPU the
#   sizes are already on the host, and CPU work is synchronous: the replacement only turns them
#   into numpy arrays, as the CUDA path does, so the all-to-all calls get the types they get there.
_NO_STREAM = "no CUDA stream: split sizes are already on the host"
_SPLIT_SIZES = ("input_splits", "output_splits", "output_splits_tp")


def _moe_without_cuda() -> None:
    """The alltoall dispatcher without CUDA streams (see above)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize is _split_sizes_as_numpy:
        return
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _split_sizes_as_numpy
    log.info("megatron-core MoE on CPU: alltoall dispatcher without CUDA streams")


def without_transformer_engine() -> None:
    """The router's gating GEMM without Transformer Engine (see above; on any machine: a no-op
    where Transformer Engine imported)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _split_sizes_as_numpy(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on CPU: at the point where the
    CUDA path copies to the host (never with drop-and-pad), the split sizes become numpy arrays."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in _SPLIT_SIZES:
            sizes = getattr(self, name)
            if isinstance(sizes, torch.Tensor):
                setattr(self, name, sizes.numpy())
    return tokens_per_expert


# Pipeline stages (`services.trainer.backends.megatron_pipeline`) reach two more: the schedule
# counts tokens in a tensor made on the device named "cuda" (``torch.zeros(..., device="cuda")``
# in ``schedules``), and the stage-to-stage exchange of activation shapes calls
# ``torch.cuda.synchronize()`` after its sends and receives. On CPU the count is made on the CPU,
# and there is nothing to synchronise (gloo's sends and receives have completed when waited on).


class _TorchOnCpu(types.ModuleType):
    """``torch`` as the pipeline schedule sees it on CPU: tensors it makes on "cuda" are made on the
    CPU; everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _pipeline_without_cuda() -> None:
    """The pipeline schedule without CUDA (see above)."""
    from megatron.core.pipeline_parallel import schedules

    if isinstance(schedules.torch, _TorchOnCpu):
        return
    schedules.torch = _TorchOnCpu("torch")
    torch.cuda.synchronize = _nothing_to_synchronize
    log.info("megatron-core pipeline schedule on CPU: token counts on the CPU, no CUDA synchronisation")


def _nothing_to_synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize`` without CUDA: CPU work is synchronous."""


# Gated DeltaNet layers (Qwen3.5, `services.trainer.backends.megatron_hybrid`): megatron-core's
# ``GatedDeltaNet`` takes ``l2norm`` and ``chunk_gated_delta_rule`` from flash-linear-attention
# (``fla``), whose Triton kernels need a GPU, and refuses to build without it (``HAVE_FLA``). Where
# ``fla`` does not import (CPU, or a GPU machine without it), the module's two names are bound to
# transformers' pure-torch implementations of the same functions, the ones transformers' own
# Qwen3.5 runs there (``modeling_qwen3_5_moe.l2norm`` and ``torch_chunk_gated_delta_rule``, the
# same signature and [batch, time, heads, dim] layout). Its short convolution already falls back
# to ``nn.Conv1d`` without the ``causal_conv1d`` package. Where ``fla`` imports, nothing changes.


def gated_delta_net_kernels() -> None:
    """Gated DeltaNet's kernels without flash-linear-attention (see above; a no-op with it)."""
    from megatron.core.ssm import gated_delta_net

    if gated_delta_net.HAVE_FLA:
        return
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_qwen3_5

    gated_delta_net.l2norm = hf_qwen3_5.l2norm
    gated_delta_net.chunk_gated_delta_rule = hf_qwen3_5.torch_chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True
    log.info("megatron-core Gated DeltaNet without flash-linear-attention: transformers' torch kernels")
