"""How solver ``ilp`` searches: CP-SAT on a relaxation of the model whose memory rows join it
only once a plan breaks them (row generation, or lazy constraints).

Most of the model is the memory of backward and recompute events (``ilp_model``: one row per
node and phase, each a sum over the storages alive there, with the booleans that define them),
yet at an optimum only a few of those rows bind, near the start of backward where the peak
sits. So the search builds the model with the forward rows only (and
``IlpVars.bounding_clauses``; each row left out brings the variables only it reads when it
joins, so this relaxation is a small model, not the whole one with rows missing), simulates
every plan CP-SAT reports, and, as soon as one breaks the budget, adds the rows of the events
where it does (the proof phase: only the fullest of them) and searches again, hinted with the
cheapest plan that fits.
Every model along the way is a relaxation of the whole model, so each lower bound CP-SAT proves
holds for the whole model too: the search is done, proven optimal, when the bound meets the
cheapest plan the simulator accepts; and a relaxation without plans proves the budget
infeasible. Branch-and-cut solvers treat rows too many to state up front the same way.

Two uses, one loop: with one worker on CP-SAT's deterministic clock (the callback's decisions
depend only on the plans, which one worker finds in a fixed order) the search is reproducible;
with ``proof_workers()``, a CP-SAT portfolio whose LP-based workers raise the lower bound, it is
the proof phase. From a plan whose whole cost is recomputing some of a class of interchangeable
nodes, the proof phase searches only the plans recomputing fewer (``fewer_of_a_class``). What
its proofs take, with and without row generation: docs/tuning.md, "ilp_lazy".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from ckptplan.graph import ComputeGraph
from ckptplan.plan import Region
from ckptplan.remat import conflicts, deep_chains
from ckptplan.simulation import Report, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.cpsat import (
    configure,
    extract_regions,
    extract_remat,
    hint_complete,
    lighten_presolve,
    solve_interruptibly,
)
from ckptplan.solvers.ilp_model import COST_SCALE, IlpVars, add_bounding_clauses, add_events, build_model

log = logging.getLogger(__name__)

DEFERRED_PHASES = frozenset({"backward", "recompute"})


@dataclass(frozen=True)
class LazyResult:
    """Where the search ended. ``status``: ``OPTIMAL`` (``regions`` proven cheapest),
    ``FEASIBLE``, ``INFEASIBLE`` (no plan fits the budget; proven) or ``UNKNOWN`` (no plan found
    in time). ``regions`` is the cheapest plan the simulator accepted (the one given unless a
    strictly cheaper one was found), rematerialising ``remat`` (``search_lazily``'s joint
    model; none otherwise), ``cost`` its simulated cost and ``bound`` a proven lower
    bound on every plan's, in ``COST_SCALE`` units. ``rows`` counts the event rows added of the
    ``deferred`` left out, over ``rounds`` CP-SAT runs, ``seeded`` of them before the first;
    ``variables`` and ``constraints`` size the final model."""

    status: str
    regions: tuple[Region, ...] | None
    cost: float
    bound: float
    rounds: int
    rows: int
    deferred: int
    seeded: int
    variables: int
    constraints: int
    seconds: float
    split: str = ""  # which plans the proof phase left out, and why (``fewer_of_a_class``)
    remat: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.deferred:
            return f"the whole model, {self.rounds} round(s)"
        described = (f"{self.rows} of {self.deferred} backward and recompute memory rows needed "
                     f"({self.seeded} stated up front), {self.rounds} round(s)")
        return f"{described}; {self.split}" if self.split else described


@dataclass(frozen=True)
class RecomputeAtMost:
    """The plans that recompute at most ``most`` of ``nodes``."""

    nodes: tuple[int, ...]
    most: int

    def holds(self, report: Report) -> bool:
        return len(set(self.nodes) & set(report.recomputed)) <= self.most

    def restrict(self, model: cp_model.CpModel, v: IlpVars) -> None:
        """State it over the model's ``recomputed`` variables (a plan's model solution sets them
        as the simulator counts, so every plan in the range stays in the model)."""
        model.Add(sum(v.recomputed[t] for t in self.nodes) <= self.most)


def _states(graph: ComputeGraph, v: IlpVars, remat: tuple[str, ...]) -> bool:
    """Whether the model ``v`` can rematerialise the nodes named ``remat`` together: each is one
    of its candidates, and the set breaks none of its rules (``remat.conflicts``,
    ``remat.deep_chains``)."""
    nodes = [graph.index_of[name] for name in remat]
    return all(x in v.remat for x in nodes) and not conflicts(graph, nodes) and not deep_chains(graph, nodes)


def _slack(graph: ComputeGraph) -> int:
    """How far below a plan's simulated cost its model objective may fall, in ``COST_SCALE``
    units: the model rounds each node's cost to a whole unit, half a unit per term (recomputed,
    start, rec, keep: at most four per node)."""
    return 2 * len(graph.nodes) + 1


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def proof_workers() -> int:
    """The proof phase's CP-SAT workers: one per core where CP-SAT's own portfolio fits
    (``tuning.FULL_PORTFOLIO_WORKERS`` cores or more), else ``tuning.PROOF_WORKERS``, which
    ``cpsat.configure`` gives its bound-raising workers (``tuning.BOUND_SUBSOLVERS``)."""
    cores = _cores()
    return cores if cores >= tuning.FULL_PORTFOLIO_WORKERS else tuning.PROOF_WORKERS


def search_workers() -> int:
    """The workers of a portfolio that searches for cheaper plans more than for a proof
    (``auto``'s last phase, ``solvers.polish``): ``proof_workers()``, but no more than one per
    core. On 2 cores that drops the LP tree search and leaves CP-SAT's neighbourhood workers a
    core of their own (docs/tuning.md, "polish", ``search_workers``)."""
    return min(proof_workers(), _cores())


def _fullest(report: Report, keys) -> list[tuple[str, int]]:
    """The events of ``report`` named in ``keys`` (``(phase, node)``), those where it holds the
    most bytes first (ties in execution order)."""
    by_bytes = sorted(report.timeline, key=lambda e: -e.live_bytes)
    return list(dict.fromkeys((e.phase, e.node) for e in by_bytes if (e.phase, e.node) in keys))


def _seed_rows(v: IlpVars, start: Report, count: int, gap: int = 0) -> int:
    """Add the deferred rows of the ``count`` events where the ``start`` plan holds the most
    bytes, each at least ``gap`` nodes from those chosen before it while there are such events
    (then the fullest of the rest); returns how many were added."""
    fullest = _fullest(start, v.deferred)
    chosen: list[tuple[str, int]] = []
    for event in fullest:
        if len(chosen) == count:
            break
        if all(abs(event[1] - other[1]) >= gap for other in chosen):
            chosen.append(event)
    chosen += [event for event in fullest if event not in chosen][:count - len(chosen)]
    add_events(v, chosen)
    return len(chosen)


class _Watcher(cp_model.CpSolverSolutionCallback):
    """Simulates each plan the search reports: keeps the cheapest that fits the budget, and
    stops the search at the first that does not and breaks rows the model still lacks
    (``violated``: those events, or the ``rows_per_round`` where it holds the most bytes).
    ``on_better`` hears each cheaper plan's cost and peak as it is found."""

    def __init__(
        self, graph: ComputeGraph, v: IlpVars, budget_bytes: int, best_cost: float, rows_per_round: int | None,
        on_better: Callable[[float, int], object] | None = None,
    ) -> None:
        super().__init__()
        self.graph, self.v, self.budget_bytes = graph, v, budget_bytes
        self.rows_per_round = rows_per_round
        self.best: tuple[Region, ...] | None = None
        self.best_remat: tuple[str, ...] = ()
        self.best_cost = best_cost
        self.best_peak: int | None = None
        self.on_better = on_better
        self.violated: set[tuple[str, int]] = set()

    def on_solution_callback(self) -> None:
        regions = extract_regions(self.graph, self.v, self.Value)
        remat = extract_remat(self.graph, self.v, self.Value)
        report = simulate(self.graph, regions, remat=remat)
        over = {(e.phase, e.node) for e in report.timeline if e.live_bytes > self.budget_bytes}
        missing = _fullest(report, over & self.v.deferred.keys())
        if missing:
            self.violated.update(missing[:self.rows_per_round])
            self.StopSearch()
        elif not over and report.cost_seconds < self.best_cost:
            self.best, self.best_cost, self.best_peak = regions, report.cost_seconds, report.peak_bytes
            self.best_remat = remat
            if self.on_better is not None:
                self.on_better(report.cost_seconds, report.peak_bytes)


def proof_search(
    graph: ComputeGraph,
    budget_bytes: int,
    regions: tuple[Region, ...] | None,
    ctx: SolveContext,
    *,
    seconds: float,
    seed: int = 0,
    window: int | None = None,
    bound: float = 0.0,
    announce: bool = True,
    remat: Sequence[int] = (),
    start_remat: tuple[str, ...] = (),
    seeded_rows: int = tuning.PROOF_SEEDED_ROWS,
    rows_per_round: int | None = tuning.PROOF_ROWS_PER_ROUND,
    light_presolve: bool = False,
    workers: int | None = None,
) -> LazyResult:
    """The proof phase: ``search_lazily`` with ``workers`` (None: ``proof_workers()``),
    ``seeded_rows`` up front and ``rows_per_round`` per round; or, when ``regions``' whole cost
    is recomputing some of a class of interchangeable nodes, the same search of the plans that
    recompute fewer of them (``fewer_of_a_class``). ``remat`` and ``start_remat``: the joint model's, as
    ``search_lazily`` takes them (the plans a rematerialisation recomputes are no class's), and
    so is ``light_presolve``."""
    options = {"seconds": seconds, "workers": workers or proof_workers(), "seed": seed, "window": window, "bound": bound,
               "announce": announce, "seeded_rows": seeded_rows, "rows_per_round": rows_per_round,
               "remat": remat, "start_remat": start_remat, "light_presolve": light_presolve}
    fewer = fewer_of_a_class(graph, regions) if regions is not None and not remat else None
    if fewer is None:
        return search_lazily(graph, budget_bytes, regions, ctx, **options)
    name = graph.nodes[fewer.nodes[0]].name
    log.log(logging.INFO if announce else logging.DEBUG, "ilp: the plan's cost is recomputing %d of the %d nodes "
            "like %s; the proof phase searches the plans recomputing fewer", fewer.most + 1, len(fewer.nodes), name)
    found = search_lazily(graph, budget_bytes, regions, ctx, within=fewer, **options)
    note = (f"searched the plans recomputing fewer than {fewer.most + 1} of the {len(fewer.nodes)} nodes like "
            f"{name}, the others costing at least as much")
    return dataclasses.replace(found, split=note)


def symmetric_classes(graph: ComputeGraph) -> list[tuple[int, ...]]:
    """Nodes with a recompute cost, grouped by what makes them interchangeable in the model: op,
    FLOPs, output bytes and the bytes they save (the same op of each repeated block). Groups of
    two or more, in execution order of their first node."""
    groups: dict[tuple, list[int]] = {}
    for node in graph.nodes:
        if round(node.fwd_cost * COST_SCALE) <= 0:
            continue
        saved = tuple(sorted(graph.storages[s].nbytes for s in node.saved))
        groups.setdefault((node.op, node.fwd_flops, node.output_bytes, saved), []).append(node.index)
    return [tuple(nodes) for nodes in groups.values() if len(nodes) > 1]


def fewer_of_a_class(graph: ComputeGraph, regions: tuple[Region, ...]) -> RecomputeAtMost | None:
    """When the whole cost of ``regions`` is recomputing k nodes of one ``symmetric_classes``
    class: the plans recomputing fewer than k of them, the only ones that may cost less (every
    plan recomputing k or more pays at least for the k cheapest). Else None.

    Why: CP-SAT branches on one variable at a time. When a plan recomputes, say, 17 of 23
    blocks' attention, the LP relaxation frees the bytes still missing with a fraction of an
    18th, and proving that nothing is cheaper means ruling that out for each of the many
    interchangeable choices of blocks. Among the plans recomputing at most 16, the LP must free
    those bytes some other way, and their search takes the plan's cost as a cutoff (how long
    each proof takes: docs/tuning.md, "ilp_lazy"). (Splitting on how
    many of a symmetric set of variables are set, rather than on one of them, is the idea of
    orbital branching: Ostrowski, Linderoth, Rossi and Smriglio, Math. Programming 126, 2011.)"""
    report = simulate(graph, regions)
    recomputed = set(report.recomputed)
    for nodes in symmetric_classes(graph):
        count = sum(1 for t in nodes if t in recomputed)
        if not count:
            continue
        least_seconds = sum(sorted(graph.nodes[t].fwd_cost for t in nodes)[:count])
        if least_seconds * COST_SCALE >= report.cost_seconds * COST_SCALE - _slack(graph):
            return RecomputeAtMost(nodes, count - 1)
    return None


def search_lazily(
    graph: ComputeGraph,
    budget_bytes: int,
    regions: tuple[Region, ...] | None,
    ctx: SolveContext,
    *,
    seconds: float,
    workers: int,
    deterministic_seconds: float | None = None,
    seed: int = 0,
    window: int | None = None,
    bound: float = 0.0,
    announce: bool = True,
    deferred_phases: frozenset[str] = DEFERRED_PHASES,
    seeded_rows: int = tuning.SEEDED_ROWS,
    rows_per_round: int | None = None,
    within: RecomputeAtMost | None = None,
    remat: Sequence[int] = (),
    start_remat: tuple[str, ...] = (),
    light_presolve: bool = False,
) -> LazyResult:
    """The cheapest one-level plan within ``budget_bytes`` the search finds in ``seconds``,
    starting from ``regions`` (a plan that fits, or None). With one worker the rounds share
    ``deterministic_seconds`` of CP-SAT's clock and the result is reproducible (see
    ``cpsat.configure``). ``bound``: a lower bound already proven. ``deferred_phases``: the
    phases whose rows wait for a plan to break them (none: one search on the whole model);
    ``seeded_rows``: how many of them join at once, those of the events where ``regions`` holds
    the most bytes; ``rows_per_round``: how many of the rows a plan breaks join after it (the
    fullest; None: all). ``within``: search only the plans in that range (``regions`` then
    only bounds the cost, and hints the search if it lies in the range; a range without plans
    ends ``OPTIMAL``: none is cheaper). A ``regions`` with a region longer than ``window``
    nodes is no plan of the model either: no round has a hint to start from, at least
    ``tuning.UNHINTED_SEEDED_ROWS`` rows join up front (events ``tuning.UNHINTED_ROW_GAP`` nodes
    apart where there are enough), every row a plan breaks joins after it, and
    only the plans cheaper than ``regions`` count, though CP-SAT is free to pass through dearer
    ones (the search ends ``OPTIMAL`` when none of the model's plans is cheaper). ``remat``:
    rematerialisation candidates (``ckptplan.remat``) the joint model decides beside the
    regions (``build_model``'s ``remat``), and ``start_remat`` the names
    ``regions`` rematerialises; a start the model cannot state (a name no candidate, or one its
    rules forbid) is taken as one past the window is. ``light_presolve``: each round's CP-SAT
    presolves once (``cpsat.lighten_presolve``). Ctrl-C ends the search with the best plan
    so far, and so does ``ctx``'s deadline when it comes before ``seconds`` have passed."""
    phase = ctx.within(seconds)
    model, v = build_model(graph, budget_bytes, window=window, deferred_phases=deferred_phases, remat=remat)
    if deferred_phases:  # the relaxation's bound rests on them; the whole model's search does better without
        add_bounding_clauses(model, v)
    if within is not None:
        within.restrict(model, v)
    model.Minimize(v.cost)
    deferred = len(v.deferred)
    slack = _slack(graph)
    best, best_cost, hinted, seeded = regions, math.inf, regions, 0
    best_remat = start_remat if regions is not None else ()
    # ``regions`` is no plan of this model: out of ``within``, a region past the window, or a
    # rematerialisation the model cannot state
    outside = False
    if regions is not None:
        report = simulate(graph, regions, remat=start_remat)
        best_cost = report.cost_seconds
        unstated = (any(region.end - region.start > v.window for region in regions)
                    or not _states(graph, v, start_remat))
        outside = (within is not None and not within.holds(report)) or unstated
        gap = 0
        if unstated and within is None:
            # No hint: every round starts from no plan, and stops at the first of CP-SAT's own
            # plans that breaks a row; those plans are not the start, so the rows stated up front
            # are spread over the step (docs/tuning.md, "ilp_lazy", ``tuning.UNHINTED_ROW_GAP``).
            seeded_rows, rows_per_round = max(seeded_rows, tuning.UNHINTED_SEEDED_ROWS), None
            gap = tuning.UNHINTED_ROW_GAP
        seeded = _seed_rows(v, report, seeded_rows, gap)
        if outside:
            hinted = None
            if within is not None:
                # CP-SAT never sees this plan as a solution, so it would prune with the dearer ones
                # it finds; only plans no dearer matter (model costs are within ``slack`` of
                # simulated ones). Without a range the search is not bounded so: from no hint,
                # CP-SAT's first plans are often dearer than the start, and its neighbourhood
                # workers improve on them (docs/tuning.md, "ilp_lazy", ``tuning.UNHINTED_SEEDED_ROWS``).
                model.Add(v.cost <= math.floor(best_cost * COST_SCALE) + slack)
    clock = deterministic_seconds if workers == 1 else None
    status, rounds = "UNKNOWN", 0
    scored = announce and within is None  # the whole graph's search: its plans and bound are the solve's
    while not ctx.cancelled:
        left = phase.left()
        if clock is not None and clock < tuning.MIN_CLOCK_SECONDS:
            break
        # The first round always runs (for at least tuning.MIN_WALL_SECONDS: see ``configure``); later
        # ones while the wall clock lasts, or, for the portfolio, while a round can still get going.
        if rounds and left < (tuning.MIN_WALL_SECONDS if clock is None else 0.0):
            break
        rounds += 1
        if hinted is not None:
            hint_complete(model, graph, v, hinted, ctx, remat=best_remat)
            left = phase.left()  # completing the hint solves a copy of the model
        solver = cp_model.CpSolver()
        configure(solver, wall_seconds=left, deterministic_seconds=left if clock is None else clock,
                  workers=workers, seed=seed)
        if light_presolve:
            lighten_presolve(solver)
        watcher = _Watcher(graph, v, budget_bytes, best_cost, rows_per_round, on_better=(
            (lambda cost, peak: ctx.report(cost_seconds=cost, peak_bytes=peak)) if scored else None))
        try:
            log.log(logging.INFO if announce else logging.DEBUG,
                    "ilp: %d worker(s), round %d, %d of %d backward and recompute rows in the model, up to %.0f s; "
                    "Ctrl-C stops early and keeps the best plan", workers, rounds, deferred - len(v.deferred),
                    deferred, solver.parameters.max_time_in_seconds)
            code = solve_interruptibly(solver, model, ctx, watcher)
        except KeyboardInterrupt:  # pressed as this was announced, before the search began
            ctx.cancel.set()
            break
        model.ClearHints()
        if clock is not None:
            clock -= solver.ResponseProto().deterministic_time
        if watcher.best is not None:
            best, best_cost, best_remat = watcher.best, watcher.best_cost, watcher.best_remat
            hinted = best
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            bound = max(bound, solver.BestObjectiveBound())
        if scored:
            ctx.report(bound_cost_seconds=bound / COST_SCALE)
        if code == cp_model.INFEASIBLE:
            if within is not None or outside:  # no plan of the model cheaper than ``best``
                bound = math.inf
                status = "OPTIMAL" if best is not None else "INFEASIBLE"
            elif best is None:
                status = "INFEASIBLE"
            else:  # a plan that fits breaks no row: the model and the simulator disagree (a bug)
                log.warning("ilp: the model rejects every plan, even one the simulator accepts")
            break
        if best is not None and bound >= best_cost * COST_SCALE - slack:
            status = "OPTIMAL"
            break
        if not watcher.violated:  # out of time, or a plan the simulator rejects on rows already in
            break
        add_events(v, sorted(watcher.violated))
    if status == "UNKNOWN" and best is not None:
        status = "FEASIBLE"
    cost = best_cost * COST_SCALE
    proto = model.Proto()
    return LazyResult(
        status=status, regions=best, cost=cost, bound=min(bound, cost), rounds=rounds, rows=deferred - len(v.deferred),
        deferred=deferred, seeded=seeded, variables=len(proto.variables), constraints=len(proto.constraints),
        seconds=phase.elapsed(), remat=best_remat,
    )
