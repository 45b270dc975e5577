"""ckptplan's partition of the compiled step against PyTorch's memory-budget knob, on CPU.

    python benchmarks/compile_compare.py                 # the compare.py models
    python benchmarks/compile_compare.py --models gpt    # some of them
    python benchmarks/compile_compare.py --dtype bfloat16   # weights and inputs in bfloat16

For each model, the peer is ``torch.compile`` with AOTAutograd's min-cut partitioner under
``torch._functorch.config.activation_memory_budget`` at 1.0, 0.8, 0.5, 0.2 and 0.0 (inductor's
decompositions, eager kernels: ``aot_eager_decomp_partition``, random ops as eager draws them).
ckptplan is ``ckptplan.compile(backend="aot_eager")`` on the same joint graph, at a budget of
each knob setting's measured peak, and at the least peak it reaches, its recomputation priced in
FLOPs (``profiler.cost.FLOPS``: the comparison is of FLOPs computed again). Each row: the allocator's
peak over one step (``measure_step``, the loop dropping the outputs), ckptplan's predicted peak,
the FLOPs the backward computes again (forward nodes the backward graph runs that the forward
graph ran too), the step time over the eager model's (median of paired steps), for ckptplan's
rows the step time over the knob setting's at whose peak it was solved (median of pairs of the
two steps, timed one after the other: head to head, without the eager step's noise), whether the
gradients equal those of the first row, the compiled step that recomputes nothing, for the same
seed (``torch.testing.assert_close``'s defaults for the gradients' dtype: the same decomposed
arithmetic; a knob setting that recomputes dropout draws new masks), and the seconds the
partitioner spent. Writes ``benchmarks/results/compile_compare.md`` and ``.json``; with
``--dtype bfloat16`` (the models' parameters, buffers and floating inputs cast to it),
``compile_compare_bfloat16.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import compare  # benchmarks/compare.py, beside this script
import results_file  # benchmarks/results_file.py, beside this script
import torch
from torch import fx, nn

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.planner.compiled import choose_loss_functions
from ckptplan.profiler.cost import A100, FLOPS
from ckptplan.profiler.joint import read_joint

KNOBS = (1.0, 0.8, 0.5, 0.2, 0.0)
DEFAULT_MODELS = ("gpt", "unet", "resnet", "gpt2", "llama", "bert")


def _knob_backend(knob: float, found: dict[str, Any]) -> Any:
    """AOTAutograd with the min-cut partitioner at ``knob``, as ``aot_eager_decomp_partition``
    builds it, noting the FLOPs its backward computes again."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import select_decomp_table

    def partition(joint: fx.GraphModule, inputs: Any, *, num_fwd_outputs: int, **kwargs: Any) -> Any:
        graph = read_joint(joint, num_fwd_outputs, A100)
        started = time.perf_counter()
        with functorch_config.patch(activation_memory_budget=knob):
            forward, backward = min_cut_rematerialization_partition(
                joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
            )
        found["seconds"] = time.perf_counter() - started
        ran = {n.name for n in forward.graph.nodes}
        again = [v for v in graph.values if v.phase == "forward" and v.name in ran
                 and v.name in {n.name for n in backward.graph.nodes if n.op == "call_function"}]
        found["recompute_flops"] = sum(v.flops for v in again)
        return forward, backward

    with inductor_config.patch(fallback_random=True):
        decompositions = select_decomp_table()
    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                        decompositions=decompositions)


def _peak(module: nn.Module, work: compare.Workload) -> int:
    ckptplan.measure_step(module, work.args, work.kwargs, outputs_live=False)
    return ckptplan.measure_step(module, work.args, work.kwargs, outputs_live=False).peak_bytes


def _in_dtype(work: compare.Workload, dtype: torch.dtype) -> compare.Workload:
    """``work`` with its model's parameters and buffers and its floating inputs in ``dtype``."""
    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    model = work.model.to(dtype)
    return compare.Workload(model, tuple(map(cast, work.args)), {k: cast(v) for k, v in work.kwargs.items()})


def run_case(case: compare.Case, repeats: int, solver: str = "auto", time_limit: float | None = None,
             dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    work = case.build()
    if dtype != torch.float32:
        work = _in_dtype(work, dtype)
    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}  # the gradients of the compiled step that recomputes nothing

    def row(method: str, module: nn.Module, **fields: Any) -> None:
        peak = _peak(module, work)
        compare._step(module, work)
        if not reference:
            reference.update(compare._grads(work.model))
        gradients = compare._compare_grads(reference, work.model)
        ratio = compare.time_ratio(module, work, repeats)
        rows.append({"model": case.name, "dtype": str(dtype).removeprefix("torch."), "method": method,
                     "measured_peak_bytes": peak, "step_time_ratio": ratio,
                     "gradients_equal": gradients, **fields})
        predicted = fields.get("predicted_peak_bytes")
        print(f"{case.name} | {method} | {ckptplan.format_bytes(peak)}"
              + (f" (predicted {ckptplan.format_bytes(predicted)})" if predicted else "")
              + f" | {fields.get('recompute_flops', 0) / 1e9:.2f} GFLOP again | {ratio:.2f}x | gradients {gradients}",
              flush=True)

    choose_loss_functions(work.model)  # the peers compile the model whole too
    peers: dict[str, nn.Module] = {}  # each knob setting's compiled model, by its row's method
    for knob in KNOBS:
        torch._dynamo.reset()
        found: dict[str, Any] = {}
        try:
            module = torch.compile(work.model, backend=_knob_backend(knob, found), fullgraph=True)
            _peak(module, work)
        except Exception as exc:  # noqa: BLE001 (a peer that cannot compile this model is a result)
            print(f"{case.name} | knob {knob} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        row(f"activation_memory_budget {knob}", module, budget_bytes=None, predicted_peak_bytes=None,
            recompute_flops=found.get("recompute_flops", 0), partition_seconds=found.get("seconds"))
        peers[rows[-1]["method"]] = module
    budgets = [(f"ckptplan at knob {r['method'].split()[-1]}'s peak", r["measured_peak_bytes"], r)
               for r in list(rows)]
    torch._dynamo.reset()
    try:
        ckptplan.compile(work.model, work.args, work.kwargs, budget=1, backend="aot_eager", outputs_live=False,
                         roofline=FLOPS, solver=solver, time_limit=time_limit)
    except InfeasibleBudgetError as error:
        budgets.append(("ckptplan at its least", error.min_peak_bytes, None))
    except Exception as exc:  # noqa: BLE001 (a model ckptplan cannot compile is a result)
        print(f"{case.name} | ckptplan | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    for method, budget, peer_row in budgets:
        torch._dynamo.reset()
        started = time.perf_counter()
        try:
            module = ckptplan.compile(work.model, work.args, work.kwargs, budget=budget, backend="aot_eager",
                                      outputs_live=False, roofline=FLOPS, solver=solver, time_limit=time_limit)
        except InfeasibleBudgetError as error:
            print(f"{case.name} | {method} | infeasible: least {ckptplan.format_bytes(error.min_peak_bytes)}")
            continue
        except Exception as exc:  # noqa: BLE001 (a model ckptplan cannot compile is a result)
            print(f"{case.name} | {method} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        plan = module.ckptplan_plan
        row(method, module, budget_bytes=budget, predicted_peak_bytes=plan.peak_bytes,
            recompute_flops=plan.recompute_flops, partition_seconds=time.perf_counter() - started,
            joint_nodes=len(plan.graph.values), solver=plan.solver, status=plan.status)
        if peer_row is not None:
            # Head to head: the knob's step (compiled again, since the reset) timed right after
            # ckptplan's, pair by pair, and its peak measured again as a check.
            peer = peers[peer_row["method"]]
            again = _peak(peer, work)
            rows[-1]["time_vs_knob"] = compare.time_ratio(module, work, repeats, against=peer)
            rows[-1]["knob_peak_again_bytes"] = again
            print(f"{case.name} | {method} | step time over the knob's {rows[-1]['time_vs_knob']:.3f}"
                  + ("" if again == peer_row["measured_peak_bytes"] else
                     f" | the knob's step measured {ckptplan.format_bytes(again)} this time"), flush=True)
    torch._dynamo.reset()
    return rows


def _table(rows: list[dict[str, Any]]) -> list[str]:
    def mib(n: Any) -> str:
        return "-" if n is None else f"{n / 2**20:.2f}"

    lines = [("| model | method | measured peak (MiB) | predicted (MiB) | error | GFLOP again | step time "
              "| over the knob's | gradients |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        predicted = r.get("predicted_peak_bytes")
        error = "-" if predicted is None else f"{(predicted - r['measured_peak_bytes']) / r['measured_peak_bytes']:+.2%}"
        versus = f"{r['time_vs_knob']:.3f}" if r.get("time_vs_knob") is not None else "-"
        lines.append(f"| {r['model']} | {r['method']} | {mib(r['measured_peak_bytes'])} | {mib(predicted)} | {error} | "
                     f"{r['recompute_flops'] / 1e9:.2f} | {r['step_time_ratio']:.2f}x | {versus} | "
                     f"{r['gradients_equal']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated compare.py models")
    parser.add_argument("--repeats", type=int, default=5, help="step-time pairs per row")
    parser.add_argument("--solver", default="auto", help="ckptplan.compile's solver: auto, exact or greedy")
    parser.add_argument("--time-limit", type=float, default=None, help="its seconds per partition (default: its own)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the models' parameters, buffers and floating inputs (default float32)")
    options = parser.parse_args(argv)
    dtype = getattr(torch, options.dtype)
    names = [n for n in options.models.split(",") if n]
    unknown = [n for n in names if n not in compare.CASES]
    if unknown:
        print(f"Unknown model {unknown[0]!r}; choose from {', '.join(compare.CASES)}.", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        rows += run_case(compare.CASES[name], options.repeats, options.solver, options.time_limit, dtype)
    lines = _table(rows)
    print("\n".join(lines))
    results_file.write(
        __file__, "ckptplan's partition of the compiled step against the memory-budget knob (CPU"
        + (f", {options.dtype})" if dtype != torch.float32 else ")"), lines,
        about=(f"Parameters, buffers and floating inputs in {options.dtype}. " if dtype != torch.float32 else "")
              + "Peaks as the CPU allocator counts them over one step (the loop drops the outputs), with the model's "
              "state and inputs; step time over the eager model's; GFLOP again: what the backward recomputes. "
              "ckptplan rows: `ckptplan.compile(backend=\"aot_eager\")` at a budget of the knob row's measured peak, "
              "and its step time over the knob's (the median over pairs of steps timed one after the other), "
              f"solver {options.solver}"
              + (f", {options.time_limit:g} s per partition." if options.time_limit is not None else ", its default time."),
        rows=rows, variant=options.dtype if dtype != torch.float32 else "",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
