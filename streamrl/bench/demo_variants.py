"""``streamrl bench --only demo_variants``: the demo run again with one setting changed, against the
demo's own settings, each run shortened to ``STEPS`` steps, on the demo's seed and one warm-started
policy for all three runs.

1. Nucleus sampling (``policy.generation.top_p: 0.9``). The trainer scores the sampled tokens
   under the top-p nucleus they were drawn from (`shared_torch.nucleus.sampled_logprobs`); before that
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
figures come from each run's ``metrics.jsonl`` (`run_figures`), and `summarize` turns them into
the section's `VariantsResults`, rendered by ``templates/demo_variants.md.jinja``. Called by
`streamrl.bench.suite`.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from streamrl.bench.report import Results, render

STEPS = 30
WINDOW = 5
TOP_P = 0.9
BATCH_MULTIPLIER = 1.5
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "top_p": (f"policy.generation.top_p={TOP_P}",),
    "dynamic_sampling": ("grpo.use_dynamic_sampling=true", f"grpo.batch_multiplier={BATCH_MULTIPLIER}"),
}
OUTLIER = 1.1  # a step's token_mult_prob_error above it is called out


class RunSteps(msgspec.Struct):
    """One run's per-step figures read back from its records (None where a step did not measure one)."""

    steps: int
    reward: list[float]  # the trained groups' mean reward
    reward_judged: list[float]  # every judged group's: the trained ones and the ones filtered
    filtered_fraction: list[float | None]
    filtered_groups: int
    tied_share: list[float]  # trained groups whose rewards all tie
    step_s: list[float]
    validation: list[tuple[int, float]]  # (step, greedy accuracy)
    token_mult_prob_error: list[float | None]
    gen_kl_error: list[float | None]
    token_mult_prob_error_untruncated: list[float | None]
    gen_kl_error_untruncated: list[float | None]
    max_abs_logprob_diff: list[float | None]


class RunRecord(msgspec.Struct):
    """A finished run: its variant, how it ended and its steps."""

    name: str
    overrides: list[str]
    exit_code: int
    total_s: float  # engine start and validations included
    steps: RunSteps


class Validation(msgspec.Struct):
    start: float
    end: float
    end_step: int


class RunRow(msgspec.Struct):
    """One run in the section's first table."""

    name: str  # a key of VARIANTS
    overrides: list[str]
    steps: int
    reward_first: float | None  # mean over the first WINDOW steps
    reward_last: float | None  # and the last
    validation: Validation | None
    total_s: float
    exit_code: int


class Mismatch(msgspec.Struct):
    step0: float | None
    mean: float | None
    median: float | None


class Scoring(msgspec.Struct):
    """The trainer/generator mismatch of one way of scoring the sampled tokens, over a run."""

    token_mult_prob_error: Mismatch
    gen_kl_error: Mismatch
    step0_excess: float | None  # token_mult_prob_error at step 0 over 1 (0: the sides agree exactly)


class Outliers(msgspec.Struct):
    """Steps of a run whose token_mult_prob_error is above OUTLIER, and the worst of them."""

    run: str  # "top_p 1.0", "top_p 0.9"
    steps: int
    worst: float | None
    worst_diff_nats: float | None  # the largest max_abs_logprob_diff of those steps


class Dynamic(msgspec.Struct):
    """Dynamic sampling against the default run."""

    filtered_share_mean: float | None  # filtered / (filtered + trained groups), per step
    filtered_share_first: float | None
    filtered_share_last: float | None
    filtered_groups: int
    tied_share_default: float | None
    tied_share_dynamic: float | None
    step_s_default: float | None
    step_s_dynamic: float | None


class Window(msgspec.Struct):
    first_step: int
    last_step: int
    default_reward: float | None
    trained_reward: float | None  # dynamic sampling: the trained groups
    judged_reward: float | None  # dynamic sampling: every judged group
    filtered_share: float | None


class VariantsResults(Results):
    date: str
    machine: str
    max_num_steps: int
    seed: int
    groups: int  # trained per step (grpo.num_prompts_per_step)
    top_p: float
    batch_multiplier: float
    runs: list[RunRow]
    nucleus: Scoring  # top_p run, under the nucleus (trained on)
    untruncated: Scoring  # top_p run, the same tokens without the truncation
    baseline: Scoring  # default run (top_p 1.0: nothing to truncate)
    outliers: list[Outliers]
    dynamic: Dynamic
    windows: list[Window]

    def run(self, name: str) -> RunRow:
        return next(r for r in self.runs if r.name == name)


def run_figures(out: Path, groups: int) -> RunSteps:
    """One run's per-step figures from its records; ``groups``: the groups every step trains
    (``grpo.num_prompts_per_step``)."""
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
    learner = [r.learner for r in steps]
    return RunSteps(
        steps=len(steps),
        reward=[r.batch.reward_mean for r in steps],
        reward_judged=judged,
        filtered_fraction=filtered,
        filtered_groups=sum(r.dynamic_sampling.num_filtered_groups for r in steps if r.dynamic_sampling),
        tied_share=[r.batch.zero_advantage_groups / groups for r in steps],
        step_s=[r.timing.step_s for r in steps],
        validation=[(v.step, v.accuracy) for v in vals],
        token_mult_prob_error=[m.token_mult_prob_error for m in learner],
        gen_kl_error=[m.gen_kl_error for m in learner],
        token_mult_prob_error_untruncated=[m.token_mult_prob_error_untruncated for m in learner],
        gen_kl_error_untruncated=[m.gen_kl_error_untruncated for m in learner],
        max_abs_logprob_diff=[m.max_abs_logprob_diff for m in learner],
    )


def demo_variants_benchmark(out_dir: Path, machine: str, steps: int = STEPS) -> VariantsResults:
    """Run every variant for ``steps`` steps in ``out_dir/<name>``, each from a copy of one
    warm-started policy (``out_dir/policy``)."""
    from shared.config import load
    from shared.run_config import RunConfig
    from streamrl.demo import CONFIG, prepare, run_demo

    cfg = load(RunConfig, CONFIG, env={})
    shutil.rmtree(out_dir, ignore_errors=True)
    policy = prepare(out_dir / "policy")  # the warm start, outside the runs' times
    runs = []
    for name, overrides in VARIANTS.items():
        out = out_dir / name
        shutil.copytree(policy, out / "policy-init")
        print(f"demo variant {name}: {' '.join(overrides) or 'the demo config'}, {steps} steps", flush=True)
        t0 = time.perf_counter()
        code = run_demo(out, steps=steps, progress=False, overrides=list(overrides))
        total_s = time.perf_counter() - t0
        runs.append(RunRecord(name, list(overrides), code, total_s, run_figures(out, cfg.grpo.num_prompts_per_step)))
    return summarize(
        runs,
        date=time.strftime("%Y-%m-%d"),
        machine=machine,
        max_num_steps=steps,
        seed=cfg.run.seed,
        groups=cfg.grpo.num_prompts_per_step,
    )


# -- figures -------------------------------------------------------------------------------------


def _mean(values: Sequence[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.mean(real) if real else None


def _median(values: Sequence[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def _mismatch(values: list[float | None]) -> Mismatch:
    return Mismatch(values[0] if values else None, _mean(values), _median(values))


def _scoring(errors: list[float | None], kl: list[float | None]) -> Scoring:
    excess = errors[0] - 1.0 if errors and errors[0] is not None else None
    return Scoring(_mismatch(errors), _mismatch(kl), excess)


def _outliers(label: str, s: RunSteps) -> Outliers:
    pairs = zip(s.token_mult_prob_error, s.max_abs_logprob_diff, strict=True)
    high = [(v, d or 0.0) for v, d in pairs if v and v > OUTLIER]
    if not high:
        return Outliers(label, 0, None, None)
    return Outliers(label, len(high), max(v for v, _ in high), max(d for _, d in high))


def _row(run: RunRecord) -> RunRow:
    v = run.steps.validation
    return RunRow(
        name=run.name,
        overrides=run.overrides,
        steps=run.steps.steps,
        reward_first=_mean(run.steps.reward[:WINDOW]),
        reward_last=_mean(run.steps.reward[-WINDOW:]),
        validation=Validation(v[0][1], v[-1][1], v[-1][0]) if v else None,
        total_s=run.total_s,
        exit_code=run.exit_code,
    )


def _dynamic(default: RunSteps, ds: RunSteps) -> Dynamic:
    frac = [f for f in ds.filtered_fraction if f is not None]
    return Dynamic(
        filtered_share_mean=_mean(frac),
        filtered_share_first=frac[0] if frac else None,
        filtered_share_last=frac[-1] if frac else None,
        filtered_groups=ds.filtered_groups,
        tied_share_default=_mean(default.tied_share),
        tied_share_dynamic=_mean(ds.tied_share),
        step_s_default=_mean(default.step_s),
        step_s_dynamic=_mean(ds.step_s),
    )


def _windows(default: RunSteps, ds: RunSteps) -> list[Window]:
    n = max(default.steps, ds.steps)
    out = []
    for s in range(0, n, WINDOW):
        cut = slice(s, s + WINDOW)
        means = (_mean(default.reward[cut]), _mean(ds.reward[cut]), _mean(ds.reward_judged[cut]))
        out.append(Window(s, min(s + WINDOW, n) - 1, *means, _mean(ds.filtered_fraction[cut])))
    return out


def summarize(
    runs: list[RunRecord], *, date: str, machine: str, max_num_steps: int, seed: int, groups: int
) -> VariantsResults:
    """The section's figures from the three runs (``default``, ``top_p``, ``dynamic_sampling``)."""
    by_name = {r.name: r.steps for r in runs}
    default, top_p, ds = by_name["default"], by_name["top_p"], by_name["dynamic_sampling"]
    return VariantsResults(
        date=date,
        machine=machine,
        max_num_steps=max_num_steps,
        seed=seed,
        groups=groups,
        top_p=TOP_P,
        batch_multiplier=BATCH_MULTIPLIER,
        runs=[_row(r) for r in runs],
        nucleus=_scoring(top_p.token_mult_prob_error, top_p.gen_kl_error),
        untruncated=_scoring(top_p.token_mult_prob_error_untruncated, top_p.gen_kl_error_untruncated),
        baseline=_scoring(default.token_mult_prob_error, default.gen_kl_error),
        outliers=[_outliers("top_p 1.0", default), _outliers(f"top_p {TOP_P}", top_p)],
        dynamic=_dynamic(default, ds),
        windows=_windows(default, ds),
    )


def render_section(r: VariantsResults) -> str:
    return render("demo_variants", r=r, window=WINDOW, outlier=OUTLIER)
