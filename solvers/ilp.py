"""Solver ``ilp``: the cheapest one-level plan with per-node keep-sets, by CP-SAT (OR-Tools).

Three steps, kept apart: ``build_model`` (``solvers.ilp_model``) states the plan space and the
simulator's memory as constraints; ``solvers.ilp_lazy`` solves it under a time limit, starting
from a relaxation without most memory rows and adding those that plans break; ``extract_regions``
(``solvers.cpsat``) reads the plan back. The reproducible search (one worker on CP-SAT's
deterministic clock: half of it lazily, the rest in ``improve_locally``, a large-neighbourhood
search over windows of nodes on the whole model) leaves its time to the proof phase, the lazy
search again with CP-SAT's parallel portfolio, which proves the plan optimal or finds a cheaper
one. On graphs of repeated blocks, given time for a proof, the proof phase starts at once from
the block-by-block plan (``solvers.blocks``) instead; on larger ones without that time, the
block-by-block plan is the answer, after ``refine.add_keeps`` has kept more outputs where they
fit. The ``sqrt`` and ``dp`` plans warm-start the search (as hints when they are one-level, after
``solvers.refine`` has added or shed keeps on them) and stay candidates: a time-limited solve
never returns anything worse than them. Every plan is simulated before it is taken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

from ortools.sat.python import cp_model

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import blocks, registry
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.cpsat import configure, extract_regions, fix_plan, hint_complete, solve_interruptibly
from ckptplan.solvers.ilp_lazy import DEFERRED_PHASES, LazyResult, proof_search, search_lazily
from ckptplan.solvers.ilp_model import COST_SCALE, IlpVars, build_model, region_window
from ckptplan.solvers.least import least_of
from ckptplan.solvers.refine import Moves, add_keeps, shed_keeps, simplify
from ckptplan.solvers.registry import get_solver
from ckptplan.solvers.solution import Solution, run_kernel, solution
from ckptplan.solvers.sqrt import least_peak_regions
from ckptplan.units import describe_bytes

log = logging.getLogger(__name__)

# ilp's tuning constants, one line each; the measurements behind them are in docs/tuning.md
# ("ilp"), under the constant's name.
DEFAULT_TIME_LIMIT = registry.default_seconds("ilp")  # seconds, when the caller gives none
WARM_SOLVERS = ("dp", "sqrt")  # whose plans the search starts from
DETERMINISTIC_SECONDS_PER_SECOND = 0.3  # CP-SAT deterministic seconds per second asked for
LNS_WINDOW = 24  # nodes whose decisions one local-search step frees
LNS_DETERMINISTIC_SECONDS = 1.0  # deterministic-time limit of one local-search step
GLOBAL_SHARE = 0.5  # of the reproducible search: the lazy search; the rest is local search
REFINE_SHARE = 0.1  # of the limit: more keeps on the warm plans (``refine``) ...
REFINE_MIN_SECONDS = 0.02  # ... and at least this
SIMULATE_SECONDS_PER_NODE = 15e-6  # what one refine move is priced at, per node
FLAT_MAX_NODES = 400  # larger graphs of repeated blocks are solved block by block
POLICY_SHARE = 0.5  # of ``solve_hierarchical``'s limit: the block policies
LARGE_POLICY_SHARE = 0.7  # ... on larger graphs given warm plans and LARGE_POLICY_MIN_SECONDS
LARGE_POLICY_MIN_SECONDS = 10.0
LARGE_REFINE_SHARE = 0.15  # of the limit, on larger graphs: ``keep_more``'s moves
LARGE_SIMULATE_SECONDS_PER_NODE = 40e-6  # what one of those moves is priced at, per node
QUICK_PROOF_MAX_NODES = 1_200  # up to here the proof phase follows the blocks when it gets MIN_PROOF_SECONDS
SLOW_PROOF_MIN_SECONDS = 100.0  # larger graphs need this much for it
HIERARCHICAL = "block by block"  # how notes name the hierarchical mode
LEAST_SHARE = 0.5  # of the limit, when no warm plan fits: the least-peak search
HIERARCHICAL_SHARE = 0.25  # of the limit, without a proof phase to follow: the block-by-block warm start
MIN_PROOF_SECONDS = 10.0  # the least time worth a proof phase
PROOF_SHARE = 0.3  # of the limit, kept for the proof phase when that is MIN_PROOF_SECONDS or more
LARGE_PROOF_SHARE = 0.5  # the same above FLAT_MAX_NODES
BUILD_SECONDS_PER_PAIR = 75e-6  # building the CP-SAT model, per (node, node of its window)
SIMPLIFY_GRACE = 0.05  # of the proof phase's time: simplifying the plan it found, past its end


def improve_locally(
    model: cp_model.CpModel,
    graph: ComputeGraph,
    v: IlpVars,
    regions: tuple[Region, ...],
    budget_bytes: int,
    ctx: SolveContext,
    *,
    deadline: float,
    deterministic_seconds: float,
    seed: int,
) -> tuple[Region, ...]:
    """Large-neighbourhood search from ``regions``: free the decisions of ``LNS_WINDOW`` nodes at a
    time (stepping by half a window), fix the rest to the incumbent, and keep any cheaper plan
    the simulator confirms; sweep until a sweep finds nothing or CP-SAT's deterministic clock has
    run ``deterministic_seconds`` in all (``deadline``, wall clock, only backs that up). Each
    small solve runs to optimality or a deterministic limit, so the result is reproducible."""
    found = [regions]  # the incumbent, kept current so that Ctrl-C loses nothing
    try:
        _sweeps(model, graph, v, found, budget_bytes, ctx, deadline=deadline, clock=deterministic_seconds, seed=seed)
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
    deadline: float,
    clock: float,
    seed: int,
) -> None:
    n = len(graph.nodes)
    best = found[0]
    best_cost = simulate(graph, best).cost_seconds
    improved = True
    while improved and clock > 0 and time.perf_counter() < deadline:
        improved = False
        for lo in range(0, max(1, n - LNS_WINDOW // 2), LNS_WINDOW // 2):
            if clock <= 0 or time.perf_counter() >= deadline:
                break
            sub = model.Clone()
            fix_plan(sub, graph, v, best, free=range(lo, lo + LNS_WINDOW))
            solver = cp_model.CpSolver()
            configure(solver, wall_seconds=deadline - time.perf_counter(),
                      deterministic_seconds=min(LNS_DETERMINISTIC_SECONDS, clock), workers=1, seed=seed)
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
    whose limit cannot pay for building the model twice (``BUILD_SECONDS_PER_PAIR``), which
    skips the search."""
    start, start_peak = least_peak_regions(graph)
    if ctx.limit < 2 * BUILD_SECONDS_PER_PAIR * len(graph.nodes) * region_window(graph, window):
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
    """The solvers whose plans ``solve_ilp`` starts from: not ``dp`` above ``FLAT_MAX_NODES``,
    where it is slow and coarse (see ``solvers.solve_auto``)."""
    return ("sqrt",) if len(graph.nodes) > FLAT_MAX_NODES else WARM_SOLVERS


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


def solve_ilp(
    graph: ComputeGraph,
    budget_bytes: int,
    ctx: SolveContext | None = None,
    *,
    workers: int = 1,
    seed: int = 0,
    window: int | None = None,
    warm: Sequence[Solution] | None = None,
) -> Solution:
    """The least-recompute one-level plan with keep-sets whose simulated peak fits ``budget_bytes``.

    On graphs made of repeated blocks the block-by-block plan (``solvers.blocks``: the flat model
    on one block per class, then one policy per block by dynamic programming) comes first. When
    the limit leaves the proof phase ``MIN_PROOF_SECONDS`` (``proof_share`` of it) and the graph
    has at most ``QUICK_PROOF_MAX_NODES`` nodes (or ``SLOW_PROOF_MIN_SECONDS`` is left for a
    larger one), the proof phase then runs on the whole graph from the
    cheapest warm plan, with the rest of the limit (``solve_flat(proof_only=True)``): from a
    block-by-block start it proves in seconds what the one-worker search would spend its time
    approaching. Otherwise graphs above ``FLAT_MAX_NODES`` nodes return the block-by-block plan
    with more outputs kept where they fit (``keep_more``; its policies get ``LARGE_POLICY_SHARE``
    of the limit when ``warm`` plans are given), and smaller ones, or ones without repeated
    blocks, are searched whole (``solve_flat``) with the block-by-block plan among the warm starts.
    Ctrl-C at any point keeps the cheapest plan made so far (status ``timeout``; ``sqrt``'s when
    none was made yet): during a CP-SAT search that search ends with its best plan, and before
    one the phases left are skipped. ``ctx.limit`` sizes the phases; they end by ``ctx.deadline``
    (None: ``DEFAULT_TIME_LIMIT`` from now).
    """
    ctx = ctx if ctx is not None else SolveContext.limited(DEFAULT_TIME_LIMIT)
    made = list(warm or ())  # every plan made so far that fits the budget
    try:
        log.info("ilp: %d nodes, up to %.0f s; Ctrl-C stops early and keeps the best plan so far", len(graph.nodes),
                 min(ctx.limit, ctx.left()))
        return _solve_ilp(graph, budget_bytes, made, ctx, workers=workers, seed=seed, window=window, warm=warm)
    except KeyboardInterrupt:
        ctx.cancel.set()
        return _interrupted(graph, budget_bytes, made, ctx)


def _solve_ilp(
    graph: ComputeGraph,
    budget_bytes: int,
    made: list[Solution],
    ctx: SolveContext,
    *,
    workers: int,
    seed: int,
    window: int | None,
    warm: Sequence[Solution] | None,
) -> Solution:
    """``solve_ilp``'s phases, each plan they make added to ``made`` (which starts as ``warm``);
    a Ctrl-C that a CP-SAT search of the block-by-block phase took (``ctx.cancel``) raises
    ``KeyboardInterrupt`` again before the next phase."""
    limit = ctx.limit
    if budget_bytes >= baseline_peak_bytes(graph):
        return solve_flat(graph, budget_bytes, ctx)
    large, provable = len(graph.nodes) > FLAT_MAX_NODES, proof_follows(graph, limit)
    if large and not provable:
        longer = warm is not None and limit >= LARGE_POLICY_MIN_SECONDS
        plan = solve_hierarchical(graph, budget_bytes, ctx, warm=warm,
                                  policy_share=LARGE_POLICY_SHARE if longer else POLICY_SHARE)
        if plan is not None:
            made.append(plan)
            return keep_more(graph, plan, budget_bytes, ctx)
    share = blocks_share(graph, limit)
    try:
        by_blocks = solve_hierarchical(graph, budget_bytes, ctx.within(limit * share), warm=())
    except InfeasibleBudgetError:
        by_blocks = None
    warm_errors: list[InfeasibleBudgetError] = []
    if warm is None and not ctx.cancelled:
        made.extend(warm_plans(graph, budget_bytes, ctx, names=warm_solvers(graph), errors=warm_errors))
    if by_blocks is not None:
        made.append(by_blocks)
    if ctx.cancelled:  # a CP-SAT search of the block-by-block phase took a Ctrl-C
        raise KeyboardInterrupt
    try:
        return solve_flat(  # starts from every plan made: the warm ones, then the block-by-block one
            graph, budget_bytes, ctx, search_seconds=limit * (1 - share), workers=workers, seed=seed,
            window=window, warm=made, proof_only=provable and by_blocks is not None,
        )
    except InfeasibleBudgetError as exc:
        # The least peak ilp states is the least of every plan it could return: its own one-level
        # plans' and the warm solvers' (a nested dp plan may peak lower).
        leasts = [e for e in warm_errors if isinstance(e.least_plan, Solution)]
        if not any(e.min_peak_bytes < exc.min_peak_bytes for e in leasts):
            raise
        return least_of([exc, *leasts], budget_bytes, "No ilp plan fits")


def _interrupted(graph: ComputeGraph, budget_bytes: int, made: list[Solution], ctx: SolveContext) -> Solution:
    """The cheapest of ``made`` (else ``sqrt``'s plan) as ``solve_ilp``'s answer to a Ctrl-C that
    came before its search could return one; ``KeyboardInterrupt`` again when there is none."""
    plans = made or warm_plans(graph, budget_bytes, ctx.within(0.0), names=("sqrt",))
    if not plans:
        raise KeyboardInterrupt
    best = min(plans, key=lambda p: p.cost_seconds)
    log.info("ilp: stopped by Ctrl-C; returning the %s plan", _origin(best))
    return best.but(solver="ilp", status="timeout", gap=None, origin=None,
                    note=f"stopped by Ctrl-C before its search returned; the {_origin(best)} plan made so far")


def proof_share(graph: ComputeGraph) -> float:
    """The share of the limit ``solve_ilp`` keeps for the proof phase on ``graph``."""
    return LARGE_PROOF_SHARE if len(graph.nodes) > FLAT_MAX_NODES else PROOF_SHARE


def proof_follows(graph: ComputeGraph, limit: float) -> bool:
    """Whether ``solve_ilp`` with ``limit`` seconds runs the proof phase on the whole ``graph``."""
    least = MIN_PROOF_SECONDS if len(graph.nodes) <= QUICK_PROOF_MAX_NODES else SLOW_PROOF_MIN_SECONDS
    return proof_share(graph) * limit >= least


def blocks_share(graph: ComputeGraph, limit: float) -> float:
    """The share of ``limit`` that ``solve_ilp`` gives the block-by-block plan on smaller graphs
    (or ones with a proof phase to follow), where it is a warm start."""
    return 1 - proof_share(graph) if proof_follows(graph, limit) else HIERARCHICAL_SHARE


def solve_hierarchical(
    graph: ComputeGraph,
    budget_bytes: int,
    ctx: SolveContext,
    *,
    warm: Sequence[Solution] | None = None,
    policy_share: float = POLICY_SHARE,
) -> Solution | None:
    """``solvers.blocks`` on ``graph``; None when it has no repeated blocks. ``policy_share`` of
    ``ctx.limit`` goes to finding block policies; ``warm`` plans (default: ``sqrt``'s, made
    after them) are returned instead when cheaper, or when the decomposition finds no plan."""
    ctx.report("ilp: block by block")
    found = blocks.decompose(graph, ctx.within(ctx.limit * policy_share).unscored())
    if found is None:
        return None
    dec, windows = found
    warm = list(warm) if warm is not None else warm_plans(graph, budget_bytes, ctx, names=("sqrt",))
    result = blocks.solve_blocks(graph, budget_bytes, dec, windows)
    note = f"{HIERARCHICAL}: {dec.describe()}"
    if result is None:
        if not warm:
            least, regions = blocks.least_peak(graph, dec, windows)
            least_plan = solution(graph, regions, "ilp", note=f"{note}; the least-peak choice of block policies",
                                  origin=HIERARCHICAL)
            if least <= budget_bytes:
                return least_plan
            raise InfeasibleBudgetError(
                f"Budget {describe_bytes(budget_bytes)} is below the least peak the block-by-block ilp reaches, "
                f"{describe_bytes(least)}; raise the budget or try --solver dp (nested regions).",
                budget_bytes=budget_bytes, min_peak_bytes=least, least_plan=least_plan,
            )
        best = min(warm, key=lambda p: p.cost_seconds)
        return best.but(solver="ilp", status="feasible", gap=None, origin=_origin(best),
                        note=f"{note}; no block choice fits, returning the {best.solver} plan")
    regions, report, repairs = result
    if repairs:
        note += f"; chosen again {repairs} time(s) below the budget where blocks interact"
    plan = solution(graph, regions, "ilp", note=note, origin=HIERARCHICAL, report=report)
    cheaper = [p for p in warm if p.cost_seconds < plan.cost_seconds]
    if cheaper:
        best = min(cheaper, key=lambda p: p.cost_seconds)
        return best.but(solver="ilp", status="feasible", gap=None, origin=_origin(best),
                        note=f"the {best.solver} plan is cheaper than the block-by-block plan ({dec.describe()})")
    return plan


def keep_more(graph: ComputeGraph, plan: Solution, budget_bytes: int, ctx: SolveContext) -> Solution:
    """``plan`` after ``refine.add_keeps`` with ``LARGE_REFINE_SHARE`` of ``ctx.limit`` in moves (at
    ``LARGE_SIMULATE_SECONDS_PER_NODE`` each); ``plan`` itself when it is nested, when no keep
    both fits and recomputes less, or on Ctrl-C (during the moves or before them).

    The block-by-block plan picks each block's policy from a menu of whole-block solves; a keep
    added where another block's backward leaves room is a choice the menu cannot make
    (GPT-3 at 80 GB: 18.6% of the step with auto's 30 s, 18.2% after its 24 moves)."""
    if ctx.cancelled or any(region.children for region in plan.regions):  # moves are counted, not timed
        return plan
    count = int(LARGE_REFINE_SHARE * ctx.limit / (LARGE_SIMULATE_SECONDS_PER_NODE * len(graph.nodes)))
    try:
        regions = add_keeps(graph, plan.regions, budget_bytes, moves=Moves(count))
    except KeyboardInterrupt:
        ctx.cancel.set()
        return plan
    if regions == plan.regions:
        return plan
    added = sum(len(r.keep) for r in regions) - sum(len(r.keep) for r in plan.regions)
    return solution(graph, regions, plan.solver, status=plan.status, gap=plan.gap, origin=plan.origin,
                    note=f"{plan.note}; then {added} more output(s) kept by refine.add_keeps")


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
    phase starts from the refined warm plans at once and runs until ``ctx``'s deadline.
    """
    limit = ctx.limit if search_seconds is None else search_seconds
    end = ctx.within(limit).deadline
    if budget_bytes >= baseline_peak_bytes(graph):
        return solution(graph, (), "ilp", status="optimal", gap=0.0, note="the budget holds the step without checkpointing")
    warm = list(warm) if warm is not None else warm_plans(graph, budget_bytes, ctx)
    if not warm:
        warm = [_least_plan(graph, budget_bytes, ctx.within(limit * LEAST_SHARE), workers=workers, seed=seed,
                            window=window)]
    refine_seconds = max(REFINE_MIN_SECONDS, limit * REFINE_SHARE)
    start = starting_plan(graph, warm, budget_bytes,
                          moves=Moves(int(refine_seconds / (SIMULATE_SECONDS_PER_NODE * len(graph.nodes)))))
    # Time kept for the proof phase, whose portfolio finds and proves optima the one worker does
    # not (ilp_speed at 60 s: without the reserve the search left GPT at 50% 9 s, no proof).
    reserve = PROOF_SHARE * limit if PROOF_SHARE * limit >= MIN_PROOF_SECONDS else 0.0
    clock = (limit - reserve) * DETERMINISTIC_SECONDS_PER_SECOND  # of the time asked for, not left: reproducible
    last = ctx.deadline  # where the proof phase ends
    build_seconds = BUILD_SECONDS_PER_PAIR * len(graph.nodes) * region_window(graph, window)
    found = None
    if start is not None and not proof_only and limit - reserve < 2 * build_seconds:
        status, regions, bound = "FEASIBLE", start, 0.0
        how = (f"no CP-SAT search: too little time to build its model (about {build_seconds:.1f} s, twice), "
               "so the refined warm plan")
    elif proof_only and start is not None:
        ctx.report("ilp: proof phase")
        found, regions = _proof_phase(graph, budget_bytes, start, ctx, seconds=max(0.1, last - time.perf_counter()),
                                      seed=seed, window=window, bound=0.0, announce=announce)
        status, bound = found.status, found.bound
        blocks_note = next((f" ({p.note})" for p in warm if _origin(p) == HIERARCHICAL), "")
        how = f"proof phase on the whole graph from the cheapest warm plan{blocks_note}: {found.describe()}"
    else:
        ctx.report("ilp: search")
        found, regions = _search(graph, budget_bytes, start, ctx, search_end=end - reserve, clock=clock,
                                 workers=workers, seed=seed, window=window, announce=announce, lazy=lazy,
                                 model_seconds=build_seconds)
        status, bound = found.status, found.bound
        how = f"search: {found.describe()}"
        left = last - time.perf_counter()
        if status == "FEASIBLE" and not ctx.cancelled and left >= MIN_PROOF_SECONDS:
            ctx.report("ilp: proof phase")
            proof, regions = _proof_phase(graph, budget_bytes, regions, ctx, seconds=left, seed=seed, window=window,
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
            status, note = "feasible", f"no one-level plan fits ({size}); returning the {_origin(fallback)} plan"
        else:
            status, note = "timeout", f"no ilp plan within {limit:g} s ({size}); returning the {_origin(fallback)} plan"
        return fallback.but(solver="ilp", status=status, note=note, gap=None, origin=None)
    plan = solution(graph, regions, "ilp")
    better_warm = [p for p in warm if p.cost_seconds < plan.cost_seconds]
    if better_warm:
        # Only a nested dp plan can beat the optimum of the one-level space, or a stopped search.
        best = min(better_warm, key=lambda p: p.cost_seconds)
        note = f"the {_origin(best)} plan is cheaper than the best one-level plan found ({size})"
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
    least = least_peak(graph, ctx, deterministic_seconds=ctx.limit * DETERMINISTIC_SECONDS_PER_SECOND,
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


def _proof_phase(
    graph: ComputeGraph,
    budget_bytes: int,
    regions: tuple[Region, ...],
    ctx: SolveContext,
    *,
    seconds: float,
    seed: int,
    window: int | None,
    bound: float,
    announce: bool,
) -> tuple[LazyResult, tuple[Region, ...]]:
    """The lazy search with CP-SAT's portfolio (``proof_workers()``) from ``regions`` for
    ``seconds``: its result, and the plan it ends with (``regions`` unless it found a strictly
    cheaper one, which is simplified until ``SIMPLIFY_GRACE`` of ``seconds`` past them)."""
    deadline = min(time.perf_counter() + seconds * (1 + SIMPLIFY_GRACE), ctx.deadline)
    proof = proof_search(graph, budget_bytes, regions, ctx, seconds=seconds, seed=seed, window=window, bound=bound,
                         announce=announce)
    if proof.regions == regions:
        return proof, regions
    return proof, simplify(graph, proof.regions, budget_bytes, deadline=deadline)


def _search(
    graph: ComputeGraph,
    budget_bytes: int,
    start: tuple[Region, ...] | None,
    ctx: SolveContext,
    *,
    search_end: float,
    clock: float,
    workers: int,
    seed: int,
    window: int | None,
    announce: bool,
    lazy: bool,
    model_seconds: float,
) -> tuple[LazyResult, tuple[Region, ...] | None]:
    """``solve_flat``'s reproducible search from ``start`` until ``search_end`` (a
    ``time.perf_counter()`` value) or ``clock`` seconds of CP-SAT's deterministic clock: the
    lazy search with half of both, then ``improve_locally`` if more than ``model_seconds`` (what
    building its model, the whole one, should take) is left. Returns the lazy search's result
    and the plan after both (None when neither found one)."""
    found = search_lazily(
        graph, budget_bytes, start, ctx, seconds=max(0.1, search_end - time.perf_counter()) * GLOBAL_SHARE,
        workers=workers,
        deterministic_seconds=clock * GLOBAL_SHARE, seed=seed, window=window, announce=announce,
        # Without a plan to start from, the whole model: its presolve proves an infeasible budget
        # at once, where the relaxation must first gain rows (ViT at 70% with 2 s: no answer).
        deferred_phases=DEFERRED_PHASES if lazy and start is not None else frozenset(),
    )
    regions = found.regions
    if regions is not None and regions != start:
        regions = simplify(graph, regions, budget_bytes)
    # With less time left than its model takes to build, the local search would not free one window.
    if found.status == "FEASIBLE" and not ctx.cancelled and search_end - time.perf_counter() > model_seconds:
        model, v = build_model(graph, budget_bytes, window=window)
        model.Minimize(v.cost)
        regions = improve_locally(
            model, graph, v, regions, budget_bytes, ctx, deadline=search_end,
            deterministic_seconds=clock * (1 - GLOBAL_SHARE), seed=seed,
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


def _origin(plan: Solution) -> str:
    """What made a warm-start plan's regions, for notes (``Solution.origin``)."""
    return plan.origin or plan.solver
