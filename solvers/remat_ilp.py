"""Regions and rematerialisation chosen together: the ``ilp`` model with a ``remat_{x}`` decision
per candidate (``build_model(remat=...)``; ``ckptplan.remat``), searched from a plan by
large-neighbourhood search.

``solvers.with_remat`` first chooses the two apart: rematerialisation alone, or regions solved on
a graph where every candidate is rematerialised, then the candidates the plan fits without shed.
Here each candidate is a decision beside the regions and keep-sets of the nodes around it, so a
step can trade a region for rematerialised ops or the other way round (one level of regions,
keep-sets, candidates outside regions: none read through a view of another, chains at most two
deep, ``remat.deep_chains``). The joint model is searched a neighbourhood at a time, as
``ilp.improve_locally`` does for regions alone, not whole (docs/tuning.md, "remat_ilp", says
why). The model is built whole (no lazy rows), so this
suits graphs of up to ``tuning.FLAT_MAX_NODES`` nodes.
"""

from __future__ import annotations

import logging

from ortools.sat.python import cp_model

from ckptplan import remat as _remat
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import Report, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.cpsat import (
    configure,
    extract_regions,
    extract_remat,
    fix_plan,
    lighten_presolve,
    solve_interruptibly,
)
from ckptplan.solvers.ilp_model import build_model, region_window
from ckptplan.solvers.solution import Solution, solution

log = logging.getLogger(__name__)


def affordable(graph: ComputeGraph, seconds: float | None) -> bool:
    """Whether a joint search of ``seconds`` (None: no limit) suits ``graph``: candidates to
    decide, at most ``tuning.FLAT_MAX_NODES`` nodes, and time for more than building the model twice."""
    if not _remat.candidates(graph) or len(graph.nodes) > tuning.FLAT_MAX_NODES:
        return False
    build = tuning.BUILD_SECONDS_PER_PAIR * len(graph.nodes) * region_window(graph, tuning.REMAT_WINDOW)
    return seconds is None or seconds >= max(tuning.REMAT_MIN_SECONDS, 2 * build)


def search_with_remat(
    graph: ComputeGraph, budget_bytes: int, start: Solution, ctx: SolveContext, *, max_steps: int | None = None,
    seed: int = 0,
) -> Solution | None:
    """The cheapest plan a large-neighbourhood search of the joint model finds from ``start`` (a
    plan of one level that fits ``budget_bytes``) in ``ctx.limit`` seconds, or None when it finds
    none cheaper. As ``ilp.improve_locally`` does for regions alone: free the decisions (region,
    keep and rematerialisation) of ``tuning.LNS_WINDOW`` nodes at a time (``_neighbourhoods``, dearest
    first), fix the rest to the incumbent, and move to any cheaper plan the simulator confirms
    (then rank the neighbourhoods again); stop when a whole round finds nothing, or after
    ``max_steps`` steps (default ``ctx.limit / tuning.REMAT_STEP_SECONDS``) or
    ``tuning.DETERMINISTIC_SECONDS_PER_SECOND`` of the limit on CP-SAT's deterministic clock: the same
    inputs give the same plan unless the wall clock, which only backs these up, ends it first."""
    time_limit = ctx.limit
    phase = ctx.within(time_limit)
    if any(r.children for r in start.regions):
        return None
    log.info("remat: choosing regions and rematerialised ops together, up to %.0f s", min(time_limit, ctx.left()))
    # Regions of at most tuning.REMAT_WINDOW nodes, or the start's longest: a smaller model makes each step's
    # copy and presolve cheaper.
    window = max(tuning.REMAT_WINDOW, max((r.end - r.start for r in start.regions), default=0))
    model, v = build_model(graph, budget_bytes, window=window, remat=_remat.candidates(graph))
    model.Minimize(v.cost)
    clock = time_limit * tuning.DETERMINISTIC_SECONDS_PER_SECOND
    best, best_report, steps = (start.regions, start.remat), start.report, 0
    most_steps = max(1, int(time_limit / tuning.REMAT_STEP_SECONDS)) if max_steps is None else max_steps
    improved = True
    while improved and clock > 0 and steps < most_steps and not phase.over():
        improved = False
        for lo in _neighbourhoods(graph, best[0], best_report):
            if clock <= 0 or steps >= most_steps or phase.over():
                break
            sub = model.Clone()
            fix_plan(sub, graph, v, best[0], free=range(lo, lo + tuning.LNS_WINDOW), remat=best[1])
            solver = cp_model.CpSolver()
            configure(solver, wall_seconds=phase.left(),
                      deterministic_seconds=min(tuning.REMAT_STEP_DETERMINISTIC_SECONDS, clock), workers=1, seed=seed)
            # Most of a step's time is CP-SAT's presolve of the copied model.
            lighten_presolve(solver)
            code = solve_interruptibly(solver, sub, ctx)
            clock -= solver.ResponseProto().deterministic_time
            steps += 1
            if ctx.cancelled:
                break
            if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                continue
            regions, remat = extract_regions(graph, v, solver.Value), extract_remat(graph, v, solver.Value)
            report = simulate(graph, regions, remat=remat)
            if report.peak_bytes <= budget_bytes and report.cost_seconds < best_report.cost_seconds:
                best, best_report, improved = (regions, remat), report, True
                break  # rank the neighbourhoods again around the new plan
    if best == (start.regions, start.remat):
        return None
    proto = model.Proto()
    note = (
        f"one-level regions with keep-sets and rematerialisation chosen together ({len(graph.nodes)} nodes, "
        f"{len(proto.variables)} variables): {steps} neighbourhood steps from a plan costing "
        f"{start.cost_seconds * 1e3:.2f} ms; rematerialises {len(best[1])} nodes"
    )
    return solution(graph, best[0], "ilp", note=note, report=best_report, remat=best[1])


def _neighbourhoods(graph: ComputeGraph, regions: tuple[Region, ...], report: Report) -> list[int]:
    """First nodes of the ``tuning.LNS_WINDOW``-node neighbourhoods (every half window) where the plan
    (``regions`` and the rematerialisation ``report`` simulated with them) spends something,
    dearest first: the forward seconds of the nodes it recomputes there (a rematerialised node
    once per recompute) and the fixed cost of each region starting there. A step can only lower
    the cost where the neighbourhood holds some; the rest is fixed."""
    spent = [0.0] * len(graph.nodes)
    for t in report.recomputed:
        spent[t] += graph.nodes[t].fwd_cost
    for region in regions:
        spent[region.start] += graph.region_cost
    starts = range(0, max(1, len(graph.nodes) - tuning.LNS_WINDOW // 2), tuning.LNS_WINDOW // 2)
    weights = {lo: sum(spent[lo:lo + tuning.LNS_WINDOW]) for lo in starts}
    return sorted((lo for lo in starts if weights[lo] > 0), key=lambda lo: (-weights[lo], lo))
