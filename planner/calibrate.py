"""Measure a ``Roofline`` on this machine: the cost model for plans that will run here.

The default cost model is an A100's datasheet, where a convolution is a few times cheaper than
the batch norm after it; on a CPU it is the other way round, and checkpointing's own bookkeeping
(per region, per op inside one, per kept op under a selective policy, per recompute of a
rematerialised op) no longer hides behind GPU kernels (docs/tuning.md, "Cost models", has one
CPU's numbers). Plans ranked by the wrong model
recompute the wrong ops: profile with ``roofline=measure_roofline()`` when the plan is to run
where it is measured.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from ckptplan.plan import Region
from ckptplan.profiler.cost import Roofline

log = logging.getLogger(__name__)

MATMUL_SIDE = 1024  # square fp32 matmul timed for peak FLOP/s
STREAM_ELEMENTS = 1 << 22  # fp32 elements of the elementwise add timed for bandwidth
CHAIN_DEPTH = 16  # Linear+sin pairs of the model whose checkpointed steps are timed
CHAIN_WIDTH = 8  # tiny layers: their steps are almost all fixed costs


class _Sin(nn.Module):
    """A tiny op whose backward saves its input, not its output: a rematerialisation candidate
    whose recompute costs about ``op_seconds`` (GELU's kernel alone takes several times that)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)


def measure_roofline(device: str | torch.device = "cpu", *, repeats: int = 15) -> Roofline:
    """Time a matmul, an elementwise add, a tiny op, a random draw, and checkpointed and
    rematerialising steps of a small chain on ``device`` with torch's current thread settings
    (medians of ``repeats`` runs; about a second on CPU). The fixed costs are differences of
    medians, floored at 0."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def median_seconds(fn: Callable[[], object], inner: int = 1) -> float:
        fn()
        sync()
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            samples.append((time.perf_counter() - started) / inner)
        return statistics.median(samples)

    with torch.no_grad():
        a = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device)
        flops_per_s = 2 * MATMUL_SIDE**3 / median_seconds(lambda: a @ a)
        x = torch.randn(STREAM_ELEMENTS, device=device)
        bandwidth = 3 * x.element_size() * STREAM_ELEMENTS / median_seconds(lambda: x + x)
        one = torch.ones(1, device=device)
        op_seconds = median_seconds(lambda: one + one, inner=200)
        draw_seconds = median_seconds(lambda: x.bernoulli_(0.5)) / STREAM_ELEMENTS  # dropout's draw
    region_seconds, region_op_seconds, policy_op_seconds, remat_seconds = _checkpoint_costs(
        device, sync, repeats, op_seconds
    )
    roofline = Roofline(
        peak_flops_per_s=flops_per_s,
        bandwidth_bytes_per_s=bandwidth,
        op_seconds=op_seconds,
        region_seconds=region_seconds,
        region_op_seconds=region_op_seconds,
        policy_op_seconds=policy_op_seconds,
        remat_seconds=remat_seconds,
        draw_seconds=draw_seconds,
        source="measured",
    )
    log.info("measured on %s: %s", device, roofline)
    return roofline


def _checkpoint_costs(
    device: torch.device, sync: Callable[[], object], repeats: int, op_seconds: float
) -> tuple[float, float, float, float]:
    """(region_seconds, region_op_seconds, policy_op_seconds, remat_seconds) from training steps
    of a tiny chain emitted with no regions; one region per node (each recomputing one tiny op:
    a region's cost and one op's); one region over every node (the region's cost and every
    op's); one region keeping every node (nothing recomputed; every node also runs under a
    selective policy's dispatch mode, in forward and in the recompute); and no regions with
    every sin rematerialised (recomputed in the next Linear's backward, from the input sin's
    own backward keeps). The five are
    timed in turn, ``repeats`` rounds, so that a change in the machine's speed meanwhile falls
    on all of them alike."""
    from ckptplan.build import make_plan
    from ckptplan.planner.emit import emit  # planner imports profiler, not the other way
    from ckptplan.profiler import profile
    from ckptplan.profiler.loss import training_loss
    from ckptplan.remat import why_not
    from ckptplan.simulation import simulate
    from ckptplan.solvers.ilp_model import keepable

    layers = [m for _ in range(CHAIN_DEPTH) for m in (nn.Linear(CHAIN_WIDTH, CHAIN_WIDTH), _Sin())]
    model = nn.Sequential(*layers).to(device)
    x = torch.randn(4, CHAIN_WIDTH, device=device)
    graph = profile(model, (x,))
    n = len(graph.nodes)

    singles = [Region(t, t + 1) for t in range(n) if t in graph.boundaries and t + 1 in graph.boundaries]
    kept = tuple(node.name for node in graph.nodes if keepable(graph, node.index))
    remat = tuple(node.name for node in graph.nodes if node.op.endswith("sin.default") and not why_not(graph, node.index))
    plans = {
        "none": make_plan(graph, []),
        "singles": make_plan(graph, singles),
        "every": make_plan(graph, [Region(0, n)]),
        "kept": make_plan(graph, [Region(0, n, keep=kept)]),
        "remat": make_plan(graph, [], remat=remat),
    }
    modules = {name: emit(graph, plan) for name, plan in plans.items()}
    samples: dict[str, list[float]] = {name: [] for name in plans}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, module in modules.items():
            started = time.perf_counter()
            for p in model.parameters():
                p.grad = None
            training_loss(module(x)).backward()
            sync()
            if round_:
                samples[name].append(time.perf_counter() - started)

    def extra_seconds(name: str) -> float:
        """What plan ``name`` adds to a step besides its recomputed ops' own time."""
        recomputed = len(simulate(graph, plans[name]).recomputed)
        return statistics.median(samples[name]) - statistics.median(samples["none"]) - recomputed * op_seconds

    one_node = extra_seconds("singles") / len(singles)  # a region and one op
    per_op = max((extra_seconds("every") - one_node) / (n - 1), 0.0)  # a region and n ops
    per_region = max(one_node - per_op, 0.0)
    per_policy_op = (extra_seconds("kept") - per_region - n * per_op) / (2 * len(kept))
    per_remat = extra_seconds("remat") / max(1, len(simulate(graph, plans["remat"]).recomputed))
    return per_region, per_op, max(per_policy_op, 0.0), max(per_remat, 0.0)

