"""Predicted against measured peak on a CUDA device: the GPU counterpart of accuracy.py.

    python benchmarks/cuda_verify.py [--budgets 1.0,0.9,0.7,0.5] [--solver auto] [--time-limit 10]
                                     [--out table.md] [--snapshots DIR] [CASE ...]

Each case (the bundled examples, accuracy.py's ``transformers`` and zoo models, and a
Korthikanti-style GPT layer stack in bf16) is moved to the GPU, profiled for CUDA's kernels
(``target="cuda"``), solved at each budget, and checked by ``ckptplan.verify(..., device="cuda")``:
one real step of the emitted module and of the model, peak from ``torch.cuda.max_memory_allocated``
above the memory resident before the step, gradients compared, median step times. Beside it,
PyTorch's ``MemTracker`` measures the same step on the GPU: it counts live tensors, not the caching
allocator's blocks, so the two measurements separate the memory model's errors from the
allocator's rounding and library workspaces. Prints a Markdown table for ``benchmarks/RESULTS.md``.
Needs a CUDA device; without one it says so and exits 1 (the test suite never runs it).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import logging
import pickle
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ckptplan
from ckptplan.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("cuda_verify")


def _load(relative: str) -> Any:
    path = ROOT / relative
    name = f"cuda_verify_{path.parent.name}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _korthikanti() -> Any:
    """Four of Korthikanti et al.'s GPT layers (explicit softmax attention, dropout) at width 2048,
    16 heads, 2 × 1024 tokens, parameters in bf16: the paper's setting at a size one GPU trains."""
    model, args = _load("examples/korthikanti_gpt.py").build(
        layers=4, hidden=2048, heads=16, seq=1024, batch=2, device="cpu", vocab=8192
    )
    return _load("benchmarks/compare.py").Workload(model, tuple(args))


def cases() -> dict[str, tuple[Callable[[], Any], str | None]]:
    """name -> (build, autocast dtype name or None)."""
    accuracy = _load("benchmarks/accuracy.py")
    example = accuracy._example
    table: dict[str, tuple[Callable[[], Any], str | None]] = {
        "gpt": (lambda: example("gpt"), None),
        "gpt-bf16": (lambda: example("gpt"), "bfloat16"),
        "resnet": (lambda: example("resnet"), None),
        "unet": (lambda: example("unet"), None),
        "korthikanti": (_korthikanti, None),
    }
    for name, case in accuracy.CASES.items():
        if name in ("gpt", "resnet", "unet"):
            continue  # the examples above, at their own sizes
        for precision in case.precisions:
            key = name if precision == "fp32" else f"{name}-{precision}"
            table[key] = (case.build, None if precision == "fp32" else "bfloat16")
    return table


def _on_cuda(value: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, value)


def _memtracker_peak(module: torch.nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None) -> int:
    return ckptplan.measure_step(module, args, kwargs, autocast=autocast).peak_bytes


def _snapshot(module: torch.nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None, path: Path) -> None:
    """One more step of ``module`` with the allocator's history recorded, saved for offline reading."""
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=50_000)
    try:
        ckptplan.measure_step(module, args, kwargs, autocast=autocast)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    path.write_bytes(gzip.compress(pickle.dumps(snapshot)))


def run_case(name: str, build: Callable[[], Any], autocast: str | None, options: argparse.Namespace, out: Any) -> None:
    torch.manual_seed(0)
    work = build()
    model = work.model.cuda()
    args, kwargs = _on_cuda(tuple(work.args)), _on_cuda(dict(work.kwargs))
    dtype = getattr(torch, autocast) if autocast else None
    started = time.perf_counter()
    graph = ckptplan.profile(model, args, kwargs, target="cuda", autocast=dtype)
    log.warning("%s: %d nodes profiled in %.1fs", name, len(graph.nodes), time.perf_counter() - started)
    for fraction in (float(b) for b in options.budgets.split(",")):
        try:
            plan = ckptplan.solve(graph, fraction, solver=options.solver, time_limit=options.time_limit)
        except ckptplan.InfeasibleBudgetError as error:
            out(f"| {name} | {fraction:g} | infeasible (least {format_bytes(error.min_peak_bytes)}) | | | | | | | |")
            continue
        result = ckptplan.verify(model, args, plan, kwargs, steps=options.steps, device="cuda")
        emitted = ckptplan.apply(model, args, plan, kwargs)
        tracked = _memtracker_peak(emitted, args, kwargs, dtype)
        error = result.prediction_error
        tracked_error = (plan.prediction.peak_bytes - tracked) / tracked
        out(
            f"| {name} | {fraction:g} | {plan.solver.name} | {format_bytes(plan.prediction.peak_bytes)} "
            f"| {format_bytes(result.measured_peak_bytes)} | {error:+.2%} | {tracked_error:+.2%} "
            f"| {'yes' if result.within_budget else 'NO'} "
            f"| {'yes' if result.gradients_equal else f'NO ({result.max_grad_error:.1e})'} "
            f"| {plan.prediction.overhead:.1%} / {result.step_overhead:+.1%} |"
        )
        if options.snapshots and abs(error) > 0.03 and options.max_snapshots > 0:
            options.max_snapshots -= 1
            stem = f"{name}_{fraction:g}"
            _snapshot(emitted, args, kwargs, dtype, options.snapshots / f"{stem}.pickle.gz")
            (options.snapshots / f"{stem}.json").write_text(plan.to_json())
        del emitted
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1.0,0.9,0.7,0.5")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also append the table to this file, row by row")
    parser.add_argument("--snapshots", type=Path, help="save allocator snapshots of steps off by over 3%% here")
    parser.add_argument("--max-snapshots", type=int, default=3)
    parser.add_argument("cases", nargs="*")
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        print("No CUDA device here; run this script on a machine with one.", file=sys.stderr)
        return 1
    table = cases()
    unknown = [name for name in options.cases if name not in table]
    if unknown:
        print(f"Unknown cases {unknown}; choose from {sorted(table)}.", file=sys.stderr)
        return 2
    if options.snapshots:
        options.snapshots.mkdir(parents=True, exist_ok=True)

    def out(line: str) -> None:
        print(line, flush=True)
        if options.out:
            with options.out.open("a") as handle:
                handle.write(line + "\n")

    out(f"torch {torch.__version__}, Python {platform.python_version()}, {torch.cuda.get_device_name()}, "
        f"solver {options.solver}\n")
    out("| case | budget | solver | predicted peak | measured peak | error | error vs MemTracker "
        "| within budget | gradients equal | overhead predicted / measured |")
    out("|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for name in options.cases or list(table):
        build, autocast = table[name]
        try:
            run_case(name, build, autocast, options, out)
        except Exception:  # one broken case must not cost the rest of a device lease
            failures += 1
            out(f"| {name} | failed: see the log | | | | | | | | |")
            traceback.print_exc()
        torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
