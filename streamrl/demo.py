"""``streamrl demo``: the README's first command.

1. build the tiny model + tokenizer if missing (runs/models/tiny-qwen3; ``--arch qwen3_5_moe``:
   runs/models/tiny-qwen3_5_moe, the reference run's family in miniature);
2. write the crossing train/validation datasets;
3. warm-start the model briefly (streamrl.warmstart) so its first reward is in (0.1, 0.6);
4. run `streamrl up deploy/configs/demo.yaml` (embedded Valkey, vLLM generator, gateway, trainer);
5. print the reward of the first and last five steps and where the metrics and the plot are.
Every demo run starts training from the warm-started policy (earlier checkpoints are removed).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shared.jsonl import write_jsonl
from streamrl.model_builder import ARCHS, build_tiny_model, is_model_dir, tiny_spec
from streamrl.warmstart import WarmStartSpec

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "configs" / "demo.yaml"
MODEL_DIR = Path("runs/models/tiny-qwen3")
NUM_TRAIN, NUM_VAL = 4000, 64
# What the demo changes for the hybrid model: vLLM's CPU kernels for Gated DeltaNet layers run
# in bfloat16 only (the trainer keeps float32 master weights and computes in float32).
ARCH_OVERRIDES: dict[str, list[str]] = {
    "qwen3": [],
    "qwen3_5_moe": ["policy.generation.vllm_cfg.dtype=bfloat16"],
}
# The warm start of each family: the hybrid MoE takes a lower learning rate for longer (at the dense
# model's 2e-3 its loss climbs back after 100 steps).
WARM_STARTS = {"qwen3": WarmStartSpec(), "qwen3_5_moe": WarmStartSpec(steps=200, lr=1e-3)}


def model_dir(arch: str) -> Path:
    """Where the demo keeps the tiny model of ``arch``."""
    return MODEL_DIR if arch == "qwen3" else Path(f"runs/models/tiny-{arch}")


def default_out(arch: str) -> Path:
    return Path("runs/demo") if arch == "qwen3" else Path(f"runs/demo-{arch}")


def prepare(out: Path, arch: str = "qwen3") -> Path:
    """Model, data and warm-started policy for a run in ``out``; returns the policy folder."""
    import transformers

    from services.gym_gateway.envs.crossing import CrossingEnv
    from streamrl.warmstart import warm_start

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHS)}")
    transformers.logging.disable_progress_bar()
    base, spec = model_dir(arch), tiny_spec(arch)
    rebuilt = not is_model_dir(base) or _built_spec(base) != asdict(spec)
    if rebuilt:
        print(f"[1/4] building the tiny {arch} model and tokenizer in {base}", flush=True)
        shutil.rmtree(base, ignore_errors=True)
        build_tiny_model(base, spec)
    else:
        print(f"[1/4] tiny {arch} model found in {base}", flush=True)
    env = CrossingEnv()
    data = out / "data"
    write_jsonl(
        data / "train.jsonl", [{"env": "crossing", "instance": i} for i in env.make_instances(NUM_TRAIN, seed=1)]
    )
    write_jsonl(data / "val.jsonl", [{"env": "crossing", "instance": i} for i in env.make_instances(NUM_VAL, seed=2)])
    print(f"[2/4] datasets: {NUM_TRAIN} train / {NUM_VAL} validation crossing tasks in {data}", flush=True)
    policy = out / "policy-init"
    if rebuilt or not (policy / "warmstart.json").is_file() or _model_type(policy) != _model_type(base):
        print("[3/4] warm-starting the policy (short supervised fine-tune)", flush=True)
        summary = warm_start(base, policy, WARM_STARTS[arch])
        print(f"      done in {summary['time_s']:.0f}s (loss {summary['final_loss']:.3f})", flush=True)
    else:
        print(f"[3/4] warm-started policy found in {policy}", flush=True)
    # A fresh run each time: the last run's streams (its Redis) would announce weights deleted here.
    for stale in (
        *("checkpoints", "weights", "redis", "tensorboard", "logs"),
        *("metrics.jsonl", "reward_curve.png", "run.json", "summary.json"),
    ):
        p = out / stale
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return policy


def _built_spec(folder: Path) -> dict[str, Any] | None:
    """The spec the tiny model in ``folder`` was built from (None when unknown)."""
    try:
        spec: dict[str, Any] = json.loads((folder / "streamrl_tiny_spec.json").read_text())
    except (OSError, ValueError):
        return None
    return spec


def _model_type(folder: Path) -> str | None:
    try:
        model_type: str = json.loads((folder / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError):
        return None
    return model_type


def summarize(out: Path) -> dict[str, Any]:
    from shared.records import read_records, step_records, validation_records

    records = read_records(out / "metrics.jsonl")
    steps, vals = step_records(records), validation_records(records)
    if not steps:
        return {"steps": 0}
    first = [r.batch.reward_mean for r in steps[:5]]
    last = [r.batch.reward_mean for r in steps[-5:]]
    ids = [i for r in steps for i in r.consumed_ids]
    return {
        "steps": len(steps),
        "first5_reward": sum(first) / len(first),
        "last5_reward": sum(last) / len(last),
        "improvement": sum(last) / len(last) - sum(first) / len(first),
        "trajectories_trained": len(ids),
        "duplicate_ids": len(ids) - len(set(ids)),
        "mean_staleness": sum(r.staleness.mean for r in steps) / len(steps),
        "mean_step_s": sum(r.timing.step_s for r in steps) / len(steps),
        "validation_accuracy": [(v.step, v.accuracy) for v in vals],
    }


def run_demo(
    out: Path,
    *,
    steps: int | None = None,
    progress: bool = True,
    overrides: Sequence[str] = (),
    arch: str = "qwen3",
) -> int:
    from streamrl.supervisor import Supervisor

    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    out = Path(out)
    policy = prepare(out, arch)
    run_overrides = [
        *ARCH_OVERRIDES[arch],
        f"run.output_dir={out}",
        f"data.train_path={out / 'data' / 'train.jsonl'}",
        f"data.val_path={out / 'data' / 'val.jsonl'}",
        f"policy.model_name={policy}",
    ]
    if steps is not None:
        run_overrides.append(f"grpo.max_num_steps={steps}")
    run_overrides += overrides
    print(f"[4/4] async GRPO: streamrl up {CONFIG.relative_to(ROOT)} {' '.join(run_overrides)}", flush=True)
    code = Supervisor(str(CONFIG), run_overrides, progress=progress).run()
    s = summarize(out)
    s["total_time_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(s, indent=2))
    if s.get("steps"):
        print(
            f"\nreward: first 5 steps {s['first5_reward']:.3f} -> last 5 steps {s['last5_reward']:.3f} "
            f"({s['improvement']:+.3f}); {s['trajectories_trained']} trajectories trained, "
            f"{s['duplicate_ids']} trained twice; mean staleness {s['mean_staleness']:.2f}; "
            f"total {s['total_time_s'] / 60:.1f} min"
        )
        if s["validation_accuracy"]:
            print(
                "validation accuracy (greedy): "
                + " -> ".join(f"step {st}: {a:.3f}" for st, a in s["validation_accuracy"])
            )
        print(f"metrics: {out / 'metrics.jsonl'}  plot: {out / 'reward_curve.png'}  logs: {out / 'logs'}")
    return code
