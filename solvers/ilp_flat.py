"""``ilp`` on the whole graph as one CP-SAT model: where the search starts (the warm plans of
``sqrt`` and ``dp``, refined), the reproducible search (the lazy search, then ``improve_locally``,
a large-neighbourhood search), the proof phase, and the least peak one-level plans reach. Its
phases are sized by ``tuning``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from ortools.sat.python import cp_model

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.cpsat import configure, extract_regions, fix_plan, hint_complete, solve_interruptibly
from ckptplan.solvers.ilp_lazy import DEFERRED_PHASES, LazyResult, proof_search, search_lazily
from ckptplan.solvers.ilp_model import COST_SCALE, IlpVars, build_model, region_window
from ckptplan.solvers.refine import Moves, add_keeps, shed_keeps, simplify
from ckptplan.solvers.registry import get_solver
from ckptplan.solvers.solution import Solution, run_kernel, solution
from ckptplan.solvers.sqrt import least_peak_regions
from ckptplan.units import describe_bytes

log = logging.getLogger(__name__)

WARM_SOLVERS = ("dp", "sqrt")  # whose plans the search starts from
HIERARCHICAL = "block by block"  # how notes name the hierarchical mode


def improve_locally(
    model: cp_model.CpModel,
    graph: ComputeGraph,
    v: IlpVars,
    regions: tuple[Region, ...],
    budget_bytes: int,
    ctx: SolveContext,
    *,
    deterministic_seconds: float,
    seed: int,
) -> tuple[Region, ...]:
    """Large-neighbourhood search from ``regions``: free the decisions of ``tuning.LNS_WINDOW`` nodes at a
    time (stepping by half a window), fix the rest to the incumbent, and keep any cheaper plan
    the simulator confirms; sweep until a sweep finds nothing or CP-SAT's deterministic clock has
    run ``deterministic_seconds`` in all (``ctx``'s deadline, wall clock, only backs that up). Each
    small solve runs to optimality or a deterministic limit, so the result is reproducible."""
    found = [regions]  # the incumbent, kept current so that Ctrl-C loses nothing
    try:
        _sweeps(model, graph, v, found, budget_bytes, ctx, clock=deterministic_seconds, seed=seed)
    except KeyboardInterrupt:  # Ctrl-C between two small solves (solve_interruptibly takes it during one)
        ctx.cancel.set()
    return simplify(graph, found[0], budget_bytes)


def _sweeps(
    model: cp_model.CpModel,
    graph: ComputeGraph,
    v: IlpVars,
    found: list[tuple[Region, ...]],
    budget_bytes: int,
    ctx: SolveContext,
    *,
    clock: float,
    seed: int,
) -> None:
    n = len(graph.nodes)
    best = found[0]
    best_cost = simulate(graph, best).cost_seconds
    improved = True
    while improved and clock > 0 and not ctx.over():
        improved = False
        for lo in range(0, max(1, n - tuning.LNS_WINDOW // 2), tuning.LNS_WINDOW // 2):
            if clock <= 0 or ctx.over():
                break
            sub = model.Clone()
            fix_plan(sub, graph, v, best, free=range(lo, lo + tuning.LNS_WINDOW))
            solver = cp_model.CpSolver()
            configure(solver, wall_seconds=ctx.left(),
                      deterministic_seconds=min(tuning.LNS_DETERMINISTIC_SECONDS, clock), workers=1, seed=seed)
            code = solve_interruptibly(solver, sub, ctx)
            clock -= solver.ResponseProto().deterministic_time
            if ctx.cancelled:
                return
            if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                continue
            candidate = extract_regions(graph, v, solver.Value)
            report = simulate(graph, candidate)
            if report.peak_bytes <= budget_bytes and report.cost_seconds < best_cost:
                best, best_cost, improved = candidate, report.cost_seconds, True
                found[0] = best


class LeastPeak(NamedTuple):
    """The least peak a search found, whether it is proven least, and the plan reaching it."""

    peak_bytes: int
    proven: bool
    regions: tuple[Region, ...]


def least_peak(
    graph: ComputeGraph,
    ctx: SolveContext,
    *,
    deterministic_seconds: float,
    workers: int,
    seed: int,
    window: int | None,
) -> LeastPeak:
    """The least peak one-level plans with keep-sets reach (``proven``), else the least the search
    found within ``ctx``, with the plan that reaches it (simulated). The search starts from
    ``sqrt``'s least-peak plan, so a short one still reports at least that; so does a ``ctx``
    whose limit cannot pay for building the model twice (``tuning.BUILD_SECONDS_PER_PAIR``), which
    skips the search."""
    start, start_peak = least_peak_regions(graph)
    if ctx.limit < 2 * tuning.BUILD_SECONDS_PER_PAIR * len(graph.nodes) * region_window(graph, window):
        return LeastPeak(start_peak, False, start)
    model, v = build_model(graph, None, window=window)
    model.Minimize(v.peak)
    hint_complete(model, graph, v, start, ctx)
    solver = cp_model.CpSolver()
    configure(solver, wall_seconds=ctx.left(), deterministic_seconds=deterministic_seconds, workers=workers, seed=seed)
    code = solve_interruptibly(solver, model, ctx)
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        regions = extract_regions(graph, v, solver.Value)
        peak = simulate(graph, regions).peak_bytes
        if peak <= start_peak:
            return LeastPeak(peak, code == cp_model.OPTIMAL, regions)
    return LeastPeak(start_peak, False, start)


def warm_solvers(graph: ComputeGraph) -> tuple[str, ...]:
    """The solvers whose plans ``solve_ilp`` starts from: not ``dp`` above ``tuning.FLAT_MAX_NODES``,
    where it is slow and coarse (see ``solvers.solve_auto``)."""
    return ("sqrt",) if len(graph.nodes) > tuning.FLAT_MAX_NODES else WARM_SOLVERS


def warm_plans(
    graph: ComputeGraph, budget_bytes: int, ctx: SolveContext, names: Sequence[str] = WARM_SOLVERS,
    *, errors: list[InfeasibleBudgetError] | None = None,
) -> list[Solution]:
    """The plans of the solvers ``names`` within ``budget_bytes``, leaving out those that find none
    (their errors go to ``errors`` when given). (``sqrt`` and ``dp`` plan no region across an
    FSDP unit edge, so these run as they are.)"""
    plans = []
    for name in names:
        try:
            plans.append(run_kernel(get_solver(name), graph, budget_bytes, ctx))
        except InfeasibleBudgetError as exc:
            if errors is not None:
                errors.append(exc)
    return plans


def _gap(optimal: bool, cost: float, bound: float) -> float:
    """The proven relative gap of a plan costing ``cost`` against the lower ``bound`` (both in
    ``COST_SCALE`` units): 0 when proven optimal or free."""
    return 0.0 if optimal or cost <= 0 else max(0.0, (cost - bound) / cost)


def solve_flat(
    graph: ComputeGraph,
    budget_bytes: int,
    ctx: SolveContext,
    *,
    search_seconds: float | None = None,
    workers: int = 1,
    seed: int = 0,
    window: int | None = None,
    warm: Sequence[Solution] | None = None,
    announce: bool = True,
    lazy: bool = True,
    proof_only: bool = False,
) -> Solution:
    """``solve_ilp`` on the whole graph as one CP-SAT model.

    ``search_seconds`` (default ``ctx.limit``) bounds the reproducible search
    (``ilp_lazy.search_lazily`` with ``workers``, then ``improve_locally``), and sets its
    deterministic clock; ``ctx``'s deadline can end that search sooner on the wall clock, and the
    proof phase (the same search with ``proof_workers()``) runs until it.
    With ``workers=1`` (the default) and a fixed ``seed`` the search is reproducible (see
    ``configure``); more workers usually find cheaper plans in the same time. Status:
    ``optimal`` (proven for this plan space), ``feasible`` with the proven relative gap, or
    ``timeout`` when the search found nothing better than the warm-start plan it returns.
    ``window`` bounds the nodes per region (see ``build_model``). ``warm``: plans to start from
    (default: those of ``WARM_SOLVERS``), returned instead when cheaper. ``lazy=False``: the
    reproducible search states every memory row up front (``solvers.blocks`` on small blocks
    and short clocks, where restarting after each broken row costs more than it saves); so does
    it when no warm plan is one-level and fits. ``proof_only``: no reproducible search, the proof
    phase starts from the refined warm plans at once and runs until ``ctx``'s deadline. When the
    reproducible search's time cannot pay for building the model twice
    (``tuning.BUILD_SECONDS_PER_PAIR``), there is no search: the refined warm plan comes back, or,
    when no warm plan is one-level, the cheapest warm plan (status ``timeout``).
    """
    limit = ctx.limit if search_seconds is None else search_seconds
    search = ctx.within(limit)  # the reproducible search ends by its deadline, less the proof's reserve
    if budget_bytes >= baseline_peak_bytes(graph):
        return solution(graph, (), "ilp", status="optimal", gap=0.0, note="the budget holds the step without checkpointing")
    warm = list(warm) if warm is not None else warm_plans(graph, budget_bytes, ctx)
    if not warm:
        warm = [_least_plan(graph, budget_bytes, ctx.promised(limit * tuning.LEAST_SHARE), workers=workers, seed=seed,
                            window=window)]
    refine_seconds = max(tuning.REFINE_MIN_SECONDS, limit * tuning.REFINE_SHARE)
    start = starting_plan(graph, warm, budget_bytes,
                          moves=Moves(int(refine_seconds / (tuning.SIMULATE_SECONDS_PER_NODE * len(graph.nodes)))))
    # Time kept for the proof phase, whose portfolio finds and proves optima the one worker does
    # not (docs/tuning.md, "ilp", ``MIN_PROOF_SECONDS``).
    reserve = tuning.PROOF_SHARE * limit if tuning.PROOF_SHARE * limit >= tuning.MIN_PROOF_SECONDS else 0.0
    clock = (limit - reserve) * tuning.DETERMINISTIC_SECONDS_PER_SECOND  # of the time asked for, not left: reproducible
    build_seconds = tuning.BUILD_SECONDS_PER_PAIR * len(graph.nodes) * region_window(graph, window)
    found = None
    short = not proof_only and limit - reserve < 2 * build_seconds  # no time to build the model twice
    if short:  # the refined warm plan, or, without a one-level one, the cheapest warm plan (below)
        status, regions, bound = "FEASIBLE" if start is not None else "UNKNOWN", start, 0.0
        how = (f"no CP-SAT search: too little time to build its model (about {build_seconds:.1f} s, twice), "
               + ("so the refined warm plan" if start is not None else "and no one-level warm plan"))
    elif proof_only and start is not None:
        ctx.report("ilp: proof phase")
        seconds = max(tuning.MIN_SEARCH_SECONDS, ctx.left())
        found, regions = proof_phase(graph, budget_bytes, start, ctx, seconds=seconds,
                                      seed=seed, window=window, bound=0.0, announce=announce)
        status, bound = found.status, found.bound
        blocks_note = next((f" ({p.note})" for p in warm if origin_of(p) == HIERARCHICAL), "")
        how = f"proof phase on the whole graph from the cheapest warm plan{blocks_note}: {found.describe()}"
    else:
        ctx.report("ilp: search")
        found, regions = _search(graph, budget_bytes, start, search.before(reserve), clock=clock,
                                 workers=workers, seed=seed, window=window, announce=announce, lazy=lazy,
                                 model_seconds=build_seconds)
        status, bound = found.status, found.bound
        how = f"search: {found.describe()}"
        left = ctx.left()
        if status == "FEASIBLE" and not ctx.cancelled and left >= tuning.MIN_PROOF_SECONDS:
            ctx.report("ilp: proof phase")
            proof, regions = proof_phase(graph, budget_bytes, regions, ctx, seconds=left, seed=seed, window=window,
                                          bound=bound, announce=announce)
            if proof.status == "OPTIMAL":
                status = "OPTIMAL"
            bound = max(bound, proof.bound)
            how += f"; proof phase: {proof.describe()}"
    size = f"{len(graph.nodes)} nodes"
    if found is not None:
        size += f", {found.variables} variables, {found.constraints} constraints"
    if region_window(graph, window) < len(graph.nodes):
        size += f", regions of at most {region_window(graph, window)} nodes"
    if regions is None:  # no one-level plan (proven, when a warm plan is nested), or none in time
        fallback = min(warm, key=lambda p: p.cost_seconds)
        if status == "INFEASIBLE":
            status, note = "feasible", f"no one-level plan fits ({size}); returning the {origin_of(fallback)} plan"
        else:
            why = how if short else f"no ilp plan within {limit:g} s ({size})"
            status, note = "timeout", f"{why}; returning the {origin_of(fallback)} plan"
        return fallback.but(solver="ilp", status=status, note=note, gap=None, origin=None)
    plan = solution(graph, regions, "ilp")
    better_warm = [p for p in warm if p.cost_seconds < plan.cost_seconds]
    if better_warm:
        # Only a nested dp plan can beat the optimum of the one-level space, or a stopped search.
        best = min(better_warm, key=lambda p: p.cost_seconds)
        note = f"the {origin_of(best)} plan is cheaper than the best one-level plan found ({size})"
        return best.but(solver="ilp", status="feasible", note=note, gap=None, origin=None)
    cost = plan.cost_seconds * COST_SCALE
    gap = _gap(status == "OPTIMAL", cost, bound)
    note = f"one-level regions with keep-sets, {size}; {how}"
    return plan.but(status="optimal" if status == "OPTIMAL" else "feasible", gap=gap, note=note)


def _least_plan(
    graph: ComputeGraph, budget_bytes: int, ctx: SolveContext, *, workers: int, seed: int, window: int | None
) -> Solution:
    """Where the search starts when no warm plan fits: the plan of least peak ``least_peak`` finds
    in ``ctx`` (on CP-SAT's deterministic clock, so the same on every run), when it fits; else
    ``InfeasibleBudgetError`` stating that plan's peak, which a solve at that budget reaches."""
    least = least_peak(graph, ctx, deterministic_seconds=ctx.limit * tuning.DETERMINISTIC_SECONDS_PER_SECOND,
                       workers=workers, seed=seed, window=window)
    plan = solution(graph, least.regions, "ilp", status="optimal" if least.proven else "feasible",
                    note="the least peak one-level plans with keep-sets reach" if least.proven else
                    "the least peak the search for it found")
    if least.peak_bytes <= budget_bytes:
        return plan
    reach = (
        f"the least peak one-level plans with keep-sets reach, {describe_bytes(least.peak_bytes)}" if least.proven
        else f"the least peak found for one-level plans with keep-sets in {ctx.limit:.3g} s, "
             f"{describe_bytes(least.peak_bytes)} (not proven least)"
    )
    raise InfeasibleBudgetError(
        f"Budget {describe_bytes(budget_bytes)} is below {reach}; raise the budget or try --solver dp (nested regions).",
        budget_bytes=budget_bytes, min_peak_bytes=least.peak_bytes, least_plan=plan,
    )


def proof_phase(
    graph: ComputeGraph,
    budget_bytes: int,
    regions: tuple[Region, ...] | None,
    ctx: SolveContext,
    *,
    seconds: float,
    seed: int,
    window: int | None,
    bound: float,
    announce: bool,
    remat: Sequence[int] = (),
    start_remat: tuple[str, ...] = (),
    rows: tuple[int, int | None] | None = None,
    light_presolve: bool = False,
    workers: int | None = None,
) -> tuple[LazyResult, tuple[Region, ...] | None]:
    """The lazy search with CP-SAT's portfolio (``workers``; None: ``proof_workers()``) from
    ``regions`` (None: from no plan) for ``seconds``: its result, and the plan it ends with
    (``regions`` unless it found a strictly cheaper one, which is simplified until
    ``tuning.SIMPLIFY_GRACE`` of ``seconds`` past them). ``remat`` (candidates) and
    ``start_remat``: the joint model's search (``ilp_lazy.search_lazily``); the plan it ends
    with rematerialises the result's ``remat``.
    ``rows``: the memory rows stated up front and added per round (``proof_search``'s
    ``seeded_rows`` and ``rows_per_round``; None: its defaults), and ``light_presolve``, as it
    takes them."""
    seeding = {} if rows is None else {"seeded_rows": rows[0], "rows_per_round": rows[1]}
    proof = proof_search(graph, budget_bytes, regions, ctx, seconds=seconds, seed=seed, window=window, bound=bound,
                         announce=announce, remat=remat, start_remat=start_remat, light_presolve=light_presolve,
                         workers=workers, **seeding)
    if proof.regions == regions and proof.remat == start_remat:
        return proof, regions
    return proof, simplify(graph, proof.regions, budget_bytes, ctx=ctx.within(seconds * (1 + tuning.SIMPLIFY_GRACE)),
                           remat=proof.remat)


def _search(
    graph: ComputeGraph,
    budget_bytes: int,
    start: tuple[Region, ...] | None,
    ctx: SolveContext,
    *,
    clock: float,
    workers: int,
    seed: int,
    window: int | None,
    announce: bool,
    lazy: bool,
    model_seconds: float,
) -> tuple[LazyResult, tuple[Region, ...] | None]:
    """``solve_flat``'s reproducible search from ``start`` until ``ctx``'s deadline or ``clock``
    seconds of CP-SAT's deterministic clock: the lazy search with ``tuning.GLOBAL_SHARE`` of both,
    then ``improve_locally`` if more than ``model_seconds`` (what building its model, the whole
    one, should take) is left. Returns the lazy search's result and the plan after both (None
    when neither found one)."""
    found = search_lazily(
        graph, budget_bytes, start, ctx, seconds=max(tuning.MIN_SEARCH_SECONDS, ctx.left()) * tuning.GLOBAL_SHARE,
        workers=workers,
        deterministic_seconds=clock * tuning.GLOBAL_SHARE, seed=seed, window=window, announce=announce,
        # Without a plan to start from, the whole model: its presolve proves an infeasible budget
        # at once, where the relaxation must first gain rows (docs/tuning.md, "ilp").
        deferred_phases=DEFERRED_PHASES if lazy and start is not None else frozenset(),
    )
    regions = found.regions
    if regions is not None and regions != start:
        regions = simplify(graph, regions, budget_bytes)
    # With less time left than its model takes to build, the local search would not free one window.
    if found.status == "FEASIBLE" and not ctx.cancelled and ctx.left() > model_seconds:
        model, v = build_model(graph, budget_bytes, window=window)
        model.Minimize(v.cost)
        regions = improve_locally(
            model, graph, v, regions, budget_bytes, ctx,
            deterministic_seconds=clock * (1 - tuning.GLOBAL_SHARE), seed=seed,
        )
    return found, regions


def starting_plan(
    graph: ComputeGraph, warm: Sequence[Solution], budget_bytes: int, *, moves: Moves | None = None
) -> tuple[Region, ...] | None:
    """Where the search starts: the cheapest one-level plan made from the regions of a one-level
    ``warm`` plan by ``refine.add_keeps``, either on its keep-sets or on ``refine.shed_keeps``'s
    (all sharing ``moves``); None when no warm plan is one-level."""
    refined = []
    for regions in dict.fromkeys(p.regions for p in warm if all(not r.children for r in p.regions)):
        refined.append(add_keeps(graph, regions, budget_bytes, moves=moves))
        selective = shed_keeps(graph, regions, budget_bytes, moves=moves)
        if selective is not None:
            refined.append(add_keeps(graph, selective, budget_bytes, moves=moves))
    best = min(refined, key=lambda regions: simulate(graph, regions).cost_seconds, default=None)
    return None if best is None else simplify(graph, best, budget_bytes)


def origin_of(plan: Solution) -> str:
    """What made a warm-start plan's regions, for notes (``Solution.origin``)."""
    return plan.origin or plan.solver
