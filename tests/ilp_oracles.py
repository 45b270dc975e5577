"""Oracles for the ``ilp`` model, used by tests only: the model's optimum for one fixed plan,
which must agree with what ``simulate`` says of that plan."""

from __future__ import annotations

from collections.abc import Callable

from ortools.sat.python import cp_model

from ckptplan import remat as _remat
from ckptplan.errors import CkptPlanError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Region
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.cpsat import fix_plan, solve_interruptibly
from ckptplan.solvers.ilp_model import COST_SCALE, IlpVars, add_bounding_clauses, build_model


def model_peak(
    graph: ComputeGraph, regions: tuple[Region, ...], *, window: int | None = None, bounding: bool = False,
    remat: tuple[str, ...] = (),
) -> int:
    """The least peak the model allows for one fixed one-level plan rematerialising ``remat``
    (tests compare it with ``simulate``: they must agree). ``bounding``: with
    ``IlpVars.bounding_clauses`` added, which must change nothing."""
    return _fixed_optimum(graph, regions, window, lambda v: v.peak, bounding=bounding, remat=remat)


def model_cost(
    graph: ComputeGraph, regions: tuple[Region, ...], *, window: int | None = None, budget_bytes: int | None = None,
    bounding: bool = False, remat: tuple[str, ...] = (),
) -> float:
    """The least cost (seconds) the model allows for one fixed one-level plan within
    ``budget_bytes`` (tests compare it with ``simulate``'s ``cost_seconds`` at the simulated
    peak: they must agree up to ``COST_SCALE`` rounding). ``bounding`` and ``remat`` as for
    ``model_peak``."""
    return _fixed_optimum(
        graph, regions, window, lambda v: v.cost, budget_bytes, bounding=bounding, remat=remat
    ) / COST_SCALE


def _fixed_optimum(
    graph: ComputeGraph, regions: tuple[Region, ...], window: int | None,
    objective: Callable[[IlpVars], cp_model.LinearExprT], budget_bytes: int | None = None, *, bounding: bool = False,
    remat: tuple[str, ...] = (),
) -> int:
    """The least value of ``objective`` over the model with ``regions``' decisions fixed (and
    ``remat``'s, among every rematerialisation candidate when it names any)."""
    candidates = _remat.candidates(graph) if remat else ()
    model, v = build_model(graph, budget_bytes, window=window, remat=candidates)
    if bounding:
        add_bounding_clauses(model, v)
    fix_plan(model, graph, v, tuple(regions), remat=tuple(remat))
    target = objective(v)
    model.Minimize(target)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    ctx = SolveContext.limited(None)
    code = solve_interruptibly(solver, model, ctx)
    if ctx.cancelled:
        raise KeyboardInterrupt
    if code != cp_model.OPTIMAL:
        raise CkptPlanError(f"the ilp model has no value for this plan ({solver.StatusName(code)})")
    return int(solver.Value(target))
