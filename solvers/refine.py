"""Cheap moves on a one-level plan, each scored by ``simulate``: ``add_keeps`` caches the
outputs whose recomputation costs most per byte while the budget holds, ``shed_keeps`` starts
from every output cached and recomputes the cheapest per byte until the budget holds, and
``simplify`` drops regions and keeps that buy nothing.

They turn the ``dp`` and ``sqrt`` plans, which recompute whole regions, into starting points
for the ilp's search that already keep the expensive outputs, the way selective recompute does
(Korthikanti et al. 2022 keep matmul outputs and recompute the cheap ops between them): each
costs one ``simulate`` per candidate node, where a short CP-SAT search often does not get that
far (``benchmarks/ilp_speed.py --time-limit 6`` measures both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import Report, simulate
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp_model import keepable


@dataclass
class Moves:
    """How many more moves (each one ``simulate``) the passes sharing this allowance may make.
    A count rather than a deadline, so that a refined plan depends on the graph and the
    allowance, never on how fast the machine ran."""

    left: int

    def take(self) -> bool:
        """Spend one move; False (and nothing spent) when none is left."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def keep_priority(graph: ComputeGraph, t: int) -> float:
    """Recompute seconds saved per byte held by keeping node ``t``'s output."""
    return graph.nodes[t].fwd_cost / max(1, graph.new_bytes(t))


def _worth_keeping(graph: ComputeGraph, t: int) -> bool:
    """A node the moves may keep: one that can be kept and costs something to recompute."""
    return graph.nodes[t].fwd_cost > 0 and keepable(graph, t)


def add_keeps(
    graph: ComputeGraph, regions: tuple[Region, ...], budget_bytes: int, *, moves: Moves | None = None
) -> tuple[Region, ...]:
    """``regions`` with more nodes kept: every keepable node inside a region that costs something
    to recompute, tried once each in order of ``keep_priority`` (highest first), stays kept when
    the plan still fits ``budget_bytes`` and recomputes less. The pass ends early when ``moves``
    run out. ``regions`` must be one-level."""
    current = list(regions)
    best = simulate(graph, regions)
    candidates = sorted(
        ((region_index, t) for region_index, region in enumerate(current) for t in range(region.start, region.end)
         if graph.nodes[t].name not in region.keep and _worth_keeping(graph, t)),
        key=lambda item: (-keep_priority(graph, item[1]), item[1]),
    )
    for region_index, t in candidates:
        if moves is not None and not moves.take():
            break
        region = current[region_index]
        keep = sorted([*region.keep, graph.nodes[t].name], key=graph.index_of.__getitem__)
        trial = [*current[:region_index], Region(region.start, region.end, keep=tuple(keep)), *current[region_index + 1:]]
        report = simulate(graph, tuple(trial))
        if report.peak_bytes <= budget_bytes and report.cost_seconds < best.cost_seconds:
            current, best = trial, report
    return tuple(current)


def shed_keeps(
    graph: ComputeGraph, regions: tuple[Region, ...], budget_bytes: int, *, moves: Moves | None = None
) -> tuple[Region, ...] | None:
    """``regions`` keeping every keepable node that costs something to recompute, then keeping
    fewer, lowest ``keep_priority`` first, until the plan fits ``budget_bytes`` (Megatron's
    selective recompute from the other end: recompute the cheap ops first); None when it never
    fits (or ``moves`` run out first). ``add_keeps`` afterwards takes back what fits again."""
    current = [
        Region(r.start, r.end, keep=tuple(
            graph.nodes[t].name for t in range(r.start, r.end) if _worth_keeping(graph, t)))
        for r in regions
    ]
    shed = sorted(
        ((region_index, graph.index_of[name]) for region_index, region in enumerate(current) for name in region.keep),
        key=lambda item: (keep_priority(graph, item[1]), item[1]),
    )
    report = simulate(graph, tuple(current))
    for region_index, t in shed:
        if report.peak_bytes <= budget_bytes or (moves is not None and not moves.take()):
            break
        region = current[region_index]
        current[region_index] = Region(
            region.start, region.end, keep=tuple(k for k in region.keep if k != graph.nodes[t].name))
        report = simulate(graph, tuple(current))
    return tuple(current) if report.peak_bytes <= budget_bytes else None


def simplify(
    graph: ComputeGraph, regions: tuple[Region, ...], budget_bytes: int, *, ctx: SolveContext | None = None,
    remat: Sequence[str] = (),
) -> tuple[Region, ...]:
    """Drop regions and keeps that buy nothing: each is removed, in execution order, when the plan
    without it (rematerialising ``remat`` throughout) still fits ``budget_bytes`` and recomputes
    no more. A stopped search leaves such no-ops behind (a one-node region keeping its node, a
    region around free ops), and every region is a ``checkpoint`` call at run time. ``ctx``'s deadline (or Ctrl-C) ends the trials
    early, with what they removed so far: one simulation per region and keep
    adds up on large graphs (see ``tuning.SIMPLIFY_GRACE``)."""
    best: Report = simulate(graph, regions, remat=remat)

    def no_worse(candidate: tuple[Region, ...]) -> bool:
        nonlocal best
        if ctx is not None and ctx.over():
            return False
        report = simulate(graph, candidate, remat=remat)
        if report.peak_bytes <= budget_bytes and report.cost_seconds <= best.cost_seconds:
            best = report
            return True
        return False

    current = list(regions)
    index = 0
    while index < len(current):
        candidate = current[:index] + current[index + 1:]
        if no_worse(tuple(candidate)):
            current = candidate
            continue
        region = current[index]
        for name in region.keep:
            trimmed = Region(region.start, region.end, keep=tuple(k for k in region.keep if k != name))
            if no_worse(tuple(current[:index] + [trimmed] + current[index + 1:])):
                region = current[index] = trimmed
        index += 1
    return tuple(current)
