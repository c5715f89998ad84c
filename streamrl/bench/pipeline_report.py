"""The markdown section of the pipeline-efficiency benchmark: result tables and the targets
checked against them (`streamrl.bench.pipeline` measures, this module reports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamrl.bench.schedule import LONG_RUN_SEEDS, LONG_RUN_STEPS

HEADING = "## Pipeline efficiency"
EFFICIENCY_TARGET = 0.95  # real steps/hour over the ideal schedule's
PACKING_TARGET = 0.95
REAL_RUN_ATTEMPTS = 2
CONTENDED_OVERSHOOT_S = 0.05  # a train_step sleep this much late: the host's CPU was taken
CONTENDED_OTHER_CPU = 0.5  # cores used by other processes of the host during a run


def _speedup(runs: dict[str, Any], lag: int, kind: str) -> float:
    speedup: float = runs[str(lag)][kind]["steps_per_hour"] / runs["0"][kind]["steps_per_hour"]
    return speedup


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(target, measured figure, met) for every target of the section."""
    rows: list[tuple[str, str, bool]] = []
    for name, sc in results["scenarios"].items():
        for lag, r in sc["runs"].items():
            eff = r["real"]["steps_per_hour"] / r["ideal"]["steps_per_hour"]
            rows.append(
                (
                    f"{name}, lag {lag}: real >= {EFFICIENCY_TARGET:.0%} of the ideal schedule's steps/hour",
                    f"{eff:.1%}",
                    eff >= EFFICIENCY_TARGET,
                )
            )
        f = sc["facts"]
        real, ideal = _speedup(sc["runs"], f["target_lag"], "real"), _speedup(sc["runs"], f["target_lag"], "ideal")
        rows.append(
            (
                f"{name}: lag {f['target_lag']} >= {f['target_speedup']}x synchronous",
                f"real {real:.2f}x (ideal {ideal:.2f}x)",
                real >= f["target_speedup"],
            )
        )
    p = results["packing"]
    rows.append(
        (
            f"packing efficiency >= {PACKING_TARGET:.0%}",
            f"{p['packing_mean']:.1%} (min {p['packing_min']:.1%})",
            p["packing_min"] >= PACKING_TARGET,
        )
    )
    return rows


def _runs(results: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for name, sc in results["scenarios"].items():
        for lag, r in sc["runs"].items():
            re_, id_ = r["real"], r["ideal"]
            rows.append(
                {
                    "name": name,
                    "lag": lag,
                    "real_sph": f"{re_['steps_per_hour']:.0f}",
                    "ideal_sph": f"{id_['steps_per_hour']:.0f}",
                    "efficiency": f"{re_['steps_per_hour'] / id_['steps_per_hour']:.1%}",
                    "busy_real": f"{re_['busy_fraction']:.2f}",
                    "busy_ideal": f"{id_['busy_fraction']:.2f}",
                    "sync_real": f"{_speedup(sc['runs'], int(lag), 'real'):.2f}x",
                    "sync_ideal": f"{_speedup(sc['runs'], int(lag), 'ideal'):.2f}x",
                    "sync_long": f"{sc['long_run_ideal_speedup'][lag]:.2f}x",
                    "issued": f"{re_['issued_groups']} / {id_['issued_groups']}",
                    "evicted": f"{re_['evicted_groups']} / {id_['evicted_groups']}",
                    "peak": str(re_["peak_rollouts"]),
                }
            )
    return rows


def _pair(run: dict[str, Any], key: str) -> str:
    return f"{run[key + '_mean_s']:.3f} / {run[key + '_max_s']:.3f}"


def _gaps(results: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for name, sc in results["scenarios"].items():
        for lag, r in sc["runs"].items():
            re_ = r["real"]
            other = re_["mean_gap_s"] - re_["mean_refit_s"] - re_["mean_wait_data_s"]
            rows.append(
                {
                    "name": name,
                    "lag": lag,
                    "gap": f"{re_['mean_gap_s']:.3f} / {r['ideal']['mean_gap_s']:.3f}",
                    "refit": f"{re_['mean_refit_s']:.3f} / {re_['max_refit_s']:.3f}",
                    "wait": f"{re_['mean_wait_data_s']:.3f}",
                    "other": f"{other:.3f}",
                    "pickup": _pair(re_, "pickup"),
                    "open": _pair(re_, "open"),
                    "last_start": f"{re_['last_start_mean_s']:.3f}",
                    "delivery": _pair(re_, "delivery"),
                }
            )
    return rows


def _hosts(results: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {
            "name": name,
            "lag": lag,
            "attempts": str(r["real"]["attempts"]),
            "overshoot_ms": f"{r['real']['max_train_overshoot_s'] * 1000:.1f}",
            "other_cpu": f"{r['real']['other_cpu_cores']:.2f}",
            "wall_s": f"{r['real']['run_wall_s']:.0f}",
        }
        for name, sc in results["scenarios"].items()
        for lag, r in sc["runs"].items()
    ]


def _scenarios(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "description": f["description"],
            "median": f"{f['rollout_median_s']:.3f}",
            "sigma": f["sigma"],
            "p99": f"{f['p99_over_p50']:.1f}",
            "sampled_p99": f"{f['sampled_p99_over_p50']:.1f}",
            "makespan": f["makespan_over_train"],
            "train_s": f["train_s"],
            "steps": f["steps"],
        }
        for name, f in ((name, sc["facts"]) for name, sc in results["scenarios"].items())
    ]


def render_pipeline(results: dict[str, Any]) -> str:
    """The markdown section for the results of `run_pipeline_benchmark` (the prose and table
    layout live in templates/pipeline.md.jinja; the figures are formatted here)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    text = env.get_template("pipeline.md.jinja").render(
        heading=HEADING,
        r=results,
        first=next(iter(results["scenarios"].values()))["facts"],
        scenarios=_scenarios(results),
        runs=_runs(results),
        gaps=_gaps(results),
        hosts=_hosts(results),
        targets=targets(results),
        p=results["packing"],
        c=results["packing"]["case"],
        pct=lambda v: f"{v:.1%}",
        long_run_steps=f"{LONG_RUN_STEPS:,}",
        long_run_seeds=LONG_RUN_SEEDS,
        attempts=REAL_RUN_ATTEMPTS,
        contended_cpu=CONTENDED_OTHER_CPU,
        contended_ms=f"{CONTENDED_OVERSHOOT_S * 1000:.0f}",
    )
    return text.rstrip("\n") + "\n"
