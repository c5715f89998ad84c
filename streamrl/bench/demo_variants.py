"""``streamrl bench --only demo_variants``: the demo run again with one setting changed, against the
demo's own settings, each run shortened to ``STEPS`` steps, on the demo's seed and one warm-started
policy for all three runs.

1. Nucleus sampling (``policy.generation.top_p: 0.9``). The trainer scores the sampled tokens
   under the top-p nucleus they were drawn from (`shared.nucleus.sampled_logprobs`); before that
   fix it scored them under the temperature-only softmax. The same run reports both: the step's
   ``token_mult_prob_error`` and ``gen_kl_error`` (as trained) and their ``*_untruncated``
   figures, the same tokens and forward pass scored without the truncation
   (`services.trainer.mismatch`). Baseline: the top_p 1.0 run, where nothing is truncated. Each
   figure at step 0 (trainer and generator on the same weights, so only the scoring differs) and
   its mean over the run.
2. Dynamic sampling (``grpo.use_dynamic_sampling: true``, ``grpo.batch_multiplier``): the share of
   groups filtered per step (``dynamic_sampling.filtered_fraction``: mean, first and last step),
   the reward per 5-step window and the greedy validation accuracy at the start and the end, next
   to the default run (which trains the groups whose rewards all tie, with a zero advantage).

The runs go one after the other (`streamrl.demo.run_demo`: the whole stack, vLLM on CPU); the
figures come from each run's ``metrics.jsonl``. Called by `streamrl.bench`.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HEADING = "## Demo variants"
STEPS = 30
WINDOW = 5
TOP_P = 0.9
BATCH_MULTIPLIER = 1.5
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "top_p": (f"policy.generation.top_p={TOP_P}",),
    "dynamic_sampling": ("grpo.use_dynamic_sampling=true", f"grpo.batch_multiplier={BATCH_MULTIPLIER}"),
}
NAMES = {"default": "default (the demo's settings)", "top_p": f"top_p {TOP_P}", "dynamic_sampling": "dynamic sampling"}
ERRORS = ("token_mult_prob_error", "gen_kl_error", "token_mult_prob_error_untruncated", "gen_kl_error_untruncated")
OUTLIER = 1.1  # a step's token_mult_prob_error above it is called out


def run_figures(out: Path, groups: int) -> dict[str, Any]:
    """One run's per-step figures from its records (None where a step did not measure one);
    ``groups``: the groups every step trains (``grpo.num_prompts_per_step``)."""
    from shared.records import read_records, step_records, validation_records

    path = out / "metrics.jsonl"
    records = read_records(path) if path.is_file() else []
    steps, vals = step_records(records), validation_records(records)
    judged: list[float] = []
    filtered: list[float | None] = []
    for r in steps:
        ds = r.dynamic_sampling
        n, mean = (ds.num_filtered_groups, ds.filtered_reward_mean) if ds is not None else (0, 0.0)
        # every group judged: the trained ones and the ones filtered since the previous step
        judged.append((r.batch.reward_mean * groups + mean * n) / (groups + n))
        filtered.append(None if ds is None else ds.filtered_fraction)
    return {
        "steps": len(steps),
        "reward": [r.batch.reward_mean for r in steps],
        "reward_judged": judged,
        "filtered_fraction": filtered,
        "filtered_groups": sum(r.dynamic_sampling.num_filtered_groups for r in steps if r.dynamic_sampling),
        "tied_share": [r.batch.zero_advantage_groups / groups for r in steps],
        "step_s": [r.timing.step_s for r in steps],
        "validation": [(v.step, v.accuracy) for v in vals],
        **{k: [getattr(r.learner, k) for r in steps] for k in (*ERRORS, "max_abs_logprob_diff")},
    }


def demo_variants_benchmark(out_dir: Path, machine: str, steps: int = STEPS) -> dict[str, Any]:
    """Run every variant for ``steps`` steps in ``out_dir/<name>``, each from a copy of one
    warm-started policy (``out_dir/policy``)."""
    from shared.config import load
    from shared.run_config import RunConfig
    from streamrl.demo import CONFIG, prepare, run_demo

    cfg = load(RunConfig, CONFIG, env={})
    shutil.rmtree(out_dir, ignore_errors=True)
    policy = prepare(out_dir / "policy")  # the warm start, outside the runs' times
    runs: dict[str, Any] = {}
    for name, overrides in VARIANTS.items():
        out = out_dir / name
        shutil.copytree(policy, out / "policy-init")
        print(f"demo variant {name}: {' '.join(overrides) or 'the demo config'}, {steps} steps", flush=True)
        t0 = time.perf_counter()
        code = run_demo(out, steps=steps, progress=False, overrides=list(overrides))
        runs[name] = {
            "overrides": list(overrides),
            "exit_code": code,
            "total_s": time.perf_counter() - t0,
            **run_figures(out, cfg.grpo.num_prompts_per_step),
        }
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "max_num_steps": steps,
        "seed": cfg.run.seed,
        "groups": cfg.grpo.num_prompts_per_step,
        "generations": cfg.grpo.num_generations_per_prompt,
        "runs": runs,
    }


def _mean(values: Sequence[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.mean(real) if real else None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _median(values: Sequence[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def _error_row(label: str, run: str, figures: dict[str, Any], key: str) -> str:
    cells = []
    for values, spec in ((figures[key], ".5f"), (figures[key.replace("token_mult_prob_error", "gen_kl_error")], ".2e")):
        cells += [_fmt(v, spec) for v in (values[0] if values else None, _mean(values), _median(values))]
    return f"| {label} | {run} | " + " | ".join(cells) + " |"


def _outliers(runs: dict[str, dict[str, Any]]) -> str:
    """The steps whose token_mult_prob_error is above OUTLIER in each of ``runs``, in words."""
    parts = []
    for label, figures in runs.items():
        pairs = zip(figures["token_mult_prob_error"], figures["max_abs_logprob_diff"], strict=True)
        high = [(v, d or 0.0) for v, d in pairs if v and v > OUTLIER]
        if high:
            worst = f"at most {max(v for v, _ in high):.2f}, a token {max(d for _, d in high):.1f} nats apart"
            parts.append(f"{len(high)} of the {label} run ({worst})")
    if not parts:
        return f"No step of either run has a token_mult_prob_error above {OUTLIER}."
    return (
        f"Steps above {OUTLIER}: {'; '.join(parts)}. One such step outweighs the rest of its run's mean, so the "
        "medians compare the runs."
    )


def _excess(figures: dict[str, Any], key: str) -> float | None:
    """The step-0 value's excess over 1 (1.0: trainer and generator agree exactly)."""
    return figures[key][0] - 1.0 if figures[key] and figures[key][0] is not None else None


def render_nucleus(d: dict[str, Any]) -> list[str]:
    default, top_p = d["runs"]["default"], d["runs"]["top_p"]
    n = d["max_num_steps"]
    lines = [
        "| the trainer's logprobs of the sampled tokens | run | token_mult_prob_error: step 0 | mean over the "
        "steps | median | gen_kl_error: step 0 | mean | median |",
        "|---|---|---|---|---|---|---|---|",
        _error_row(
            "under the top-p nucleus, renormalised, as sampled (after the fix; trained on)",
            f"top_p {TOP_P}",
            top_p,
            "token_mult_prob_error",
        ),
        _error_row(
            "temperature only, untruncated (before the fix; `*_untruncated`, same forward pass)",
            f"top_p {TOP_P}",
            top_p,
            "token_mult_prob_error_untruncated",
        ),
        _error_row("temperature only (nothing to truncate): baseline", "top_p 1.0", default, "token_mult_prob_error"),
    ]
    after, before = _excess(top_p, "token_mult_prob_error"), _excess(top_p, "token_mult_prob_error_untruncated")
    base = _excess(default, "token_mult_prob_error")
    lines += [
        "",
        f"token_mult_prob_error is the mean over loss tokens of exp|logp_gen - logp_trainer| (1: they agree), "
        f"gen_kl_error the k3 estimate of KL(generator || trainer); mean and median over the {n} steps of each run. "
        "At step 0 the trainer and the generator hold the same weights, so only the scoring differs: the excess "
        f"over 1 is {_fmt(after, '.2e')} after the fix against {_fmt(before, '.2e')} before it, and "
        f"{_fmt(base, '.2e')} at top_p 1.0. Later steps train on samples of the previous weight version (lag 1). "
        f"{_outliers({'top_p 1.0': default, f'top_p {TOP_P}': top_p})} The untruncated figures are what the old "
        "scoring gives on the same samples and weights; the run itself trains with the fixed importance weights "
        "(a run trained with the old ones would drift apart after step 0).",
    ]
    return lines


def _window_rows(d: dict[str, Any]) -> list[str]:
    default, ds = d["runs"]["default"], d["runs"]["dynamic_sampling"]
    n = max(default["steps"], ds["steps"])
    rows = []
    for s in range(0, n, WINDOW):
        cut = slice(s, s + WINDOW)
        cells = [_mean(default["reward"][cut]), _mean(ds["reward"][cut]), _mean(ds["reward_judged"][cut])]
        share = _mean(ds["filtered_fraction"][cut])
        end = min(s + WINDOW, n) - 1
        rows.append(f"| {s}-{end} | " + " | ".join(_fmt(c, ".3f") for c in cells) + f" | {_fmt(share, '.2f')} |")
    return rows


def _val(figures: dict[str, Any]) -> str:
    v = figures["validation"]
    return f"{v[0][1]:.3f} -> {v[-1][1]:.3f} (step {v[-1][0]})" if v else "n/a"


def render_dynamic(d: dict[str, Any]) -> list[str]:
    default, ds = d["runs"]["default"], d["runs"]["dynamic_sampling"]
    frac = [f for f in ds["filtered_fraction"] if f is not None]
    g = d["groups"]
    lines = [
        f"Dynamic sampling (`grpo.use_dynamic_sampling: true`, `grpo.batch_multiplier: {BATCH_MULTIPLIER}`) against "
        "the default run: a group whose rewards all tie is filtered instead of trained with a zero advantage, and a "
        "new prompt replaces it. The trained groups' reward leaves the filtered groups out (all solved: 1, all "
        "failed: 0); the reward of every judged group adds them back, the figure comparable with the default run's.",
        "",
        "| figure | default run | dynamic sampling |",
        "|---|---|---|",
        f"| groups filtered per step, filtered / (filtered + {g}): mean | 0 (none filtered) | "
        f"{_fmt(_mean(frac), '.3f')} |",
        f"| the same, first step / last step | - | {_fmt(frac[0] if frac else None, '.3f')} / "
        f"{_fmt(frac[-1] if frac else None, '.3f')} |",
        f"| groups filtered, whole run (trained: {g} per step) | 0 | {ds['filtered_groups']} |",
        "| trained groups whose rewards all tie (no signal), share per step: mean | "
        f"{_fmt(_mean(default['tied_share']), '.3f')} | {_fmt(_mean(ds['tied_share']), '.3f')} |",
        f"| validation accuracy (greedy), start -> end | {_val(default)} | {_val(ds)} |",
        f"| mean step time (s) | {_fmt(_mean(default['step_s']), '.2f')} | {_fmt(_mean(ds['step_s']), '.2f')} |",
        "",
        "| steps | default run: mean reward | dynamic sampling: trained groups | dynamic sampling: every judged "
        "group | dynamic sampling: filtered share |",
        "|---|---|---|---|---|",
        *_window_rows(d),
    ]
    return lines


def render_section(d: dict[str, Any]) -> str:
    """The BENCHMARKS.md section for the results of `demo_variants_benchmark`."""
    runs = d["runs"]
    head = (
        f"{HEADING} (`streamrl bench --only demo_variants`: the demo's config and seed ({d['seed']}), "
        f"{d['max_num_steps']} steps per run, one warm-started policy; {d['date']}, {d['machine']})"
    )
    lines = [
        head,
        "",
        "| run | overrides | steps trained | mean reward, first / last 5 steps | validation accuracy (greedy) | "
        "run time incl. engine start, validations (min) | exit code |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        first, last = _mean(r["reward"][:WINDOW]), _mean(r["reward"][-WINDOW:])
        overrides = ", ".join(f"`{o}`" for o in r["overrides"]) or "none (top_p 1.0)"
        lines.append(
            f"| {NAMES.get(name, name)} | {overrides} | {r['steps']} | {_fmt(first, '.3f')} / {_fmt(last, '.3f')} | "
            f"{_val(r)} | {r['total_s'] / 60:.1f} | {r['exit_code']} |"
        )
    lines += ["", *render_nucleus(d), "", *render_dynamic(d)]
    return "\n".join(lines) + "\n"
