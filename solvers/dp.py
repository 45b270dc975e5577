"""Optimal nested checkpointing of a chain by dynamic programming (solver ``dp``).

Idea from rotor / "Optimal checkpointing for heterogeneous chains" (Beaumont, Herrmann,
Shilova et al., 2019) and Griewank–Walther's Revolve: the best schedule for a segment either
stores its first stage and recurses on the rest, or checkpoints a prefix (keeping only its
input), recurses on the rest, and then recomputes the prefix the same way. Here the schedules
are exactly what PyTorch's non-reentrant ``checkpoint`` runs: a *region* saves nothing in
forward but its inputs; when backward reaches it, it reruns its forward once — saving what its
own (directly contained) stages save and only the inputs of its child regions — stopping early
at its last saved tensor, then runs backward through its items in reverse, each child region
recomputing itself in turn. The memory of every step is counted as ``ckptplan.simulate``
counts it (see ``solvers.chain`` for the per-stage quantities).

Tables. Memory is in units of ``mem_unit`` bytes above the resident memory (which every step
holds, so it is subtracted from the budget exactly), every quantity rounded *up* (so a plan the
DP accepts never exceeds the budget in bytes). A *frame* is the top level of the step or one
region's recomputation; its *items* are stages run directly and child regions.

``suffix[k][b][region][ms][mb][ihs][ihb]`` = the least recompute cost of handling the items that
cover stages ``k..b`` of a frame ending at stage b (``region``: the frame is a region's
recompute, else the top level), given that ``ms`` units are held by everything outside these
items while the frame runs forward and ``mb`` while it runs backward, and ``ihs`` / ``ihb``
say whether stage k's input is already held by the items before it in those two phases; or
infinity if some step would exceed the budget. Its first item is either stage k run directly
(it then holds what it saves: the rest sees more held memory) or a child region ``[k, d]``
(which holds its input; its own recompute is ``frame[k][d]``, evaluated after the rest).

``frame[k][d][top][mb][ih]`` = ``suffix`` of region ``[k, d]``'s recompute: forward with its
input held and the gradient of its output present, backward with its input held for a
top-level region (``frame.save_inputs``) or only if its parent holds it (nested: the input came
from the parent's recompute and dies with this one's).

``ChainDP`` fills these tables for one budget, memoised on the states reached: the slow,
obvious reference. ``solve_dp`` runs ``solvers.dp_curve``, the same recurrence vectorised over
held memory, which answers every budget in one pass of O(L³) array operations of length U
(L stages, U memory units); the two are tested against each other on random chains.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import Report, baseline_peak_bytes, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.chain import Chain, build_chain, stage_starts
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.dp_curve import CostCurve, StageUnits, cost_curve
from ckptplan.solvers.memo import graph_memo
from ckptplan.solvers.solution import Solution, solution
from ckptplan.solvers.sqrt import solve_sqrt
from ckptplan.units import describe_bytes

log = logging.getLogger(__name__)

INF = math.inf


class ChainDP(StageUnits):
    """The DP over one chain at one budget, memoised on exact held memory: the slow, obvious
    reference that ``solvers.dp_curve`` (what ``solve_dp`` runs) is tested against.
    ``solve()`` returns (cost, top-level item choices)."""

    def __init__(self, chain: Chain, budget_bytes: int, mem_unit: int) -> None:
        super().__init__(chain, mem_unit)
        # Resident bytes are held at every step, so they come off the budget exactly (in bytes)
        # and the units resolve only what plans change: on a model whose optimizer state dwarfs
        # its activations, units of the whole budget would round away the differences.
        self.budget = (budget_bytes - chain.resident_bytes) // mem_unit
        self._memo: dict[tuple, tuple[float, tuple]] = {}

    def suffix(
        self, k: int, b: int, region: bool, ms: int, mb: int, ihs: bool, ihb: bool, first: bool = False
    ) -> tuple[float, tuple]:
        """``suffix[k][b][region][ms][mb][ihs][ihb]`` (module docstring); ``first``: k starts
        the frame, so a child region may not span all of it (that would only repeat it)."""
        key = (k, b, region, ms, mb, ihs, ihb, first)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._suffix(*key)
        return found

    def _suffix(
        self, k: int, b: int, region: bool, ms: int, mb: int, ihs: bool, ihb: bool, first: bool
    ) -> tuple[float, tuple]:
        if k > b:
            return 0.0, ()
        best: tuple[float, tuple] = (INF, ())
        ctx = self._ctx(b, region)
        budget = self.budget
        # Skips live while this frame runs forward: a recomputation runs during backward, where
        # everything made up to the frame's end may be live with its gradient (solvers.chain).
        skips = self.skip_bwd[b] if region else 0
        skip_fwd = self.skip_fwd if not region else None
        # Option 1: stage k runs directly and keeps what it saves until its backward.
        alloc = self.f_stop[k] if region and k == b else self.f_all[k]
        held_in_s = self._in(k) if not ihs else 0
        sweep = ms + ctx + held_in_s + alloc + (skip_fwd[k] if skip_fwd else skips)
        hs = self.H[k] + (self.X[k] if self.so[k] else 0) + (held_in_s if self.si[k] else 0)
        hb = self.H[k] + (self.X[k] if self.so[k] else 0) + (self._in(k) if self.si[k] and not ihb else 0)
        backward = mb + hb + self._grad_in(k) + self.params_after[k + 1] + self.b_extra[k] + self.skip_bwd[k]
        if sweep <= budget and backward <= budget:
            rest, plan = self.suffix(k + 1, b, region, ms + hs, mb + hb, self.so[k], self.so[k])
            total = (self.cost[k] if region else 0.0) + rest
            if total < best[0]:
                best = (total, (("stage", k), *plan))
        # Option 2: a child region [k, d] holds only its input and recomputes itself later.
        rin_s = self._in(k) if not ihs else 0
        rin_b = self._in(k) if not ihb else 0
        # Children that end before the frame does run forward inside it; in a region's recompute,
        # a child ending with it is where early stop ends the recompute, so its forward is skipped.
        last_run = min(b - 1 if region else b, self.chain.last_region_stage(k))
        peak_none = 0
        for d in range(k, last_run + 1):
            peak_none = max(peak_none, (self.X[d - 1] if d > k else 0) + self.f_none[d]
                            + (skip_fwd[d] if skip_fwd else skips))
            if ms + ctx + rin_s + peak_none > budget:
                break  # a longer child's forward only needs more
            sweep_cost = self.prefix_cost[d + 1] - self.prefix_cost[k] if region else 0.0
            best = self._with_child(best, k, d, b, region, ms, mb, rin_s, rin_b, ihb, sweep_cost)
        if region and not first and b <= self.chain.last_region_stage(k) and ms + ctx + rin_s + skips <= budget:
            best = self._with_child(best, k, b, b, region, ms, mb, rin_s, rin_b, ihb, 0.0)
        return best

    def _with_child(
        self, best: tuple[float, tuple], k: int, d: int, b: int, region: bool, ms: int, mb: int,
        rin_s: int, rin_b: int, ihb: bool, sweep_cost: float,
    ) -> tuple[float, tuple]:
        """``best`` or, if cheaper, child region [k, d] followed by the rest of the frame."""
        rest, plan = self.suffix(d + 1, b, region, ms + rin_s, mb + rin_b, False, False)
        if rest == INF:
            return best
        child, inner = self.frame(k, d, not region, mb, rin_b, ihb)
        total = sweep_cost + rest + child + self.chain.machinery_cost(k, d)
        if total < best[0]:
            return total, (("region", k, d, inner), *plan)
        return best

    def frame(self, k: int, d: int, top_level: bool, mb: int, rin: int, ih: bool) -> tuple[float, tuple]:
        """``frame[k][d][top][mb][ih]``: region [k, d]'s recompute and backward while its parent
        holds ``mb`` units; ``rin`` units are its input if nothing else holds it."""
        return self.suffix(k, d, True, mb + rin, mb + (rin if top_level else 0), True, top_level or ih, True)

    def solve(self) -> tuple[float, tuple]:
        if self.L == 0:
            return 0.0, ()
        if self.budget < 0:
            return INF, ()
        return self.suffix(0, self.L - 1, False, 0, 0, True, True)


def regions_from_items(chain: Chain, items: tuple) -> tuple[Region, ...]:
    """Turn the DP's item choices into ``Region``s over node indices."""
    regions = []
    for item in items:
        if item[0] == "region":
            _, k, d, inner = item
            start, _ = chain.span(k)
            _, end = chain.span(d)
            regions.append(Region(start, end, children=regions_from_items(chain, inner)))
    return tuple(regions)


def solve_chain(chain: Chain, budget_bytes: int, mem_unit: int) -> tuple[float, tuple[Region, ...]]:
    """Least-cost nested regions for ``chain`` within ``budget_bytes`` (``INF`` if none)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * len(chain) + 1000))  # the DP recurses once per stage
    try:
        cost, items = ChainDP(chain, budget_bytes, mem_unit).solve()
    finally:
        sys.setrecursionlimit(limit)
    return cost, regions_from_items(chain, items) if cost < INF else ()


@dataclass(frozen=True)
class _Found:
    """A plan the DP found on one chain, confirmed by ``simulate``."""

    regions: tuple[Region, ...]
    report: Report
    curve: CostCurve
    repaired: int = 0
    least_search: bool = False


def candidate_chains(graph: ComputeGraph) -> list[Chain]:
    """The distinct stage chains of ``tuning.CHAIN_SKIP_SHARES``, clean cuts first (one on a pure
    chain), then, on a graph with skips, the chain cut where the segments of ``sqrt``'s
    least-peak plan start and end: Chen's greedy places its cuts by the bytes that cross them,
    which the fixed shares of ``tuning.CHAIN_SKIP_SHARES`` cannot. None depends on the budget, so the best of them costs
    no less at a lower budget."""
    chains: dict[tuple[int, ...], Chain] = {}
    for share in tuning.CHAIN_SKIP_SHARES:
        starts = stage_starts(graph, skip_share=share)
        if tuple(starts) not in chains:
            chains[tuple(starts)] = build_chain(graph, starts)
    if len(chains) > 1:
        starts = _segment_cuts(graph)
        if starts and tuple(starts) not in chains:
            chains[tuple(starts)] = build_chain(graph, starts)
    return list(chains.values())


def _segment_cuts(graph: ComputeGraph) -> list[int]:
    """Stage starts at the region edges of ``sqrt``'s least-peak plan (empty if it has none)."""
    try:
        plan = solve_sqrt(graph, graph.static.resident_bytes)
    except InfeasibleBudgetError as error:
        plan = solve_sqrt(graph, error.min_peak_bytes)
    edges = {0}
    for region in plan.regions:
        edges.update((region.start, region.end))
    return sorted(edge for edge in edges if edge < len(graph.nodes)) if len(edges) > 1 else []


def chain_curve(graph: ComputeGraph, chain: Chain, mem_unit: int | None = None) -> CostCurve:
    """``chain``'s cost at every budget up to the no-checkpoint peak, at ``mem_unit`` (default:
    that range above resident memory over ``tuning.DEFAULT_MEM_UNITS``, rounded up; never finer than
    ``tuning.MAX_MEM_UNITS`` units over it, since the tables hold one entry per unit)."""
    span = max(1, baseline_peak_bytes(graph) - chain.resident_bytes)
    unit = max(mem_unit or -(-span // tuning.DEFAULT_MEM_UNITS), -(-span // tuning.MAX_MEM_UNITS), 1)
    return cost_curve(chain, baseline_peak_bytes(graph), unit)


def solve_dp(
    graph: ComputeGraph,
    budget_bytes: int,
    ctx: SolveContext | None = None,
    *,
    mem_unit: int | None = None,
) -> Solution:
    """Optimal nested checkpoint regions for ``graph``'s stage chain within ``budget_bytes``.

    ``mem_unit``: bytes per DP memory unit. Default: the range from resident memory to the
    no-checkpoint peak over ``tuning.DEFAULT_MEM_UNITS`` (exact bytes when the range is smaller); at
    most ``tuning.MAX_MEM_UNITS`` units over that range, whatever is asked. Every
    quantity is rounded up to units, so coarser units solve faster but may miss plans that fit
    within one unit per held item of the budget; the plan is optimal at its unit. One pass of
    the DP answers every budget (``solvers.dp_curve``).

    On a graph with skips, each of ``candidate_chains`` is solved and the cheapest plan wins
    (under ``ctx``'s limit, at most ``tuning.CHAIN_SECONDS_PER_NODE`` per node for each chain tried
    after the first). On a chain of one-node
    stages the DP's memory model is the simulator's, so the plan is optimal. Merged stages are
    modelled conservatively in most respects, but not all (a merged stage's internal gradient
    accumulation, for one); every plan is checked with ``simulate``, and if one overshoots, the
    plan at the budget lowered by the overshoot is taken instead and reported as ``feasible``
    rather than ``optimal``.

    Each chain's plan at its least budget is simulated too and competes when it fits (the
    model overstates merged stages, so it may fit where the curve says nothing does); below
    every such plan ``InfeasibleBudgetError`` names the least of their simulated peaks, a budget
    at which this solver does return a plan.

    The chains, their curves and least-peak plans do not depend on the budget: they are kept
    with the graph (``solvers.memo``), so later solves of it are a lookup and a simulated plan.
    """
    if budget_bytes >= baseline_peak_bytes(graph):  # storing everything is free and fits
        return solution(graph, (), "dp", status="optimal", gap=0.0, note="the budget holds the step without checkpointing")
    memo = graph_memo(graph, "dp", lambda: _GraphCurves(candidate_chains(graph)))
    chains = memo.chains
    curves: list[CostCurve] = []
    best: _Found | None = None
    lowest: _Found | None = None  # the least-peak plan of the chains tried
    limit = math.inf if ctx is None else ctx.limit
    most_chains = len(chains) if math.isinf(limit) else max(
        1, math.floor(limit / (tuning.CHAIN_SECONDS_PER_NODE * max(1, len(graph.nodes))))
    )
    for index in range(len(chains)):
        if best is not None and index >= most_chains:
            break
        curve, least = memo.curve(graph, index, mem_unit)
        curves.append(curve)
        if least is not None and (lowest is None or least.report.peak_bytes < lowest.report.peak_bytes):
            lowest = least
        # The chain's model is conservative on merged stages: its least-peak plan may fit a
        # budget the curve rejects, and cost less than the curve's plan there.
        for found in (_checked(graph, curves[-1], budget_bytes), least):
            if found is None or found.report.peak_bytes > budget_bytes:
                continue
            if best is None or found.report.cost_seconds < best.report.cost_seconds:
                best = found
    if best is None:
        least_bytes = baseline_peak_bytes(graph) if lowest is None else lowest.report.peak_bytes
        least_plan = None if lowest is None else solution(
            graph, lowest.regions, "dp", note="the stage chain's least-peak plan", report=lowest.report)
        raise InfeasibleBudgetError(
            f"Budget {describe_bytes(budget_bytes)} is below the least peak the dp solver reaches, "
            f"{describe_bytes(least_bytes)}; raise the budget.",
            budget_bytes=budget_bytes,
            min_peak_bytes=least_bytes,
            least_plan=least_plan,
        )
    chain = best.curve.chain
    note = f"{len(chain)} stages over {len(graph.nodes)} nodes, memory unit {best.curve.unit} byte(s)"
    if len(chain) < len(graph.nodes):
        note += "; nodes merged into stages (skip connections or the stage limit): optimal for that stage chain"
    if len(chains) > 1:
        note += f"; best of {len(curves)} stage chains"
    if best.repaired:
        note += f"; re-solved {best.repaired} time(s) below the budget where merged stages were underestimated"
    if best.least_search:
        note += "; the stage chain's least-peak plan (its model of merged stages overstates their memory)"
    exact = not best.repaired and not best.least_search
    return solution(graph, best.regions, "dp", status="optimal" if exact else "feasible", gap=0.0 if exact else None,
                    note=note, report=best.report)


@dataclass
class _GraphCurves:
    """What ``solve_dp`` computes for a graph whatever the budget: its candidate stage chains,
    and per (chain index, ``mem_unit``) the chain's cost curve and least-peak plan."""

    chains: list[Chain]
    curves: dict[tuple[int, int | None], tuple[CostCurve, _Found | None]] = field(default_factory=dict)

    def curve(self, graph: ComputeGraph, index: int, mem_unit: int | None) -> tuple[CostCurve, _Found | None]:
        key = (index, mem_unit)
        if key not in self.curves:
            curve = chain_curve(graph, self.chains[index], mem_unit)
            self.curves[key] = (curve, _least(graph, curve))
        return self.curves[key]


def _checked(graph: ComputeGraph, curve: CostCurve, budget_bytes: int) -> _Found | None:
    """The curve's plan at the budget, or (at most ``tuning.DP_MAX_REPAIRS`` times) at the budget lowered
    by what ``simulate`` says the last one overshot, until one fits."""
    target = budget_bytes
    for repaired in range(tuning.DP_MAX_REPAIRS + 1):
        if curve.cost(target) == INF:
            return None
        regions = curve.regions(target)
        report = simulate(graph, regions)
        overshoot = report.peak_bytes - budget_bytes
        if overshoot <= 0:
            return _Found(regions, report, curve, repaired)
        log.info("dp plan overshoots by %d bytes on merged stages; taking the plan at a lower budget", overshoot)
        target -= overshoot + curve.unit
    return None


def _least(graph: ComputeGraph, curve: CostCurve) -> _Found | None:
    """The plan at the least budget the curve accepts, with its simulated peak."""
    units = curve.least_units()
    if units is None:
        return None
    regions = curve.regions(curve.chain.resident_bytes + units * curve.unit)
    return _Found(regions, simulate(graph, regions), curve, least_search=True)
