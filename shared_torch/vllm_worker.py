"""The generator's extension of vLLM's workers (``worker_extension_cls``, named by
`services.generator.vllm_engine` for every refit transport), imported in each worker before the
model loads:

* ``streamrl_transfer_checksum``: the checksum of the last weight transfer the worker received
  (`shared_torch.gloo_weights.TransferChecksumExtension`);
* on CPU, routed experts read correctly after an in-place weight update (`keep_cpu_experts_packed`).

vLLM's CPU MoE kernels read expert weights in a packed layout of their own, which vLLM 0.32 makes
only at the first load (`CPUUnquantizedExperts.process_weights_after_loading`, called from
`UnquantizedFusedMoEMethod._setup_kernel` only while no kernel exists). An in-place update (a
folder reload, a weight transfer) goes through the same ``_setup_kernel`` with the kernel already
built, so it copies the new weights in unpacked and the experts compute garbage: on the tiny
Qwen3.5-MoE, reloading the very weights it serves moved its greedy logprobs by 0.19 nats, new
weights were 2.6 nats off a transformers forward pass. `keep_cpu_experts_packed` makes an update
pack them as the first load does, unless vLLM already did so during that update.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from shared_torch.gloo_weights import TransferChecksumExtension

log = logging.getLogger(__name__)


def keep_cpu_experts_packed() -> None:
    """On CPU, make a weight update pack routed experts for vLLM's CPU MoE kernels (idempotent;
    nothing elsewhere)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, "streamrl_packs_on_update", False):
        return

    @functools.wraps(original)
    def setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        experts = self.moe_kernel.fused_experts if self.moe_kernel is not None else None
        if not isinstance(experts, CPUUnquantizedExperts):  # a first load, or not vLLM's CPU experts
            original(self, layer, w13, w2)
            return
        pack = experts.process_weights_after_loading
        packed = 0

        def counted(target: Any) -> None:
            nonlocal packed
            packed += 1
            pack(target)

        experts.process_weights_after_loading = counted
        try:
            original(self, layer, w13, w2)
        finally:
            del experts.process_weights_after_loading
        if not packed:  # vLLM copied the update in unpacked: pack it as the first load did
            experts.process_weights_after_loading(layer)

    setup_kernel.streamrl_packs_on_update = True  # type: ignore[attr-defined]
    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel
    log.debug("CPU MoE experts are packed again after each weight update")


class WorkerExtension(TransferChecksumExtension):
    """Mixed into vLLM's workers by the generator; importing this module prepares them."""


keep_cpu_experts_packed()
EXTENSION = f"{__name__}.WorkerExtension"
