"""Predicted peaks against what the allocator counts, on CPU.

    python benchmarks/allocator.py [--models gpt,resnet,unet,efficientnet,...] [--budget 0.6]

For each model (the examples, and ``tests/architectures.py``'s architectures built locally), the
step without checkpointing and ``auto``'s plan at the budget (a fraction of the no-checkpoint
peak; the least peak it states where that is infeasible) run for real: their peak as the CPU
allocator counts it (``ckptplan.measure_step``: the profiler's memory events, with the module's
state and inputs) against the prediction, with the kernel workspaces the profiler measures and
without them (``profile(..., workspaces=False)``: what fake tensors see). Writes
``benchmarks/results/allocator.md``.
"""

from __future__ import annotations

import argparse

import results_file  # benchmarks/results_file.py, beside this script
import torch
import zoo  # benchmarks/zoo.py, beside this script

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes

MIB = 2**20


def _row(name: str, what: str, measured: int, predicted: int, fake: int) -> str:
    def error(value: int) -> str:
        return f"{(value - measured) / measured:+.2%}"

    return (f"| {name} | {what} | {measured / MIB:.2f} | {predicted / MIB:.2f} ({error(predicted)}) | "
            f"{fake / MIB:.2f} ({error(fake)}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated; default: all")
    parser.add_argument("--budget", type=float, default=0.6)
    parser.add_argument("--time-limit", type=float, default=5.0)
    options = parser.parse_args()
    builders = zoo.builders()
    names = options.models.split(",") if options.models else list(builders)
    print("| model | step | measured | predicted | fake only |")
    print("|---|---|---|---|---|")
    for name in names:
        model, args, kwargs = builders[name]()
        graph = ckptplan.profile(model, args, kwargs, outputs_live=False)
        fake = ckptplan.profile(model, args, kwargs, workspaces=False, outputs_live=False)
        torch.manual_seed(0)
        measured = ckptplan.measure_step(model, args, kwargs, outputs_live=False).peak_bytes
        print(_row(name, "no checkpointing", measured, baseline_peak_bytes(graph), baseline_peak_bytes(fake)), flush=True)
        try:
            plan = ckptplan.solve(graph, options.budget, time_limit=options.time_limit)
            what = f"auto at {options.budget:g}"
        except InfeasibleBudgetError as error:
            plan = ckptplan.solve(graph, error.min_peak_bytes, time_limit=options.time_limit)
            what = "auto at its stated least"
        torch.manual_seed(0)
        measured = ckptplan.measure_step(ckptplan.emit(graph, plan), args, kwargs, outputs_live=False).peak_bytes
        print(_row(name, what, measured, plan.prediction.peak_bytes, ckptplan.simulate(fake, plan).peak_bytes), flush=True)


TITLE = "Predicted peaks against the allocator (CPU)"
ABOUT = ("Measured: the allocator's peak over one step (MiB, with the module's state and inputs). Predicted: the "
         "plan's peak, with the kernel workspaces the profiler measures; fake only: the same plan simulated on the "
         "profile without them.")


if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
