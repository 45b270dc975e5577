"""solvers: ``ComputeGraph`` + budget -> ``Plan``. Pure functions over the frozen graph, registered
by name; none imports torch. ``solve`` resolves the budget and checks every claim with the
simulator."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ckptplan import remat as _remat
from ckptplan.build import solver_plan
from ckptplan.errors import CkptPlanError, InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import BudgetInfo, Plan, Region, SolverInfo
from ckptplan.repeats import find_blocks
from ckptplan.sharding import split_at_unit_edges
from ckptplan.simulation import build_region_tree, simulate
from ckptplan.solvers import dp as _dp  # noqa: F401  (registers "dp")
from ckptplan.solvers import ilp as _ilp  # registers "ilp"; auto calls it with warm starts
from ckptplan.solvers import remat_ilp as _remat_ilp
from ckptplan.solvers import sqrt as _sqrt  # noqa: F401  (registers "sqrt")
from ckptplan.solvers.cpsat import stopped
from ckptplan.solvers.registry import available_solvers, get_solver, register
from ckptplan.units import describe_bytes, parse_budget

__all__ = ["available_solvers", "register", "solve"]

log = logging.getLogger(__name__)

AUTO_ILP_SECONDS = 30.0  # auto's default time limit for the ilp search


@register("auto")
def solve_auto(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None) -> Plan:
    """Run the solvers that suit the graph and keep the cheapest plan the simulator confirms.

    ``sqrt`` always runs, ``dp`` too except on graphs ``ilp`` solves block by block (its chain
    DP is slow and coarse there). ``ilp`` runs on graphs of up to ``ilp.FLAT_MAX_NODES`` nodes
    and on larger ones made of repeated blocks (which it solves block by block), started from
    their plans and limited to ``time_limit`` seconds (default ``AUTO_ILP_SECONDS``), so it can
    only improve on them. Solvers registered by users
    run too. The plan records which solver won and what was skipped.
    """
    started = time.perf_counter()
    plans: list[Plan] = []
    least_peak: int | None = None
    skipped: list[str] = []

    def attempt(run: Callable[[], Plan]) -> None:
        nonlocal least_peak
        try:
            plans.append(at_unit_edges(graph, run(), budget_bytes))
        except InfeasibleBudgetError as exc:
            least_peak = exc.min_peak_bytes if least_peak is None else min(least_peak, exc.min_peak_bytes)

    by_blocks = len(graph.nodes) > _ilp.FLAT_MAX_NODES and bool(find_blocks(graph)[0])
    for name in available_solvers():
        if name in ("auto", "ilp"):
            continue
        if name == "dp" and by_blocks:
            skipped.append(f"dp skipped: {len(graph.nodes)} nodes of repeated blocks, which ilp solves block by block")
            continue
        attempt(lambda name=name: get_solver(name)(graph, budget_bytes, time_limit=time_limit))
    if len(graph.nodes) <= _ilp.FLAT_MAX_NODES or by_blocks:
        limit = AUTO_ILP_SECONDS if time_limit is None else max(1.0, time_limit - (time.perf_counter() - started))
        warm = [p for p in plans if p.solver.name in _ilp.WARM_SOLVERS]
        attempt(lambda: _ilp.solve_ilp(graph, budget_bytes, time_limit=limit, warm=warm))
    else:
        skipped.append(f"ilp skipped: {len(graph.nodes)} nodes > {_ilp.FLAT_MAX_NODES} and no repeated blocks")
    if not plans:
        raise InfeasibleBudgetError(
            f"No solver fits the budget of {describe_bytes(budget_bytes)}; the least peak any reaches is "
            f"{describe_bytes(least_peak or 0)}. Raise the budget.",
            budget_bytes=budget_bytes,
            min_peak_bytes=least_peak or 0,
        )
    best = min(plans, key=lambda p: (p.prediction.cost_seconds, p.prediction.peak_bytes))
    why = "; ".join(["cheapest plan within budget", *skipped])
    note = f"auto chose {best.solver.name}: {why}. {best.solver.note}".strip()
    return best.model_copy(
        update={"solver": best.solver.model_copy(update={"note": note, "seconds": time.perf_counter() - started})}
    )


def at_unit_edges(graph: ComputeGraph, plan: Plan, budget_bytes: int) -> Plan:
    """``plan`` with its regions cut at FSDP unit edges (``sharding.split_at_unit_edges``), which
    the emitted module needs; raises ``InfeasibleBudgetError`` if the cut plan no longer fits."""
    regions = split_at_unit_edges(graph, plan.regions)
    if regions == plan.regions:
        return plan
    report = simulate(graph, regions)
    if report.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(
            f"The {plan.solver.name} plan no longer fits {describe_bytes(budget_bytes)} once its regions are cut at "
            f"the shard units' edges ({describe_bytes(report.peak_bytes)}); try --solver ilp, whose large-graph "
            "plans stay inside blocks, or raise the budget.",
            budget_bytes=budget_bytes,
            min_peak_bytes=report.peak_bytes,
        )
    note = f"{plan.solver.note}; regions cut at shard unit edges".lstrip("; ")
    return solver_plan(graph, regions, budget_bytes, plan.solver.model_copy(update={"note": note}), report=report)


def solve(
    graph: ComputeGraph,
    budget: str | float = "8GB",
    solver: str = "auto",
    time_limit: float | None = None,
    remat: bool | None = None,
) -> Plan:
    """The plan ``solver`` finds for ``graph`` within ``budget`` (see ``ckptplan.units.parse_budget``).

    ``remat``: also consider rematerialising cheap ops outside regions (``ckptplan.remat``,
    ``with_remat``) and return the cheapest plan; None (the default) does for ``auto`` only.
    Raises ``InfeasibleBudgetError`` (with the least peak reached) when nothing fits.
    """
    budget_bytes = parse_budget(budget, graph.baseline_peak_bytes)
    remat = solver == "auto" if remat is None else remat

    def run(g: ComputeGraph, limit: float | None) -> Plan:
        return at_unit_edges(g, get_solver(solver)(g, budget_bytes, time_limit=limit), budget_bytes)

    plan = with_remat(graph, budget_bytes, run, time_limit, solver) if remat else run(graph, time_limit)
    report = simulate(graph, plan)
    if report.peak_bytes != plan.prediction.peak_bytes or report.peak_bytes > budget_bytes:
        raise CkptPlanError(
            f"Solver {solver!r} returned a plan the simulator does not confirm "
            f"(claimed {plan.prediction.peak_bytes} bytes, simulated {report.peak_bytes}, budget {budget_bytes}); "
            "this is a bug in ckptplan, please report it."
        )
    requested = budget if isinstance(budget, str) else repr(budget)
    return plan.model_copy(update={"budget": BudgetInfo(requested=requested, bytes=budget_bytes)})


def with_remat(
    graph: ComputeGraph,
    budget_bytes: int,
    run: Callable[[ComputeGraph, float | None], Plan],
    time_limit: float | None = None,
    solver: str = "",
) -> Plan:
    """The cheapest of ``run``'s plan for ``graph`` and plans that rematerialise candidates
    (``remat.by_price``, cheapest per byte first, chains included):

    * when rematerialising them all fits ``budget_bytes`` without regions, the shortest prefix
      of that order that fits (found by bisection: each prefix frees more, near enough; the
      prefix returned is simulated and fits);
    * otherwise ``run``'s plan for the graph with all of them rematerialised
      (``remat.Remat.graph``), less those its regions contain or store as inputs (they would
      free nothing) and those ``shed_remat`` finds the plan fits without, if the simulator
      confirms it fits once savers inside its regions are left to them;
    * for ``auto`` and ``ilp`` when the graph is small enough and the time allows
      (``remat_ilp.affordable``), then the joint model's neighbourhood search from the cheapest
      of these (``remat_ilp.search_with_remat``), which chooses regions and rematerialisation
      together.

    ``time_limit`` is shared: ``PLAIN_SHARE`` for the plain solve and ``JOINT_SHARE`` for the
    neighbourhood search when it runs, the rest for the solve on the rematerialised graph (half
    each without the search); without a limit the solves take their solver's default and the
    search ``JOINT_SECONDS``. ``solver`` names what ``run`` runs, for the notes and the search.
    A Ctrl-C that stopped the plain solve's ``ilp`` skips the later solve and the search.
    Raises ``InfeasibleBudgetError`` with the least peak either reached when neither fits."""
    started = time.perf_counter()
    stopped.clear()
    order = _remat.by_price(graph)
    names = tuple(graph.nodes[x].name for x in order)
    alone = bool(order) and simulate(graph, (), remat=names).peak_bytes <= budget_bytes
    both = bool(order) and not alone
    joint_seconds = JOINT_SECONDS if time_limit is None else time_limit * JOINT_SHARE
    joint = solver in ("auto", "ilp") and _remat_ilp.affordable(graph, joint_seconds)
    if time_limit is None:
        plain_seconds = None
    else:
        plain_seconds = time_limit * (PLAIN_SHARE if joint else 0.5) if both or joint else time_limit
    plans: list[Plan] = []
    errors: list[InfeasibleBudgetError] = []
    try:
        plans.append(run(graph, plain_seconds))
    except InfeasibleBudgetError as exc:
        errors.append(exc)
    if alone:
        fits, short = len(names), 0  # the prefix of length ``fits`` fits; ``short`` does not (or is empty)
        while fits - short > 1:
            middle = (fits + short) // 2
            if simulate(graph, (), remat=names[:middle]).peak_bytes <= budget_bytes:
                fits = middle
            else:
                short = middle
        chose = "auto chose remat: " if solver == "auto" else ""
        info = SolverInfo(name="remat", status="feasible", seconds=time.perf_counter() - started,
                          note=f"{chose}no regions, rematerialises {fits} of {len(names)} candidates, the fewest that fit")
        plans.append(solver_plan(graph, (), budget_bytes, info, remat=names[:fits]))
    elif both and not stopped.is_set():
        left = None
        if time_limit is not None:
            left = max(time_limit - (joint_seconds if joint else 0.0) - (time.perf_counter() - started), 1.0)
        log.info("remat: solving again with %d cheap ops rematerialised (dropped after forward, recomputed in backward)",
                 len(order))
        try:
            shrunk = run(_remat.Remat(graph, order, ()).graph, left)
        except CkptPlanError as exc:  # infeasible, or out of time: the plain plan stands
            if isinstance(exc, InfeasibleBudgetError):
                errors.append(exc)
        else:
            region_inputs = {s for top in build_region_tree(graph, shrunk.regions) for s in top.input_storages}
            kept = [x for x in _remat.outside(graph, order, shrunk.regions)
                    if graph.nodes[x].outputs[0] not in region_inputs]
            kept = shed_remat(graph, shrunk.regions, kept, budget_bytes)
            note = f"{shrunk.solver.note}; rematerialises {len(kept)} nodes".lstrip("; ")
            plan = solver_plan(graph, shrunk.regions, budget_bytes, shrunk.solver.model_copy(update={"note": note}),
                               remat=[graph.nodes[x].name for x in kept])
            if plan.prediction.peak_bytes <= budget_bytes:
                plans.append(plan)
    if not plans:
        raise min(errors, key=lambda exc: exc.min_peak_bytes)
    best = min(plans, key=lambda p: (p.prediction.cost_seconds, p.prediction.peak_bytes))
    if joint and best.prediction.cost_seconds > 0 and not stopped.is_set():
        seconds = joint_seconds if time_limit is None else max(time_limit - (time.perf_counter() - started), 1.0)
        found = _remat_ilp.search_with_remat(graph, budget_bytes, best, time_limit=seconds)
        if found is not None:
            chose = "auto chose ilp: " if solver == "auto" else ""
            best = found.model_copy(update={"solver": found.solver.model_copy(update={"note": chose + found.solver.note})})
    return best.model_copy(update={"solver": best.solver.model_copy(update={"seconds": time.perf_counter() - started})})


PLAIN_SHARE = 0.4  # of with_remat's time limit: the plain solve, when the joint search follows
JOINT_SHARE = 0.3  # and the joint search
JOINT_SECONDS = 10.0  # the joint search's time without a limit (beside the solver's own defaults)
SHED_SIMULATED_NODES = 20_000  # shed_remat simulates at most this many nodes' worth of plans (and 8 plans)


def shed_remat(graph: ComputeGraph, regions: tuple[Region, ...], nodes: Sequence[int], budget_bytes: int) -> list[int]:
    """``nodes`` (rematerialised beside ``regions``) less those the plan fits ``budget_bytes``
    without: dearest first (recompute seconds, with the hooks' fixed cost, times savers outside
    regions), each dropped when the simulated peak stays within the budget. Regions solved on a
    graph with every candidate rematerialised often leave bytes to spare, which pays for
    recomputing fewer. Deterministic: at most ``max(8, SHED_SIMULATED_NODES // nodes)``
    simulations, so large graphs try only their dearest few."""
    covered = _remat.Remat(graph, nodes, regions).recomputed_by
    recomputes = {x: sum(x in xs for xs in covered.values()) for x in nodes}
    dearest = sorted(nodes, key=lambda x: (-(graph.nodes[x].fwd_cost + graph.remat_cost) * recomputes[x], x))
    kept = list(nodes)
    for x in dearest[: max(8, SHED_SIMULATED_NODES // max(1, len(graph.nodes)))]:
        trial = [y for y in kept if y != x]
        names = [graph.nodes[y].name for y in trial]
        if simulate(graph, regions, remat=names).peak_bytes <= budget_bytes:
            kept = trial
    return kept
