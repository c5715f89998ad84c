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

`render_section` turns the results into the BENCHMARKS.md section; `replace_section` swaps it
into an existing file so ``streamrl bench --only generator`` leaves the other sections as they are.
Called by `streamrl.bench`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from streamrl.bench.throughput import BLOCKS, MAX_TOKENS, ROUNDS_PER_BLOCK, make_requests, throughput
from streamrl.bench.throughput import words as words_of
from streamrl.child_guard import guarded

if TYPE_CHECKING:
    import aiohttp

    from services.generator.chat import ChatRenderer
    from shared.openai_api import ChatMessage

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Generator"
TARGET_RATIO = 0.95
REFITS = 5


# -- setup -------------------------------------------------------------------------------------


def config_tree(model_dir: Path, redis_url: str, run_id: str) -> dict[str, Any]:
    """A run config for one vLLM generator on ``model_dir`` with the demo's engine settings."""
    from streamrl.demo import CONFIG

    demo = yaml.safe_load(CONFIG.read_text())
    return {
        "run": {"run_id": run_id, "seed": 0},
        "redis": {"url": redis_url},
        "policy": {
            "model_name": str(model_dir.resolve()),
            "generation": {
                "backend": "vllm",
                "temperature": 0.8,
                "top_p": 1.0,
                "max_new_tokens": MAX_TOKENS,
                "vllm_cfg": demo["policy"]["generation"]["vllm_cfg"],
            },
        },
        "generator": {"host": "127.0.0.1", "drain_timeout_s": 30.0, "weight_load_timeout_s": 60.0},
    }


def perturbed_versions(model_dir: Path, out: Path, n: int) -> list[tuple[Path, dict[str, Any]]]:
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


class GeneratorProcess:
    """``python -m services.generator`` as a child process in its own session."""

    def __init__(self, config: Path, port: int, log_path: Path) -> None:
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "services.generator",
            "--config",
            str(config),
            "--port",
            str(port),
            "--worker-id",
            "gen-bench",
        ]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                guarded(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )  # stops with the benchmark, however the benchmark ends

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 300.0) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"generator exited with {self.proc.returncode}; see {self.log_path}")
            try:
                async with session.get(f"{self.url}/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
        raise RuntimeError(f"generator not ready within {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the process group (vLLM's engine process included)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# -- 2. splice ---------------------------------------------------------------------------------


def conversation(renderer: ChatRenderer, turns: int, words: int) -> tuple[list[ChatMessage], list[ChatMessage]]:
    """(messages with the last assistant turn's token ids, the same messages without ids)."""
    import msgspec

    from shared.openai_api import ChatMessage

    rng = random.Random(turns)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant. " + words_of(rng, words)}]
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


def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def splice_benchmark(renderer: ChatRenderer) -> dict[str, dict[str, float]]:
    """Median microseconds of `ChatRenderer.chat_prompt` with and without the earlier turn's ids."""
    out = {}
    for name, turns, repeats in (("short", 3, 300), ("long", 30, 60)):
        spliced, plain = conversation(renderer, turns, words=50)
        prompt = renderer.chat_prompt(spliced)
        if not prompt.model_prefix_len:
            raise RuntimeError("the conversation carries token ids but was not spliced")
        out[name] = {
            "turns": turns,
            "prompt_tokens": len(prompt.prompt_ids),
            "spliced_us": _median_us(functools.partial(renderer.chat_prompt, spliced), repeats),
            "plain_us": _median_us(functools.partial(renderer.chat_prompt, plain), repeats),
        }
    return out


# -- 3. refit ----------------------------------------------------------------------------------


async def refit_rounds(
    redis_url: str, run_id: str, gen: GeneratorProcess, versions: list[Path]
) -> list[dict[str, float]]:
    """Once ``gen`` is ready, publish versions 1..N one after another; seconds from publish to its ack."""
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
            out.append({"refit_s": elapsed, "load_s": ack.load_s})
    finally:
        await redis.aclose()
    return out


def save_load_baseline(state_dicts: list[dict[str, Any]], folder: Path) -> list[float]:
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


def generator_benchmark(work: Path, redis_url: str, machine: str) -> dict[str, Any]:
    """Throughput (generator processes started per block), splice and refit (a generator of its
    own); a JSON-able dict for `render_section`."""
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
    config.write_text(yaml.safe_dump(config_tree(MODEL_DIR, redis_url, run_id)))
    cfg = load(RunConfig, config, env={})
    renderer = build_renderer(cfg)
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
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "max_tokens": MAX_TOKENS,
        "prompt_tokens": len(make_requests(renderer, 1, seed=0)[0].prompt_ids),
        "blocks": BLOCKS,
        "rounds_per_block": ROUNDS_PER_BLOCK,
        "throughput": tput,
        "splice": splice,
        "refit": {
            "refit_s": statistics.median(r["refit_s"] for r in refits),
            "load_s": statistics.median(r["load_s"] for r in refits),
            "baseline_s": statistics.median(baseline),
            "num_bytes": (versions[0][0] / "model.safetensors").stat().st_size,
            "n": len(refits),
        },
    }


def render_section(g: dict[str, Any]) -> str:
    """The BENCHMARKS.md section for the results of `generator_benchmark`."""
    tp = g["throughput"]
    loads = [r["load_avg"] for v in tp.values() for r in v["rounds"]]
    lines = [
        f"{HEADING} (tiny Qwen3, vLLM on CPU; `streamrl bench --only generator` refreshes this section alone)",
        "",
        f"Measured on {g['date']} ({g['machine']}). HTTP: POST /v1/chat/completions on a "
        "`python -m services.generator` "
        "process, sent with aiohttp. Raw: vLLM `AsyncLLM` in a process of its own with the same engine args, prompt "
        f"ids, seeds, sampling parameters and max_tokens ({g['max_tokens']}); one-message prompts of "
        f"{g['prompt_tokens']} tokens (short enough that no prefill is split into chunks: vLLM on CPU cannot rewind "
        "a seeded request's generator after a partial prefill and its engine dies). One engine is alive at a time: "
        f"{g['blocks']} blocks per side, each starting its engine, running {g['rounds_per_block']} rounds at every "
        "concurrency and stopping it, in the order raw, HTTP, HTTP, raw, ... (a second, idle vLLM engine kept alive "
        "shares the pinned worker core and its busy-waiting processes starved the measured side for seconds at a "
        "time). Tokens/s are medians of the rounds, HTTP / raw is the median of the ratios of rounds that sent the "
        "same requests. CPU per request is the CPU time of the processes outside vLLM's engine: the AsyncLLM front "
        "end (raw), the generator's API process and the client (HTTP). The 1-minute load "
        f"average ranged {min(loads):.1f}-{max(loads):.1f} over the rounds.",
        "",
        "| concurrent requests | raw AsyncLLM tokens/s | HTTP tokens/s | HTTP / raw (range over rounds) "
        "| tokens generated, raw / HTTP "
        "(all rounds) | CPU ms per request: raw front end / HTTP server + client |",
        "|---|---|---|---|---|---|",
    ]
    for c, v in tp.items():
        lines.append(
            f"| {c} | {v['raw_tok_s']:.0f} | {v['http_tok_s']:.0f} | "
            f"{v['ratio']:.2f} ({v['ratio_min']:.2f}-{v['ratio_max']:.2f}) | "
            f"{v['raw_tokens']} / {v['http_tokens']} | {v['raw_frontend_cpu_ms_per_request']:.1f} / "
            f"{v['http_server_cpu_ms_per_request']:.1f} + {v['http_client_cpu_ms_per_request']:.1f} |"
        )
    checked = [c for c in tp if int(c) >= 16]
    met = all(tp[c]["ratio"] >= TARGET_RATIO for c in checked)
    lines += [
        "",
        f"Target HTTP / raw >= {TARGET_RATIO} at {' and '.join(checked)} concurrent requests: "
        f"{'met' if met else 'not met'}.",
        "",
        "| splice (`ChatRenderer.chat_prompt`, median) | prompt tokens | last assistant turn with its ids, spliced "
        "(us) | same messages without ids, one render (us) | overhead (us) | spliced / plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in g["splice"].items():
        lines.append(
            f"| {name}: {v['turns']} turns | {v['prompt_tokens']} | {v['spliced_us']:.0f} | "
            f"{v['plain_us']:.0f} | {v['spliced_us'] - v['plain_us']:.0f} | "
            f"{v['spliced_us'] / v['plain_us']:.2f} |"
        )
    r = g["refit"]
    lines += [
        "",
        f"| refit ({r['num_bytes'] / 2**20:.1f} MiB of safetensors, median of {r['n']}) | ms |",
        "|---|---|",
        "| publish WeightAnnouncement -> WeightAck received (checksum, drain, reload, cache reset, ack) | "
        f"{r['refit_s'] * 1e3:.0f} |",
        f"| of which the generator's load_s (from the ack) | {r['load_s'] * 1e3:.0f} |",
        f"| baseline: safetensors save + load_file of the same state dict, one process | {r['baseline_s'] * 1e3:.0f} |",
        "",
        f"Refit over baseline: {r['refit_s'] / r['baseline_s']:.1f}x.",
        "",
    ]
    return "\n".join(lines)


def replace_section(text: str, section: str, heading: str = HEADING, after: str | None = None) -> str:
    """``text`` with the section starting with ``heading`` (to the next ``## `` heading) replaced by
    ``section``; when there is none, ``section`` goes after the section headed ``after`` (if given
    and present), else at the end."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        prev = next((i for i, line in enumerate(lines) if after and line.startswith(after)), None)
        if prev is None:
            return text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
        start = end = next((i for i in range(prev + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    rest = lines[end:]
    return "\n".join(lines[:start] + section.rstrip("\n").splitlines() + ([""] + rest if rest else [])) + "\n"
