"""One process of the refit section of ``streamrl bench`` (`streamrl.bench.refit` starts it).

    python -m streamrl.bench.refit_worker prepare MODEL OUT.json --spec SPEC.json --tokenizer DIR
    torchrun --nproc-per-node 2 -m streamrl.bench.refit_worker broadcast MODEL OUT.json --bucket-mb B
    python -m streamrl.bench.refit_worker refit MODEL OUT.json --redis URL --refits N

* ``prepare``: builds a Qwen3 model of SPEC at random (bfloat16, the tiny model's tokenizer, so
  vLLM can load it) into MODEL, then times baseline B on its state dict: ``safetensors.torch``
  ``save_file`` + ``load_file`` back into the same tensors (page cache), and sha256 / xxh3-128
  over the same bytes; and, apart, the float32 -> bfloat16 cast of the model with one thread.
* ``broadcast``: baseline A, a raw ``torch.distributed`` gloo broadcast from rank 0 to rank 1 of
  the bytes the collective transport sends, in the same buckets (`shared_torch.weight_wire.plan_buckets`
  over the model's parameter list), preallocated buffers, no digests; rank 0 times it to a barrier.
* ``refit``: a vLLM generator service process (``python -m services.generator``) and, here, the
  trainer's learner (`LocalLearner` over the torch backend, one thread) with one `WeightPublisher`
  per transport (filesystem, collective over gloo) on the same generator. One warm-up refit per
  transport (the collective one forms the transfer group and writes the first snapshot), then N
  per transport alternated (A B, B A, ...), each timed by `RefitReport` with the generator's ack,
  SETTLE_S apart (a training step stands there in a run): vLLM's engine processes busy-poll for
  a second after each call they answer, and the filesystem transport removes the version before
  last in the background; neither belongs to the next refit.

Every mode writes OUT.json (rank 0 for ``broadcast``): a `Prepared`, `Broadcast` or `Refits` of
`streamrl.bench.refit_runs`. The first timed repeat of a baseline is a warm-up, dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from streamrl.bench.refit_runs import BringUp, Broadcast, HashRates, Prepared, RefitRun, Refits, SaveLoadRound

if TYPE_CHECKING:
    import torch

    from services.trainer.refit import WeightPublisher
    from services.trainer.weight_transport import WeightTransport
    from shared.streams import StreamClient

GENERATOR_ID = "gen-bench"  # the worker id `GeneratorProcess` starts its generator with
BASELINE_REPEATS = 5  # after one warm-up
KV_CACHE_BYTES = 64 << 20
SETTLE_S = 2.0  # between refits; longer than vLLM's busy-polling after a call (1 s)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


# -- prepare: the model and baseline B -------------------------------------------------------------


def build(model_dir: Path, spec_json: Path, tokenizer_dir: Path) -> dict[str, torch.Tensor]:
    """A randomly initialised bfloat16 Qwen3 of the spec in ``model_dir`` with the tiny tokenizer;
    its state dict (what baseline B saves)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from streamrl.model_builder import TinyModelSpec, qwen3_config

    spec = msgspec.json.decode(spec_json.read_bytes(), type=TinyModelSpec)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    pad, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    cfg = qwen3_config(spec, spec.vocab_size, pad_id=pad, bos_id=pad, eos_id=eos)
    cfg.dtype = "bfloat16"
    torch.manual_seed(spec.seed)
    torch.set_default_dtype(torch.bfloat16)  # initialised in the published dtype: half the memory
    model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    shutil.rmtree(model_dir, ignore_errors=True)
    model.save_pretrained(model_dir, safe_serialization=True, max_shard_size="100GB")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, model_dir / name)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def cast_s(tensors: dict[str, torch.Tensor]) -> float:
    """Seconds to cast the model from float32 to bfloat16 with one torch thread, a tensor at a time,
    into fresh memory kept until the end (as the export keeps a file's tensors): the trainer's part
    of publishing (it holds float32 master weights) that no baseline has."""
    import torch

    torch.set_num_threads(1)
    total, kept = 0.0, []
    for t in tensors.values():
        master = t.float()
        t0 = time.perf_counter()
        kept.append(master.to(torch.bfloat16))
        total += time.perf_counter() - t0
    return total


def save_load(tensors: dict[str, torch.Tensor], folder: Path) -> tuple[int, list[SaveLoadRound]]:
    """Baseline B: seconds to ``save_file`` the tensors into a fresh file and ``load_file`` it back
    into them (mmap, then a copy into each tensor: what loading into a model does); the file's bytes."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    rounds = []
    for _ in range(1 + BASELINE_REPEATS):
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        save_file(tensors, path, metadata={"format": "pt"})
        t1 = time.perf_counter()
        for name, t in load_file(path).items():  # mmap: copying into place reads every byte
            tensors[name].copy_(t)
        t2 = time.perf_counter()
        rounds.append(SaveLoadRound(t1 - t0, t2 - t1, t2 - t0, os.getloadavg()[0]))
    num_bytes = path.stat().st_size
    path.unlink()
    return num_bytes, rounds


def hash_rates(tensors: dict[str, torch.Tensor]) -> HashRates:
    """One pass of sha256 and of xxh3-128 over the tensors' bytes, GiB/s."""
    import torch
    import xxhash

    views = [t.view(-1).view(torch.uint8).numpy() for t in tensors.values()]
    rates = []
    for new in (hashlib.sha256, xxhash.xxh3_128):
        t0 = time.perf_counter()
        for v in views:
            new(v).digest()
        rates.append(sum(v.nbytes for v in views) / 2**30 / (time.perf_counter() - t0))
    return HashRates(*rates)


def prepare(model_dir: Path, spec_json: Path, tokenizer_dir: Path, work: Path) -> Prepared:
    """The model built, then baseline B, the hash rates and the cast, over its tensors."""
    t0 = time.perf_counter()
    tensors = build(model_dir, spec_json, tokenizer_dir)
    build_s = time.perf_counter() - t0
    num_bytes, rounds = save_load(tensors, work)
    timed = rounds[1:]
    return Prepared(
        build_s=build_s,
        num_bytes=num_bytes,
        rounds=rounds,
        save_s=statistics.median(r.save_s for r in timed),
        load_s=statistics.median(r.load_s for r in timed),
        total_s=statistics.median(r.total_s for r in timed),
        hash_gib_s=hash_rates(tensors),
        cast_s=cast_s(tensors),
    )


# -- broadcast: baseline A -------------------------------------------------------------------------


def bucket_sizes(model_dir: Path, bucket_bytes: int) -> list[int]:
    """Bytes of each bucket the collective transport sends for this model (bfloat16), in order."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared_torch.weight_wire import ParamSpec, nbytes, plan_buckets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    metas = [ParamSpec(n, torch.bfloat16, tuple(t.shape)) for n, t in model.state_dict().items()]
    return [sum(nbytes(metas[i].dtype, metas[i].shape) for i in b) for b in plan_buckets(metas, bucket_bytes)]


def broadcast(model_dir: Path, bucket_bytes: int) -> Broadcast | None:
    """Baseline A (both ranks): every bucket broadcast from rank 0, timed on rank 0 to a barrier."""
    import torch
    import torch.distributed as dist

    sizes = bucket_sizes(model_dir, bucket_bytes)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    buf = torch.ones(max(sizes), dtype=torch.uint8) if rank == 0 else torch.empty(max(sizes), dtype=torch.uint8)
    times = []
    for _ in range(1 + BASELINE_REPEATS):
        dist.barrier()
        t0 = time.perf_counter()
        for n in sizes:
            dist.broadcast(buf[:n], src=0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return Broadcast(sum(sizes), len(sizes), times, statistics.median(times[1:]), os.getloadavg()[0])


# -- refit: the two transports ---------------------------------------------------------------------


def generator_config(model_dir: Path, redis_url: str, run_id: str, bucket_mb: int) -> dict[str, Any]:
    """One vLLM generator (bfloat16 on CPU) on ``model_dir`` and the trainer's refit settings: the
    collective transport over gloo from 127.0.0.1 (the generator takes filesystem versions too)."""
    return {
        "run": {"run_id": run_id, "seed": 0},
        "redis": {"url": redis_url},
        "data": {"train_path": "unused.jsonl"},
        "policy": {
            "model_name": str(model_dir.resolve()),
            "precision": "bfloat16",
            "generation": {
                "backend": "vllm",
                "max_new_tokens": 8,
                "vllm_cfg": {
                    "dtype": "bfloat16",
                    "enforce_eager": True,
                    "max_model_len": 512,
                    "kv_cache_memory_bytes": KV_CACHE_BYTES,
                    "max_num_seqs": 8,
                    "enable_prefix_caching": True,
                },
            },
        },
        "refit": {
            "transport": "collective",
            "collective": {"master_address": "127.0.0.1", "bucket_mb": bucket_mb, "snapshot_period": 1_000_000},
        },
        "trainer": {"refit_timeout_s": 600.0, "torch_threads": 1},
        "generator": {"host": "127.0.0.1", "drain_timeout_s": 30.0, "weight_load_timeout_s": 600.0},
    }


async def _ack_load_s(streams: StreamClient, version: int) -> float:
    """The generator's load_s from its ack of ``version``."""
    from shared.keys import ENTRY_FIELD
    from shared.protocol import WeightAck, decode
    from shared.redis_replies import range_entries

    for _, fields in range_entries(await streams.redis.xrevrange(streams.keys.weight_acks, count=10)):
        ack = decode(fields[ENTRY_FIELD], WeightAck)
        if ack.version == version and ack.worker_id == GENERATOR_ID:
            return float(ack.load_s)
    raise RuntimeError(f"no ack of weight version {version} from {GENERATOR_ID}")


async def _alternated(
    streams: StreamClient, transports: dict[str, WeightTransport], pubs: dict[str, WeightPublisher], n: int
) -> list[RefitRun]:
    """One warm-up refit per transport, then ``n`` each alternated (A B, B A, ...), SETTLE_S apart."""
    order = ["filesystem", "collective"]
    for i in range(n):
        order += ["filesystem", "collective"] if i % 2 else ["collective", "filesystem"]
    out = []
    for version, name in enumerate(order, start=1):
        await transports["filesystem"].aclose()  # the last removal of an old version is done
        await asyncio.sleep(SETTLE_S)
        report = await pubs[name].refit(version)
        out.append(
            RefitRun(
                transport=name,
                version=version,
                warm_up=version <= 2,
                total_s=report.total_s,
                save_s=report.save_s,
                confirm_s=report.confirm_s,
                num_bytes=report.num_bytes,
                attempts=report.attempts,
                load_s=await _ack_load_s(streams, version),
                load_avg=os.getloadavg()[0],
            )
        )
    return out


async def refits(model_dir: Path, work: Path, redis_url: str, n: int, bucket_mb: int) -> Refits:
    """The warm-up and ``n`` timed refits per transport (see the module docstring), then the
    generator's bring-up both ways."""
    import aiohttp
    import yaml

    from services.trainer.backends import build_backend
    from services.trainer.learner import LocalLearner
    from services.trainer.refit import WeightPublisher
    from services.trainer.weight_transport import FilesystemTransport, build_transport
    from shared.config import load
    from shared.keys import RunKeys
    from shared.pause import PauseControl
    from shared.run_config import RunConfig
    from shared.streams import StreamClient, connect
    from streamrl.bench.generator_process import GeneratorProcess
    from streamrl.redis_server import free_port

    run_id = f"bench-refit-{os.getpid()}-{int(time.time())}"
    config = work / "run.yaml"
    config.write_text(yaml.safe_dump(generator_config(model_dir, redis_url, run_id, bucket_mb)))
    cfg = load(RunConfig, config, env={})
    gen = GeneratorProcess(config, free_port(), work.with_suffix(".generator.log"))
    learner = LocalLearner(lambda: build_backend(cfg))
    redis = connect(redis_url)
    try:
        await learner.start()
        async with aiohttp.ClientSession() as session:
            await gen.wait_ready(session, timeout_s=600.0)
        keys = RunKeys(run_id)
        streams = StreamClient(redis, keys, "trainer")
        pause = PauseControl(redis, keys)
        transports: dict[str, WeightTransport] = {
            "filesystem": FilesystemTransport(work / "published", learner.export_weights, keep_versions=1),
            "collective": build_transport(cfg, learner, work / "snapshots", redis, keys),
        }
        pubs = {
            name: WeightPublisher(streams, pause, t, timeout_s=600.0, in_flight_updates=False)
            for name, t in transports.items()
        }
        out = await _alternated(streams, transports, pubs, n)
    finally:
        gen.stop()
        await learner.close()
        await redis.aclose()
    bring = {f: await bring_up(config, work, f) for f in BRING_UP}
    return Refits(BringUp(dummy=bring["dummy"], auto=bring["auto"]), out)


BRING_UP = ("dummy", "auto")  # started alone, one after the other, the model's files in the page cache


async def bring_up(config: Path, work: Path, load_format: str) -> float:
    """Start to /ready of the same generator, alone on the host, with ``load_format``: ``auto``
    reads the checkpoint; ``dummy`` (the collective transport's default) starts on random weights."""
    import aiohttp
    import yaml

    from streamrl.bench.generator_process import GeneratorProcess
    from streamrl.redis_server import free_port

    tree = yaml.safe_load(config.read_text())
    tree["policy"]["generation"]["vllm_cfg"]["load_format"] = load_format
    tree["run"]["run_id"] += f"-{load_format}"
    path = work / f"run-{load_format}.yaml"
    path.write_text(yaml.safe_dump(tree))
    t0 = time.perf_counter()
    gen = GeneratorProcess(path, free_port(), work.with_suffix(f".generator-{load_format}.log"))
    try:
        async with aiohttp.ClientSession() as session:
            await gen.wait_ready(session, timeout_s=600.0)
        return time.perf_counter() - t0
    finally:
        gen.stop()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("prepare", "broadcast", "refit"))
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--spec", help="prepare: the model spec (TinyModelSpec as JSON)")
    p.add_argument("--tokenizer", help="prepare: the folder whose tokenizer the model takes")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--redis", help="refit: the run's Redis URL")
    p.add_argument("--refits", type=int, default=2, help="refit: timed refits per transport")
    args = p.parse_args()
    model, out = Path(args.model), Path(args.out)
    work = out.parent / out.stem  # scratch of prepare and refit, removed when they succeed
    if args.mode != "broadcast":
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    result: Prepared | Broadcast | Refits | None
    if args.mode == "prepare":
        result = prepare(model, Path(args.spec), Path(args.tokenizer), work)
    elif args.mode == "broadcast":
        result = broadcast(model, args.bucket_mb << 20)
    else:
        from services.generator.vllm_env import apply_env_defaults

        apply_env_defaults()
        result = asyncio.run(refits(model, work, args.redis, args.refits, args.bucket_mb))
    shutil.rmtree(work, ignore_errors=True)
    if result is not None:
        out.write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
