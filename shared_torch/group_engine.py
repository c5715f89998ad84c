"""What the gloo weight-transfer engines (`shared_torch.gloo_weights`, `shared_torch.gloo_reshard`)
share: the worker side's group, vLLM's layer-wise reload around an update, closing; and rank 0's
side of a group's rendezvous."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shared_torch.weight_wire import Group, TransferError


class GroupEngine:
    """What both gloo worker engines share: their group, vLLM's layer-wise reload around an
    update (the weights arrive in checkpoint format, as vLLM's NCCL engine does it), closing."""

    group: Group | None
    model: torch.nn.Module
    model_config: Any

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def form_group(open_: Callable[[], Group], ask_workers: Callable[[], Any], group_id: str) -> Group:
    """Rank 0's side of a group's rendezvous: the workers block in init_weight_transfer_engine
    until everyone joined, so ``ask_workers`` runs on a side thread while this rank opens the
    group (and hosts its rendezvous); raises `TransferError` when it does not form."""
    with ThreadPoolExecutor(max_workers=1) as exe:
        future = exe.submit(ask_workers)
        try:
            group = open_()
        except Exception as exc:
            raise TransferError(f"weight-transfer group {group_id} did not form: {exc}") from exc
        future.result()
    return group
