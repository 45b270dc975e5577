"""How far inductor's compiled step strays from the model of the two graphs, and what
``ckptplan.compile`` does about it, on CPU.

    python benchmarks/inductor_memory.py                       # the compare.py models
    python benchmarks/inductor_memory.py --models unet --budgets 0.6

For each model and budget (a fraction of the compiled step's peak with nothing recomputed),
``ckptplan.compile(backend="inductor")``: each step it compiled and measured, the inductor
settings it ran with, the peak the model of the partitioned graphs predicts for it
(``ckptplan.partition``, exact for ``backend="aot_eager"``), the peak the allocator measured for
inductor's step, and the margin the partition was solved with (``compile`` compiles the same
partition under ``MODELLED_INDUCTOR``, then partitions again for less, while the measured step
is over the budget). Then the final module's peak measured once more, as a user's loop would
see it; a budget no step met, the last step measured. Writes
``benchmarks/results/inductor_memory.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import compare  # benchmarks/compare.py, beside this script
import results_file  # benchmarks/results_file.py, beside this script
import torch

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.planner.compiled import MODELLED_INDUCTOR
from ckptplan.profiler.cost import FLOPS

DEFAULT_MODELS = ("gpt", "unet", "resnet", "gpt2", "llama", "bert")
DEFAULT_BUDGETS = (1.0, 0.6)


def run_case(case: compare.Case, budgets: list[float], time_limit: float) -> list[dict[str, Any]]:
    work = case.build()
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        torch._dynamo.reset()
        started = time.perf_counter()
        try:
            module = ckptplan.compile(work.model, work.args, work.kwargs, budget=budget, backend="inductor",
                                      outputs_live=False, roofline=FLOPS, time_limit=time_limit)
        except InfeasibleBudgetError as error:
            # Every partition measured over the budget: the last one, as the error holds it.
            plan = error.least_plan
            print(f"{case.name} | {budget} | raised: {error}", flush=True)
            if plan is not None and plan.measured_peak_bytes is not None:
                rows.append(_row(case.name, budget, plan, None, kept=False, raised=True))
            continue
        seconds = time.perf_counter() - started
        ckptplan.measure_step(module, work.args, work.kwargs, outputs_live=False)
        final = ckptplan.measure_step(module, work.args, work.kwargs, outputs_live=False).peak_bytes
        attempts = module.ckptplan_attempts
        for number, plan in enumerate(attempts, 1):
            kept = number == len(attempts)
            rows.append(_row(case.name, budget, plan, number, kept=kept, final=final if kept else None,
                             seconds=seconds if kept else None))
            error = (plan.peak_bytes - plan.measured_peak_bytes) / plan.measured_peak_bytes
            print(f"{case.name} | {budget} | attempt {number} | margin {ckptplan.format_bytes(plan.margin_bytes)} | "
                  f"{_settings(plan.inductor_options)} | model {ckptplan.format_bytes(plan.peak_bytes)} | measured "
                  f"{ckptplan.format_bytes(plan.measured_peak_bytes)} ({error:+.1%}) | budget "
                  f"{ckptplan.format_bytes(plan.budget_bytes)}", flush=True)
    torch._dynamo.reset()
    return rows


def _row(model: str, budget: float, plan: Any, number: int | None, *, kept: bool, final: int | None = None,
         seconds: float | None = None, raised: bool = False) -> dict[str, Any]:
    return {
        "model": model, "budget": budget, "budget_bytes": plan.budget_bytes, "attempt": number,
        "margin_bytes": plan.margin_bytes, "inductor_options": dict(plan.inductor_options),
        "predicted_peak_bytes": plan.peak_bytes, "measured_peak_bytes": plan.measured_peak_bytes,
        "recompute_flops": plan.recompute_flops, "kept": kept, "raised": raised,
        "final_measured_peak_bytes": final, "compile_seconds": seconds,
    }


def _settings(options: dict[str, bool]) -> str:
    """Inductor's settings a step ran with, in the table's words."""
    if not options:
        return "defaults"
    return "modelled" if options == dict(MODELLED_INDUCTOR) else ", ".join(f"{k}={v}" for k, v in options.items())


def _table(rows: list[dict[str, Any]]) -> list[str]:
    def mib(n: Any) -> str:
        return "-" if n is None else f"{n / 2**20:.2f}"

    lines = [("| model | budget | budget (MiB) | step | inductor | solved for (MiB) | model's peak (MiB) "
              "| measured (MiB) | model error | GFLOP again | final step (MiB) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        error = (r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        lines.append(
            f"| {r['model']} | {r['budget']:g} | {mib(r['budget_bytes'])} | "
            f"{'last (raised: over the budget)' if r['raised'] else r['attempt']}{' (kept)' if r['kept'] else ''} | "
            f"{_settings(r['inductor_options'])} | {mib(r['budget_bytes'] - r['margin_bytes'])} | "
            f"{mib(r['predicted_peak_bytes'])} | {mib(r['measured_peak_bytes'])} | {error:+.1%} | "
            f"{r['recompute_flops'] / 1e9:.2f} | {mib(r['final_measured_peak_bytes'])} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated compare.py models")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                        help="comma-separated fractions of the peak with nothing recomputed")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per partition (default 10)")
    options = parser.parse_args(argv)
    names = [n for n in options.models.split(",") if n]
    unknown = [n for n in names if n not in compare.CASES]
    if unknown:
        print(f"Unknown model {unknown[0]!r}; choose from {', '.join(compare.CASES)}.", file=sys.stderr)
        return 2
    budgets = [float(b) for b in options.budgets.split(",") if b]
    rows = []
    for name in names:
        rows += run_case(compare.CASES[name], budgets, options.time_limit)
    lines = _table(rows)
    print("\n".join(lines))
    results_file.write(
        __file__, "Inductor's compiled step against the model of the partitioned graphs (CPU)", lines,
        about="`ckptplan.compile(backend=\"inductor\")`, the loop dropping the outputs, solver auto, "
              f"{options.time_limit:g} s per partition. One row per inductor step compiled and measured: the inductor "
              "settings it ran with (inductor's defaults, or `MODELLED_INDUCTOR`: no reordering for peak memory, no "
              "layout optimization; tried on the same partition after a step over the budget), the budget its "
              "partition was solved for (the budget less the margin from the steps measured before it), the model's "
              "peak for it, the allocator's peak of inductor's step (model error: model over measured), the FLOPs "
              "its backward recomputes; the kept row's final step is the returned module's peak measured again. A "
              "budget no step met shows its last step, as `compile` raised it.",
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
