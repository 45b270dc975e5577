"""What ``--spell-out`` buys on CPU, and what checkpointing's fixed costs are on a real layer.

    python benchmarks/spell_out.py [--budget-mib 28.6] [--repeats 15] [--sections plans,costs,pricing]

On ``benchmarks/compare.py``'s BERT classifier (scaled-dot-product attention with dropout, so
the math kernel on CPU) profiled as compare.py does (``--costs here``), ``ilp`` plans at one
budget (default: the peak torch.compile measured at ``activation_memory_budget=0.8`` there)
with the kernels whole and spelled out, at compare.py's 6 s and at the default 60 s. Each plan
is run as compare.py measures a point: MemTracker peak, extra matmul FLOPs (``FlopCounterMode``),
step time over the no-checkpoint step's (median of ``repeats`` interleaved steps), gradients.

Then the fixed costs ``--costs here`` charges per region, per op in one and per kept op
(``measure_roofline``, timed on a tiny chain) against what they are on this model: four regions,
one per layer, each around the layer's 512→128 ``linear`` (recomputed), the same keeping its
output (nothing recomputed: the policy's cost alone), and around an ``add`` that saves nothing
(never recomputed: the region's cost alone); forward and backward timed apart, per region.
Last, what the default A100 prices say a composite kernel costs, whole and spelled out: the
GPT example's first attention and the whole step. Prints Markdown and writes it to
``benchmarks/results/spell_out.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import compare  # benchmarks/compare.py: its BERT, its cost model and its measurement
import results_file  # benchmarks/results_file.py, beside this script
import torch
from torch.utils.flop_counter import FlopCounterMode

import ckptplan
from ckptplan import Region
from ckptplan.profiler.loss import training_loss

MIB = 2**20
SECTIONS = ("plans", "costs", "pricing")
TIME_LIMITS = (6.0, 60.0)  # a short solve, and ilp's default


def matmul_flops(module: torch.nn.Module, work: compare.Workload) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        compare._step(module, work)
    return counter.get_total_flops()


def plan_rows(work: compare.Workload, budget: int, repeats: int) -> list[str]:
    reference = compare._grads(work.model)
    base_flops = matmul_flops(work.model, work)
    rows = []
    for spell_out in (False, True):
        graph = ckptplan.profile(work.model, work.args, work.kwargs, roofline=compare.host_roofline(),
                                 measure_times=True, spell_out=spell_out, outputs_live=False)
        dp = ckptplan.solve(graph, budget, solver="dp")
        for limit in TIME_LIMITS:
            started = time.perf_counter()
            plan = ckptplan.solve(graph, budget, solver="ilp", time_limit=limit)
            seconds = time.perf_counter() - started
            module = ckptplan.emit(graph, plan)
            metrics = compare.measure(module, work.model, work, reference, repeats)
            flops = matmul_flops(module, work)
            rows.append(plan_row(
                "spelled out" if spell_out else "whole", len(graph.nodes), limit, seconds, plan,
                plan.regions == dp.regions, metrics, flops / base_flops - 1,
            ))
    return rows


def plan_row(kernels: str, nodes: int, limit: float, seconds: float, plan: ckptplan.Plan, as_dp: bool,
                metrics: compare.Metrics, extra_flops: float) -> str:
    return (f"| {kernels} | {nodes} | {limit:g} s | {seconds:.1f} | {plan.prediction.overhead:.3f} | "
            f"{'yes' if as_dp else 'no'} | {plan.prediction.peak_bytes / MIB:.1f} | {metrics.peak_bytes / MIB:.1f} | "
            f"{extra_flops * 100:+.1f} | {metrics.time_ratio:.2f} | {metrics.grads} |")


def region_costs(work: compare.Workload, repeats: int) -> tuple[ckptplan.ComputeGraph, list[str]]:
    graph = ckptplan.profile(work.model, work.args, work.kwargs, roofline=compare.host_roofline(), outputs_live=False)
    at = graph.index_of
    linears = [n.name for n in graph.nodes if n.op == "aten.linear.default" and n.inputs and
               graph.nodes[n.inputs[0]].op == "aten.gelu.default"]  # each layer's 512→128 projection
    adds = [n.name for n in graph.nodes if n.op == "aten.add.Tensor" and not graph.saved_bytes(n.index)][:len(linears)]
    plans = {
        "none": [],
        "around each linear (recomputed)": [Region(at[n], at[n] + 1) for n in linears],
        "around each linear, keeping it": [Region(at[n], at[n] + 1, keep=(n,)) for n in linears],
        "around an add that saves nothing": [Region(at[n], at[n] + 1) for n in adds],
    }
    modules = {name: ckptplan.emit(graph, regions) for name, regions in plans.items()}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in plans}
    for _ in range(2):  # warm-up
        for module in modules.values():
            _timed_halves(module, work)
    for _ in range(max(repeats, 1) * 3):
        for name, module in modules.items():
            forward, backward = _timed_halves(module, work)
            times[name][0].append(forward)
            times[name][1].append(backward)
    base = [statistics.median(t) for t in times["none"]]
    rows = []
    for name, regions in plans.items():
        if not regions:
            continue
        fwd, bwd = (statistics.median(t) - b for t, b in zip(times[name], base))
        report = ckptplan.simulate(graph, regions)
        rows.append(f"| {name} | {len(regions)} | {fwd / len(regions) * 1e3:.2f} | {bwd / len(regions) * 1e3:.2f} | "
                    f"{report.recompute_seconds / len(regions) * 1e3:.2f} | "
                    f"{report.checkpoint_seconds / len(regions) * 1e3:.2f} |")
    return graph, rows


def pricing_rows() -> list[str]:
    """The GPT example (default shapes, CPU kernels) profiled whole and spelled out under the
    default A100 roofline: its first attention's forward price and the step's."""
    spec = importlib.util.spec_from_file_location("gpt_example", compare.EXAMPLES / "gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, args = example.build()[:2]
    whole = ckptplan.profile(model, args, outputs_live=False)
    parts = ckptplan.profile(model, args, spell_out=True, outputs_live=False)
    attention = whole.node("scaled_dot_product_attention")
    spelled = parts.nodes[parts.index_of["attn_query"]:parts.index_of["attn_out"] + 1]
    return [
        f"| whole | `{attention.name}` | {attention.fwd_cost * 1e6:.1f} | {whole.step_cost * 1e3:.2f} |",
        (f"| spelled out | {', '.join(f'`{n.name}`' for n in spelled)} | "
         f"{sum(n.fwd_cost for n in spelled) * 1e6:.1f} | {parts.step_cost * 1e3:.2f} |"),
    ]


def _timed_halves(module: torch.nn.Module, work: compare.Workload) -> tuple[float, float]:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)
    started = time.perf_counter()
    loss = training_loss(module(*work.args, **work.kwargs))
    middle = time.perf_counter()
    loss.backward()
    return middle - started, time.perf_counter() - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=28.6)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="which tables, of " + ", ".join(SECTIONS))
    options = parser.parse_args()
    sections = options.sections.split(",")
    torch.set_num_threads(1)
    print(compare.machine_line(1))
    if "plans" in sections or "costs" in sections:
        work = compare.CASES["bert"].build()
        work.model.train()
        compare._step(work.model, work)
        print(f"\n{compare.CASES['bert'].title}; budget {options.budget_mib:g} MiB\n")
        if "plans" in sections:
            print_plans(work, int(options.budget_mib * MIB), options.repeats)
        if "costs" in sections:
            print_costs(work, options.repeats)
    if "pricing" in sections:
        print("\nThe GPT example (examples/gpt.py, default shapes, CPU kernels) under the default A100 prices:\n")
        print("| kernels | attention's nodes (layer 0) | forward µs | step ms (forward + backward) |")
        print("|---|---|---|---|")
        for row in pricing_rows():
            print(row)


def print_plans(work: compare.Workload, budget: int, repeats: int) -> None:
    print("| kernels | nodes | ilp limit | ilp s | predicted overhead | dp's plan | predicted peak MiB | "
          "measured peak MiB | extra matmul FLOPs % | step time ratio | gradients equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in plan_rows(work, budget, repeats):
        print(row)


def print_costs(work: compare.Workload, repeats: int) -> None:
    graph, rows = region_costs(work, repeats)
    print(f"\nCharged per region {graph.region_cost * 1e3:.2f} ms, per node in it {graph.region_op_cost * 1e3:.3f} ms, "
          f"per kept node {graph.policy_op_cost * 1e3:.3f} ms (twice: forward and recompute); "
          "measured per region, "
          "medians of interleaved steps against the plan without regions:\n")
    print("| regions | count | forward ms | backward ms | predicted recompute ms | charged fixed ms |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(row)


TITLE = "Spelled-out composites and checkpointing's fixed costs on CPU"
ABOUT = (
    "compare.py's BERT classifier at the budget (by default 28.6 MiB, the peak torch.compile measured there at "
    "`activation_memory_budget` 0.8), profiled as compare.py does (`--costs here`), planned by `ilp` with its "
    "kernels whole and with `spell_out=True` (scaled-dot-product attention as its scaling, matmuls, softmax and "
    "dropout; every dropout as a one-byte mask and its product), at compare.py's 6 s and the default 60 s, each plan "
    "measured as compare.py measures a point. \"costs\": what the cost model charges for checkpointing itself "
    "against what it costs on this model, per region, forward and backward timed apart. \"pricing\": what the "
    "default A100 prices say a composite kernel costs, whole and spelled out."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
