"""Plans that rematerialise cheap ops beside checkpoint regions (``ckptplan.remat``): how a
solve weighs them against the solver's plain plan."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ckptplan import remat as _remat
from ckptplan.errors import CkptPlanError, InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import build_region_tree, simulate
from ckptplan.solvers import remat_ilp, tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.least import least_of
from ckptplan.solvers.polish import hints, polish, polishes
from ckptplan.solvers.solution import Solution, solution

log = logging.getLogger(__name__)


def with_remat(
    graph: ComputeGraph,
    budget_bytes: int,
    run: Callable[[ComputeGraph, SolveContext], Solution],
    ctx: SolveContext,
    solver: str = "",
) -> Solution:
    """The cheapest of ``run``'s plan for ``graph`` and plans that rematerialise candidates
    (``remat.by_price``, cheapest per byte first, chains included):

    * when rematerialising them all fits ``budget_bytes`` without regions, the shortest prefix
      of that order that fits (found by bisection: each prefix frees more, near enough; the
      prefix returned is simulated and fits);
    * otherwise ``run``'s plan for the graph with all of them rematerialised
      (``remat.Remat.graph``), less those its regions contain or store as inputs (they would
      free nothing) and those ``shed_remat`` finds the plan fits without, if the simulator
      confirms it fits once savers inside its regions are left to them;
    * for ``auto`` on graphs of at most ``tuning.JOINT_PORTFOLIO_MAX_NODES`` nodes that the whole
      CP-SAT model suits (``polish.polishes``): CP-SAT's portfolio of the joint model, which
      chooses regions and rematerialisation together, from the cheapest of these
      (``polish.polish(joint=True)``), until the deadline; where more than
      ``tuning.ALONE_FIRST_DENSITY`` of the nodes are candidates, from the plan of a portfolio of
      regions alone run first from that start (``tuning.ALONE_FIRST_SHARE`` of the time at most);
    * for ``auto`` on larger graphs it suits, the joint portfolio from the cheaper of the plain
      plan and the rematerialised graph's plan, until the deadline; from a start whose regions
      it cannot hint (``polish.hints``), from the plan of a portfolio of regions alone run first
      on the graph that start was solved on (``tuning.UNHINTED_ALONE_SHARE`` of the time; a plan of
      the rematerialised graph's then sheds what it can);
    * otherwise, for ``auto`` and ``ilp`` when the graph is small enough and the time allows
      (``remat_ilp.affordable``), the joint model's neighbourhood search from the cheapest of
      these (``remat_ilp.search_with_remat``).

    ``ctx.limit`` is shared. With the joint portfolio, the plain solve gets
    ``(1 - tuning.POLISH_SHARE) * tuning.PLAIN_SHARE`` of it and the portfolio the rest. Otherwise
    ``tuning.JOINT_SHARE`` goes to the neighbourhood search at the end when it runs; of the rest,
    ``tuning.POLISH_SHARE`` to the portfolio search when it runs, which also takes what the solves
    before them leave; the remainder to the plain solve and the solve on the rematerialised
    graph (``tuning.PLAIN_SHARE`` to ``1 - tuning.PLAIN_SHARE - tuning.JOINT_SHARE`` with the neighbourhood search,
    half each without it). Each solve ends by its share's end, the search by ``ctx``'s
    deadline (less the neighbourhood search's share, and what shedding takes).
    With the joint portfolio, the solve on the rematerialised graph runs only when the plain
    solve fits nothing, in the time the solves have left (a start for the portfolio, or a lower
    least peak).
    ``solver`` names what ``run`` runs, for the notes and the search. A Ctrl-C that stopped the
    plain solve's ``ilp`` skips the later solve and the searches. When neither fits, the least
    peak of the plans either made (``solvers.least``), each simulated on ``graph``."""
    limit = ctx.limit
    order = _remat.by_price(graph)
    names = tuple(graph.nodes[x].name for x in order)
    alone = bool(order) and simulate(graph, (), remat=names).peak_bytes <= budget_bytes
    polishing = polishes(graph, solver, limit)
    # The portfolio searches regions and rematerialisation together: no neighbourhood search
    # after it, and no solve on the rematerialised graph unless the plain solve fits nothing.
    together = polishing and bool(order) and len(graph.nodes) <= tuning.JOINT_PORTFOLIO_MAX_NODES
    both = bool(order) and not alone
    joint = solver in ("auto", "ilp") and not together and remat_ilp.affordable(graph, limit * tuning.JOINT_SHARE)
    reserve = limit * tuning.JOINT_SHARE if joint else 0.0  # the joint search's, at the end
    solves = (limit - reserve) * (1 - tuning.POLISH_SHARE) if polishing else limit - reserve  # the two solves'
    if together:  # the plain solve's time as beside a joint search, the rest the portfolio's
        plain_seconds = limit * (1 - tuning.POLISH_SHARE) * tuning.PLAIN_SHARE
    else:
        share = (tuning.PLAIN_SHARE / (1 - tuning.JOINT_SHARE) if joint else 0.5) if both or joint else 1.0
        plain_seconds = solves * share
    plans: list[Solution] = []
    errors: list[InfeasibleBudgetError] = []
    plain = None  # the plain solve's plan
    try:
        plain = run(graph, ctx.within(plain_seconds))
        plans.append(plain)
    except InfeasibleBudgetError as exc:
        errors.append(exc)
    both = both and not (together and plain is not None)
    if alone:
        fits, short = len(names), 0  # the prefix of length ``fits`` fits; ``short`` does not (or is empty)
        while fits - short > 1:
            middle = (fits + short) // 2
            if simulate(graph, (), remat=names[:middle]).peak_bytes <= budget_bytes:
                fits = middle
            else:
                short = middle
        chose = "auto chose remat: " if solver == "auto" else ""
        note = f"{chose}no regions, rematerialises {fits} of {len(names)} candidates, the fewest that fit"
        plans.append(solution(graph, (), "remat", note=note, remat=names[:fits]))
    rematerialised = _remat.Remat(graph, order, ()) if both else None

    def onto(found: Solution) -> Solution:
        """A plan of the rematerialised graph's as one of ``graph``'s: its regions, rematerialising
        the candidates beside them that it needs (``shed_remat``)."""
        kept = shed_remat(graph, found.regions, _beside(graph, order, found.regions), budget_bytes)
        note = f"{found.note}; rematerialises {len(kept)} nodes".lstrip("; ")
        return found.resimulated(graph, found.regions, [graph.nodes[x].name for x in kept], note=note)

    from_rematerialised = None  # the rematerialised graph's plan, on ``graph``
    if rematerialised is not None and not ctx.cancelled:
        log.info("remat: solving again with %d cheap ops rematerialised (dropped after forward, recomputed in backward)",
                 len(order))
        ctx.report(f"{solver or 'solve'} with {len(order)} ops rematerialised")
        try:
            shrunk = run(rematerialised.graph, ctx.within(solves - plain_seconds).unscored())
        except CkptPlanError as exc:  # infeasible, or out of time: the plain plan stands
            if isinstance(exc, InfeasibleBudgetError):
                errors.append(_on_graph(graph, exc, order))
        else:
            plan = onto(shrunk)
            if plan.peak_bytes <= budget_bytes:
                plans.append(plan)
                from_rematerialised = plan
                ctx.report(cost_seconds=plan.cost_seconds, peak_bytes=plan.peak_bytes)
    if not plans:
        plans.append(least_of(errors, budget_bytes, "No plan fits"))
    best = min(plans, key=lambda p: (p.cost_seconds, p.peak_bytes))
    # The portfolio search of the joint model where there are candidates, from the cheapest plan
    # (docs/tuning.md, "polish"); a shorter one of regions alone first where that helps it.
    start = best if together else min((p for p in (plain, from_rematerialised) if p is not None),
                                      key=lambda p: p.cost_seconds, default=None)
    if polishing and start is not None:
        phase = ctx.before(reserve)
        if together and not start.remat and (
                len(_remat.candidates(graph)) > tuning.ALONE_FIRST_DENSITY * len(graph.nodes)):
            start = _alone_first(graph, budget_bytes, start, phase, tuning.ALONE_FIRST_SHARE)
        elif order and not together and not hints(graph, start):
            solved_on = rematerialised.graph if start is from_rematerialised else None
            start = _alone_first(graph, budget_bytes, start, phase, tuning.UNHINTED_ALONE_SHARE, solved_on=solved_on,
                                 onto=onto)
        found = polish(graph, budget_bytes, start, phase, joint=bool(order))
        if (found.cost_seconds, found.status != "optimal") < (best.cost_seconds, best.status != "optimal"):
            best = found
    if joint and best.cost_seconds > 0 and not ctx.cancelled:
        ctx.report("joint search of regions and rematerialisation")
        found = remat_ilp.search_with_remat(graph, budget_bytes, best, ctx.sized(reserve))
        if found is not None:
            chose = "auto chose ilp: " if solver == "auto" else ""
            best = found.but(note=chose + found.note)
            ctx.report(cost_seconds=best.cost_seconds, peak_bytes=best.peak_bytes)
    # What the plain solve skipped on ``graph`` (or, where it fit nothing, the solve on the
    # rematerialised graph, of as many nodes), whichever plan won.
    solved = plain if plain is not None else from_rematerialised
    return best.but(skipped=solved.skipped) if solved is not None else best


def _alone_first(
    graph: ComputeGraph,
    budget_bytes: int,
    start: Solution,
    ctx: SolveContext,
    share: float,
    *,
    solved_on: ComputeGraph | None = None,
    onto: Callable[[Solution], Solution] | None = None,
) -> Solution:
    """The cheaper of ``start`` and the plan of a portfolio of regions alone from it, for
    ``share`` of ``ctx``'s time left (``polish.polish``): on ``solved_on``, the rematerialised
    graph ``start`` was solved on, whose plans ``onto`` makes ``graph``'s, less the time that
    shedding takes; else on ``graph``."""
    phase = ctx.within(ctx.left() * share)
    if solved_on is None:
        found = polish(graph, budget_bytes, start, phase)
    else:  # ``onto`` sheds rematerialisation after the search: its simulations come out of the search's time
        found = polish(graph, budget_bytes, start, phase.before(_shed_seconds(graph)), solved_on=solved_on, onto=onto)
    # Not ``polish``'s copy of ``start`` marked proven: that proof is among plans without
    # rematerialisation, and the joint search after it would return it as its own.
    return found if found.cost_seconds < start.cost_seconds else start


def shed_remat(graph: ComputeGraph, regions: tuple[Region, ...], nodes: Sequence[int], budget_bytes: int) -> list[int]:
    """``nodes`` (rematerialised beside ``regions``) less those the plan fits ``budget_bytes``
    without: dearest first (recompute seconds, with the hooks' fixed cost, times savers outside
    regions), each dropped when the simulated peak stays within the budget. Regions solved on a
    graph with every candidate rematerialised often leave bytes to spare, which pays for
    recomputing fewer. Deterministic: at most
    ``max(tuning.SHED_MIN_PLANS, tuning.SHED_SIMULATED_NODES // nodes)`` simulations, so large
    graphs try only their dearest few."""
    covered = _remat.Remat(graph, nodes, regions).recomputed_by
    recomputes = {x: sum(x in xs for xs in covered.values()) for x in nodes}
    dearest = sorted(nodes, key=lambda x: (-(graph.nodes[x].fwd_cost + graph.remat_cost) * recomputes[x], x))
    kept = list(nodes)
    for x in dearest[: _shed_trials(graph)]:
        trial = [y for y in kept if y != x]
        names = [graph.nodes[y].name for y in trial]
        if simulate(graph, regions, remat=names).peak_bytes <= budget_bytes:
            kept = trial
    return kept


def _shed_trials(graph: ComputeGraph) -> int:
    """How many plans ``shed_remat`` simulates on ``graph``, at most."""
    return max(tuning.SHED_MIN_PLANS, tuning.SHED_SIMULATED_NODES // max(1, len(graph.nodes)))


def _shed_seconds(graph: ComputeGraph) -> float:
    """What ``shed_remat`` may take on ``graph``: its simulations of the whole graph, each priced
    as ``ilp.keep_more``'s moves (``tuning.LARGE_SIMULATE_SECONDS_PER_NODE``)."""
    return _shed_trials(graph) * tuning.LARGE_SIMULATE_SECONDS_PER_NODE * len(graph.nodes)


def _beside(graph: ComputeGraph, nodes: Sequence[int], regions: tuple[Region, ...]) -> list[int]:
    """Those of ``nodes`` a plan of ``regions`` (solved on the graph with ``nodes`` rematerialised)
    rematerialises on ``graph``: not those its regions contain or store as inputs, which would
    free nothing."""
    region_inputs = {s for top in build_region_tree(graph, regions) for s in top.input_storages}
    return [x for x in _remat.outside(graph, nodes, regions) if graph.nodes[x].outputs[0] not in region_inputs]


def _on_graph(graph: ComputeGraph, exc: InfeasibleBudgetError, nodes: Sequence[int]) -> InfeasibleBudgetError:
    """``exc`` from the solve on the graph with ``nodes`` rematerialised, its least-peak plan made
    on ``graph`` (``_beside``) and simulated there."""
    least = exc.least_plan
    if not isinstance(least, Solution):
        return exc
    remat = [graph.nodes[x].name for x in _beside(graph, nodes, least.regions)]
    plan = least.resimulated(graph, least.regions, remat)
    return InfeasibleBudgetError(str(exc), budget_bytes=exc.budget_bytes, min_peak_bytes=plan.peak_bytes,
                                 least_plan=plan)
