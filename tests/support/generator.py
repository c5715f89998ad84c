"""The generator's engine and app on the tiny model, in-process, and model copies its tests need;
the fixtures that hand these out live in tests/conftest.py (used by more than one tier) and
tests/integration/conftest.py.

* `config_tree` / `write_generator_config`: a run config for the tiny model (YAML path and
  `RunConfig`).
* `InProcessGenerator` / `in_process_generator`: the generator app with its lifespan running,
  behind an httpx client (ASGI transport), on a fresh run id.
* `wait_generating`: until an engine generated a few tokens of a request.
* `build_tiny`: a tiny model folder of an architecture (the session fixtures' builds).
* `perturbed_copy`, `fine_tune_to_answer`, `reference_logprobs`: copies of a model folder with
  noise added, or trained to answer one prompt; per-token logprobs of a plain forward pass.
* `one_torch_thread`: torch on one thread for a block.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from shared.config import load
from shared.run_config import RunConfig

KV_CACHE_BYTES = 64 * 2**20
ROOT = Path(__file__).resolve().parents[2]
# The variable that hands a session's build of each tiny model (by architecture; "_multimodal" for
# the multimodal build) to a child pytest session, which then builds nothing (~5 s a model).
TINY_MODEL_ENV = {
    "qwen3": "STREAMRL_TEST_TINY_MODEL_DIR",
    "qwen3_5_moe": "STREAMRL_TEST_TINY_HYBRID_MOE_DIR",
    "qwen3_5_moe_multimodal": "STREAMRL_TEST_TINY_MULTIMODAL_MOE_DIR",
}


def build_tiny(tmp_path_factory: Any, arch: str, *, multimodal: bool = False) -> Path:
    """The tiny model of ``arch`` (``multimodal``: in the multimodal checkpoint format) built in a
    new folder of the session, or the folder a parent session handed over (`TINY_MODEL_ENV`)."""
    name = f"{arch}_multimodal" if multimodal else arch
    if given := os.environ.get(TINY_MODEL_ENV[name]):
        return Path(given)
    out = Path(tmp_path_factory.mktemp(f"tiny-{name}"))
    # Built in a child process: building imports torch/transformers, which tests that only need
    # the folder should not pay for in the pytest process.
    code = "from streamrl.model_builder import build_tiny_model as b, tiny_spec as s; "
    code += f"b({str(out)!r}, s({arch!r}, multimodal={multimodal!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return out


def config_tree(model_dir: Path | str, *, run_id: str, redis_url: str | None, backend: str, **generation: Any) -> dict:
    gen = {"backend": backend, "temperature": 0.8, "top_p": 1.0, "max_new_tokens": 24, "val_temperature": 0.5}
    gen.update(generation)
    gen["vllm_cfg"] = {
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_num_seqs": 16,
        "enable_prefix_caching": True,
    }
    return {
        "run": {"run_id": run_id, "seed": 0},
        "redis": {"url": redis_url},
        "policy": {"model_name": str(model_dir), "generation": gen},
        "generator": {"host": "127.0.0.1", "drain_timeout_s": 5.0, "weight_load_timeout_s": 30.0},
    }


def write_generator_config(
    folder: Path, model_dir: Path | str, *, redis_url=None, backend="transformers", run_id=None, **generation
) -> tuple[Path, RunConfig]:
    """`config_tree` (on a fresh run id unless ``run_id``) written to a new file of ``folder``."""
    run_id = run_id or f"gen-{uuid.uuid4().hex[:8]}"
    tree = config_tree(model_dir, run_id=run_id, redis_url=redis_url, backend=backend, **generation)
    path = folder / f"run-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path, load(RunConfig, path, env={})


class InProcessGenerator:
    """An app with its lifespan running and an httpx client bound to it."""

    def __init__(self, app, client, cfg: RunConfig) -> None:
        self.app = app
        self.client = client
        self.cfg = cfg

    @property
    def runtime(self):
        return self.app.state.runtime

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            r = await self.client.get("/ready")
            if r.status_code == 200:
                return
            if r.json().get("state") == "failed":  # bring-up raised: it will not become ready
                raise RuntimeError(f"generator failed at start: {r.text}")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"generator not ready: {r.text}")
            await asyncio.sleep(0.05)


async def wait_generating(engine, task: asyncio.Task, min_tokens: int = 3, timeout_s: float = 60.0) -> None:
    """Until ``engine`` produced ``min_tokens`` for the request ``task`` runs; raises its error."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.stats().generated_tokens_total < min_tokens:
        if task.done():
            task.result()
            raise AssertionError("the request finished before generating")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the request did not start generating")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def in_process_generator(cfg: RunConfig) -> AsyncIterator[InProcessGenerator]:
    """The generator app of ``cfg`` with its lifespan running, once ready."""
    import httpx

    from services.generator.app import build_app

    app = build_app(cfg, worker_id=f"gen-test-{uuid.uuid4().hex[:6]}", port=0)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://generator", timeout=60.0) as client:
            gen = InProcessGenerator(app, client, cfg)
            await gen.wait_ready()
            yield gen


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for the block: small ops on a busy 2-core machine run many times faster
    on one thread than on two threads that spin-wait for each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def perturbed_copy(src: Path | str, dst: Path | str, *, scale: float = 0.05, seed: int = 1) -> Path:
    """``src`` with Gaussian noise (std ``scale``) added to every weight, saved as safetensors in ``dst``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return save_with_tokenizer(model, src, dst)


def save_with_tokenizer(model, src: Path | str, dst: Path | str) -> Path:
    """``model`` saved as safetensors in ``dst``, with the tokenizer files of ``src``."""
    dst = Path(dst)
    model.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)
    return dst


def reference_logprobs(
    model_dir: Path | str, prompt_ids: Sequence[int], generated_ids: Sequence[int], temperature: float
) -> list[float]:
    """log softmax(logits / temperature) of each generated token given everything before it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    ids = torch.tensor([list(prompt_ids) + list(generated_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt_ids)
    logp = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(generated_ids)]


def fine_tune_to_answer(
    src: Path | str, dst: Path | str, prompt_ids: Sequence[int], answer_ids: Sequence[int], *, max_steps: int = 300
) -> Path:
    """``src`` trained on one (prompt, answer) pair until greedy decoding reproduces the answer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)])
    start = len(prompt_ids)
    targets = ids[0, start:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(max_steps):
        logits = model(input_ids=ids).logits[0, start - 1 : -1]
        with torch.no_grad():
            top = torch.log_softmax(logits, -1).max(-1)
            done = bool((top.indices == targets).all()) and float(top.values.min()) > -0.01
        if done:
            break
        loss = torch.nn.functional.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        raise AssertionError(f"the model did not learn the answer in {max_steps} steps")
    return save_with_tokenizer(model, src, dst)
