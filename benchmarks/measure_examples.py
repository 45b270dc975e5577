"""Solve each bundled example at a budget, run one real CPU step of the emitted module, and print
predicted vs measured peak (the allocator's count, ``ckptplan.measure_step``) and a gradient
check as a Markdown table.

    python benchmarks/measure_examples.py [--budget 0.6] [--solver auto]

Writes ``benchmarks/results/measure_examples.md``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import platform
import time
from pathlib import Path

import results_file  # benchmarks/results_file.py, beside this script
import torch

import ckptplan
from ckptplan.profiler.loss import training_loss
from ckptplan.units import format_bytes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


def gradients_equal(model: torch.nn.Module, emitted: torch.nn.Module, args: tuple) -> bool:
    reference = copy.deepcopy(model)
    for module in (reference, emitted):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        training_loss(module(*args)).backward()
    return all(
        torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters())
        if q.grad is not None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.6")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("examples", nargs="*", default=["gpt", "resnet", "unet"])
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    budget = float(options.budget) if "." in options.budget else options.budget
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()} CPU, "
          f"budget {options.budget}, solver {options.solver}\n")
    print("| example | nodes | no-checkpoint peak (measured) | budget | predicted peak | measured peak | error | "
          "within budget | gradients equal | recompute overhead | solve s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in options.examples:
        model, args = load(name)
        graph = ckptplan.profile(model, args, outputs_live=False)
        baseline = ckptplan.measure_step(model, args, outputs_live=False).peak_bytes
        started = time.perf_counter()
        plan = ckptplan.solve(graph, budget, solver=options.solver)
        solve_seconds = time.perf_counter() - started
        emitted = ckptplan.emit(graph, plan)
        measured = ckptplan.measure_step(emitted, args, outputs_live=False).peak_bytes
        predicted = plan.prediction.peak_bytes
        print(
            f"| {name} | {len(graph.nodes)} | {format_bytes(baseline)} | {format_bytes(plan.budget.bytes)} | "
            f"{format_bytes(predicted)} | {format_bytes(measured)} | {100 * (predicted - measured) / measured:+.2f}% | "
            f"{'yes' if measured <= plan.budget.bytes else 'NO'} | "
            f"{'yes' if gradients_equal(model, emitted, args) else 'NO'} | "
            f"{100 * plan.prediction.overhead:.1f}% | {solve_seconds:.2f} |"
        )


TITLE = "Predicted against measured peak on the examples"
ABOUT = ("Each example solved at the budget (a fraction of its no-checkpoint peak), one real CPU training step of "
         "the emitted module measured as the allocator counts it (`ckptplan.measure_step`), gradients compared with "
         "the original model's. Recompute overhead: the roofline estimate of the recomputed forward time over the "
         "step's forward plus backward time (`Plan.prediction.overhead`).")

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
