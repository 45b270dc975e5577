"""Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", made budget-aware.

Chen's Algorithm 3 walks the execution order, accumulating the bytes each op saves, and closes
a checkpoint segment at the next cheap cut once the running total passes a threshold ``B``;
with ``B`` ≈ √(total) that gives O(√N) memory for one extra forward. Here the threshold and the
set of cuts allowed are searched, each candidate plan is scored by the simulator, and the
cheapest plan whose simulated peak fits the budget wins.

A *cut* k sits between node k-1 and node k; its *crossing bytes* are the bytes of activation
storages produced before k and still read at or after k. Cheap cuts (few crossing bytes) are
where a segment boundary stores little (Chen's "articulation points" on chains).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.sharding import split_at_unit_edges
from ckptplan.simulation import Report, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.memo import graph_memo
from ckptplan.solvers.solution import Solution, solution
from ckptplan.units import describe_bytes


def crossing_bytes(graph: ComputeGraph) -> list[int]:
    """``crossing[k]`` for k in 0..n: activation bytes live across cut k in forward."""
    n = len(graph.nodes)
    last_reader: dict[int, int] = {}
    for node in graph.nodes:
        readers = graph.users[node.index]
        if readers:
            for s in node.outputs:
                last_reader[s] = max(last_reader.get(s, -1), readers[-1])
    delta = [0] * (n + 2)
    for s, last in last_reader.items():
        storage = graph.storages[s]
        if storage.kind == "activation":
            delta[storage.producer + 1] += storage.nbytes
            delta[last + 1] -= storage.nbytes
    crossing, running = [], 0
    for k in range(n + 1):
        running += delta[k]
        crossing.append(running)
    return crossing


def segment(graph: ComputeGraph, threshold_bytes: float, cuts: set[int]) -> list[tuple[int, int]]:
    """Chen's greedy: close a segment at the first allowed cut after ``threshold_bytes`` of
    saved activations have accumulated."""
    n = len(graph.nodes)
    segments, start, acc = [], 0, 0
    for i in range(n):
        acc += graph.saved_bytes(i)
        if acc > threshold_bytes and (i + 1) in cuts and i + 1 < n:
            segments.append((start, i + 1))
            start, acc = i + 1, 0
    segments.append((start, n))
    return segments


def solve_sqrt(graph: ComputeGraph, budget_bytes: int, ctx: SolveContext | None = None) -> Solution:
    """Cheapest plan found by Chen's segmenting over the searched thresholds and cut sets
    (all of them, or as many as ``ctx``'s time allows)."""
    n = len(graph.nodes)
    best: tuple[float, int, tuple[Region, ...], Report] | None = None
    least: tuple[int, int] | None = None  # (peak, candidate)
    scored = _scored(graph)
    for k, regions in enumerate(scored.candidates):
        report = scored.report(graph, k)
        least = min(least or (report.peak_bytes, k), (report.peak_bytes, k))
        if report.peak_bytes > budget_bytes:
            continue
        key = (report.cost_seconds, report.peak_bytes)
        if best is None or key < best[:2]:
            best = (report.cost_seconds, report.peak_bytes, regions, report)
        if ctx is not None and ctx.over():
            break
    if best is None:
        least_peak, k = least
        raise InfeasibleBudgetError(
            f"Budget {describe_bytes(budget_bytes)} is below the least peak the sqrt solver reaches, "
            f"{describe_bytes(least_peak)}; raise the budget or try another solver.",
            budget_bytes=budget_bytes,
            min_peak_bytes=least_peak,
            least_plan=solution(graph, scored.candidates[k], "sqrt", note="the sqrt candidate of least peak",
                                report=scored.report(graph, k)),
        )
    _, _, regions, report = best
    note = f"{len(regions)} checkpoint segment(s) over {n} nodes (Chen et al. 2016 greedy, budget-searched)"
    return solution(graph, regions, "sqrt", note=note, report=report)


def least_peak_regions(graph: ComputeGraph) -> tuple[tuple[Region, ...], int]:
    """The candidate with the least simulated peak, and that peak: a one-level plan that
    searches for the least peak start from (no checkpointing when nothing beats it)."""
    scored = _scored(graph)
    peaks = [(scored.report(graph, k).peak_bytes, k, regions) for k, regions in enumerate(scored.candidates)]
    peak, _, regions = min(peaks)
    return regions, peak


@dataclass
class _Scored:
    """``_candidates(graph)`` and the simulated reports of as many of them as were asked for:
    none depends on the budget, so they are kept with the graph (``solvers.memo``)."""

    candidates: list[tuple[Region, ...]]
    reports: list[Report] = field(default_factory=list)

    def report(self, graph: ComputeGraph, k: int) -> Report:
        while len(self.reports) <= k:
            self.reports.append(simulate(graph, self.candidates[len(self.reports)]))
        return self.reports[k]


def _scored(graph: ComputeGraph) -> _Scored:
    return graph_memo(graph, "sqrt", lambda: _Scored(_candidates(graph)))


def _candidates(graph: ComputeGraph) -> list[tuple[Region, ...]]:
    """Distinct region sets to score: no checkpointing, then every (threshold, cut set) pair,
    with and without a region on the last segment, each cut at FSDP unit edges."""
    n = len(graph.nodes)
    seen: set[tuple[Region, ...]] = set()
    ordered: list[tuple[Region, ...]] = []

    def add(regions: tuple[Region, ...]) -> None:
        # Scored as the emitted module runs it, cut at FSDP unit edges: uncut, a candidate's peak
        # can differ (docs/tuning.md, "sqrt"), and the least peak this solver names would not be
        # the least its plans reach.
        regions = split_at_unit_edges(graph, regions)
        if regions not in seen:
            seen.add(regions)
            ordered.append(regions)

    add(())
    if n == 0:
        return ordered
    crossing = crossing_bytes(graph)
    inner = sorted(crossing[1:n])
    saved = [graph.saved_bytes(i) for i in range(n)]
    total = sum(saved)
    if total == 0:
        return ordered
    lo = max(1, max(saved))
    thresholds = [lo * (total / lo) ** (k / (tuning.SQRT_THRESHOLDS - 1)) for k in range(tuning.SQRT_THRESHOLDS)]
    thresholds = [0.0, *thresholds[:-1]]
    for quantile in tuning.SQRT_CUT_QUANTILES:
        if not inner:
            break
        level = inner[min(len(inner) - 1, math.floor(quantile * (len(inner) - 1)))]
        cuts = {k for k in range(1, n) if crossing[k] <= level and k in graph.boundaries}
        for threshold in thresholds:
            segments = [s for s in segment(graph, threshold, cuts) if any(saved[i] for i in range(*s))]
            regions = tuple(Region(a, b) for a, b in segments)
            add(regions)
            if len(regions) > 1:
                add(regions[:-1])
    return ordered
