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

Here: the entry point (``solve_ilp``, which picks the phases) and the block-by-block mode
(``solve_hierarchical``, ``keep_more``); the whole-graph pipeline is ``solvers.ilp_flat``, and the
constants sizing both are ``solvers.tuning``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.simulation import baseline_peak_bytes
from ckptplan.solvers import blocks, registry, tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp_flat import (
    HIERARCHICAL,
    origin_of,
    solve_flat,
    warm_plans,
    warm_solvers,
)
from ckptplan.solvers.least import least_of
from ckptplan.solvers.refine import Moves, add_keeps
from ckptplan.solvers.solution import Solution, solution
from ckptplan.units import describe_bytes

log = logging.getLogger(__name__)


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
    the limit leaves the proof phase ``tuning.MIN_PROOF_SECONDS`` (``proof_share`` of it) and the graph
    has at most ``tuning.QUICK_PROOF_MAX_NODES`` nodes (or ``tuning.SLOW_PROOF_MIN_SECONDS`` is left for a
    larger one), the proof phase then runs on the whole graph from the
    cheapest warm plan, with the rest of the limit (``solve_flat(proof_only=True)``): from a
    block-by-block start it proves in seconds what the one-worker search would spend its time
    approaching. Otherwise graphs above ``tuning.FLAT_MAX_NODES`` nodes return the block-by-block plan
    with more outputs kept where they fit (``keep_more``; its policies get ``tuning.LARGE_POLICY_SHARE``
    of the limit when ``warm`` plans are given), and smaller ones, or ones without repeated
    blocks, are searched whole (``solve_flat``) with the block-by-block plan among the warm starts.
    Ctrl-C at any point keeps the cheapest plan made so far (status ``timeout``; ``sqrt``'s when
    none was made yet): during a CP-SAT search that search ends with its best plan, and before
    one the phases left are skipped. ``ctx.limit`` sizes the phases; they end by ``ctx.deadline``
    (None: ``registry.default_seconds("ilp")`` from now).
    """
    ctx = ctx if ctx is not None else SolveContext.limited(registry.default_seconds("ilp"))
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
    large, provable = len(graph.nodes) > tuning.FLAT_MAX_NODES, proof_follows(graph, limit)
    if large and not provable:
        longer = warm is not None and limit >= tuning.LARGE_POLICY_MIN_SECONDS
        plan = solve_hierarchical(graph, budget_bytes, ctx, warm=warm,
                                  policy_share=tuning.LARGE_POLICY_SHARE if longer else tuning.POLICY_SHARE)
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
    log.info("ilp: stopped by Ctrl-C; returning the %s plan", origin_of(best))
    return best.but(solver="ilp", status="timeout", gap=None, origin=None,
                    note=f"the {origin_of(best)} plan made before its search could return one")


def proof_share(graph: ComputeGraph) -> float:
    """The share of the limit ``solve_ilp`` keeps for the proof phase on ``graph``."""
    return tuning.LARGE_PROOF_SHARE if len(graph.nodes) > tuning.FLAT_MAX_NODES else tuning.PROOF_SHARE


def proof_follows(graph: ComputeGraph, limit: float) -> bool:
    """Whether ``solve_ilp`` with ``limit`` seconds runs the proof phase on the whole ``graph``."""
    least = tuning.MIN_PROOF_SECONDS if len(graph.nodes) <= tuning.QUICK_PROOF_MAX_NODES else tuning.SLOW_PROOF_MIN_SECONDS
    return proof_share(graph) * limit >= least


def blocks_share(graph: ComputeGraph, limit: float) -> float:
    """The share of ``limit`` that ``solve_ilp`` gives the block-by-block plan on smaller graphs
    (or ones with a proof phase to follow), where it is a warm start."""
    return 1 - proof_share(graph) if proof_follows(graph, limit) else tuning.HIERARCHICAL_SHARE


def solve_hierarchical(
    graph: ComputeGraph,
    budget_bytes: int,
    ctx: SolveContext,
    *,
    warm: Sequence[Solution] | None = None,
    policy_share: float = tuning.POLICY_SHARE,
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
        return best.but(solver="ilp", status="feasible", gap=None, origin=origin_of(best),
                        note=f"{note}; no block choice fits, returning the {best.solver} plan")
    regions, report, repairs = result
    if repairs:
        note += f"; chosen again {repairs} time(s) below the budget where blocks interact"
    plan = solution(graph, regions, "ilp", note=note, origin=HIERARCHICAL, report=report)
    cheaper = [p for p in warm if p.cost_seconds < plan.cost_seconds]
    if cheaper:
        best = min(cheaper, key=lambda p: p.cost_seconds)
        return best.but(solver="ilp", status="feasible", gap=None, origin=origin_of(best),
                        note=f"the {best.solver} plan is cheaper than the block-by-block plan ({dec.describe()})")
    return plan


def keep_more(graph: ComputeGraph, plan: Solution, budget_bytes: int, ctx: SolveContext) -> Solution:
    """``plan`` after ``refine.add_keeps`` with ``tuning.LARGE_REFINE_SHARE`` of ``ctx.limit`` in moves (at
    ``tuning.LARGE_SIMULATE_SECONDS_PER_NODE`` each); ``plan`` itself when it is nested, when no keep
    both fits and recomputes less, or on Ctrl-C (during the moves or before them).

    The block-by-block plan picks each block's policy from a menu of whole-block solves; a keep
    added where another block's backward leaves room is a choice the menu cannot make
    (docs/tuning.md, "ilp", ``ilp.keep_more``)."""
    if ctx.cancelled or any(region.children for region in plan.regions):  # moves are counted, not timed
        return plan
    count = int(tuning.LARGE_REFINE_SHARE * ctx.limit / (tuning.LARGE_SIMULATE_SECONDS_PER_NODE * len(graph.nodes)))
    try:
        regions = add_keeps(graph, plan.regions, budget_bytes, moves=Moves(count))
    except KeyboardInterrupt:
        ctx.cancel.set()
        return plan
    if regions == plan.regions:
        return plan
    added = sum(len(r.keep) for r in regions) - sum(len(r.keep) for r in plan.regions)
    return plan.resimulated(graph, regions, note=f"{plan.note}; then {added} more output(s) kept by refine.add_keeps")
