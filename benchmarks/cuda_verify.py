"""Predicted against measured peak on a CUDA device: the GPU counterpart of measure_examples.py.

    python benchmarks/cuda_verify.py [--budgets 0.9,0.7,0.5] [--solver auto] [--time-limit 30]

Each bundled example is moved to the GPU, profiled for CUDA's kernels (``target="cuda"``),
solved at each budget, and checked by ``ckptplan.verify(..., device="cuda")``: one real step of
the emitted module and of the model, peak from ``torch.cuda.max_memory_allocated`` above the
memory resident before the step, gradients compared. Prints a Markdown table for
``benchmarks/RESULTS.md``. Needs a CUDA device; without one it says so and exits 1 (the test
suite never runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import platform
import sys
from pathlib import Path

import torch

import ckptplan
from ckptplan.units import format_bytes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> tuple:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = module.build()
    return built[0], tuple(built[1]), dict(built[2]) if len(built) > 2 else {}


def on_cuda(value: object) -> object:
    return torch.utils._pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.9,0.7,0.5")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("examples", nargs="*", default=["gpt", "resnet", "unet"])
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        print("No CUDA device here; run this script on a machine with one.", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {torch.cuda.get_device_name()}, "
          f"solver {options.solver}\n")
    print("| example | budget | predicted peak | measured peak | error | within budget | gradients equal |")
    print("|---|---|---|---|---|---|---|")
    for name in options.examples:
        model, args, kwargs = load(name)
        model = model.cuda()
        args, kwargs = on_cuda(args), on_cuda(kwargs)
        graph = ckptplan.profile(model, args, kwargs, target="cuda")
        for fraction in (float(b) for b in options.budgets.split(",")):
            try:
                plan = ckptplan.solve(graph, fraction, solver=options.solver, time_limit=options.time_limit)
            except ckptplan.InfeasibleBudgetError as error:
                print(f"| {name} | {fraction:g} | infeasible (least {format_bytes(error.min_peak_bytes)}) | | | | |")
                continue
            result = ckptplan.verify(model, args, plan, kwargs, steps=1, device="cuda")
            error = (plan.prediction.peak_bytes - result.measured_peak_bytes) / result.measured_peak_bytes
            print(f"| {name} | {fraction:g} | {format_bytes(plan.prediction.peak_bytes)} "
                  f"| {format_bytes(result.measured_peak_bytes)} | {error:+.2%} "
                  f"| {'yes' if result.within_budget else 'NO'} | {'yes' if result.gradients_equal else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
