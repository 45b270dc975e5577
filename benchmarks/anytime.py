"""How close does a short solve come to a long one?

    python benchmarks/anytime.py [--short 10] [--long 60] [--budgets 0.5,0.3] [--models gpt,unet,...]

For each model (the examples, the models of ``benchmarks/compare.py``, and a 13-layer GPT-2 of
about 600 nodes) ``auto`` solves each budget (a fraction of the no-checkpoint peak) twice on this
machine's cores: with the short and with the long time limit. The table gives each solve's seconds
and the short plan's predicted cost (recompute plus checkpoint seconds, what solvers minimise)
over the long one's. A budget no plan fits is reported as such, with the least peak stated.
Writes ``benchmarks/results/anytime.md`` and ``anytime.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import zoo  # benchmarks/zoo.py, beside this script

import ckptplan
from ckptplan.errors import InfeasibleBudgetError

ROOT = zoo.ROOT
RESULTS = ROOT / "benchmarks" / "results" / "anytime.md"


def _workloads() -> dict:
    """Builders returning ``(model, args, kwargs)``, by name."""
    compare = zoo.load(ROOT / "benchmarks" / "compare.py", "ckptplan_bench_compare")
    found = {name: build for name, build in zoo.builders().items() if name in ("gpt", "resnet", "unet")}
    def unpack(work) -> tuple:
        return work.model, work.args, work.kwargs

    for name in ("gpt2", "llama", "bert"):
        found[name] = lambda name=name: unpack(compare.CASES[name].build())
    found["gpt2-13"] = lambda: unpack(compare._gpt2(layers=13))
    return found


def _solve(graph: ckptplan.ComputeGraph, budget: float, limit: float) -> dict:
    started = time.perf_counter()
    try:
        plan = ckptplan.solve(graph, budget, time_limit=limit)
    except InfeasibleBudgetError as exc:
        return {"seconds": time.perf_counter() - started, "status": "infeasible", "least_bytes": exc.min_peak_bytes}
    return {
        "seconds": time.perf_counter() - started,
        "status": plan.solver.status,
        "peak_bytes": plan.prediction.peak_bytes,
        "cost_seconds": plan.prediction.cost_seconds,
        "overhead": plan.prediction.overhead,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=float, default=10.0)
    parser.add_argument("--long", type=float, default=60.0)
    parser.add_argument("--budgets", default="0.5,0.3")
    parser.add_argument("--models", default=None, help="comma-separated; default: all")
    options = parser.parse_args()
    workloads = _workloads()
    names = options.models.split(",") if options.models else list(workloads)
    budgets = [float(b) for b in options.budgets.split(",")]
    records, rows = [], []
    for name in names:
        model, args, kwargs = workloads[name]()
        graph = ckptplan.profile(model, args, kwargs)
        for budget in budgets:
            short = _solve(graph, budget, options.short)
            long = _solve(graph, budget, options.long)
            record = {"model": name, "nodes": len(graph.nodes), "budget": budget, "short": short, "long": long}
            if "cost_seconds" in short and "cost_seconds" in long:
                record["cost_ratio"] = short["cost_seconds"] / long["cost_seconds"] if long["cost_seconds"] else 1.0
                verdict = f"{record['cost_ratio']:.4f}"
            elif short["status"] == long["status"] == "infeasible":
                verdict = f"infeasible at both (least {short['least_bytes']:,} / {long['least_bytes']:,} bytes)"
            else:
                verdict = f"short: {short['status']}, long: {long['status']}"
            records.append(record)
            rows.append(f"| {name} | {len(graph.nodes)} | {budget:g} | {short['seconds']:.1f} | {short['status']} | "
                        f"{long['seconds']:.1f} | {long['status']} | {verdict} |")
            print(rows[-1], flush=True)
    ratios = [r["cost_ratio"] for r in records if "cost_ratio" in r]
    worst = max(ratios, default=float("nan"))
    slowest = max((r["short"]["seconds"] for r in records), default=float("nan"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    command = (f"`python benchmarks/anytime.py --short {options.short:g} --long {options.long:g} --budgets "
               f"{options.budgets}` on {platform.machine()}, {cores} cores, torch {torch.__version__}. `auto` at each "
               "budget (a fraction of the no-checkpoint peak) with each time limit; the last column is the short "
               "plan's predicted cost (recompute + checkpoint seconds) over the long plan's.")
    text = "\n".join([
        "# Short solves against long ones",
        "",
        command,
        "",
        f"| model | nodes | budget | {options.short:g}-s seconds | status | {options.long:g}-s seconds | status | cost ratio |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Worst cost ratio: {worst:.4f}; slowest {options.short:g}-s solve: {slowest:.1f} s.",
        "",
    ])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    RESULTS.with_suffix(".json").write_text(json.dumps(records, indent=2) + "\n")
    print(f"\n{text.splitlines()[-2]} Written to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
