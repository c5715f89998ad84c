"""The generator section of ``streamrl bench``: what the serving layer costs on top of vLLM.

1. Throughput, side by side (`streamrl.bench.throughput`): tokens/s of POST /v1/chat/completions
   on the real generator against the raw vLLM ``AsyncLLM`` with the same engine args, prompt ids,
   seeds and max_tokens, one engine alive at a time, in alternating blocks; the ratio is the
   median of the per-round ratios. Also CPU time per request outside the engine processes.
2. Splice: ``ChatRenderer.chat_prompt`` for a conversation whose last assistant turn carries its
   token ids (two template renders + the splice) against the same conversation without ids (one
   render), for a short and a long conversation.
3. Refit: a ``WeightAnnouncement`` published on the run's weights stream until the generator's
   ``WeightAck`` arrives (checksum, drain, in-place reload, prefix-cache reset, ack), against a
   plain ``safetensors`` save + load of the same state dict in one process. The perturbed weight
   versions are written before anything is timed.

`generator_benchmark` returns the section's `GeneratorResults`, rendered by
``templates/generator.md.jinja``. Called by `streamrl.bench.suite`.
"""

from __future__ import annotations

import asyncio
import functools
import random
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import yaml

from streamrl.bench.generator_process import GeneratorProcess, generator_config
from streamrl.bench.report import MIB, Results, render
from streamrl.bench.throughput import BLOCKS, MAX_TOKENS, ROUNDS_PER_BLOCK, Throughput, make_requests, throughput
from streamrl.bench.throughput import words as words_of

if TYPE_CHECKING:
    import torch

    from services.generator.chat import ChatRenderer
    from shared.openai_api import ChatMessage

TARGET_RATIO = 0.95  # HTTP tokens/s over raw, from 16 concurrent requests up
TARGET_FROM_CONCURRENCY = 16
REFITS = 5


class SpliceRow(msgspec.Struct):
    """`ChatRenderer.chat_prompt` of one conversation, with and without the last turn's ids."""

    name: str
    turns: int
    prompt_tokens: int
    spliced_us: float  # median
    plain_us: float  # median of one render without ids
    overhead_us: float
    ratio: float  # spliced / plain


class GeneratorRefit(msgspec.Struct):
    size_mib: float  # one version's safetensors
    n: int  # refits; the figures are medians
    refit_s: float  # publish WeightAnnouncement -> WeightAck received
    load_s: float  # the generator's, from its ack
    baseline_s: float  # safetensors save + load_file of the same state dict, one process
    ratio: float  # refit over baseline


class GeneratorResults(Results):
    date: str
    machine: str
    max_tokens: int
    prompt_tokens: int
    blocks: int  # per side, one engine start each
    rounds_per_block: int
    throughput: Throughput
    splice: list[SpliceRow]
    refit: GeneratorRefit


# -- setup -------------------------------------------------------------------------------------


def perturbed_versions(model_dir: Path, out: Path, n: int) -> list[tuple[Path, dict[str, torch.Tensor]]]:
    """``n`` copies of the model's weights with noise added, as safetensors folders; with their state dicts."""
    import torch
    from safetensors.torch import load_file, save_file

    base: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(f))
    versions = []
    for v in range(1, n + 1):
        gen = torch.Generator().manual_seed(v)
        sd = {k: t + 0.01 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in base.items()}
        folder = out / f"v{v:06d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(model_dir / "config.json", folder / "config.json")
        versions.append((folder, sd))
    return versions


# -- 2. splice ---------------------------------------------------------------------------------


def conversation(renderer: ChatRenderer, turns: int, words: int) -> tuple[list[ChatMessage], list[ChatMessage]]:
    """(messages with the last assistant turn's token ids, the same messages without ids)."""
    import msgspec

    from shared.openai_api import ChatMessage

    rng = random.Random(turns)
    msgs: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant. " + words_of(rng, words)}]
    for _ in range(turns):
        msgs += [
            {"role": "user", "content": words_of(rng, words)},
            {"role": "assistant", "content": words_of(rng, words)},
        ]
    msgs.append({"role": "user", "content": words_of(rng, words)})
    plain = msgspec.convert(msgs, list[ChatMessage])
    last = len(plain) - 2
    prompt_ids = renderer.chat_prompt(plain[:last]).prompt_ids
    generated = renderer.encode_text(msgs[last]["content"]) + [renderer.terminator_id]
    spliced = list(plain)
    spliced[last] = msgspec.structs.replace(plain[last], prompt_token_ids=prompt_ids, generation_token_ids=generated)
    return spliced, plain


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def splice_row(name: str, turns: int, prompt_tokens: int, spliced_us: float, plain_us: float) -> SpliceRow:
    return SpliceRow(name, turns, prompt_tokens, spliced_us, plain_us, spliced_us - plain_us, spliced_us / plain_us)


def splice_benchmark(renderer: ChatRenderer) -> list[SpliceRow]:
    """Median microseconds of `ChatRenderer.chat_prompt` with and without the earlier turn's ids."""
    out = []
    for name, turns, repeats in (("short", 3, 300), ("long", 30, 60)):
        spliced, plain = conversation(renderer, turns, words=50)
        prompt = renderer.chat_prompt(spliced)
        if not prompt.model_prefix_len:
            raise RuntimeError("the conversation carries token ids but was not spliced")
        spliced_us = _median_us(functools.partial(renderer.chat_prompt, spliced), repeats)
        plain_us = _median_us(functools.partial(renderer.chat_prompt, plain), repeats)
        out.append(splice_row(name, turns, len(prompt.prompt_ids), spliced_us, plain_us))
    return out


# -- 3. refit ----------------------------------------------------------------------------------


async def refit_rounds(
    redis_url: str, run_id: str, gen: GeneratorProcess, versions: list[Path]
) -> list[tuple[float, float]]:
    """Once ``gen`` is ready, publish versions 1..N one after another; seconds from publish to its
    ack, and the generator's load_s from the ack, of each."""
    import aiohttp

    from shared import keys as K
    from shared.protocol import WeightAck, WeightAnnouncement
    from shared.redis_replies import as_text, range_entries
    from shared.streams import StreamClient, connect
    from shared.weights_format import checksum_dir, dir_num_bytes

    async with aiohttp.ClientSession() as session:
        await gen.wait_ready(session)
    redis = connect(redis_url)
    sc = StreamClient(redis, K.RunKeys(run_id), "bench")
    out = []
    try:
        for version, path in enumerate(versions, start=1):
            ann = WeightAnnouncement(
                version=version, path=str(path.resolve()), checksum=checksum_dir(path), num_bytes=dir_num_bytes(path)
            )
            last = range_entries(await redis.xrevrange(sc.keys.weight_acks, count=1))
            cursor = as_text(last[0][0]) if last else "0-0"
            t0 = time.perf_counter()
            await sc.publish(sc.keys.weights, ann, maxlen=K.WEIGHTS_MAXLEN)
            ack = None
            while ack is None:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError(f"no ack for weight version {version}")
                for d in await sc.read_after(sc.keys.weight_acks, cursor, WeightAck, block_ms=1000):
                    cursor = d.entry_id
                    if d.msg is not None and d.msg.version == version:
                        ack = d.msg
            elapsed = time.perf_counter() - t0
            if not ack.ok:
                raise RuntimeError(f"weight version {version} failed: {ack.error}")
            out.append((elapsed, ack.load_s))
    finally:
        await redis.aclose()
    return out


def save_load_baseline(state_dicts: list[dict[str, torch.Tensor]], folder: Path) -> list[float]:
    """Seconds to save each state dict as safetensors into ``folder`` and load it back."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    out = []
    for sd in state_dicts:
        t0 = time.perf_counter()
        save_file(sd, path, metadata={"format": "pt"})
        load_file(path)
        out.append(time.perf_counter() - t0)
    return out


# -- the section -------------------------------------------------------------------------------


def generator_benchmark(work: Path, redis_url: str, machine: str) -> GeneratorResults:
    """Throughput (generator processes started per block), splice and refit (a generator of its own)."""
    from services.generator.vllm_env import apply_env_defaults

    apply_env_defaults()  # before anything imports vLLM
    from services.generator.app import build_renderer
    from shared.config import load
    from shared.run_config import RunConfig
    from streamrl.demo import MODEL_DIR
    from streamrl.model_builder import build_tiny_model, is_model_dir
    from streamrl.redis_server import free_port

    if not is_model_dir(MODEL_DIR):
        build_tiny_model(MODEL_DIR)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run_id = f"bench-gen-{uuid.uuid4().hex[:6]}"
    config = work / "run.yaml"
    config.write_text(yaml.safe_dump(generator_config(MODEL_DIR, redis_url, run_id, MAX_TOKENS)))
    renderer = build_renderer(load(RunConfig, config, env={}))
    versions = perturbed_versions(MODEL_DIR, work / "weights", REFITS)
    splice = splice_benchmark(renderer)
    baseline = save_load_baseline([sd for _, sd in versions], work / "baseline")
    log = work / "generator.log"
    tput = throughput(config, renderer, lambda: GeneratorProcess(config, free_port(), log), work)
    gen = GeneratorProcess(config, free_port(), log)
    try:
        refits = asyncio.run(refit_rounds(redis_url, run_id, gen, [p for p, _ in versions]))
    finally:
        gen.stop()
    return GeneratorResults(
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        max_tokens=MAX_TOKENS,
        prompt_tokens=len(make_requests(renderer, 1, seed=0)[0].prompt_ids),
        blocks=BLOCKS,
        rounds_per_block=ROUNDS_PER_BLOCK,
        throughput=tput,
        splice=splice,
        refit=refit_figures(refits, baseline, (versions[0][0] / "model.safetensors").stat().st_size),
    )


def refit_figures(refits: list[tuple[float, float]], baseline: list[float], num_bytes: int) -> GeneratorRefit:
    """Medians of the refits ((seconds to the ack, the ack's load_s) each) and of the baseline."""
    refit_s = statistics.median(r for r, _ in refits)
    baseline_s = statistics.median(baseline)
    load_s = statistics.median(load for _, load in refits)
    return GeneratorRefit(num_bytes / MIB, len(refits), refit_s, load_s, baseline_s, refit_s / baseline_s)


def render_section(r: GeneratorResults) -> str:
    return render("generator", r=r, target=TARGET_RATIO, target_from=TARGET_FROM_CONCURRENCY)
