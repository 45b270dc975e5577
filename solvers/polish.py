"""The last phase of ``auto`` on graphs of up to ``tuning.POLISH_MAX_NODES`` nodes: CP-SAT's portfolio from the
cheapest plans the reproducible phases made, until the solve's deadline.

The reproducible phases (``sqrt``, ``dp``, ``ilp``'s block policies and its one-worker search on
CP-SAT's deterministic clock, on the model's graph and on the graph with cheap ops
rematerialised: ``remat_plans.with_remat``) are sized from the limit asked for, so the same
limit gives them the same plans, and at short limits they end early: ``ilp`` skips its search
when its share cannot pay for building the model twice. They get ``1 - tuning.POLISH_SHARE`` of the limit;
this phase takes the rest, with the time they leave unused. From their plans the portfolio's
LP-based and neighbourhood workers find and often prove the optimum of the whole model within
seconds, where the one worker sweeps it a window at a time (docs/tuning.md, "polish"). It
searches plans of short regions first (``tuning.POLISH_WINDOWS``), whose model is smaller, and widens the
regions to ``ilp``'s own window as each stage proves its plan. A start with regions longer than
the first stage allows is cut into shorter ones where the cut plan still fits (``split_start``),
so that the stage can take it as its hint.
The portfolio is not deterministic: its plan can differ from run to run, is taken only when it
costs strictly less than its start, and costs the same on every run that proves it optimal.

On graphs of up to ``tuning.JOINT_PORTFOLIO_MAX_NODES`` nodes the search is of the joint
model (``joint``): each cheap op's rematerialisation (``ckptplan.remat``) is a decision beside
the regions, so one search weighs a region against dropping and recomputing an op's output
(where most nodes are candidates, after a shorter search of regions alone:
``tuning.ALONE_FIRST_DENSITY``).
On larger ones the joint search starts from the cheaper of the plain plan and the rematerialised
graph's (``remat_plans.with_remat``); where that start has regions too long for a hint
(``hints``), a search of regions alone comes first, on the graph the start was solved on: a plan
of the rematerialised graph is searched on that graph, and its regions then rematerialise on the
model's graph what they need (``remat_plans.shed_remat``)."""

from __future__ import annotations

import math
from collections.abc import Callable

from ckptplan import remat as _remat
from ckptplan.errors import PlanFormatError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp_model import region_window
from ckptplan.solvers.solution import Solution

CHOSE = "auto chose ilp: "  # how the notes of this phase's plans begin: it is ``auto``'s, and they are ``ilp``'s


def polishes(graph: ComputeGraph, solver: str, limit: float) -> bool:
    """Whether a solve by ``solver`` with ``limit`` seconds ends with this phase on ``graph``:
    ``auto`` on graphs of at most ``tuning.POLISH_MAX_NODES`` nodes, with a finite limit whose
    ``tuning.POLISH_SHARE`` is at least ``tuning.POLISH_MIN_SECONDS``."""
    return (solver == "auto" and len(graph.nodes) <= tuning.POLISH_MAX_NODES and math.isfinite(limit)
            and limit * tuning.POLISH_SHARE >= tuning.POLISH_MIN_SECONDS)


def windows(graph: ComputeGraph) -> list[int]:
    """The longest regions, in nodes, each stage of the search allows: ``tuning.POLISH_WINDOWS`` below
    ``ilp``'s own window on ``graph`` (``ilp_model.region_window``), then that window. The model
    of shorter regions is smaller, and the portfolio finds cheap plans in it sooner
    (docs/tuning.md, "polish")."""
    full = region_window(graph, None)
    return [window for window in tuning.POLISH_WINDOWS if window < full] + [full]


def hints(graph: ComputeGraph, plan: Solution) -> bool:
    """Whether the first stage of the search on ``graph`` takes ``plan``'s regions as CP-SAT's
    hint as they are: one level, none longer than the first of ``windows``. ``polish`` cuts longer
    ones where a cut fits (``split_start``); from a plan it can neither hint nor cut, each round
    of the search starts from no plan (``ilp_lazy.search_lazily``)."""
    return all(not region.children for region in plan.regions) and _within(plan.regions, windows(graph)[0])


def _within(regions: tuple[Region, ...], window: int) -> bool:
    """Whether no region of ``regions`` spans more than ``window`` nodes."""
    return all(region.end - region.start <= window for region in regions)


def polish(
    graph: ComputeGraph,
    budget_bytes: int,
    best: Solution,
    ctx: SolveContext,
    *,
    solved_on: ComputeGraph | None = None,
    onto: Callable[[Solution], Solution] | None = None,
    joint: bool = False,
) -> Solution:
    """The portfolio search (``ilp_flat.proof_phase``) from ``best`` (its regions when they are
    one level, cut to the first stage's window where a cut fits: ``split_start``; else from
    nothing) until ``ctx``'s deadline, first among plans of regions no
    longer than the first of ``windows``, then, each time a stage proves its plan the cheapest
    there, the next; ``best`` unless it finds a plan that fits ``budget_bytes`` and costs
    strictly less, or the last stage (``ilp``'s own window) proves ``best`` optimal among
    ``ilp``'s one-level plans (then ``best`` says so, as ``ilp``'s, its regions' origin kept).
    ``solved_on``: the graph ``best``'s regions were solved on (None: ``graph``), whose plans
    ``onto`` makes plans of ``graph`` (rematerialising what they need). ``joint``: the model
    decides rematerialisation beside the regions (``ckptplan.remat.candidates``; ``graph``'s own
    plans only), and starts from ``best``'s. Ctrl-C ends the search
    with the best plan so far (``ctx.cancel`` set)."""
    if ctx.over() or ctx.left() < tuning.POLISH_MIN_SECONDS or best.cost_seconds <= 0:
        return best
    try:
        return _polish(graph, budget_bytes, best, ctx, solved_on=solved_on, onto=onto, joint=joint)
    except KeyboardInterrupt:  # outside CP-SAT's search, which takes Ctrl-C itself
        ctx.cancel.set()
        return best


def _polish(
    graph: ComputeGraph,
    budget_bytes: int,
    best: Solution,
    ctx: SolveContext,
    *,
    solved_on: ComputeGraph | None,
    onto: Callable[[Solution], Solution] | None,
    joint: bool,
) -> Solution:
    from ckptplan.solvers.ilp_flat import proof_phase  # imports ortools
    from ckptplan.solvers.ilp_lazy import search_workers

    own = solved_on is None
    joint = joint and own
    searched = graph if own else solved_on
    one_level = all(not region.children for region in best.regions) and (joint or not (own and best.remat))
    start = best.regions if one_level else None
    start_remat = best.remat if one_level and joint else ()
    candidates = _remat.candidates(graph) if joint else ()
    phase = ctx if own else ctx.unscored()
    phase.report("portfolio search" + ("" if own else " with cheap ops rematerialised")
                 + (" of regions and rematerialisation" if joint else ""))
    stages = windows(searched)
    regions, remat = start, start_remat
    if start is not None and not _within(start, stages[0]):  # the stages' hint: the start cut to fit
        cutting = phase.within(ctx.left() * tuning.SPLIT_START_SHARE)
        regions = split_start(searched, budget_bytes, start, start_remat, stages[0], cutting) or start
    for window in stages:
        # Each stage's bound holds for its window only (announce=False: none is reported as the solve's).
        # The joint search from a plan the model takes as a hint states more rows at a time:
        # each round that ends on a broken row pays the presolve again (docs/tuning.md, "polish").
        hinted = regions is not None and _within(regions, window)
        rows = tuning.POLISH_JOINT_ROWS if joint and hinted else None
        found, regions = proof_phase(searched, budget_bytes, regions, phase, seconds=ctx.left(), seed=0,
                                     window=window, bound=0.0, announce=False, remat=candidates, start_remat=remat,
                                     rows=rows, light_presolve=joint, workers=search_workers())
        remat = found.remat
        if found.status != "OPTIMAL" or ctx.left() < tuning.POLISH_MIN_SECONDS:
            break
    proven = found.status == "OPTIMAL" and window == stages[-1]  # over ``ilp``'s plans, not a narrower window's
    shorter = "" if window == stages[-1] else f"regions of at most {window} nodes, "
    portfolio = f"CP-SAT's portfolio for the time left ({shorter}{found.describe()})"
    if regions is None or (regions == start and remat == start_remat):
        if proven and start is not None and own:  # proven by the model of ``ilp``'s plans
            return best.but(solver="ilp", status="optimal", gap=0.0, origin=best.origin or best.solver,
                            note=f"{CHOSE}the {best.solver} plan ({_own(best)}), proven optimal by {portfolio}")
        return best
    bare = Solution(regions=regions, report=best.report, solver="ilp", skipped=best.skipped)
    plan = bare.resimulated(graph, regions, remat) if own or onto is None else onto(bare)
    if plan.peak_bytes > budget_bytes or plan.cost_seconds >= best.cost_seconds:
        return best
    proven = proven and own
    where = (" and rematerialisation chosen together" if joint else "") if own else " on the graph with cheap ops rematerialised"
    note = (f"{CHOSE}one-level regions with keep-sets{where}, from the {best.solver} plan costing "
            f"{best.cost_seconds * 1e3:.3g} ms, then {portfolio}" + (f"; {plan.note}" if plan.note else ""))
    ctx.report(cost_seconds=plan.cost_seconds, peak_bytes=plan.peak_bytes)
    return plan.but(solver="ilp", status="optimal" if proven else "feasible", gap=0.0 if proven else None,
                    note=note, origin=None)


def split_start(
    graph: ComputeGraph, budget_bytes: int, regions: tuple[Region, ...], remat: tuple[str, ...], window: int,
    ctx: SolveContext,
) -> tuple[Region, ...] | None:
    """``regions`` with each region longer than ``window`` nodes cut at boundaries into regions
    no longer (each keeping the nodes of its part of the keep-set), where the plan still fits
    ``budget_bytes``: a plan the first stage can hint. The longest region is cut first, in two
    where both halves fit the window (else its first part at most ``window`` long), at the cut
    whose plan fits and costs least (then peaks least); None where a region has no cut that
    fits, or once ``ctx``'s deadline passes (each cut tried is a simulation of the graph). A cut
    holds the tensors crossing it and recomputes less at a time, so it can raise the peak or
    lower it (docs/tuning.md, "polish")."""
    cuts = sorted(graph.boundaries)
    index = graph.index_of
    plan = list(regions)
    while True:
        long = [region for region in plan if region.end - region.start > window]
        if not long:
            return tuple(plan)
        region = max(long, key=lambda region: (region.end - region.start, -region.start))
        halves = region.end - region.start <= 2 * window
        rest = [other for other in plan if other is not region]
        cheapest: tuple[tuple[float, int], list[Region]] | None = None
        for cut in cuts:
            if not region.start < cut < region.end or cut - region.start > window:
                continue
            if halves and region.end - cut > window:
                continue
            if ctx.over():
                return None
            left = tuple(name for name in region.keep if index[name] < cut)
            right = tuple(name for name in region.keep if index[name] >= cut)
            tried = sorted([*rest, Region(region.start, cut, left), Region(cut, region.end, right)],
                           key=lambda other: other.start)
            try:
                report = simulate(graph, tuple(tried), remat=remat)
            except PlanFormatError:  # a rematerialisation the cut leaves no saver to recompute it
                continue
            score = (report.cost_seconds, report.peak_bytes)
            if report.peak_bytes <= budget_bytes and (cheapest is None or score < cheapest[0]):
                cheapest = (score, tried)
        if cheapest is None:
            return None
        plan = cheapest[1]


def _own(best: Solution) -> str:
    """``best``'s note without the ``"auto chose <solver>: "`` that ``solve_auto`` and
    ``remat_plans.with_remat`` put first."""
    return best.note.removeprefix(f"auto chose {best.solver}: ")
