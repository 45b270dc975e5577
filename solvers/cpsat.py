"""Running CP-SAT on the ``ilp`` model: solve under limits, keep Ctrl-C meaning "stop and keep
the best plan", and move plans in and out of the model (fix, hint, extract)."""

from __future__ import annotations

import threading

from ortools.sat.python import cp_model

from ckptplan.errors import CkptPlanError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Region
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp_model import IlpVars


def extract_regions(graph: ComputeGraph, v: IlpVars, value) -> tuple[Region, ...]:
    """Regions from the decision values (``value(var) -> int``), in execution order."""
    regions: list[Region] = []
    n = len(graph.nodes)
    t = 0
    while t < n:
        if not value(v.rec[t]):
            t += 1
            continue
        end = t + 1
        while end < n and value(v.rec[end]) and not value(v.start[end]):
            end += 1
        keep = tuple(graph.nodes[j].name for j in range(t, end) if j in v.keep and value(v.keep[j]))
        regions.append(Region(t, end, keep=keep))
        t = end
    return tuple(regions)


def extract_remat(graph: ComputeGraph, v: IlpVars, value) -> tuple[str, ...]:
    """The names of the nodes the decision values rematerialise, in execution order."""
    return tuple(graph.nodes[x].name for x in sorted(v.remat) if value(v.remat[x]))


def fix_plan(
    model: cp_model.CpModel, graph: ComputeGraph, v: IlpVars, regions: tuple[Region, ...], *, free: range = range(0),
    remat: tuple[str, ...] = (),
) -> None:
    """Force the decisions of a one-level plan rematerialising ``remat``, except those of the
    nodes in ``free``, which are only hinted."""
    n = len(graph.nodes)
    rec, start, keep = [0] * n, [0] * n, [0] * n
    for region in regions:
        start[region.start] = 1
        for i in range(region.start, region.end):
            rec[i] = 1
        for name in region.keep:
            keep[graph.index_of[name]] = 1
    for t in range(n):
        pairs = [(v.rec[t], rec[t]), (v.start[t], start[t])]
        if t in v.keep:
            pairs.append((v.keep[t], keep[t]))
        elif keep[t]:
            raise CkptPlanError(f"node {graph.nodes[t].name!r} cannot be kept")
        if t in v.remat:
            pairs.append((v.remat[t], int(graph.nodes[t].name in remat)))
        elif graph.nodes[t].name in remat:
            raise CkptPlanError(f"node {graph.nodes[t].name!r} is no rematerialisation candidate of this model")
        for var, value in pairs:
            if t in free:
                model.AddHint(var, value)
            else:
                model.Add(var == value)


def hint_complete(
    model: cp_model.CpModel, graph: ComputeGraph, v: IlpVars, regions: tuple[Region, ...], ctx: SolveContext,
    remat: tuple[str, ...] = (),
) -> None:
    """Hint every variable, not just the decisions, of the plan of ``regions`` rematerialising
    ``remat``: a copy of the model with the plan fixed is solved for the values of the derived
    variables (CP-SAT repairs partial hints slowly). Within ``tuning.HINT_SECONDS`` and ``ctx``'s
    deadline; the decisions alone are hinted otherwise."""
    fixed = model.Clone()
    fix_plan(fixed, graph, v, regions, remat=remat)
    fixed.ClearObjective()
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = min(tuning.HINT_SECONDS, ctx.left())
    if solve_interruptibly(solver, fixed, ctx) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        fix_plan(model, graph, v, regions, free=range(len(graph.nodes)), remat=remat)
        return
    for index in range(len(model.Proto().variables)):
        var = model.GetIntVarFromProtoIndex(index)
        model.AddHint(var, solver.Value(fixed.GetIntVarFromProtoIndex(index)))


STOP_POLL_SECONDS = 0.05  # how often the main thread checks for Ctrl-C, and re-asks CP-SAT to stop


def solve_interruptibly(
    solver: cp_model.CpSolver, model: cp_model.CpModel, ctx: SolveContext,
    callback: cp_model.CpSolverSolutionCallback | None = None,
) -> int:
    """``solver.Solve(model, callback)``, ended early by Ctrl-C (which sets ``ctx.cancel``), or
    nothing once Ctrl-C was pressed. The wall-clock limit never reaches past ``ctx``'s deadline.

    CP-SAT's own SIGINT handler is off (``catch_sigint_signal``): it keeps its callback in a
    thread-local, so it works only when the kernel hands the signal to the solving thread; it
    replaces the process's disposition during the solve, even an inherited "ignore"; and it
    leaves SIGINT at the default action (end the process) when the solve ends, where Python's
    handler was. Instead the search runs in a thread while the main thread, where Python raises
    ``KeyboardInterrupt``, waits for it and then asks CP-SAT to stop until it does.
    """
    if ctx.cancelled:
        return cp_model.UNKNOWN
    solver.parameters.max_time_in_seconds = min(solver.parameters.max_time_in_seconds, ctx.left())
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():  # Ctrl-C never lands here
        return solver.Solve(model, callback)
    outcome: dict[str, object] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            outcome["code"] = solver.Solve(model, callback)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread below)
            outcome["error"] = exc
        finally:
            finished.set()

    try:
        threading.Thread(target=run, name="cp-sat", daemon=True).start()
        # Event.wait, not Thread.join: an interrupted join can leave the thread looking finished.
        while not finished.wait(STOP_POLL_SECONDS):
            pass
    except KeyboardInterrupt:
        ctx.cancel.set()
        solver.StopSearch()
        while not finished.wait(STOP_POLL_SECONDS):
            solver.StopSearch()  # asked before the search began, a stop may go unseen
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("code", cp_model.UNKNOWN)  # type: ignore[return-value]


def configure(
    solver: cp_model.CpSolver, *, wall_seconds: float, deterministic_seconds: float, workers: int, seed: int
) -> None:
    """Limits and search parameters. One worker stopped by CP-SAT's deterministic clock finds the
    same plan on every run: callers give it ``tuning.DETERMINISTIC_SECONDS_PER_SECOND`` of the time they
    were *asked* to take (never of what is left, which depends on the machine's load), and the
    wall-clock limit only backs it up (at least ``tuning.MIN_WALL_SECONDS``, so that a short search on a
    loaded machine still ends on its deterministic clock). More workers search better but not
    reproducibly; fewer than ``tuning.FULL_PORTFOLIO_WORKERS`` run ``tuning.BOUND_SUBSOLVERS`` as their full-problem
    workers, as many as leave one worker to CP-SAT's first-solution and neighbourhood subsolvers."""
    solver.parameters.max_time_in_seconds = max(tuning.MIN_WALL_SECONDS, wall_seconds)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    if 1 < workers < tuning.FULL_PORTFOLIO_WORKERS:
        solver.parameters.subsolvers.extend(tuning.BOUND_SUBSOLVERS[: workers - 1])
    if workers == 1:
        solver.parameters.max_deterministic_time = max(tuning.MIN_CLOCK_SECONDS, deterministic_seconds)


def lighten_presolve(solver: cp_model.CpSolver) -> None:
    """One presolve pass, without probing or symmetry detection: for searches whose time goes
    mostly to presolving a large model that propagation alone shrinks (a neighbourhood step, a
    round of the joint portfolio search), with the same plans found sooner (docs/tuning.md,
    "remat_ilp" and "polish")."""
    solver.parameters.max_presolve_iterations = 1
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.symmetry_level = 0

