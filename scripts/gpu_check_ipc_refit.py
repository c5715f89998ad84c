"""GPU check of a colocated refit: the trainer's policy (the torch backend, on the GPU) and a vLLM
engine on the same GPU, the weights moved through vLLM's ``ipc`` weight-transfer engine (CUDA IPC
handles to the trainer's own tensors: nothing is copied through the host or a socket).

The engine starts on dummy weights (``load_format: dummy``), as a collective run's engines do; the
refit brings the policy's weights in bfloat16. Then its logprobs of a probe sequence must equal,
token for token (within `TOLERANCE`), those of an engine started cold on the same checkpoint in
bfloat16, which the dummy weights' must not.

    python scripts/gpu_check_ipc_refit.py [MODEL_DIR]      (default: the tiny Qwen3, built here)

Exits non-zero on a mismatch; prints one line. Part of scripts/gpu_check.sh.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles cross to the engine core pickled

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE = list(range(10, 74))  # token ids below every tiny vocabulary
# The same bfloat16 weights through the same kernels give the same logprobs; the margin allows only
# for a kernel that reduces in another order on a reload.
TOLERANCE = 1e-4


def _engine(model: Path, *, dummy: bool) -> Any:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(model),
        dtype="bfloat16",
        load_format="dummy" if dummy else "auto",
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,  # the trainer's policy shares the GPU
        max_model_len=1024,
        weight_transfer_config={"backend": "ipc"} if dummy else None,
    )
    return AsyncLLM.from_engine_args(args)


async def _probe_logprobs(llm: Any) -> torch.Tensor:
    """The engine's logprob of each probe token after the first (greedy, no sampling)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    final = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=PROBE), params, request_id=uuid.uuid4().hex):
        final = out
    assert final is not None and final.prompt_logprobs is not None
    return torch.tensor([entry[tok].logprob for tok, entry in zip(PROBE[1:], final.prompt_logprobs[1:], strict=True)])


class _Client:
    """vLLM's weight-sync client protocol over an in-process engine, called from the trainer's
    thread while the engine's event loop runs."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.llm, self.loop = llm, loop

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=600)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.llm.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.llm.finish_weight_update())


def _on_gpu(source: Any) -> Any:
    """The backend's published stream, each tensor on the GPU (IPC shares device memory)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    class OnGpu(WeightSource):  # type: ignore[misc]
        def metadata(self) -> Any:
            return source.metadata()

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return ((name, t.to("cuda")) for name, t in source)

    return OnGpu()


async def check(model: Path) -> float:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    from services.trainer.backends import build_backend
    from services.trainer.weight_send import weight_source
    from shared.config import load
    from shared.run_config import RunConfig

    overrides = [f"policy.model_name={model}", "data.train_path=t.jsonl", "trainer.backend=torch"]
    backend = build_backend(load(RunConfig, None, [*overrides, "policy.precision=bfloat16"], env={}))
    llm = _engine(model, dummy=True)
    before = await _probe_logprobs(llm)
    client = _Client(llm, asyncio.get_running_loop())
    source = _on_gpu(weight_source(backend, torch.bfloat16))

    def send() -> None:
        trainer = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0), client=client, source=source)
        trainer.send_weights()

    await asyncio.to_thread(send)
    refitted = await _probe_logprobs(llm)
    llm.shutdown()
    del backend
    torch.cuda.empty_cache()
    cold = _engine(model, dummy=False)
    expected = await _probe_logprobs(cold)
    cold.shutdown()
    if torch.equal(before, expected):
        raise AssertionError("dummy weights scored the probe as the checkpoint does: the check would prove nothing")
    return float((refitted - expected).abs().max())


def main() -> int:
    assert torch.cuda.is_available(), "this check needs a GPU"
    if len(sys.argv) > 1:
        model = Path(sys.argv[1])
    else:
        from streamrl.model_builder import build_tiny_model

        model = Path(tempfile.mkdtemp(prefix="ipc-refit-")) / "tiny-qwen3"
        build_tiny_model(model)
    diff = asyncio.run(check(model))
    ok = diff <= TOLERANCE
    verdict = "PASS" if ok else "FAIL"
    print(f"ipc refit {model.name}: |logprob(refitted) - logprob(cold start)| max {diff:.1e}: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
