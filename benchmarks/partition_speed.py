"""The compiled step's partition searches on the compare.py models' joint graphs, on CPU.

    python benchmarks/partition_speed.py                          # gpt-tiny and gpt2, 0.8 and 0.5
    python benchmarks/partition_speed.py --models gpt --fractions 0.6 --time-limit 120

For each model, its joint graph as ``ckptplan.compile`` reads it (recomputation priced in FLOPs,
``profiler.cost.FLOPS``; the loop dropping the outputs) and each budget, a fraction of the
step's peak with nothing recomputed: from the starts ``compile`` hands it (PyTorch's min-cut
partitions), the greedy search alone (``solvers.partition``) and
``solve_partition_step``'s ``auto`` and ``exact`` (the greedy search, then the exact CP-SAT
model, ``solvers.partition_exact``, for the rest of the time), each with its predicted peak, the
FLOPs the backward computes again, what was proved and the seconds it took. Writes
``benchmarks/results/partition_speed.md`` and ``.json``.
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
from ckptplan.joint import JointGraph
from ckptplan.partition import simulate_partition
from ckptplan.profiler.cost import FLOPS
from ckptplan.solvers import tuning
from ckptplan.solvers.orchestrate import solve_partition_step
from ckptplan.solvers.partition import no_recompute


def joint_graph(name: str) -> tuple[JointGraph, list[list[int]]]:
    """The joint graph ``ckptplan.compile`` reads for model ``name``, and the starts it hands the
    search (PyTorch's min-cut partitions, ``Partitioner.starts``)."""
    work = compare.CASES[name].build()
    torch._dynamo.reset()
    module = ckptplan.compile(work.model, work.args, work.kwargs, budget=1.0, backend="aot_eager",
                              solver="greedy", outputs_live=False, roofline=FLOPS)
    torch._dynamo.reset()
    return module.ckptplan_plan.graph, module.ckptplan_partitioner.starts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt-tiny,gpt2", help="comma-separated compare.py models")
    parser.add_argument("--fractions", default="0.8,0.5", help="budgets, as fractions of the no-recompute peak")
    parser.add_argument("--solvers", default="greedy,auto,exact", help=f"of {', '.join(tuning.PARTITION_SECONDS)}")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per search (default: each one's own)")
    options = parser.parse_args(argv)
    names = [n for n in options.models.split(",") if n]
    unknown = [n for n in names if n not in compare.CASES]
    solvers = [s for s in options.solvers.split(",") if s]
    if unknown or any(s not in tuning.PARTITION_SECONDS for s in solvers):
        print(f"Unknown model or solver; models: {', '.join(compare.CASES)}; "
              f"solvers: {', '.join(tuning.PARTITION_SECONDS)}.", file=sys.stderr)
        return 2
    fractions = [float(f) for f in options.fractions.split(",") if f]
    rows: list[dict[str, Any]] = []
    lines = ["| model | joint nodes | budget | solver | peak (MiB) | GFLOP again | found by | proved | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        graph, starts = joint_graph(name)
        baseline = simulate_partition(graph, no_recompute(graph)).peak_bytes
        for fraction in fractions:
            budget = int(fraction * baseline)
            for solver in solvers:
                started = time.perf_counter()
                found = solve_partition_step(graph, budget, solver=solver, time_limit=options.time_limit,
                                             starts=starts)
                seconds = time.perf_counter() - started
                report = found.report
                rows.append({"model": name, "joint_nodes": len(graph.values), "fraction": fraction,
                             "budget_bytes": budget, "solver": solver, "feasible": found.feasible,
                             "peak_bytes": report.peak_bytes, "recompute_flops": report.recompute_flops,
                             "origin": found.origin, "status": found.status, "seconds": round(seconds, 2)})
                line = (f"| {name} | {len(graph.values)} | {fraction} | {solver} | {report.peak_bytes / 2**20:.2f}"
                        f"{'' if found.feasible else ' (over)'} | {report.recompute_flops / 1e9:.3f} | {found.origin} | "
                        f"{found.status} | {seconds:.1f} |")
                lines.append(line)
                print(line, flush=True)
    results_file.write(
        __file__, "The compiled step's partition searches (CPU)", lines,
        about="Budgets are fractions of the step's peak with nothing recomputed (the loop drops the outputs), peaks "
              "with the model's state and inputs; GFLOP again: what the backward recomputes; proved: optimal (least "
              "recomputation within the budget, in the model's integer cost units), feasible (not proved least), "
              "heuristic (no proof sought).",
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
