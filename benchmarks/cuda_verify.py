"""Predicted against measured peak on a CUDA device: the GPU counterpart of accuracy.py.

    python benchmarks/cuda_verify.py [--budgets 1.0,0.9,0.7,0.5] [--solver auto] [--time-limit 10]
                                     [--out table.md] [--traces DIR] [CASE ...]

Each case (the bundled examples, accuracy.py's ``transformers`` and zoo models, and a
Korthikanti-style GPT layer stack in bf16) is moved to the GPU, profiled for CUDA's kernels
(``target="cuda"``), solved at each budget, and checked by ``ckptplan.verify(..., device="cuda")``:
gradients compared with the model's (and, for scale, the model's with its own in a second seeded
step: GPU kernels with atomics are not bitwise repeatable), median step times. Each emitted step's
peak above the memory resident before it is measured three ways: the caching allocator's allocated
blocks (``torch.cuda.max_memory_allocated``, what ``verify`` reports), the bytes the step requested
(``requested_bytes`` in ``torch.cuda.memory_stats``: the same allocations before rounding), and
PyTorch's ``MemTracker`` on the GPU (live tensors only). The first two differ by the allocator's
rounding, the last two by library workspaces (cuBLAS, cuDNN) that are not tensors; MemTracker
against the prediction is the memory model's own error. Prints a Markdown table and writes it to
``benchmarks/results/cuda_verify.md``, its rows to ``cuda_verify.json`` (which ``cuda_from_cpu.py`` reads).
Needs a CUDA device; without one it says so and exits 1 (the test suite never runs it).
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import accuracy  # this folder's zoo (a script's own folder is on sys.path)
import results_file  # benchmarks/results_file.py, beside this script
import torch

import ckptplan
from ckptplan.units import format_bytes

log = logging.getLogger("cuda_verify")


def _korthikanti() -> Any:
    """Four of Korthikanti et al.'s GPT layers (explicit softmax attention, dropout) at width 2048,
    16 heads, 2 × 1024 tokens, parameters in bf16: the paper's setting at a size one GPU trains."""
    model, args = accuracy._load("examples/korthikanti_gpt.py").build(
        layers=4, hidden=2048, heads=16, seq=1024, batch=2, device="cpu", vocab=8192
    )
    return accuracy.Workload(model, tuple(args))


def cases() -> dict[str, tuple[Callable[[], Any], str | None]]:
    """name -> (build, autocast dtype name or None)."""
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
    return ckptplan.measure_step(module, args, kwargs, autocast=autocast, outputs_live=False).peak_bytes


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _self_difference(model: torch.nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None) -> float:
    """Largest gradient difference between two seeded steps of the untouched model."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        ckptplan.measure_step(model, args, kwargs, autocast=autocast, outputs_live=False)
        runs.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
    return max((float((a - b).abs().max()) for a, b in zip(*runs) if a is not None), default=0.0)


def _cuda_peaks(module: torch.nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None) -> tuple[int, int]:
    """One step's peak above what was allocated before it, plus the module's state and inputs
    (as ``verify`` counts them): from allocated blocks, and from requested bytes."""
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    requested = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    ckptplan.measure_step(module, args, kwargs, autocast=autocast, outputs_live=False)
    torch.cuda.synchronize()
    tensors = [*module.parameters(), *module.buffers(), *_tensors((args, kwargs))]
    own = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    peak_requested = torch.cuda.memory_stats()["requested_bytes.all.peak"]
    return torch.cuda.max_memory_allocated() - allocated + own, peak_requested - requested + own


def _op_trace(module: torch.nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None) -> list[str]:
    """MemTracker's live bytes after every op of one step, to line up against ``simulate``'s timeline."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ckptplan.planner.measure import forward_autocast, memory_tracker
    from ckptplan.profiler.loss import training_loss

    module.zero_grad(set_to_none=True)
    tracker = memory_tracker(module, *_tensors((args, kwargs)))
    lines: list[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, fargs: tuple = (), fkwargs: dict | None = None) -> Any:
            result = func(*fargs, **(fkwargs or {}))
            lines.append(f"{func} {sum(v['Total'] for v in tracker.get_tracker_snapshot('current').values())}")
            return result

    with tracker, Log():
        with forward_autocast(module, args, kwargs, autocast):
            loss = training_loss(module(*args, **kwargs))
        loss.backward()
    return lines


def _write_trace(path: Path, graph: ckptplan.ComputeGraph, plan: ckptplan.Plan, measured: list[str]) -> None:
    predicted = [f"{e.phase} {graph.nodes[e.node].name if e.node >= 0 else '-'} {e.live_bytes}"
                 for e in ckptplan.simulate(graph, plan).timeline]
    path.write_text("\n".join(["# measured: op, MemTracker live bytes", *measured,
                               "# predicted: phase, node, live bytes", *predicted, "# plan", plan.to_json()]))


def run_case(name: str, build: Callable[[], Any], autocast: str | None, options: argparse.Namespace, out: Any,
             rows: list[dict[str, Any]]) -> None:
    """Every budget of one case: a line of the table through ``out`` and a row (its cells, and the
    bytes and fractions behind them) onto ``rows``."""
    torch.manual_seed(0)
    work = build()
    model = work.model.cuda()
    args, kwargs = _on_cuda(tuple(work.args)), _on_cuda(dict(work.kwargs))
    dtype = getattr(torch, autocast) if autocast else None
    started = time.perf_counter()
    graph = ckptplan.profile(model, args, kwargs, target="cuda", autocast=dtype, outputs_live=False)
    log.warning("%s: %d nodes profiled in %.1fs", name, len(graph.nodes), time.perf_counter() - started)
    noise = _self_difference(model, args, kwargs, dtype)
    for fraction in (float(b) for b in options.budgets.split(",")):
        try:
            plan = ckptplan.solve(graph, fraction, solver=options.solver, time_limit=options.time_limit)
        except ckptplan.InfeasibleBudgetError as error:
            least = format_bytes(error.min_peak_bytes)
            out(f"| {name} | {fraction:g} | infeasible (least {least}) |" + " |" * 8)
            rows.append({"case": name, "budget": fraction, "infeasible_least": least,
                         "least_bytes": error.min_peak_bytes})
            continue
        result = ckptplan.verify(model, args, plan, kwargs, steps=options.steps, device="cuda")
        emitted = ckptplan.apply(model, args, plan, kwargs)
        allocated, requested = _cuda_peaks(emitted, args, kwargs, dtype)
        tracked = _memtracker_peak(emitted, args, kwargs, dtype)
        predicted = plan.prediction.peak_bytes

        def error(measured: int) -> str:
            return f"{(predicted - measured) / measured:+.2%}"  # noqa: B023 (used at once)

        grads = "yes" if result.gradients_equal else f"{result.max_grad_error:.1e} (itself {noise:.1e})"
        row = {
            "case": name, "budget": fraction, "solver": plan.solver.name, "predicted_peak": format_bytes(predicted),
            "allocated_peak": format_bytes(allocated), "error_vs_allocated": error(allocated),
            "error_vs_requested": error(requested), "error_vs_memtracker": error(tracked),
            "allocated_within_budget": "yes" if allocated <= plan.budget.bytes else "NO", "gradients_equal": grads,
            "overhead_predicted_measured": f"{plan.prediction.overhead:.1%} / {result.step_overhead:+.1%}",
        }
        out(f"| {name} | {fraction:g} | {row['solver']} | {row['predicted_peak']} | {row['allocated_peak']} "
            f"| {row['error_vs_allocated']} | {row['error_vs_requested']} | {row['error_vs_memtracker']} "
            f"| {row['allocated_within_budget']} | {grads} | {row['overhead_predicted_measured']} |")
        rows.append({
            **row, "budget_bytes": plan.budget.bytes, "predicted_bytes": predicted, "allocated_bytes": allocated,
            "requested_bytes": requested, "memtracker_bytes": tracked, "overhead_predicted": plan.prediction.overhead,
            "overhead_measured": result.step_overhead, "max_grad_error": result.max_grad_error,
            "self_difference": noise,
        })
        if options.traces and abs(predicted - tracked) > 0.01 * tracked and options.max_traces > 0:
            options.max_traces -= 1
            _write_trace(options.traces / f"{name}_{fraction:g}.txt", graph, plan, _op_trace(emitted, args, kwargs, dtype))
        del emitted
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1.0,0.9,0.7,0.5")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also append the table to this file, row by row")
    parser.add_argument("--traces", type=Path,
                        help="save op-by-op traces of steps whose prediction misses MemTracker by over 1%% here")
    parser.add_argument("--max-traces", type=int, default=4)
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
    if options.traces:
        options.traces.mkdir(parents=True, exist_ok=True)

    lines: list[str] = []
    rows: list[dict[str, Any]] = []

    def out(line: str) -> None:
        print(line, flush=True)
        lines.extend(line.split("\n"))
        if options.out:
            with options.out.open("a") as handle:
                handle.write(line + "\n")

    out(f"torch {torch.__version__}, Python {platform.python_version()}, {torch.cuda.get_device_name()}, "
        f"solver {options.solver}\n")
    out("| case | budget | solver | predicted peak | allocated peak | error vs allocated | vs requested "
        "| vs MemTracker | allocated within budget | gradients equal (else max difference) "
        "| overhead predicted / measured |")
    out("|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for name in options.cases or list(table):
        build, autocast = table[name]
        try:
            run_case(name, build, autocast, options, out, rows)
        except Exception:  # noqa: BLE001 (one broken case must not cost the rest of a device lease)
            failures += 1
            out(f"| {name} | failed: see the log |" + " |" * 9)
            rows.append({"case": name, "failed": "see the log"})
            traceback.print_exc()
        torch.cuda.empty_cache()
    results_file.write(__file__, TITLE, lines, about=ABOUT, rows=rows)
    return 1 if failures else 0


TITLE = "Predicted against measured peak on a GPU (CUDA)"
ABOUT = (
    "Each case is moved to the GPU, profiled there with `target=\"cuda\"`, solved at the budget (a fraction of its "
    "no-checkpoint peak), and checked with `ckptplan.verify(..., device=\"cuda\")` plus three measurements of the "
    "emitted module's step, each the peak above the memory resident before the step plus the module's state and "
    "inputs: **allocated**, `torch.cuda.max_memory_allocated` (the caching allocator's blocks, what `verify` "
    "reports); **requested**, the `requested_bytes` peak of `torch.cuda.memory_stats` (the same allocations before "
    "the allocator rounds them); **MemTracker**, PyTorch's `MemTracker` on the GPU (live tensors only). The cases: the "
    "three examples at their default sizes, the GPT example under bf16 autocast, four of Korthikanti et al.'s GPT "
    "layers in bf16 (width 2048, 16 heads, 2 × 1024 tokens), and `accuracy.py`'s zoo, in bf16 where the zoo runs it. "
    "\"Gradients equal\" compares with the untouched model (`verify`'s tolerance); where they differ, the largest "
    "difference is given beside the model's difference from itself over two seeded steps. The measured overhead is "
    "the emitted module's median step time over the model's."
)


if __name__ == "__main__":
    sys.exit(main())
