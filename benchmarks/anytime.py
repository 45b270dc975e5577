"""How close does a short solve come to a long one?

    python benchmarks/anytime.py [--short 10,30] [--long 60] [--budgets 0.5,0.3] [--repeat 3] [--models gpt,unet,...]

For each model (the examples, the models of ``benchmarks/compare.py``, and a 13-layer GPT-2 of
about 600 nodes) ``auto`` solves each budget (a fraction of the no-checkpoint peak) on this
machine's cores with each short time limit (``--repeat`` times: CP-SAT's portfolio is not reproducible, so
one short solve is one draw) and with the long one. The table gives the solves' seconds (the
slowest of the repeats) and each short plan's predicted cost (recompute plus checkpoint seconds,
what solvers minimise) over the long one's. A budget no plan fits is reported as such, with the
least peak stated.
Writes ``benchmarks/results/anytime.md`` and ``anytime.json``.
"""

from __future__ import annotations

import argparse
import time

import results_file  # benchmarks/results_file.py, beside this script
import zoo  # benchmarks/zoo.py, beside this script

import ckptplan
from ckptplan.errors import InfeasibleBudgetError

ROOT = zoo.ROOT


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


def _ratio(short: dict, long: dict) -> float | None:
    """A short solve's cost over the long solve's (None unless both found a plan)."""
    if "cost_seconds" in short and "cost_seconds" in long:
        return short["cost_seconds"] / long["cost_seconds"] if long["cost_seconds"] else 1.0
    return None


def _cell(shorts: list[dict], long: dict) -> str:
    """The table cell of the repeated short solves of one limit: the slowest one's seconds, and
    each one's cost over the long solve's (else its status)."""
    seconds = max(short["seconds"] for short in shorts)
    if all(short["cost_ratio"] is not None for short in shorts):
        return f"{seconds:.1f} s, " + " / ".join(f"{short['cost_ratio']:.4f}" for short in shorts)
    if all(short["status"] == long["status"] == "infeasible" for short in shorts):
        return f"{seconds:.1f} s, infeasible (least {min(short['least_bytes'] for short in shorts):,})"
    return f"{seconds:.1f} s, " + " / ".join(
        f"{short['cost_ratio']:.4f}" if short["cost_ratio"] is not None else short["status"] for short in shorts
    )


def main(record: results_file.Record) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", default="10,30", help="comma-separated time limits, in seconds")
    parser.add_argument("--long", type=float, default=60.0)
    parser.add_argument("--budgets", default="0.5,0.3")
    parser.add_argument("--repeat", type=int, default=1, help="short solves per limit and budget")
    parser.add_argument("--models", default=None, help="comma-separated; default: all")
    options = parser.parse_args()
    shorts = [float(x) for x in options.short.split(",")]
    workloads = _workloads()
    names = options.models.split(",") if options.models else list(workloads)
    budgets = [float(b) for b in options.budgets.split(",")]
    print(f"| model | nodes | budget | {' | '.join(f'{limit:g}-s solve' for limit in shorts)} | {options.long:g}-s solve |")
    print("|---|---|---|" + "---|" * (len(shorts) + 1))
    records = []
    for name in names:
        model, args, kwargs = workloads[name]()
        graph = ckptplan.profile(model, args, kwargs, outputs_live=False)
        for budget in budgets:
            long = _solve(graph, budget, options.long)
            entry = {"model": name, "nodes": len(graph.nodes), "budget": budget, "long": long, "short": {}}
            cells = []
            for limit in shorts:
                runs = [_solve(graph, budget, limit) for _ in range(options.repeat)]
                runs = [{**short, "cost_ratio": _ratio(short, long)} for short in runs]
                entry["short"][f"{limit:g}"] = runs
                cells.append(_cell(runs, long))
            long_cell = (f"{long['seconds']:.1f} s, {long['status']}" if long["status"] != "infeasible"
                         else f"{long['seconds']:.1f} s, infeasible (least {long['least_bytes']:,})")
            records.append(entry)
            print(f"| {name} | {len(graph.nodes)} | {budget:g} | {' | '.join(cells)} | {long_cell} |", flush=True)
    print()
    for limit in shorts:
        runs = [run for r in records for run in r["short"][f"{limit:g}"]]
        ratios = [run["cost_ratio"] for run in runs if run["cost_ratio"] is not None]
        within = sum(ratio <= 1.01 for ratio in ratios)
        print(f"{limit:g} s: worst cost ratio {max(ratios, default=float('nan')):.4f}, {within} of "
              f"{len(ratios)} feasible solves within 1% of the {options.long:g}-s plan, slowest "
              f"{max((run['seconds'] for run in runs), default=float('nan')):.1f} s.")
    record.rows = records


TITLE = "Short solves against long ones"
ABOUT = ("`auto` at each budget (a fraction of the no-checkpoint peak) with each time limit, the short ones "
         "`--repeat` times each. Each short cell: the slowest solve's seconds, and each plan's predicted cost "
         "(recompute + checkpoint seconds) over the long plan's.")


if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT) as record:
        main(record)
