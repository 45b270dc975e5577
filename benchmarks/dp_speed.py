"""Solve time of the ``dp`` solver against chain length and memory resolution, with ``sqrt``
and the memoised reference DP run in the same process for comparison.

    python benchmarks/dp_speed.py

Chains are MLPs of Linear+ReLU pairs profiled on the meta device (batch 4096, width 1024), one
stage per node, solved at a quarter of the way from the least peak ``dp`` reaches to the
no-checkpoint peak. "memory units": resident memory to the no-checkpoint peak in that many
units. "one budget" fills the DP's tables up to that budget; "every budget" fills them up to
the no-checkpoint peak, which answers every budget at once (what ``solve_dp`` does).
The reference (``ChainDP``, memoised per budget) runs up to 60 stages. The last line solves a
1,000-node chain (500 pairs) the default way, where the chain is cut to ``stage_starts``'s
default stage count. Writes ``benchmarks/results/dp_speed.md``.
"""

from __future__ import annotations

import argparse
import platform
import time

import results_file  # benchmarks/results_file.py, beside this script
import torch
from torch import nn

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes
from ckptplan.solvers.chain import build_chain, stage_starts
from ckptplan.solvers.dp import solve_chain, solve_dp
from ckptplan.solvers.dp_curve import cost_curve
from ckptplan.solvers.sqrt import solve_sqrt

REFERENCE_MAX_STAGES = 60


def mlp_graph(nodes: int) -> ckptplan.ComputeGraph:
    with torch.device("meta"):
        layers: list[nn.Module] = []
        for _ in range(nodes // 2):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers)
        x = torch.randn(4096, 1024)
    return ckptplan.profile(model, (x,), trace="symbolic", outputs_live=False)


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except InfeasibleBudgetError:
        result = None
    return result, time.perf_counter() - started


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}\n")
    print("| stages | memory units | dp s, one budget | dp s, every budget | reference DP s | dp overhead "
          "| sqrt s | sqrt overhead |")
    print("|---|---|---|---|---|---|---|---|")
    for nodes in (10, 20, 40, 60, 100):
        graph = mlp_graph(nodes)
        chain = build_chain(graph, stage_starts(graph, max_stages=nodes))
        span = baseline_peak_bytes(graph) - chain.resident_bytes
        for units in (500, 1000):
            unit = -(-span // units)
            curve, every_seconds = timed(cost_curve, chain, baseline_peak_bytes(graph), unit)
            least = curve.least_units()
            budget = chain.resident_bytes + (least + (units - least) // 4) * unit
            one, one_seconds = timed(cost_curve, chain, budget, unit)
            assert one.cost(budget) == curve.cost(budget)
            reference = "—"
            if nodes <= REFERENCE_MAX_STAGES:
                (cost, _), seconds = timed(solve_chain, chain, budget, unit)
                assert cost == curve.cost(budget)
                reference = f"{seconds:.2f}"
            sqrt_plan, sqrt_seconds = timed(solve_sqrt, graph, budget)
            sqrt_overhead = f"{sqrt_plan.cost_seconds / graph.step_cost:.3f}" if sqrt_plan else "infeasible"
            overhead = simulate_overhead(graph, one.regions(budget))
            print(f"| {len(chain)} | {units} | {one_seconds:.2f} | {every_seconds:.2f} | {reference} "
                  f"| {overhead:.3f} | {sqrt_seconds:.2f} | {sqrt_overhead} |")
    graph = mlp_graph(1000)
    least = None
    try:
        solve_dp(graph, 1)
    except InfeasibleBudgetError as error:
        least = error.min_peak_bytes
    budget = least + (baseline_peak_bytes(graph) - least) // 4
    plan, seconds = timed(solve_dp, graph, budget)
    sqrt_plan, sqrt_seconds = timed(solve_sqrt, graph, budget)
    sqrt_text = f"overhead {sqrt_plan.cost_seconds / graph.step_cost:.3f}" if sqrt_plan else "infeasible"
    print(f"\n1,000-node chain, default staging: dp {seconds:.1f} s ({plan.note}), overhead "
          f"{plan.cost_seconds / graph.step_cost:.3f}; sqrt {sqrt_seconds:.1f} s, {sqrt_text}")
    print("\nWhat merging the 1,000 nodes into fewer stages costs, at the same budget and unit:\n")
    print("| stages | dp s, every budget | overhead |")
    print("|---|---|---|")
    unit = -(-(baseline_peak_bytes(graph) - graph.static.resident_bytes) // 1000)
    for stages in (32, 64, 128):
        chain = build_chain(graph, stage_starts(graph, max_stages=stages))
        curve, curve_seconds = timed(cost_curve, chain, baseline_peak_bytes(graph), unit)
        overhead = simulate_overhead(graph, curve.regions(budget)) if curve.cost(budget) < float("inf") else None
        shown = f"{overhead:.4f}" if overhead is not None else "infeasible"
        print(f"| {len(chain)} | {curve_seconds:.2f} | {shown} |")


def simulate_overhead(graph: ckptplan.ComputeGraph, regions) -> float:
    return ckptplan.make_plan(graph, list(regions)).prediction.overhead


TITLE = "`dp` solve time against chain length and memory resolution"
ABOUT = (
    "MLP chains of Linear+ReLU (batch 4096, width 1024, profiled on the meta device), one stage per node, at a "
    "budget a quarter of the way from the least peak `dp` reaches to the no-checkpoint peak; `sqrt` and the memoised "
    "reference DP (`ChainDP`, one budget per run) solved in the same process. \"memory units\": resident memory to "
    "the no-checkpoint peak in that many units. \"one budget\": the DP's tables filled up to the budget asked; "
    "\"every budget\": filled up to the no-checkpoint peak, which answers every budget at once (what `solve_dp` "
    "does). \"infeasible\": `sqrt` cannot reach that budget. Merging nodes into fewer stages only removes plans, so "
    "coarsening never lowers the cost; the last table shows what it costs on the 1,000-node chain."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
