"""The orchestration layer: one ``solve`` owns the clock, cancellation, the simulator's check and
the ``Plan``'s assembly; the solvers under it are kernels run under its ``SolveContext``, each
returning a ``Solution`` (regions, remat, the simulator's report and where they came from).
``solve_partition_step`` does the same for a compiled step's joint graph."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from ckptplan.build import make_plan
from ckptplan.errors import CkptPlanError, InfeasibleBudgetError, UnknownSolverError
from ckptplan.graph import ComputeGraph
from ckptplan.joint import JointGraph
from ckptplan.plan import BudgetInfo, Plan, SolverInfo
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import Progress, SolveContext
from ckptplan.solvers.edges import at_unit_edges
from ckptplan.solvers.least import least_plan
from ckptplan.solvers.partition import Partition, solve_partition
from ckptplan.solvers.polish import polish, polishes
from ckptplan.solvers.registry import default_seconds, get_solver
from ckptplan.solvers.remat_plans import with_remat
from ckptplan.solvers.solution import Solution, run_kernel
from ckptplan.units import describe_bytes, parse_budget


def solve(
    graph: ComputeGraph,
    budget: str | float = "8GB",
    solver: str = "auto",
    time_limit: float | None = None,
    remat: bool | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> Plan:
    """The plan ``solver`` finds for ``graph`` within ``budget`` (see ``ckptplan.units.parse_budget``)
    in ``time_limit`` seconds (None: the solver's default, ``registry.default_seconds``).

    ``remat``: also consider rematerialising cheap ops outside regions (``ckptplan.remat``,
    ``remat_plans.with_remat``) and return the cheapest plan; None (the default) does for
    ``auto`` only. ``progress`` hears where the search stands as it goes (``context.Progress``:
    the phase, the cheapest plan and the best bound so far). Raises ``InfeasibleBudgetError``
    when nothing fits, naming the least peak of a
    plan it made (a budget that gets a plan), or at once when the model's state alone exceeds the
    budget.
    """
    budget_bytes = parse_budget(budget, baseline_peak_bytes(graph))
    kernel = get_solver(solver)
    started = time.perf_counter()
    requested = BudgetInfo(requested=budget if isinstance(budget, str) else repr(budget), bytes=budget_bytes)
    try:
        _refuse_below_state(graph, budget_bytes, solver)
        ctx = SolveContext.limited(time_limit, default=default_seconds(solver, len(graph.nodes)), on_progress=progress)
        ctx = ctx.before(finish_seconds(graph))

        def run(g: ComputeGraph, phase: SolveContext) -> Solution:
            return at_unit_edges(g, run_kernel(kernel, g, budget_bytes, phase), budget_bytes)

        remat = solver == "auto" if remat is None else remat
        if remat:
            found = with_remat(graph, budget_bytes, run, ctx, solver)
        elif polishes(graph, solver, ctx.limit):
            found = polish(graph, budget_bytes, run(graph, ctx.within(ctx.limit * (1 - tuning.POLISH_SHARE))), ctx)
        else:
            found = run(graph, ctx)
    except InfeasibleBudgetError as exc:
        raise _with_plan(graph, exc) from None
    report = simulate(graph, found.regions, remat=found.remat)
    if report.peak_bytes != found.peak_bytes or report.peak_bytes > budget_bytes:
        raise CkptPlanError(
            f"Solver {solver!r} returned a plan the simulator does not confirm "
            f"(claimed {found.peak_bytes} bytes, simulated {report.peak_bytes}, budget {budget_bytes}); "
            "this is a bug in ckptplan, please report it."
        )
    if ctx.cancelled:  # the kernels and phases set the flag; the plan says so here, once
        found = found.but(note=f"{found.note}; stopped by Ctrl-C".lstrip("; "))
    return plan_of(graph, found.but(report=report), requested, seconds=time.perf_counter() - started)


def finish_seconds(graph: ComputeGraph) -> float:
    """What a solve of ``graph`` keeps after its phases' deadline: CP-SAT's stop and the
    simulations of the plan found (``tuning.STOP_SECONDS``, ``tuning.FINISH_SIMULATIONS``)."""
    return tuning.STOP_SECONDS + tuning.FINISH_SIMULATIONS * tuning.LARGE_SIMULATE_SECONDS_PER_NODE * len(graph.nodes)


def plan_of(graph: ComputeGraph, found: Solution, budget: BudgetInfo, *, seconds: float = 0.0) -> Plan:
    """``found`` as a ``Plan`` for ``graph`` made for ``budget`` in ``seconds``; its note ends
    with what the solve skipped (``Solution.skipped``)."""
    note = "; ".join(part for part in (found.note, *found.skipped) if part)
    info = SolverInfo(name=found.solver, status=found.status, seconds=seconds, gap=found.gap, note=note,
                      origin=found.origin)
    return make_plan(graph, found.regions, budget=budget, solver=info, report=found.report, remat=found.remat)


def _with_plan(graph: ComputeGraph, exc: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """``exc`` with its least-peak ``Solution`` made a ``Plan`` at that peak, as the public error
    carries it (``errors.InfeasibleBudgetError.least_plan``)."""
    least = exc.least_plan
    if not isinstance(least, Solution):
        return exc
    return InfeasibleBudgetError(str(exc), budget_bytes=exc.budget_bytes, min_peak_bytes=exc.min_peak_bytes,
                                 least_plan=plan_of(graph, least, BudgetInfo(requested=str(least.peak_bytes),
                                                                             bytes=least.peak_bytes)))


def _refuse_below_state(graph: ComputeGraph, budget_bytes: int, solver: str) -> None:
    """``InfeasibleBudgetError`` at once when the budget is below what every plan holds through
    the step (``StaticMemory.floor_bytes``: the model's state, its inputs and the gradients
    backward makes), naming the least peak the solver's quick plans reach (``sqrt``'s and
    ``dp``'s, which ``auto`` and ``ilp`` start from), so that budget gets a plan; a user's
    solver gets the floor, a bound."""
    floor = graph.static.floor_bytes
    if budget_bytes >= floor:
        return
    from ckptplan.solvers.ilp_flat import warm_solvers  # imports ortools: only for this refusal

    quick = (solver,) if solver in ("sqrt", "dp") else warm_solvers(graph) if solver in ("auto", "ilp") else ()
    plans, errors = [], []
    for name in quick:
        try:
            plans.append(run_kernel(get_solver(name), graph, floor, SolveContext.limited(None)))
        except InfeasibleBudgetError as exc:
            errors.append(exc)
    held = (f"the {describe_bytes(floor)} every plan holds before any activation (parameters, buffers, inputs"
            f"{', optimizer state' if graph.static.optimizer_bytes else ''} and gradients)")
    least = plans[0] if plans else least_plan(errors)  # a plan at the floor is the least there is
    if least is None:
        raise InfeasibleBudgetError(
            f"Budget {describe_bytes(budget_bytes)} is below {held}, so no plan's peak is that low; raise the budget, "
            "or shard the model (--shard-degree).",
            budget_bytes=budget_bytes, min_peak_bytes=floor,
        )
    peak = least.peak_bytes
    raise InfeasibleBudgetError(
        f"Budget {describe_bytes(budget_bytes)} is below {held}; the least peak of a plan found at once is "
        f"{describe_bytes(peak)} ({least.solver}). Raise the budget, or shard the model (--shard-degree).",
        budget_bytes=budget_bytes, min_peak_bytes=peak, least_plan=least,
    )


def check_partition_solver(solver: str) -> None:
    """``UnknownSolverError`` unless ``solver`` names a compiled-step solver."""
    if solver not in tuning.PARTITION_SECONDS:
        raise UnknownSolverError(
            f"Unknown solver {solver!r} for a compiled step; choose one of: {', '.join(tuning.PARTITION_SECONDS)}."
        )


def solve_partition_step(
    graph: JointGraph,
    budget_bytes: int,
    *,
    solver: str = "auto",
    time_limit: float | None = None,
    starts: Iterable[Iterable[int]] = (),
    progress: Callable[[Progress], None] | None = None,
) -> Partition:
    """The saved set of a compiled step within ``budget_bytes``: the greedy search's
    (``solvers.partition``, from ``starts`` too), then, unless ``solver`` is ``"greedy"``, the
    exact CP-SAT model's (``solvers.partition_exact``) for the rest of ``time_limit`` seconds
    (None: ``tuning.PARTITION_SECONDS[solver]``), which returns a partition only when it recomputes
    less, and proves it least or proves that nothing fits. The greedy search gets
    ``tuning.GREEDY_SHARE`` of the time asked (all of it alone), counted in values simulated.
    When the greedy search fits nothing, the exact model's least-peak bisection
    (``partition_exact.least_partition``) lowers the greedy search's least peak first, for
    ``tuning.PARTITION_LEAST_SHARE`` of the time asked on CP-SAT's deterministic clock, from
    bounds that do not depend on the budget: whatever budget the greedy search misses, the same
    least is found (unless the deadline cuts it short), so a least peak stated is a budget this
    search fits. Then the exact model searches for any saved set within
    the budget (or a proof that none is), and the least recomputation from what fits. When
    nothing within the budget is found, the least peak found, ``feasible`` False. The greedy
    search, too, ends by the deadline
    (``greedy`` alone without ``time_limit`` runs until it is done). Every partition returned is
    the simulator's report of its saved set."""
    check_partition_solver(solver)
    ctx = SolveContext.limited(time_limit, default=tuning.PARTITION_SECONDS[solver], on_progress=progress)
    ctx.report("greedy")
    if solver == "greedy" and time_limit is None:  # runs until it is done
        found = solve_partition(graph, budget_bytes, starts)
    else:
        work = ctx.limit * (1.0 if solver == "greedy" else tuning.GREEDY_SHARE) * tuning.SIMULATED_VALUES_PER_SECOND
        found = solve_partition(graph, budget_bytes, starts, ctx, None if math.isinf(work) else int(work))
    if found.feasible:
        ctx.report(cost_seconds=found.report.recompute_seconds, peak_bytes=found.report.peak_bytes)
    if solver == "greedy" or ctx.over():
        return found
    from ckptplan.solvers.partition_exact import least_partition, solve_partition_exact  # imports ortools

    if not found.feasible:
        # The least peak first, on CP-SAT's deterministic clock from the greedy search's least
        # (the same for every budget below it): the least an error states is a budget whose
        # search finds that partition again (docs/limits.md, "Compiled steps").
        ctx.report("least peak")
        least, _ = least_partition(
            graph, ctx, found.report, graph.static_bytes,
            deterministic_seconds=ctx.limit * tuning.PARTITION_LEAST_SHARE * tuning.PARTITION_LEAST_CLOCK,
        )
        if least.peak_bytes < found.report.peak_bytes:  # ``least`` is the simulator's report
            fits = least.peak_bytes <= budget_bytes
            found = Partition(report=least, feasible=fits, origin="exact", status="feasible" if fits else "heuristic")
        if ctx.over():
            return found
    ctx.report("exact")
    if found.feasible:
        exact = solve_partition_exact(graph, budget_bytes, ctx, incumbent=found.report)
    else:
        # Any saved set within the budget, or a proof that none is, then the least recomputation from it.
        exact = solve_partition_exact(graph, budget_bytes, ctx, incumbent=found.report, fit_only=True)
        if exact.report is not None:
            exact = replace(exact, status="feasible")  # nothing proved of its recomputation yet
            if not ctx.over():
                exact = solve_partition_exact(graph, budget_bytes, ctx, incumbent=exact.report)
    if exact.report is None:
        return replace(found, status="infeasible") if exact.status == "infeasible" else found
    report = exact.report  # the simulator's report of its saved set, as the kernel returns only those
    if report.peak_bytes > budget_bytes:
        raise CkptPlanError(
            f"The exact partition of {graph.name} peaks at {report.peak_bytes} bytes, over the budget of "
            f"{budget_bytes}; this is a bug in ckptplan, please report it."
        )
    origin = found.origin if found.feasible and report.saved == found.report.saved else "exact"
    return Partition(report=report, feasible=True, origin=origin, status=exact.status)
