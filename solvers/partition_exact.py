"""The least recomputation of a compiled step under a byte budget, found and proved by CP-SAT.

A pure kernel over a ``JointGraph``, run under the orchestration's ``SolveContext``. Its model
is ``ckptplan.partition``'s sweep written as constraints, so that any saved set meeting them peaks
as the model says; every partition it returns is simulated again, and only the simulated one is
returned.

Decisions and what follows from them, per forward value ``j`` the backward may need:

* ``s_j``: the forward saves ``j``; ``n_j``: the backward needs ``j`` (a backward node reads it,
  or a forward value it computes again does); ``r_j = n_j - s_j``: the backward computes ``j``
  again. A random draw or a write is never computed again (``r_j = 0``); a multi-output op is
  never saved (its parts are).
* ``f_j``: the forward computes ``j`` (it is an ancestor of a forward output or of a saved
  value). The objective charges ``j``'s cost when both ``r_j`` and ``f_j`` hold: a value only
  the backward needs is computed once, in the backward. A replayed random draw
  (``JointValue.replay``) is never computed by the forward (``f_j = 0``) and is charged
  whenever ``r_j`` holds; saving a replayed mask saves the forward's own, which the forward then
  computes and holds (``JointGraph.reading_drawn``).
* Where the backward computes ``j``: just before the first node of its fixed sequence (the
  backward nodes, and forward values the joint graph places among them, in joint order with each
  ``getitem`` raised after its tuple) that needs it through values computed again — the
  *slot* ``P_j``, the least of the slots of its readers, a recomputed reader's counting only when
  it is recomputed (a ``min`` constraint, so exact). Within a slot, values computed again run in
  forward order; the slot's own node runs last. So every point of the backward is a time
  ``width * slot + rank``.
* Until when ``j`` is live: the latest time of a reader (a ``max`` constraint, exact likewise).

Memory is then, at any point of either graph, a sum over storages of their bytes times a boolean
that each of the storage's holders, live there, forces to one. The rows are the points where the
partitions found so far peak over the budget, added lazily, as ``solvers.ilp_lazy`` adds its
memory rows: the model with some rows is a relaxation of the model with all of them, so an
optimum that the simulator confirms within budget is the optimum.

``least_partition`` asks the same model, with no objective, whether anything fits a budget, and
bisects on the budget to find a least peak below the one the greedy search states.
``tests/test_partition_exact.py`` checks both against every saved set of small joint graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from ortools.sat.python import cp_model

from ckptplan.errors import CkptPlanError
from ckptplan.joint import JointGraph
from ckptplan.partition import PartitionReport, forward_ancestors, raise_getitems, simulate_partition
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.cpsat import configure, solve_interruptibly
from ckptplan.solvers.partition import no_recompute

# The objective's integer units over the costliest value's seconds (docs/tuning.md, "partition_exact").
COST_UNITS = 10**6

ExactStatus = Literal["optimal", "feasible", "infeasible", "unknown"]


@dataclass(frozen=True)
class ExactPartition:
    """The best partition found (None when none within budget was), the kernel's ``status``
    (``optimal``: least recomputation proved; ``infeasible``: no partition fits, proved), the
    rows the model ended with and its rounds."""

    report: PartitionReport | None
    status: ExactStatus
    rows: int
    rounds: int
    deterministic_seconds: float = 0.0  # CP-SAT's deterministic clock over the rounds


@dataclass(frozen=True)
class _Layout:
    """What the graph alone fixes: the backward nodes that run (``runs``), the fixed sequence's
    slots, each forward value's rank in forward order, and the time scale."""

    first: int  # the first backward node reading a tangent; forward values before it are recomputed in slots
    runs: frozenset[int]
    slot: dict[int, int]
    end: int  # the slot after the sequence (values only the gradients need run there)
    rank: dict[int, int]
    width: int

    def time(self, slot: int, rank: int | None = None) -> int:
        """A point of the backward: a recomputed value of ``rank`` in ``slot``, or (None) the
        slot's own node."""
        return self.width * slot + (self.width - 1 if rank is None else rank)


def layout(graph: JointGraph) -> _Layout:
    """The backward's fixed sequence, as ``partition.backward_values`` orders it: the backward
    nodes the gradients need and, from the first that reads a tangent on, every forward value
    too (those it needs run in place), each ``getitem`` after its tuple."""
    values = graph.values
    runs: set[int] = set()
    stack = list(graph.backward_outputs)
    while stack:
        i = stack.pop()
        if i not in runs and values[i].phase == "backward":
            runs.add(i)
            stack.extend(values[i].inputs)
    tangent_users = [j for v in values if v.phase == "tangent" for j in graph.users[v.index] if j in runs]
    first = min(tangent_users, default=0)
    forward = [v.index for v in values if v.phase == "forward"]
    sequence = raise_getitems(graph, sorted(runs | {i for i in forward if i >= first}))
    rank = {i: position for position, i in enumerate(raise_getitems(graph, forward))}
    return _Layout(first, frozenset(runs), {i: p for p, i in enumerate(sequence)}, len(sequence), rank,
                   width=len(forward) + 1)


Literal_ = int | cp_model.IntVar  # 0, 1 or a boolean variable (in rows: any 0/1 linear expression)


@dataclass
class _Model:
    """The CP-SAT model of one graph and budget, with its rows so far."""

    graph: JointGraph
    budget_bytes: int
    at: _Layout
    model: cp_model.CpModel = field(default_factory=cp_model.CpModel)
    saved: dict[int, Literal_] = field(default_factory=dict)
    needed: dict[int, Literal_] = field(default_factory=dict)
    forward: dict[int, Literal_] = field(default_factory=dict)
    place: dict[int, object] = field(default_factory=dict)  # slot: an int or an IntVar
    place_bounds: dict[int, tuple[int, int]] = field(default_factory=dict)  # when recomputed
    end: dict[int, object] = field(default_factory=dict)  # last reader's time in the backward
    end_bounds: dict[int, tuple[int, int]] = field(default_factory=dict)
    rows: set[tuple] = field(default_factory=set)
    _cache: dict[tuple, Literal_] = field(default_factory=dict)

    # -- what each value can be ------------------------------------------------------------

    def build(self, objective: bool = True) -> None:
        graph, at, values, m = self.graph, self.at, self.graph.values, self.model
        forward_ids = [v.index for v in values if v.phase == "forward"]
        wanted = set(graph.backward_outputs)
        may: set[int] = set()  # forward values the backward may need
        for j in reversed(forward_ids):
            if j in wanted or any(k in at.runs or (k in may and values[k].recomputable) for k in graph.users[j]):
                may.add(j)
        for j in reversed(forward_ids):
            if j not in may:
                continue
            v = values[j]
            direct = j in wanted or any(k in at.runs for k in graph.users[j])
            later = [k for k in graph.users[j] if k in may and values[k].recomputable]
            needed: Literal_ = 1 if direct else m.NewBoolVar(f"n{j}")
            saved: Literal_ = 0 if v.multi_output else m.NewBoolVar(f"s{j}")
            self.needed[j], self.saved[j] = needed, saved
            if not v.recomputable:
                m.Add(saved == needed)  # a random draw's tuple is never needed: its parts are saved
            else:
                m.Add(saved <= needed)
            if not direct:
                m.Add(needed <= sum(self.again(k) for k in later))
            for k in later:
                m.Add(needed >= self.again(k))
        self._forward(forward_ids)
        self._placements()
        self._ends()
        if objective:
            self._objective()

    def _forward(self, forward_ids: list[int]) -> None:
        """``f_j``: the forward computes the ancestors of its outputs and effects, and of what
        it saves."""
        graph, m = self.graph, self.model
        always = forward_ancestors(graph, graph.forward_roots)
        twins_of = graph.twins_of
        for j in reversed(forward_ids):
            if j in always:
                self.forward[j] = 1
                continue
            if graph.values[j].replay or j in graph.drawn_for:  # the forward never computes a replay's values
                self.forward[j] = 0
                continue
            sources = [x for x in (self.saved.get(j, 0), *(self.forward.get(k, 0) for k in graph.users[j]))
                       if not isinstance(x, int)]
            sources += [self.saved[t] for t in twins_of.get(j, ()) if not isinstance(self.saved.get(t, 0), int)]
            if not sources:
                self.forward[j] = 0
                continue
            f = m.NewBoolVar(f"f{j}")
            for x in sources:
                m.Add(f >= x)
            m.Add(f <= sum(sources))
            self.forward[j] = f

    def again(self, j: int):
        """``r_j``: the backward computes ``j`` again (a 0/1 linear expression, or 0)."""
        if j not in self.needed or not self.graph.values[j].recomputable:
            return 0
        return self.needed[j] - self.saved[j]

    def _placements(self) -> None:
        """``P_j`` for each value computed again before the fixed sequence: the least slot of its
        readers that run in the backward (one past the sequence when it is not computed again)."""
        graph, at, values, m = self.graph, self.at, self.graph.values, self.model
        big = at.end + 2
        own: dict[int, tuple[object, tuple[int, int]]] = {}  # a getitem's slot by its own readers
        for j in sorted(self.needed, reverse=True):
            if not values[j].recomputable:
                continue
            if j >= at.first:
                self.place[j], self.place_bounds[j] = at.slot[j], (at.slot[j], at.slot[j])
                continue
            fixed = [at.slot[k] for k in graph.users[j] if k in at.runs]
            if j in graph.backward_outputs:
                fixed.append(at.end)
            terms, lows, highs = [], [], []
            for k in graph.users[j]:
                if k not in self.needed or not values[k].recomputable:
                    continue
                slot, (low, high) = own[k] if k in own else (self.place[k], self.place_bounds[k])
                terms.append(slot + big * (1 - self.again(k)))
                lows.append(low)
                highs.append(high)
            bounds = (min(fixed + lows), min(fixed) if fixed else max(highs))
            if terms:
                var = m.NewIntVar(bounds[0], at.end + 1, f"p{j}")
                m.AddMinEquality(var, [at.end + 1, *fixed, *terms])
            else:
                var = min(fixed)
            if values[j].op == "getitem" and values[values[j].inputs[0]].multi_output:
                own[j] = (var, bounds)
            else:
                self.place[j], self.place_bounds[j] = var, bounds
        for j, (var, bounds) in own.items():  # a getitem runs right after its tuple
            parent = values[j].inputs[0]
            self.place[j], self.place_bounds[j] = (
                (self.place[parent], self.place_bounds[parent]) if parent in self.place else (var, bounds))

    def time_of(self, j: int):
        """The time ``j`` runs at in the backward (when it runs there), and its bounds."""
        at = self.at
        if j >= at.first:
            t = at.time(at.slot[j])
            return t, (t, t)
        low, high = self.place_bounds[j]
        return at.width * self.place[j] + at.rank[j], (at.time(low, at.rank[j]), at.time(high, at.rank[j]))

    def _ends(self) -> None:
        """``E_j``: the time of ``j``'s last reader in the backward."""
        graph, at, values, m = self.graph, self.at, self.graph.values, self.model
        big = at.width * (at.end + 4)
        kept = at.time(at.end + 1)
        for j in self.needed:
            fixed = [at.time(at.slot[k]) for k in graph.users[j] if k in at.runs]
            if j in graph.backward_outputs:
                fixed.append(kept)
            terms, highs = [], []
            for k in graph.users[j]:
                if k not in self.needed or not values[k].recomputable:
                    continue
                t, (_, high) = self.time_of(k)
                terms.append(t - big * (1 - self.again(k)))
                highs.append(high)
            low = max(fixed, default=-big)
            high = max([*fixed, *highs], default=-big)
            if terms:
                var = m.NewIntVar(-big, max(high, 0), f"e{j}")
                m.AddMaxEquality(var, [*fixed, *terms])
                self.end[j] = var
            else:
                self.end[j] = low
            self.end_bounds[j] = (low, high)

    def _objective(self) -> None:
        values, m = self.graph.values, self.model
        top = max((values[j].cost for j in self.needed), default=0.0)
        if top <= 0:
            return
        terms = []
        for j in self.needed:
            again = self.again(j)
            if values[j].cost <= 0 or isinstance(again, int):
                continue
            weight = max(1, round(values[j].cost / top * COST_UNITS))  # what costs anything costs
            if values[j].replay:  # a replayed draw is recomputation wherever the backward makes it
                terms.append(weight * again)
                continue
            if isinstance(self.forward.get(j, 0), int):
                if self.forward.get(j, 0) == 1:
                    terms.append(weight * again)
                continue
            charged = m.NewBoolVar(f"c{j}")
            m.Add(charged >= again + self.forward[j] - 1)
            terms.append(weight * charged)
        m.Minimize(sum(terms))

    # -- rows ----------------------------------------------------------------------------------

    def _at_most(self, key: str, var, bound: int, low: int, high: int) -> Literal_:
        """A literal for ``var <= bound`` (``var`` an int, or a variable within ``low..high``)."""
        if isinstance(var, int):
            return int(var <= bound)
        if high <= bound:
            return 1
        if low > bound:
            return 0
        cache = (key, id(var), bound)
        if cache not in self._cache:
            b = self.model.NewBoolVar(f"{key}<={bound}")
            self.model.Add(var <= bound).OnlyEnforceIf(b)
            self.model.Add(var >= bound + 1).OnlyEnforceIf(b.Not())
            self._cache[cache] = b
        return self._cache[cache]

    def _placed_by(self, j: int, slot: int) -> Literal_:
        """A literal for: the backward computes ``j`` again in ``slot`` or before it."""
        return self._at_most("p", self.place[j], slot, *self.place_bounds[j])

    def add_row(self, point: tuple) -> None:
        """The memory at ``point`` within the budget: ``("forward", value)``, ``("backward",
        value, time)`` (value -1: the backward's start)."""
        if point in self.rows:
            return
        self.rows.add(point)
        holds: dict[int, list[list[Literal_]]] = {}  # storage -> conjunctions that keep it live
        extra: list = []
        if point[0] == "forward":
            self._forward_row(point[1], holds, extra)
        else:
            self._backward_row(point[1], point[2], holds, extra)
        graph, m = self.graph, self.model
        static = graph.static_storages
        constant = 0
        terms = []
        for s, conditions in holds.items():
            if s in static:
                continue
            conditions = [[x for x in c if not (isinstance(x, int) and x == 1)] for c in conditions]
            conditions = [c for c in conditions if not any(isinstance(x, int) and x == 0 for x in c)]
            if not conditions:
                continue
            if any(not c for c in conditions):
                constant += graph.storage_bytes[s]
                continue
            if len(conditions) == 1 and len(conditions[0]) == 1:
                terms.append(graph.storage_bytes[s] * conditions[0][0])
                continue
            live = m.NewBoolVar(f"live{s}@{point}")
            for c in conditions:
                m.Add(live >= sum(c) - (len(c) - 1))
            terms.append(graph.storage_bytes[s] * live)
        m.Add(sum(terms) + sum(extra) <= self.budget_bytes - graph.static_bytes - constant)

    def _forward_row(self, i: int, holds, extra) -> None:
        graph, at, values = self.graph, self.at, self.graph.values
        here = at.rank[i]
        outputs = set(graph.forward_outputs)
        # A saved twin is its original: the forward computes and holds that one.
        twins_of = graph.twins_of
        for j, position in at.rank.items():
            if position > here or j in graph.drawn_for:
                continue
            computed = self.forward.get(j, 0)
            if isinstance(computed, int) and computed == 0:
                continue
            conditions: list[list[Literal_]] = []
            if j == i or j in outputs:
                conditions.append([computed])
            for saved in (self.saved.get(j, 0), *(self.saved.get(t, 0) for t in twins_of.get(j, ()))):
                if not (isinstance(saved, int) and saved == 0):
                    conditions.append([saved])
            for k in graph.users[j]:
                if values[k].phase == "forward" and at.rank[k] >= here:
                    conditions.append([self.forward.get(k, 0)])
            for s in values[j].storages:
                holds.setdefault(s, []).extend(conditions)
        workspace = values[i].workspace_bytes
        if workspace:
            extra.append(workspace * self.forward.get(i, 0))

    def _backward_row(self, i: int, time: int, holds, extra) -> None:
        graph, at, values = self.graph, self.at, self.graph.values
        for b in at.runs:
            readers = [at.time(at.slot[k]) for k in graph.users[b] if k in at.runs]
            last = at.time(at.end + 1) if b in graph.backward_outputs else max(readers, default=at.time(at.slot[b]))
            if at.time(at.slot[b]) <= time <= last:
                for s in values[b].storages:
                    holds.setdefault(s, []).append([])
        for v in values:
            if v.phase == "tangent":
                readers = [at.time(at.slot[k]) for k in graph.users[v.index] if k in at.runs]
                if v.index in graph.caller_held or (readers and time <= max(readers)):
                    for s in v.storages:
                        holds.setdefault(s, []).append([])
        for j in (*graph.forward_outputs, *graph.caller_held) if graph.outputs_live else graph.caller_held:
            for s in values[j].storages:
                holds.setdefault(s, []).append([])
        extra.append(graph.caller_bytes)
        for j in self.needed:
            low, high = self.end_bounds[j]
            if high < time:
                continue
            alive = 1 - self._at_most("e", self.end[j], time - 1, low, high)
            conditions: list[list[Literal_]] = []
            if not (isinstance(self.saved[j], int) and self.saved[j] == 0):
                # A saved twin is its original: that one's storages are held.
                held = values[graph.drawn_for.get(j, j)].storages
                for s in held:
                    holds.setdefault(s, []).append([self.saved[j], alive])
            again = self.again(j)
            if not isinstance(again, int):
                t, _ = self.time_of(j)
                if j >= at.first:
                    started: Literal_ = int(t <= time)
                else:
                    started = self._placed_by(j, (time - at.rank[j]) // at.width)
                conditions.append([again, started, alive])
            for s in values[j].storages:
                holds.setdefault(s, []).extend(conditions)
        if i >= 0 and values[i].workspace_bytes:
            workspace = values[i].workspace_bytes
            if i in at.runs:
                extra.append(workspace)
            elif i >= at.first:
                extra.append(workspace * self.again(i))
            elif i in self.place and not isinstance(self.again(i), int):
                slot = (time - at.rank[i]) // at.width
                upto, before = self._placed_by(i, slot), self._placed_by(i, slot - 1)
                here = self.model.NewBoolVar(f"ran{i}@{time}")
                parts = [self.again(i), upto, 1 - before]
                self.model.Add(here >= sum(parts) - 2)
                extra.append(workspace * here)

    def points(self, saved: Iterable[int]) -> tuple[PartitionReport, list[tuple[tuple, int]]]:
        """The simulated report of ``saved`` and its points with their live bytes."""
        notes: list[tuple[int, bool, int]] = []
        report = simulate_partition(self.graph, saved, notes)
        at = self.at
        found: list[tuple[tuple, int]] = []
        order = report.backward_order
        slot_after: dict[int, int] = {}
        upcoming = at.end
        for i in reversed(order):
            if i in at.slot:
                upcoming = at.slot[i]
            slot_after[i] = upcoming
        for i, backward, live in notes:
            if not backward:
                found.append((("forward", i), live))
            elif i < 0:
                found.append((("backward", -1, -1), live))
            elif i in at.slot:
                found.append((("backward", i, at.time(at.slot[i])), live))
            else:
                found.append((("backward", i, at.time(slot_after[i], at.rank[i])), live))
        return report, found

    def saved_set(self, value) -> frozenset[int]:
        return frozenset(j for j, s in self.saved.items() if not isinstance(s, int) and value(s))

    def hint(self, saved: frozenset[int]) -> None:
        drawn = self.graph.drawn_for
        for j, s in self.saved.items():
            if not isinstance(s, int):
                self.model.AddHint(s, int(j in saved or drawn.get(j) in saved))


def solve_partition_exact(
    graph: JointGraph, budget_bytes: int, ctx: SolveContext, incumbent: PartitionReport | None = None,
    *, fit_only: bool = False, deterministic_seconds: float | None = None,
) -> ExactPartition:
    """The saved set of least recomputation seconds within ``budget_bytes``, as far as ``ctx``
    lets the search go; ``incumbent``, a partition found otherwise, seeds the rows and, within
    budget, the hint, and is returned if nothing better is found. ``fit_only``: any saved set
    within the budget will do (no objective; the first found ends the search).
    ``deterministic_seconds``: the search runs one CP-SAT worker for at most that much of its
    deterministic clock over all rounds, so that it ends the same on every run unless ``ctx``'s
    deadline comes first (None: ``tuning.EXACT_WORKERS`` workers, each round sized by ``ctx.limit``).

    Each round solves the model with its rows so far and simulates every solution CP-SAT finds
    as it finds it: the first one over the budget ends the round, its points furthest over
    become rows; one that fits is kept if it recomputes less than the best so far. A round that
    ends with no solution over the budget ends the search: proved optimal (or infeasible) when
    CP-SAT proved it, else cut off by ``ctx``."""
    room = budget_bytes - graph.static_bytes
    state = _Model(graph, budget_bytes, layout(graph))
    state.build(objective=not fit_only)
    watch = _Watch(state, room, ctx, fit_only)
    if incumbent is not None and incumbent.peak_bytes <= budget_bytes:
        watch.best = incumbent
    for saved in ([incumbent.saved] if incumbent is not None else []) + [no_recompute(graph)]:
        _, points = state.points(saved)
        for point, _ in _fullest(points):
            state.add_row(point)
    rounds, spent = 0, 0.0
    status: ExactStatus = "unknown"
    while not ctx.over() and (deterministic_seconds is None or spent < deterministic_seconds):
        rounds += 1
        if watch.best is not None:
            state.model.ClearHints()
            state.hint(frozenset(watch.best.saved))
        solver = cp_model.CpSolver()
        if deterministic_seconds is None:
            configure(solver, wall_seconds=ctx.left(), deterministic_seconds=ctx.limit, workers=tuning.EXACT_WORKERS,
                      seed=0)
        else:
            configure(solver, wall_seconds=ctx.left(), deterministic_seconds=deterministic_seconds - spent,
                      workers=1, seed=0)
        watch.over = []
        code = solve_interruptibly(solver, state.model, ctx, watch)
        spent += solver.deterministic_time
        if watch.over:
            added = [point for point, _ in _fullest(watch.over) if point not in state.rows]
            if not added:
                raise CkptPlanError(
                    f"The exact partition model of {graph.name} fits a saved set the simulator puts over the budget "
                    "at a point it already constrains; this is a bug in ckptplan, please report it."
                )
            for point in added:
                state.add_row(point)
            continue
        if code == cp_model.OPTIMAL or (code == cp_model.INFEASIBLE and watch.best is None):
            status = "infeasible" if watch.best is None else "optimal"
        elif watch.best is not None:
            status = "feasible"
        break
    if status == "unknown" and watch.best is not None:
        status = "feasible"
    return ExactPartition(report=watch.best, status=status, rows=len(state.rows), rounds=rounds,
                          deterministic_seconds=spent)


class _Watch(cp_model.CpSolverSolutionCallback):
    """Simulates each solution CP-SAT finds: keeps the best within the budget (``best``), stops
    the search at the first over it, its points over the budget in ``over`` (and, ``fit_only``,
    at the first within it)."""

    def __init__(self, state: _Model, room: int, ctx: SolveContext, fit_only: bool = False) -> None:
        super().__init__()
        self.state, self.room, self.ctx, self.fit_only = state, room, ctx, fit_only
        self.best: PartitionReport | None = None
        self.over: list[tuple[tuple, int]] = []

    def on_solution_callback(self) -> None:
        report, points = self.state.points(self.state.saved_set(self.Value))
        over = [(p, live) for p, live in points if live > self.room]
        if over:
            self.over = over
            self.StopSearch()
            return
        best = self.best
        if best is None or (report.recompute_seconds, report.peak_bytes) < (best.recompute_seconds, best.peak_bytes):
            self.best = report
            self.ctx.report(cost_seconds=report.recompute_seconds, peak_bytes=report.peak_bytes)
        if self.fit_only:
            self.StopSearch()


def _fullest(points: list[tuple[tuple, int]]) -> list[tuple[tuple, int]]:
    """The ``tuning.EXACT_ROWS_PER_ROUND`` points of most live bytes."""
    return sorted(points, key=lambda p: -p[1])[:tuning.EXACT_ROWS_PER_ROUND]


def least_partition(
    graph: JointGraph, ctx: SolveContext, least: PartitionReport, infeasible_bytes: int, deterministic_seconds: float,
) -> tuple[PartitionReport, int]:
    """A partition of lower peak than ``least`` where the exact model finds one: a bisection on
    the budget between ``infeasible_bytes``, a budget proved to fit nothing, and the least peak
    found so far, each probe the exact model's search for any saved set within it. A probe that
    finds one lowers the least; one that proves none raises the bound; one that runs out of its
    time leaves the budgets below it untried. Stops when the least and the lowest budget left are
    within ``tuning.EXACT_LEAST_RESOLUTION`` of each other, or when the time is up. Returns the least partition
    found and the greatest budget proved to fit nothing.

    The probes share ``deterministic_seconds`` of CP-SAT's deterministic clock, each probe what
    the earlier ones left over the probes to come, so that the same graph, start and bound give
    the same least on every run, unless ``ctx``'s deadline cuts a probe short."""
    probe_ctx = ctx.unscored()
    low = infeasible_bytes  # budgets at or below it are proved infeasible, or given up on
    left = deterministic_seconds
    for probes_left in range(tuning.EXACT_LEAST_PROBES, 0, -1):
        if ctx.over() or left <= 0 or least.peak_bytes - low <= tuning.EXACT_LEAST_RESOLUTION * least.peak_bytes:
            break
        budget = (low + least.peak_bytes) // 2
        found = solve_partition_exact(graph, budget, probe_ctx, fit_only=True, deterministic_seconds=left / probes_left)
        left -= found.deterministic_seconds
        if found.report is not None:
            least = found.report
        else:
            low = budget
            if found.status == "infeasible":
                infeasible_bytes = budget
    return least, infeasible_bytes
