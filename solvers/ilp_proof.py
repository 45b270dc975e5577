"""The proof phase of solver ``ilp``: CP-SAT's parallel portfolio on a relaxation of the model
whose memory rows join it only once a plan breaks them (row generation).

Most of the model is the memory of backward and recompute events (``ilp_model``: one row per
node and phase, each a sum over the storages alive there, with the booleans that define them),
yet at an optimum only a few of those rows bind, near the start of backward where the peak
sits. So the proof builds the model with the forward rows only (and
``IlpVars.bounding_clauses``), simulates every plan the search reports, and, as soon as one
breaks the budget, adds the rows of the events where it does and searches again, hinted with
the cheapest plan that fits. Every model along the way is a relaxation of the whole model, so
each lower bound CP-SAT proves holds for the whole model too: the proof is done when the bound
meets the cheapest plan the simulator accepts. This is lazy constraint generation, as
branch-and-cut solvers do for rows too many to state up front.

Measured with ``benchmarks/ilp_speed.py`` (8 workers, this 2-core machine): the GPT example at
50% of its peak is proven optimal in about 40 s, where the whole model reached no bound above
zero in 60 s; the two-layer GPT-2 at 50% in about 50 s, finding a cheaper plan (6.7% of the
step against 7.3%) on the way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from ckptplan.graph import ComputeGraph
from ckptplan.plan import Region
from ckptplan.simulation import simulate
from ckptplan.solvers.cpsat import (
    MIN_WALL_SECONDS,
    StoppingCallback,
    configure,
    extract_regions,
    hint_complete,
    solve_keeping_sigint,
    stopped,
)
from ckptplan.solvers.ilp_model import COST_SCALE, IlpVars, add_bounding_clauses, add_events, build_model

log = logging.getLogger(__name__)

DEFERRED_PHASES = frozenset({"backward", "recompute"})
PROOF_WORKERS = 8  # CP-SAT's portfolio: its LP- and core-based workers raise the lower bound


@dataclass(frozen=True)
class Proof:
    """What the proof phase ends with. ``regions`` is the cheapest plan the simulator accepted
    (the one given, unless the search found a strictly cheaper one), ``cost`` its simulated
    cost and ``bound`` a proven lower bound on every plan's, both in ``COST_SCALE`` units;
    ``rows`` counts the event rows added of ``deferred`` left out."""

    regions: tuple[Region, ...]
    cost: float
    bound: float
    optimal: bool
    rounds: int
    rows: int
    deferred: int
    seconds: float


class _Watcher(StoppingCallback):
    """Simulates each plan the search reports: keeps the cheapest that fits the budget, and
    stops the search at the first that does not and breaks rows the model still lacks
    (``violated``: those events)."""

    def __init__(self, graph: ComputeGraph, v: IlpVars, budget_bytes: int, best_cost: float) -> None:
        super().__init__()
        self.graph, self.v, self.budget_bytes = graph, v, budget_bytes
        self.best: tuple[Region, ...] | None = None
        self.best_cost = best_cost
        self.violated: set[tuple[str, int]] = set()

    def on_solution_callback(self) -> None:
        regions = extract_regions(self.graph, self.v, self.Value)
        report = simulate(self.graph, regions)
        over = {(e.phase, e.node) for e in report.timeline if e.live_bytes > self.budget_bytes}
        missing = over & self.v.deferred.keys()
        if missing:
            self.violated |= missing
            self.stop()
        elif not over and report.cost_seconds < self.best_cost:
            self.best, self.best_cost = regions, report.cost_seconds


def prove(
    graph: ComputeGraph,
    budget_bytes: int,
    regions: tuple[Region, ...],
    *,
    seconds: float,
    seed: int = 0,
    window: int | None = None,
    bound: float = 0.0,
    announce: bool = True,
) -> Proof:
    """Prove the one-level plan ``regions`` (which fits ``budget_bytes``) optimal among the
    ``ilp`` model's plans, or find cheaper ones, within ``seconds``. ``bound``: a lower bound
    already proven. Not reproducible (the portfolio's workers race); Ctrl-C ends it with the
    best plan so far."""
    started = time.perf_counter()
    deadline = started + seconds
    model, v = build_model(graph, budget_bytes, window=window, deferred_phases=DEFERRED_PHASES)
    add_bounding_clauses(model, v)
    model.Minimize(v.cost)
    deferred = len(v.deferred)
    best, best_cost = regions, simulate(graph, regions).cost_seconds
    # The model rounds each node's cost to a whole COST_SCALE unit: its objective for a plan may
    # fall short of the simulated cost by half a unit per term (recomputed, start, inkeep).
    slack = 1.5 * len(graph.nodes) + 1
    rounds = 0
    optimal = False
    while not stopped.is_set():
        left = deadline - time.perf_counter()
        if left < MIN_WALL_SECONDS:
            break
        rounds += 1
        hint_complete(model, graph, v, best)
        solver = cp_model.CpSolver()
        configure(solver, wall_seconds=left, deterministic_seconds=left, workers=PROOF_WORKERS, seed=seed)
        watcher = _Watcher(graph, v, budget_bytes, best_cost)
        log.log(logging.INFO if announce else logging.DEBUG,
                "ilp proof, round %d: %d of %d backward and recompute rows in the model, up to %.0f s left",
                rounds, deferred - len(v.deferred), deferred, left)
        code = solve_keeping_sigint(solver, model, watcher)
        model.ClearHints()
        if watcher.best is not None:
            best, best_cost = watcher.best, watcher.best_cost
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            bound = max(bound, solver.BestObjectiveBound())
        if bound >= best_cost * COST_SCALE - slack:
            optimal = True
            break
        if code == cp_model.INFEASIBLE:  # the plan given fits, so this is a model/simulator bug
            log.warning("ilp proof: the relaxed model rejects every plan, even one that fits")
            break
        if not watcher.violated:  # out of time, or a plan the simulator rejects on rows already in
            break
        add_events(model, v, sorted(watcher.violated))
    return Proof(
        regions=best, cost=best_cost * COST_SCALE, bound=min(bound, best_cost * COST_SCALE), optimal=optimal,
        rounds=rounds, rows=deferred - len(v.deferred), deferred=deferred, seconds=time.perf_counter() - started,
    )
