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

Solve time is O(L² · L · U) in the worst case for L stages and U memory units, memoised on the
states actually reached.
"""

from __future__ import annotations

import logging
import math
import sys
import time

from ckptplan.build import solver_plan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Plan, Region, SolverInfo
from ckptplan.simulation import simulate
from ckptplan.solvers.chain import Chain, build_chain
from ckptplan.solvers.registry import register
from ckptplan.units import describe_bytes

log = logging.getLogger(__name__)

INF = math.inf
DEFAULT_MEM_UNITS = 500  # memory resolution for long chains: the budget is split into this many units
LEAST_PEAK_STEPS = 12  # bisection steps when reporting the least reachable peak
EXACT_STAGE_LIMIT = 24  # chains up to this many stages are solved in exact bytes (fast enough, no rounding)


class ChainDP:
    """The DP over one chain at one budget. ``solve()`` returns (cost, top-level item choices)."""

    def __init__(self, chain: Chain, budget_bytes: int, mem_unit: int) -> None:
        self.chain = chain
        self.unit = mem_unit
        # Resident bytes are held at every step, so they come off the budget exactly (in bytes)
        # and the units resolve only what plans change: on a model whose optimizer state dwarfs
        # its activations, units of the whole budget would round away the differences.
        self.budget = (budget_bytes - chain.resident_bytes) // mem_unit
        up = self._units
        L = len(chain)
        self.L = L
        self.X = [up(b) for b in chain.out_bytes]
        self.H = [up(b) for b in chain.hidden_bytes]
        self.si = chain.saves_input
        self.so = chain.saves_output
        self.f_all = [up(b) for b in chain.fwd_all_bytes]
        self.f_none = [up(b) for b in chain.fwd_none_bytes]
        self.f_stop = [up(b) for b in chain.fwd_stop_bytes]
        self.b_extra = [up(b) for b in chain.bwd_extra_bytes]
        self.cost = chain.cost
        # params_after[k]: parameter gradients already allocated when stage k's backward starts
        self.params_after = [0] * (L + 1)
        for k in reversed(range(L)):
            self.params_after[k] = self.params_after[k + 1] + up(chain.param_grad_bytes[k])
        self.prefix_cost = [0.0]
        for c in chain.cost:
            self.prefix_cost.append(self.prefix_cost[-1] + c)
        self._memo: dict[tuple, tuple[float, tuple]] = {}

    def _units(self, n_bytes: int) -> int:
        return -(-int(n_bytes) // self.unit)

    def _in(self, k: int) -> int:
        """Units of stage k's input (the graph input, before stage 0, is resident)."""
        return self.X[k - 1] if k > 0 else 0

    def _grad_in(self, k: int) -> int:
        """Units of the gradient stage k receives (the loss's is a scalar seed)."""
        return self.X[k] if k < self.L - 1 else 0

    def _ctx(self, b: int, region: bool) -> int:
        """Held by gradients while a frame ending at b runs forward: the gradient of its output
        and every parameter gradient after it (none during the original forward)."""
        return self._grad_in(b) + self.params_after[b + 1] if region else 0

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
        # Option 1: stage k runs directly and keeps what it saves until its backward.
        alloc = self.f_stop[k] if region and k == b else self.f_all[k]
        held_in_s = self._in(k) if not ihs else 0
        sweep = ms + ctx + held_in_s + alloc
        hs = self.H[k] + (self.X[k] if self.so[k] else 0) + (held_in_s if self.si[k] else 0)
        hb = self.H[k] + (self.X[k] if self.so[k] else 0) + (self._in(k) if self.si[k] and not ihb else 0)
        backward = mb + hb + self._grad_in(k) + self.params_after[k + 1] + self.b_extra[k]
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
        last_run = b - 1 if region else b
        peak_none = 0
        for d in range(k, last_run + 1):
            peak_none = max(peak_none, (self.X[d - 1] if d > k else 0) + self.f_none[d])
            if ms + ctx + rin_s + peak_none > budget:
                break  # a longer child's forward only needs more
            sweep_cost = self.prefix_cost[d + 1] - self.prefix_cost[k] if region else 0.0
            best = self._with_child(best, k, d, b, region, ms, mb, rin_s, rin_b, ihb, sweep_cost)
        if region and not first and ms + ctx + rin_s <= budget:
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
        total = sweep_cost + rest + child
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


@register("dp")
def solve_dp(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    time_limit: float | None = None,
    mem_unit: int | None = None,
) -> Plan:
    """Optimal nested checkpoint regions for ``graph``'s stage chain within ``budget_bytes``.

    ``mem_unit``: bytes per DP memory unit. Default: exact bytes for chains of up to
    ``EXACT_STAGE_LIMIT`` stages, else the budget above resident memory over
    ``DEFAULT_MEM_UNITS``, rounded up. Every
    quantity is rounded up to units, so coarser units solve faster but may miss plans that fit
    within one unit per held item of the budget; the plan is optimal at its unit.

    On a chain of one-node stages the DP's memory model is the simulator's, so the plan is
    optimal. Merged stages are modelled conservatively in most respects, but not all (a merged
    stage's internal gradient accumulation, for one); every plan is checked with ``simulate``,
    and if one overshoots, the DP is rerun with the budget lowered by the overshoot and the plan
    is reported as ``feasible`` rather than ``optimal``.
    """
    started = time.perf_counter()
    chain = build_chain(graph)
    if budget_bytes >= graph.baseline_peak_bytes:  # storing everything is free and fits
        return solver_plan(
            graph,
            (),
            budget_bytes,
            SolverInfo(name="dp", status="optimal", seconds=time.perf_counter() - started, gap=0.0,
                              note="the budget holds the step without checkpointing"),
        )
    target, repaired = budget_bytes, 0
    while True:
        cost, regions, unit = _solve_refining(chain, target, mem_unit, started, time_limit)
        if cost == INF:
            least = _least_peak(graph, chain, unit)
            raise InfeasibleBudgetError(
                f"Budget {describe_bytes(budget_bytes)} is below the least peak the dp solver reaches, "
                f"{describe_bytes(least)}; raise the budget.",
                budget_bytes=budget_bytes,
                min_peak_bytes=max(least, budget_bytes + 1),
            )
        report = simulate(graph, regions)
        overshoot = report.peak_bytes - budget_bytes
        if overshoot <= 0:
            break
        repaired += 1
        log.info("dp plan overshoots by %d bytes on merged stages; re-solving with a lower budget", overshoot)
        target -= overshoot + unit
    note = f"{len(chain)} stages over {len(graph.nodes)} nodes, memory unit {unit} byte(s)"
    if len(chain) < len(graph.nodes):
        note += "; nodes merged into stages (skip connections or the stage limit): optimal for that stage chain"
    if repaired:
        note += f"; re-solved {repaired} time(s) below the budget where merged stages were underestimated"
    return solver_plan(
        graph,
        regions,
        budget_bytes,
        SolverInfo(
            name="dp",
            status="feasible" if repaired else "optimal",
            seconds=time.perf_counter() - started,
            gap=None if repaired else 0.0,
            note=note,
        ),
        report=report,
    )


def _solve_refining(
    chain: Chain, budget_bytes: int, mem_unit: int | None, started: float, time_limit: float | None
) -> tuple[float, tuple[Region, ...], int]:
    """Solve at ``mem_unit`` (default: the budget above resident memory over ``DEFAULT_MEM_UNITS``); when that finds
    nothing, rounding may be what excludes the plans near the budget, so refine the unit
    eightfold down to exact bytes while time allows."""
    if mem_unit is not None:
        unit = mem_unit
    elif len(chain) <= EXACT_STAGE_LIMIT:
        unit = 1
    else:
        unit = max(1, -(-(budget_bytes - chain.resident_bytes) // DEFAULT_MEM_UNITS))
    while True:
        cost, regions = solve_chain(chain, budget_bytes, unit)
        out_of_time = time_limit is not None and time.perf_counter() - started > time_limit
        if cost < INF or unit == 1 or mem_unit is not None or out_of_time:
            return cost, regions, unit
        unit = max(1, unit // 8)


def _least_peak(graph: ComputeGraph, chain: Chain, unit: int) -> int:
    """Smallest budget at which the DP finds a plan, by bisection to one unit or 1/2^LEAST_PEAK_STEPS
    of the range, whichever is coarser (exact on short chains, where units are bytes)."""
    lo, hi = graph.static.resident_bytes, max(graph.baseline_peak_bytes, graph.static.resident_bytes + unit)
    if solve_chain(chain, hi, unit)[0] == INF:
        return hi
    precision = max(unit, (hi - lo) >> LEAST_PEAK_STEPS)
    while hi - lo > precision:
        mid = (lo + hi) // 2
        if solve_chain(chain, mid, unit)[0] < INF:
            hi = mid
        else:
            lo = mid
    return hi
