"""Does ``solve`` keep its time limit, and is the least peak it states reachable?

    python benchmarks/time_limits.py [--limit 10] [--budgets 0.5,0.3] [--models efficientnet,t5,...]

For each model (``tests/architectures.py``: small real architectures built locally, and the
examples), ``auto`` solves at each budget (a fraction of the no-checkpoint peak) with the time
limit, on this machine's cores: the seconds it took against the limit, and what it answered. An
infeasible budget's stated least peak is then asked for as the budget, with the same limit, and
must be met. Writes ``benchmarks/results/time_limits.md``.
"""

from __future__ import annotations

import argparse
import time

import results_file  # benchmarks/results_file.py, beside this script
import zoo  # benchmarks/zoo.py, beside this script

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes


def _solve(graph: ckptplan.ComputeGraph, budget: float, limit: float) -> tuple[float, str, int | None]:
    """Seconds taken, what came back, and the stated least peak when infeasible."""
    started = time.perf_counter()
    try:
        plan = ckptplan.solve(graph, budget, time_limit=limit)
    except InfeasibleBudgetError as exc:
        return time.perf_counter() - started, "infeasible", exc.min_peak_bytes
    seconds = time.perf_counter() - started
    peak = plan.prediction.peak_bytes / baseline_peak_bytes(graph)
    return seconds, f"{plan.solver.status}, {peak:.0%} of peak, overhead {plan.prediction.overhead:.3f}", None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=float, default=10.0)
    parser.add_argument("--budgets", default="0.5,0.3")
    parser.add_argument("--models", default=None, help="comma-separated; default: all")
    options = parser.parse_args()
    builders = zoo.builders()
    names = options.models.split(",") if options.models else list(builders)
    budgets = [float(b) for b in options.budgets.split(",")]
    print("| model | nodes | budget | seconds | of limit | answer | at the stated least |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for name in names:
        model, args, kwargs = builders[name]()
        graph = ckptplan.profile(model, args, kwargs, outputs_live=False)
        for budget in budgets:
            seconds, answer, least = _solve(graph, budget, options.limit)
            worst = max(worst, seconds / options.limit)
            again = ""
            if least is not None:
                again_seconds, again_answer, again_least = _solve(graph, least, options.limit)
                worst = max(worst, again_seconds / options.limit)
                answer = f"infeasible, least {least:,} bytes"
                again = f"{again_answer} in {again_seconds:.1f} s" if again_least is None else (
                    f"**infeasible again** (least {again_least:,}) in {again_seconds:.1f} s")
            print(f"| {name} | {len(graph.nodes)} | {budget:g} | {seconds:.1f} | {seconds / options.limit:.2f} | "
                  f"{answer} | {again} |", flush=True)
    print(f"\nLongest: {worst:.2f} of the limit.")


TITLE = "Time limits and stated least peaks"
ABOUT = ("`auto` at each budget (a fraction of the no-checkpoint peak); an infeasible budget's stated least is then "
         "asked for with the same limit.")


if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
