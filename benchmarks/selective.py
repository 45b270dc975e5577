"""Does ``ilp`` find selective recompute on its own? What its plan keeps and recomputes on the
GPT example's architecture, by op kind, at two widths.

    python benchmarks/selective.py [--time-limit 30] [--fraction 0.5]

Megatron's selective recompute (Korthikanti et al. 2022) keeps the matmul outputs and
recomputes the attention core and the pointwise ops: right where matmuls dominate the step.
Each model is built on the meta device (8 layers, batch 4 × 256 tokens, 64-wide heads) and
planned at ``fraction`` of its activation bytes above the resident state, priced by the
default A100 roofline. Prints a Markdown table and writes it to
``benchmarks/results/selective.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections import Counter
from pathlib import Path

import results_file  # benchmarks/results_file.py, beside this script
import torch

import ckptplan
from ckptplan.cli.summary import op_name
from ckptplan.simulation import baseline_peak_bytes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WIDTHS = (128, 1024)  # the example's own width; a width where matmuls are compute-bound on an A100
LAYERS, BATCH, SEQ = 8, 4, 256


def gpt_graph(width: int) -> ckptplan.ComputeGraph:
    spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLES / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model = module.GPT(n_layer=LAYERS, block_size=SEQ, n_embd=width, n_head=width // 64)
        ids = torch.randint(0, 256, (BATCH, SEQ))
    return ckptplan.profile(model, (ids, ids), outputs_live=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--fraction", type=float, default=0.5)
    options = parser.parse_args()
    print(f"torch {torch.__version__}; ilp {options.time_limit:g} s; budget: resident + "
          f"{options.fraction:.0%} of the activation bytes\n")
    print("| width | nodes | status | overhead | regions | kept outputs "
          "| recomputed (in regions, not kept; views omitted) |")
    print("|---|---|---|---|---|---|---|")
    views = {"view", "transpose", "split", "getitem", "contiguous"}
    for width in WIDTHS:
        graph = gpt_graph(width)
        activation = baseline_peak_bytes(graph) - graph.static.resident_bytes
        budget = graph.static.resident_bytes + int(options.fraction * activation)
        try:
            plan = ckptplan.solve(graph, budget, solver="ilp", time_limit=options.time_limit)
        except ckptplan.InfeasibleBudgetError as error:
            print(f"| {width} | {len(graph.nodes)} | infeasible: least peak found "
                  f"{error.min_peak_bytes / 2**20:.1f} MiB, budget {budget / 2**20:.1f} MiB | | | | |")
            continue
        kept, recomputed = Counter(), Counter()
        for region in plan.regions:
            for i in range(region.start, region.end):
                node = graph.nodes[i]
                kind = op_name(node.op)
                if node.name in region.keep:
                    kept[kind] += 1
                elif kind not in views:
                    recomputed[kind] += 1

        def show(counts: Counter) -> str:
            return ", ".join(f"{kind} ×{n}" for kind, n in sorted(counts.items())) or "–"

        print(f"| {width} | {len(graph.nodes)} | {plan.solver.status} | {plan.prediction.overhead:.3f} | "
              f"{len(plan.regions)} | {show(kept)} | {show(recomputed)} |")


TITLE = "Selective recompute, found by the solver"
ABOUT = (
    "The GPT example's architecture at 8 layers (batch 4 × 256 tokens, 64-wide heads) on the meta device, at its "
    "own width and at 1024, planned by `ilp` at the resident state plus a fraction of the activation bytes, priced "
    "by the default A100 roofline: what the plan keeps, and what its regions recompute, by op kind (views omitted). "
    "Which ops are cheap to recompute depends on the shapes: at a small width a matmul is memory-bound and costs "
    "less to recompute than the GELU after it."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
