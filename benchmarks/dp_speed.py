"""Solve time of the ``dp`` solver against chain length and memory resolution, with ``sqrt``
run in the same process for comparison.

    python benchmarks/dp_speed.py

Chains are MLPs of Linear+ReLU pairs profiled on the meta device (batch 4096, width 1024), one
stage per node, solved at a quarter of the way from the least peak ``dp`` reaches to the
no-checkpoint peak. The last line solves a 1,000-node chain (500 pairs) the default way, where
the chain is cut to ``stage_starts``'s default stage count.
"""

from __future__ import annotations

import platform
import time

import torch
from torch import nn

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.solvers.chain import build_chain, stage_starts
from ckptplan.solvers.dp import solve_chain, solve_dp
from ckptplan.solvers.sqrt import solve_sqrt


def mlp_graph(nodes: int) -> ckptplan.ComputeGraph:
    with torch.device("meta"):
        layers: list[nn.Module] = []
        for _ in range(nodes // 2):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers)
        x = torch.randn(4096, 1024)
    return ckptplan.profile(model, (x,), trace="symbolic")


def tight_budget(graph: ckptplan.ComputeGraph) -> int:
    try:
        solve_dp(graph, 1)
    except InfeasibleBudgetError as error:
        least = error.min_peak_bytes
    return least + (graph.baseline_peak_bytes - least) // 4


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except InfeasibleBudgetError:
        result = None
    return result, time.perf_counter() - started


def main() -> None:
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}\n")
    print("| stages | memory units | dp seconds | dp overhead | sqrt seconds | sqrt overhead |")
    print("|---|---|---|---|---|---|")
    for nodes in (10, 20, 40, 60, 100):
        graph = mlp_graph(nodes)
        budget = tight_budget(graph)
        chain = build_chain(graph, stage_starts(graph, max_stages=nodes))
        sqrt_plan, sqrt_seconds = timed(solve_sqrt, graph, budget)
        for units in (100, 500):
            (cost, _), dp_seconds = timed(solve_chain, chain, budget, max(1, budget // units))
            step = graph.step_cost
            sqrt_overhead = f"{sqrt_plan.prediction.overhead:.3f}" if sqrt_plan else "infeasible"
            print(f"| {len(chain)} | {units} | {dp_seconds:.2f} | {cost / step:.3f} | {sqrt_seconds:.2f} | {sqrt_overhead} |")
    graph = mlp_graph(1000)
    budget = tight_budget(graph)
    plan, seconds = timed(solve_dp, graph, budget)
    sqrt_plan, sqrt_seconds = timed(solve_sqrt, graph, budget)
    print(f"\n1,000-node chain, default staging: dp {seconds:.1f} s ({plan.solver.note}), overhead "
          f"{plan.prediction.overhead:.3f}; sqrt {sqrt_seconds:.1f} s, overhead {sqrt_plan.prediction.overhead:.3f}")


if __name__ == "__main__":
    main()
