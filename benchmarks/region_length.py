"""What one checkpoint region costs a step as it grows, measured against ckptplan's prediction.

    python benchmarks/region_length.py [--width 8] [--pairs 41]

A chain of 32 × (Linear + tanh) with tiny layers, so that a step is almost all fixed costs,
profiled as the CLI's ``--costs here`` does. For one region over the first L nodes (plain, and
keeping every 8th or every other node), it prints what ``simulate`` charges (recompute plus the
checkpoint machinery, and the part of that charged per node inside a region) and what the region
measurably adds: the median, over interleaved pairs, of a step with the region minus the plain
step timed right after it. Prints a markdown table (stdout) and writes it to
``benchmarks/results/region_length.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Sequence

import compare  # benchmarks/compare.py: its timed training step
import results_file  # benchmarks/results_file.py, beside this script
import torch
from torch import nn

import ckptplan
from ckptplan.simulation import simulate
from ckptplan.solvers.ilp_model import keepable

log = logging.getLogger("region_length")

LAYERS = 32
LENGTHS = (2, 8, 16, 32, 63)
KEEPS = {"plain": 0, "keeping every 8th node": 8, "keeping every other node": 2}  # keep nodes at multiples of this


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=8, help="features of each Linear (default 8)")
    parser.add_argument("--pairs", type=int, default=41, help="interleaved pairs per region (default 41)")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(options.width, options.width), nn.Tanh())])
    x = torch.randn(4, options.width)
    roofline = ckptplan.measure_roofline()
    graph = ckptplan.profile(model, (x,), roofline=roofline, measure_times=True, outputs_live=False)
    log.info("%s", roofline)
    work = compare.Workload(model, (x,))
    print(f"{len(graph.nodes)} nodes; charged per region {graph.region_cost * 1e3:.3f} ms, per node in a region "
          f"{graph.region_op_cost * 1e3:.3f} ms, per kept node {graph.policy_op_cost * 1e3:.3f} ms "
          "(twice)\n")
    print("| region | nodes | kept | recomputed | charged ms | of it per node in a region | measured ms |")
    print("|---|---|---|---|---|---|---|")
    for length in LENGTHS:
        for label, every in KEEPS.items():
            kept = tuple(n.name for n in graph.nodes[:length] if keepable(graph, n.index) and every and n.index % every == 0)
            region = ckptplan.Region(0, length, keep=kept)
            report = simulate(graph, [region])
            module = ckptplan.emit(graph, [region])
            for _ in range(3):
                compare._timed_step(module, work), compare._timed_step(model, work)
            added = statistics.median(
                compare._timed_step(module, work) - compare._timed_step(model, work) for _ in range(options.pairs)
            )
            print(f"| {label} | {length} | {len(kept)} | {len(report.recomputed)} | "
                  f"{(report.recompute_seconds + report.checkpoint_seconds) * 1e3:.2f} | "
                  f"{graph.region_op_cost * length * 1e3:.2f} | {added * 1e3:.2f} |")


TITLE = "What a checkpoint region costs as it grows"
ABOUT = (
    "A chain of 32 × (Linear + tanh), batch 4, so that a step is almost all fixed costs, profiled as `--costs here` "
    "does; one region over its first L nodes, plain or keeping every 8th or every other node (those that may be "
    "kept). \"Charged\" is what `simulate` adds to the step (recompute and checkpoint machinery), \"measured\" the "
    "median over interleaved pairs of a step with the region minus the plain step timed right after it (one torch "
    "thread). The fixed costs `measure_roofline` calibrates (first line) and the step times both move from run to "
    "run on a shared machine."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
