"""The seed scenario: GPT-3 175B (``examples/gpt3_175b.py``) on 80 GB GPUs, FSDP2-sharded.

    python benchmarks/gpt3_seed.py [--budget 80GB] [--shard-degree 64] [--time-limit 60]

Profiles the model on the meta device as one rank of a ZeRO-3 group (bf16 compute, fp32 masters,
AdamW, CUDA's kernels: 1-byte dropout masks), then compares, at the per-rank budget, what users do by hand — checkpoint every
transformer block (``gradient_checkpointing_enable``), Chen's √N segments (``sqrt``) — with
``auto``. Every number is the simulator's (no GPU runs here); recompute is reported both as the
roofline estimate of the step (``overhead``) and as recomputed forward FLOPs over one forward
pass's FLOPs. Prints Markdown and writes it to ``benchmarks/results/gpt3_seed.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import platform
import time
from pathlib import Path

import results_file  # benchmarks/results_file.py, beside this script
import torch

import ckptplan
from ckptplan.cli.summary import op_name
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes
from ckptplan.units import format_bytes, parse_budget

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt3_175b.py"
GB = 10**9


def load_example():
    spec = importlib.util.spec_from_file_location("gpt3_175b", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(name: str, graph: ckptplan.ComputeGraph, plan: ckptplan.Plan, seconds: float) -> str:
    fwd = graph.total_fwd_flops
    activations = plan.prediction.peak_bytes - graph.static.resident_bytes
    return (
        f"| {name} | {format_bytes(plan.prediction.peak_bytes)} | {format_bytes(activations)} | "
        f"{plan.prediction.overhead:.1%} | {plan.prediction.recompute_flops / fwd:.1%} | {len(plan.regions)} | "
        f"{seconds:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="80GB")
    parser.add_argument("--shard-degree", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=60.0)
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    example = load_example()
    model, args, kwargs = example.build()
    spec = ckptplan.ShardSpec(options.shard_degree, master_dtype=example.TRAINING["master_dtype"])
    started = time.perf_counter()
    graph = ckptplan.profile(
        model, args, kwargs, optimizer=example.TRAINING["optimizer"], shard=spec, target=example.TRAINING["target"], outputs_live=False)
    profile_seconds = time.perf_counter() - started
    budget = parse_budget(options.budget, baseline_peak_bytes(graph))
    static = graph.static
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}; "
          f"profiled {len(graph.nodes)} nodes on the meta device in {profile_seconds:.0f} s\n")
    print(f"Per rank, ZeRO-3 over {options.shard_degree} ranks (bf16 compute, fp32 masters, AdamW): "
          f"parameters {format_bytes(static.param_bytes)} (shards + the root's gathered embeddings), "
          f"optimizer state {format_bytes(static.optimizer_bytes)}, gradient shards {format_bytes(static.grad_bytes)}; "
          f"activations saved for backward without checkpointing {format_bytes(graph.activation_bytes)} "
          f"({graph.activation_bytes / GB:.0f} GB); no-checkpoint peak {format_bytes(baseline_peak_bytes(graph))}; "
          f"budget {options.budget} = {format_bytes(budget)}.\n")
    print("| plan | peak per rank | peak above resident | overhead (roofline) | recomputed / forward FLOPs "
          "| regions | solve s |")
    print("|---|---|---|---|---|---|---|")
    blocks = [ckptplan.Region(u.start, u.end) for u in graph.sharding.units]
    started = time.perf_counter()
    every_block = ckptplan.make_plan(graph, blocks)
    print(row("checkpoint every block", graph, every_block, time.perf_counter() - started), flush=True)
    plans: dict[str, ckptplan.Plan] = {}
    for solver in ("sqrt", "auto"):
        started = time.perf_counter()
        try:
            plans[solver] = plan = ckptplan.solve(graph, budget, solver=solver, time_limit=options.time_limit)
        except InfeasibleBudgetError as error:
            print(f"| {solver} | infeasible: least {format_bytes(error.min_peak_bytes)} | | | | | "
                  f"{time.perf_counter() - started:.1f} |")
            continue
        print(row(solver if solver != "auto" else f"auto ({plan.solver.name})", graph, plan,
                  time.perf_counter() - started), flush=True)
    least = None
    try:
        ckptplan.solve(graph, static.resident_bytes + 1, solver="auto", time_limit=options.time_limit)
    except InfeasibleBudgetError as error:
        least = error.min_peak_bytes
        print(f"\nLeast per-rank peak any solver reaches: {format_bytes(least)}.")
    print(korthikanti(graph))
    print(reading(graph, every_block, plans.get("auto"), least))


def reading(graph: ckptplan.ComputeGraph, every_block: ckptplan.Plan, auto: ckptplan.Plan | None,
            least: int | None) -> str:
    """The table in words: what checkpointing every block costs and leaves, and what ``auto``
    recomputes (the ops it recomputes in most of their occurrences, and those whose outputs it
    mostly keeps), from this run's plans."""
    fwd = graph.total_fwd_flops

    def spent(plan: ckptplan.Plan) -> str:
        return (f"{plan.prediction.recompute_flops / fwd:.1%} of a forward pass "
                f"({plan.prediction.overhead:.1%} of the step by the roofline estimate)")

    block_peak = every_block.prediction.peak_bytes
    text = [f"\nCheckpointing every block recomputes {spent(every_block)} and leaves {format_bytes(block_peak)} per rank"]
    if least is not None:
        text.append(", the least any solver reaches" if format_bytes(least) == format_bytes(block_peak)
                    else f"; the least any solver reaches is {format_bytes(least)}")
        text.append(" (below it `ckptplan solve` exits 3 and quotes it)")
    text.append(".")
    if auto is not None and auto.nodes:
        total: dict[str, int] = {}
        redone: dict[str, int] = {}
        for node in auto.nodes:
            if node.saved_bytes:  # ops that keep something for backward: the ones a plan decides on
                name = op_name(node.op)
                total[name] = total.get(name, 0) + 1
                redone[name] = redone.get(name, 0) + (node.decision in ("recompute", "remat"))
        mostly_redone = [name for name in total if redone[name] > total[name] / 2]
        mostly_kept = [name for name in total if redone[name] <= total[name] / 2]
        text.append(
            f" `auto` recomputes {spent(auto)} at {format_bytes(auto.prediction.peak_bytes)}, "
            f"{format_bytes(auto.prediction.peak_bytes - graph.static.resident_bytes)} above the resident state "
            f"where activations without checkpointing would be {format_bytes(graph.activation_bytes)}.")
        said = [f"recomputes most occurrences of {_listed(mostly_redone)}" if mostly_redone else "",
                f"keeps the outputs of most of {_listed(mostly_kept)}" if mostly_kept else ""]
        if total:
            text.append(f" Of the ops that save tensors for backward, it {' and '.join(filter(None, said))}.")
    return "".join(text)


def _listed(names: list[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def korthikanti(graph: ckptplan.ComputeGraph) -> str:
    """Activation bytes per transformer layer against Korthikanti et al. 2022, eq. 1: s·b·h·(34 +
    5·a·s/h) for a 16-bit layer with softmax attention and dropout (s=2048, b=1, h=12288, a=96)."""
    units = graph.sharding.units
    saved = {s for u in units for i in range(u.start, u.end) for s in graph.nodes[i].saved}
    per_layer = sum(graph.storages[s].nbytes for s in saved if not graph.storages[s].is_static) / len(units)
    s, b, h, a = 2048, 1, 12288, 96
    formula = s * b * h * (34 + 5 * a * s / h)
    return (f"\nSaved for backward per layer: {per_layer / GB:.2f} GB; Korthikanti et al. count "
            f"{formula / GB:.2f} GB for their layer ({per_layer / formula:.2f}x).")


TITLE = "GPT-3 175B on 80 GB GPUs, 64-way FSDP2"
ABOUT = (
    "`examples/gpt3_175b.py`, one sequence of 2048 tokens per rank, profiled on the meta device for CUDA's kernels "
    "(`target=\"cuda\"` in its `TRAINING`: dropout keeps 1-byte masks); every number is the simulator's per-rank "
    "prediction (no GPU runs here). Overhead is the roofline estimate of the step; \"recomputed / forward FLOPs\" "
    "the recomputed forward FLOPs over one forward pass's. At this size `auto` plans block by block and "
    "its block solves stop on the wall clock, so reruns differ by a few tenths of a percent of the step."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
