"""The CP-SAT model behind solver ``ilp``: one-level checkpoint regions with per-node keep-sets.

The plan space is what ``planner.emit`` runs: disjoint regions over the execution order (edges
only at ``graph.boundaries``), each recomputed by non-reentrant ``checkpoint``, and inside them
nodes whose outputs a selective policy keeps. Nesting is left to ``dp``. The model states the
live bytes of every event ``planner.simulate`` observes — each forward op, each region's
recompute op, each backward op — as linear expressions over the decisions, so a plan satisfies
the model exactly when the simulator's peak for it is within the peak variable (see
``tests/test_ilp.py``, which fixes random plans and compares). Ideas from Checkmate (Jain et
al. 2020: a boolean per retained tensor and stage) and Moccasin (Bartan et al. 2023: retention
as intervals in CP-SAT); here retention is tied to PyTorch's checkpoint semantics instead of a
free schedule, so each storage needs only one boolean per event inside its own retention window.

Memory is counted in exact bytes; costs are ``fwd_cost`` seconds scaled to integers by
``COST_SCALE``.

Decision families (``t`` a node index, ``n`` nodes):

* ``rec_{t}`` — node t runs inside a region.
* ``start_{t}`` — a region starts at node t (only at a boundary).
* ``keep_{t}`` — node t is inside a region and its outputs are kept (cached in forward).
* ``remat_{x}`` — candidate x (``build_model``'s ``remat``; ``ckptplan.remat``) is
  rematerialised: outside every region, its output is dropped after forward by the savers
  outside regions and recomputed in each one's backward. No two where one reads the other's
  output through a view (``remat.conflicts``), no chain three deep (``remat.deep_chains``).

Derived families (each defined by constraints next to where it is created):

* ``cont_{t}`` — node t is in the same region as node t-1 (``rec_t`` and not ``start_t``).
* ``same_{a}_{b}`` — nodes a ≤ b are in one region (only for ``b - a < window``).
* ``trigafter_{t}`` — t's region holds a *trigger* at t or later: a node whose backward runs
  and that saved something, which is where PyTorch recomputes the region. ``nexttrig_{t}``:
  t+1 is in t's region and ``trigafter_{t+1}``.
* ``nextstop_{t}`` — t+1 is in t's region and ``stopafter_{t+1}`` (t is not the early stop).
* ``hastrig_{t}`` — t's region holds a trigger somewhere (it is recomputed at all).
* ``stopafter_{t}`` — t's region holds a node that saves something at t or later: t runs in
  the recompute (early stop ends it at the last such node).
* ``last_trig_{t}`` — t is the last trigger of its region: the recompute happens just before
  t's backward.
* ``held_{s}`` — activation storage s is held past its last forward use (saved by a node
  outside regions, an input of a region, or cached by a kept node). ``input_{q}_{u}``: node
  u reads q's output from outside its own region. ``retained_{i}``: a running sum of the
  ``held`` bytes the forward carries past node i (folds long sums).
* ``alive_{s}_{i}`` — the original storage s is still held at node i's backward event.
  Holders release as backward passes them (a saver at its own backward, a region's inputs and
  cache at its start), so ``alive`` is monotone in i, and ``held_s`` for i past every release.
* ``copy_{s}_{i}`` — the recomputed copy of s is held at node i's backward event.
* ``rc_{s}_{t}`` — the recomputed copy of s is live while the recompute runs node t.
* ``cachelive_{s}_{j}_{t}`` — kept node j's cached s is live while its region's recompute runs
  t; ``savedin_{s}_{j}``: a node of j's region saves s (then ``alive`` counts it instead),
  ``savedby_{s}_{j}_{jp}``: node jp, in j's region, saves it.
* Made on demand: ``copy``, ``rc`` and ``cachelive`` with the one memory row that reads them;
  ``alive_{s}_{i}`` and ``trigger_bytes_{t}`` (below) when a row first reads them, and the
  ``same`` their definitions read. So a model built without the backward and recompute rows
  (``build_model``'s ``deferred_phases``) holds little beyond the decisions and the forward
  rows until ``add_events`` adds rows, instead of families CP-SAT's presolve would only remove
  again, slowly on the larger graphs.
* ``again_{x}_{j}`` — saver j of rematerialised x's output lies outside regions, so j's backward
  recomputes x: x's fresh bytes and forward workspace join j's backward event, and the objective
  pays x's forward seconds and ``graph.remat_cost`` (a lower bound: it only adds).
* ``chain_{x}_{y}_{j}`` — ``again_{x}_{j}`` and x reads rematerialised y directly (a chain,
  ``remat.chains``): j's recompute of x recomputes y first. The objective pays y's forward
  seconds and ``graph.remat_cost``, exactly as the simulator does; y's fresh bytes and workspace
  join j's backward event, which the simulator counts only while the unpack runs, before the
  backward allocates: a bound from above there, so the model never claims a plan below its
  simulated peak, and is exact for plans without chains.
* ``recomputed_{t}`` — node t is recomputed (in a region that is recomputed, before its early
  stop, not kept): what the objective pays for, with the machinery's cost (``_machinery_cost``:
  per ``start``, ``rec`` and ``keep``). ``IlpVars.bounding_clauses``: redundant
  pairs ``held_s or recomputed_p`` that tighten the LP relaxation (``hold_or_recompute``).

Every derived boolean that only ever adds memory or cost is bounded from below only (the
solver has no reason to raise it); those used both ways (``cont``, ``same``, ``trigafter``,
``stopafter``, ``nexttrig``, ``nextstop``) are defined exactly.

Integer families: ``peak`` (bytes, bounded by the budget) and ``trigger_bytes_{t}``: bytes held
when t's region starts recomputing (everything but the recompute's own tensors).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from ckptplan.graph import ComputeGraph
from ckptplan.remat import chains, conflicts, deep_chains, savers
from ckptplan.sharding import unit_edges
from ckptplan.simulation import gradient_bytes, made_at_early_stop, why_not_keep
from ckptplan.solvers import tuning

# A memory row: ``live <= peak`` when every literal of ``enforce`` holds.
Row = tuple[cp_model.LinearExprT, list]
COST_SCALE = 2.0**40  # integer cost units per second (synthetic test costs are exact multiples)


@dataclass
class IlpVars:
    """The decision variables of a built model, by node index, and its structure."""

    rec: list[cp_model.IntVar]
    start: list[cp_model.IntVar]
    keep: dict[int, cp_model.IntVar]
    peak: cp_model.IntVar
    cost: cp_model.LinearExpr
    window: int
    counts: dict[str, int] = field(default_factory=dict)
    bounding_clauses: list[tuple[cp_model.IntVar, ...]] = field(default_factory=list)
    # ``remat_{x}`` by candidate node (empty unless ``build_model`` was given candidates).
    remat: dict[int, cp_model.IntVar] = field(default_factory=dict)
    # ``recomputed_{t}`` by node, for the nodes whose recompute costs something (the objective's terms).
    recomputed: dict[int, cp_model.IntVar] = field(default_factory=dict)
    # Memory rows left out of the model, by event (``build_model``'s ``deferred_phases``): each
    # adds its row to the model when called, with the variables it reads that the model lacks
    # (see "Made on demand" above).
    deferred: dict[tuple[str, int], Callable[[], None]] = field(default_factory=dict)
    # States the constraints of the ``alive`` variables rows made since its last call (``add_events``).
    link_alive: Callable[[], None] = field(default=lambda: None)


class _Builder:
    def __init__(
        self, graph: ComputeGraph, budget_bytes: int | None, window: int, deferred_phases: frozenset[str] = frozenset(),
        remat: Sequence[int] = (),
    ) -> None:
        self.g = graph
        self.remat_candidates = tuple(sorted(remat))
        self.n = n = len(graph.nodes)
        self.W = window
        self.m = cp_model.CpModel()
        self.base = gradient_bytes(graph)
        self.runs_backward = set(self.base.runs)
        self.resident = graph.static.resident_bytes
        self.dynamic = [s.index for s in graph.storages if not s.is_static]
        self.savers: dict[int, list[int]] = defaultdict(list)
        for node in graph.nodes:
            for s in sorted(set(node.saved)):
                if not graph.storages[s].is_static:
                    self.savers[s].append(node.index)
        self.has_saved = [bool(node.saved) for node in graph.nodes]
        self.trigger = [self.has_saved[i] and i in self.runs_backward for i in range(n)]
        self._alias_nodes: dict[int, list[int]] = defaultdict(list)
        for node in graph.nodes:
            for s in node.outputs:
                self._alias_nodes[s].append(node.index)
        self.by_producer: dict[int, list[int]] = defaultdict(list)  # dynamic storages by producing node
        self.first_saver: dict[int, int] = {}  # the first node at or after s's producer that saves s
        for s in self.dynamic:
            p = graph.storages[s].producer
            if p >= 0:
                self.by_producer[p].append(s)
                first = min((j for j in self.savers.get(s, ()) if j >= p), default=None)
                if first is not None:
                    self.first_saver[s] = first
        self.false = self.m.NewConstant(0)
        self.true = self.m.NewConstant(1)
        self.upper = self._upper_bytes()
        upper = budget_bytes if budget_bytes is not None else self.upper
        self.peak = self.m.NewIntVar(0, max(0, upper), "peak")
        self._same: dict[tuple[int, int], cp_model.IntVar] = {}
        self.deferred_phases = deferred_phases
        self.deferred: dict[tuple[str, int], Callable[[], None]] = {}

    def _upper_bytes(self) -> int:
        """More than any event can hold: every storage, gradients and temporaries at once."""
        dynamic = sum(self.g.storages[s].nbytes for s in self.dynamic)
        grads = max(self.base.during.values(), default=0)
        work = max((node.fwd_workspace_bytes for node in self.g.nodes), default=0)
        return self.resident + 2 * dynamic + grads + work

    def event(self, key: tuple[str, int], row: Callable[[], Row]) -> None:
        """The memory row of one simulator event (``phase``, node), made by ``row``. Rows of the
        phases in ``self.deferred_phases`` are kept aside, unmade, in ``self.deferred`` for
        ``add_events``."""
        if key[0] in self.deferred_phases:
            self.deferred[key] = lambda: self.add_row(row())
        else:
            self.add_row(row())

    def add_row(self, row: Row) -> None:
        live, enforce = row
        added = self.m.Add(live <= self.peak)
        if enforce:
            added.OnlyEnforceIf(enforce)

    def implies(self, literals: list, var: cp_model.IntVar) -> None:
        """All ``literals`` true => ``var`` true, as one clause (CP-SAT propagates these best)."""
        self.m.AddBoolOr([*(literal.Not() for literal in literals), var])

    # ------------------------------------------------------------------ decisions
    def decisions(self) -> None:
        m, n, g = self.m, self.n, self.g
        self.rec = [m.NewBoolVar(f"rec_{t}") for t in range(n)]
        self.start = [m.NewBoolVar(f"start_{t}") for t in range(n)]
        self.keep: dict[int, cp_model.IntVar] = {}
        for t in range(n):
            if keepable(g, t):
                self.keep[t] = m.NewBoolVar(f"keep_{t}")
                m.AddImplication(self.keep[t], self.rec[t])
        # cont_t: t continues t-1's region. A region starts where rec rises, or where start says so.
        self.cont = [self.false] + [m.NewBoolVar(f"cont_{t}") for t in range(1, n)]
        boundaries = g.boundaries
        for t in range(n):
            m.AddImplication(self.start[t], self.rec[t])
            if t == 0:
                m.Add(self.start[0] == self.rec[0])
                continue
            c = self.cont[t]
            # cont_t <=> rec_t and not start_t; and rec_t and not rec_{t-1} => start_t.
            m.AddBoolOr([self.rec[t].Not(), self.start[t], c])
            m.AddImplication(c, self.rec[t])
            m.AddImplication(c, self.start[t].Not())
            m.AddImplication(c, self.rec[t - 1])
            m.AddBoolOr([self.rec[t].Not(), self.rec[t - 1], self.start[t]])
            if t not in boundaries:
                # No region may start or end here: an in-place op needs the tensors unmodified.
                m.Add(self.start[t] == 0)
                m.Add(self.rec[t] == self.rec[t - 1])
        for t in unit_edges(g):
            # A region may not span two FSDP units: the emitted module calls each unit's module.
            m.Add(self.cont[t] == 0)
        if n not in boundaries and n > 0:
            m.Add(self.rec[n - 1] == 0)
        # At most ``window`` nodes per region: no ``window`` consecutive continuations.
        if self.W < n:
            for t in range(self.W, n):
                m.Add(sum(self.cont[t - self.W + 1: t + 1]) <= self.W - 1)

    def rematerialisation(self) -> None:
        """``remat_{x}`` for each candidate, and ``again_{x}_{j}`` for each of its savers."""
        m, g = self.m, self.g
        self.remat = {x: m.NewBoolVar(f"remat_{x}") for x in self.remat_candidates}
        self.remat_of: dict[int, cp_model.IntVar] = {}  # by output storage
        self.again: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)  # by saver: (x, again_{x}_{j})
        for x, var in self.remat.items():
            m.AddImplication(var, self.rec[x].Not())
            self.remat_of[g.nodes[x].outputs[0]] = var
            for j in savers(g, x):
                again = m.NewBoolVar(f"again_{x}_{j}")
                self.implies([var, self.rec[j].Not()], again)
                self.again[j].append((x, again))
        for x, y in conflicts(g, self.remat_candidates):
            m.AddBoolOr([self.remat[x].Not(), self.remat[y].Not()])
        for triple in deep_chains(g, self.remat_candidates):
            m.AddBoolOr([self.remat[t].Not() for t in triple])
        # chain[j]: (y, chain_{x}_{y}_{j}) for each rematerialised y that saver j's recompute of x
        # recomputes first.
        self.chain: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
        chained_inputs: dict[int, list[int]] = defaultdict(list)
        for x, y in chains(g, self.remat_candidates):
            chained_inputs[x].append(y)
        for j, found in list(self.again.items()):
            for x, again in found:
                for y in chained_inputs.get(x, ()):
                    var = m.NewBoolVar(f"chain_{x}_{y}_{j}")
                    self.implies([again, self.remat[y]], var)
                    self.chain[j].append((y, var))

    def same(self, a: int, b: int) -> cp_model.IntVar:
        """``same_{a}_{b}``: nodes a ≤ b lie in one region (false beyond the window)."""
        if a > b:
            a, b = b, a
        if b - a >= self.W or a < 0 or b >= self.n:
            return self.false
        if a == b:
            return self.rec[a]
        key = (a, b)
        var = self._same.get(key)
        if var is None:
            inner = self.same(a, b - 1)
            var = self._same[key] = self.m.NewBoolVar(f"same_{a}_{b}")
            self.m.AddBoolAnd([inner, self.cont[b]]).OnlyEnforceIf(var)
            self.m.AddBoolOr([inner.Not(), self.cont[b].Not(), var])
        return var

    def structure(self) -> None:
        """trigafter and stopafter (exact), hastrig and last_trig (lower bounds: they only add
        memory or cost when true, so the solver sets them no higher than the plan makes them)."""
        m, n = self.m, self.n
        self.trigafter, self.next_trig = self._found_later(self.trigger, "trigafter", "nexttrig")
        self.stopafter, self.next_stop = self._found_later(self.has_saved, "stopafter", "nextstop")
        self.hastrig = []
        for t in range(n):
            h = m.NewBoolVar(f"hastrig_{t}")
            m.AddImplication(self.trigafter[t], h)
            if t > 0:
                m.AddBoolOr([self.cont[t].Not(), self.hastrig[t - 1].Not(), h])
            self.hastrig.append(h)
        self.last_trig: dict[int, cp_model.IntVar] = {}
        for t in range(n):
            if self.trigger[t]:
                lt = m.NewBoolVar(f"last_trig_{t}")
                m.AddBoolOr([self.rec[t].Not(), self.next_trig[t], lt])
                self.last_trig[t] = lt
        self.rng_stashes()

    def rng_stashes(self) -> None:
        """``randafter_{t}`` (exact), ``stash_{s}`` and ``randreg_{t}`` (lower bounds): a region
        holding a node that draws random numbers stashes the RNG state
        (``graph.rng_state_bytes``) from its start until backward passes it, and keeps a second
        copy while recomputing (``simulation``'s ``_rng_key``). ``stash_held[i]``: the bytes of
        the stashes held at forward or backward event i (regions starting at or before i)."""
        m, n, g = self.m, self.n, self.g
        self.stash_held: list = [0] * n
        self.randreg: list = [self.false] * n
        random = [node.random for node in g.nodes]
        if not g.rng_state_bytes or not any(random):
            return
        randafter, _ = self._found_later(random, "randafter", "nextrand")
        running: list = []
        for t in range(n):
            stash = m.NewBoolVar(f"stash_{t}")
            self.implies([self.start[t], randafter[t]], stash)
            running.append(g.rng_state_bytes * stash)
            if len(running) > tuning.FOLD_TERMS:  # keep each constraint short: fold the running sum into a var
                folded = m.NewIntVar(0, self.upper, f"stashes_{t}")
                m.Add(folded == sum(running))
                running = [folded]
            self.stash_held[t] = sum(running)
            here = m.NewBoolVar(f"randreg_{t}")
            m.AddImplication(randafter[t], here)
            if t > 0:
                m.AddBoolOr([self.cont[t].Not(), self.randreg[t - 1].Not(), here])
            self.randreg[t] = here

    def _found_later(self, flags: list[bool], name: str, next_name: str) -> tuple[list, list]:
        """Exact ``{name}_{t}``: t's region holds a node with ``flags`` set at t or later; and
        ``{next_name}_{t}``: t+1 is in t's region and ``{name}_{t+1}``."""
        m, n = self.m, self.n
        found = [self.false] * (n + 1)
        following = [self.false] * (n + 1)
        for t in reversed(range(n)):
            if t + 1 < n:
                nxt = m.NewBoolVar(f"{next_name}_{t}")
                m.AddBoolAnd([self.cont[t + 1], found[t + 1]]).OnlyEnforceIf(nxt)
                m.AddBoolOr([self.cont[t + 1].Not(), found[t + 1].Not(), nxt])
                following[t] = nxt
            here = self.rec[t] if flags[t] else self.false
            var = m.NewBoolVar(f"{name}_{t}")
            m.AddMaxEquality(var, [here, following[t]])
            found[t] = var
        return found, following

    # ------------------------------------------------------------------ retention
    def _keep_var(self, t: int) -> cp_model.IntVar:
        return self.keep.get(t, self.false)

    def cache_sets(self) -> dict[int, list[int]]:
        """Storages each keepable node's cache holds: its outputs and what it allocates."""
        g = self.g
        sets = {}
        for t in self.keep:
            found = set(g.nodes[t].outputs) | {st.index for st in g.produced_by(t)}
            sets[t] = sorted(s for s in found if not g.storages[s].is_static)
        return sets

    def retention(self) -> None:
        """``held_s``, and the lower bounds on ``alive_{s}_{i}`` from each kind of holder, as
        ``alive_needs``: by storage, (i, a function making the literals that, all true, make
        ``alive_{s}_{i}`` true), for ``_link_alive`` to state once the variable is made."""
        m, g, W, n = self.m, self.g, self.W, self.n
        self.held = {s: m.NewBoolVar(f"held_{s}") for s in self.dynamic}
        need: dict[int, list[tuple[int, Callable[[], list]]]] = defaultdict(list)

        def after(i: int) -> int:
            return i if i in self.runs_backward else 0  # a saver whose backward never runs never releases

        # Savers outside regions hold until their own backward, unless the storage is the output
        # of a rematerialised node other than the saver (then it recomputes it instead).
        for s, nodes in self.savers.items():
            dropped = self.remat_of.get(s)
            for j in nodes:
                if dropped is None or j == g.storages[s].producer:
                    m.AddBoolOr([self.rec[j], self.held[s]])
                    need[s].append((after(j), lambda j=j: [self.rec[j].Not()]))
                else:
                    m.AddBoolOr([self.rec[j], self.held[s], dropped])
                    need[s].append((after(j), lambda j=j, r=dropped: [self.rec[j].Not(), r.Not()]))
        # Region inputs: q's output read by u inside a region that starts after q, at some k in
        # (q, u], held until backward passes k.
        for q, node in enumerate(g.nodes):
            outs = [s for s in node.outputs if not g.storages[s].is_static]
            if not outs:
                continue
            for u in g.users[q]:
                inside = self.same(q, u)
                cross = m.NewBoolVar(f"input_{q}_{u}")
                m.AddBoolOr([self.rec[u].Not(), inside, cross])
                for s in outs:
                    m.AddImplication(cross, self.held[s])
                for k in range(max(q + 1, u - W + 1), u + 1):
                    if k not in g.boundaries:
                        continue
                    for s in outs:
                        need[s].append((k, lambda k=k, u=u: [self.rec[u], self.start[k], self.same(k, u)]))
        # Caches of kept nodes: held until their region's recompute consumes them (at its last
        # trigger; backward events after it, i.e. with no trigger at or after them, still see
        # the cache), or until backward passes the region's start if the recompute never runs j.
        self.cache = self.cache_sets()
        self.kept_order = sorted(self.keep)
        for j, storages in self.cache.items():
            kj = self.keep[j]
            for s in storages:
                m.AddImplication(kj, self.held[s])
                for i in range(max(0, j - W + 1), min(n, j + W)):
                    need[s].append((i, lambda i=i, j=j, kj=kj: [kj, self.same(i, j), self.trigafter[i].Not()]))
                    # Past the early stop, the recompute never reaches j: its cache stays.
                    need[s].append((i, lambda i=i, j=j, kj=kj: [kj, self.same(i, j), self.stopafter[j].Not()]))
                for i in range(j + 1, min(n, j + W + 1)):
                    # The first node past the region: the cache is still held there.
                    need[s].append((i, lambda i=i, j=j, kj=kj: [kj, self.same(j, i).Not()]))
                # After the recompute, savers inside the region hold the cached tensor.
                for jp in self.savers.get(s, ()):
                    if jp >= j:
                        need[s].append((after(jp), lambda jp=jp, j=j, kj=kj: [kj, self.same(j, jp)]))
        # The caller's hold on the model's outputs (``graph.outputs_live``): to the end of backward.
        # A model's own scalar loss is already held from backward's start (``gradient_bytes``).
        held_loss = {s for j in g.loss_nodes for s in g.nodes[j].outputs} if g.loss_is_output else set()
        self.caller_held = frozenset(
            s for j in g.outputs for s in g.nodes[j].outputs if s in self.held and s not in held_loss
        ) if g.outputs_live else frozenset()
        for s in sorted(self.caller_held):
            m.AddBoolOr([self.held[s]])
            need[s].append((0, list))
        # alive_{s}_{i} over each storage's window [lo, hi], monotone in i, then held_s beyond it.
        self.alive_needs: dict[int, tuple[list[int], list[Callable[[], list]]]] = {}
        self.alive: dict[int, dict[int, cp_model.IntVar]] = {}
        self.alive_made: dict[int, list[int]] = {}  # the indices of each storage's linked alive variables, ascending
        self.unlinked: list[tuple[int, int]] = []  # (s, i) of alive variables made since ``link_alive``
        self.alive_window: dict[int, tuple[int, int]] = {}
        for s in self.dynamic:
            needs = sorted(need.get(s, ()), key=lambda pair: pair[0])
            if needs:
                self.alive_needs[s] = ([i for i, _ in needs], [make for _, make in needs])
                self.alive_window[s] = (needs[0][0], needs[-1][0])
                self.alive[s], self.alive_made[s] = {}, []
        if "backward" not in self.deferred_phases:  # the whole model has every one, as it always had
            for s, (lo, hi) in self.alive_window.items():
                for i in range(lo, hi + 1):
                    self.alive_at(s, i)

    def alive_at(self, s: int, i: int) -> cp_model.IntVar:
        """``alive_{s}_{i}`` (made now if need be), or what stands for it outside s's window:
        false before it, ``held_s`` after it."""
        window = self.alive_window.get(s)
        if window is None or i < window[0]:
            return self.false
        if i > window[1]:
            return self.held[s]
        var = self.alive[s].get(i)
        if var is None:
            var = self.alive[s][i] = self.m.NewBoolVar(f"alive_{s}_{i}")
            self.unlinked.append((s, i))
        return var

    def link_alive(self) -> None:
        """State the constraints of the ``alive`` variables made since the last call, in
        ascending order (``_link_alive``), so that each holder's need joins once per batch."""
        for s, i in sorted(self.unlinked):
            self._link_alive(s, i)
        self.unlinked.clear()

    def _link_alive(self, s: int, i: int) -> None:
        """``alive_{s}_{i}`` between the nearest ones already linked (``prev`` < i < ``nxt``):
        ``alive_prev => alive_i => alive_nxt`` (``held_s`` at the window's end), and true when a
        holder needs s at some index in (prev, i]; the needs at or before prev reach it through
        ``alive_prev``. (Those in (prev, i] are stated for ``alive_nxt`` too when it was linked
        in an earlier batch.)"""
        m, made, alive = self.m, self.alive_made[s], self.alive[s]
        var = alive[i]
        k = bisect_left(made, i)
        prev = made[k - 1] if k else None
        nxt = made[k] if k < len(made) else None
        if prev is not None:
            m.AddImplication(alive[prev], var)
        if nxt is not None:
            m.AddImplication(var, alive[nxt])
        elif i == self.alive_window[s][1]:
            m.AddImplication(var, self.held[s])  # redundant: every holder implies held_s too
        indices, makers = self.alive_needs[s]
        first = 0 if prev is None else bisect_right(indices, prev)
        for make in makers[first:bisect_right(indices, i)]:
            self.implies(make(), var)
        made.insert(k, i)

    # ------------------------------------------------------------------ events
    def last_forward_use(self) -> dict[int, int]:
        """Step after which the plain forward drops each activation storage (n: held to the end of
        forward, as graph outputs and autocast's parameter casts are)."""
        g, n = self.g, self.n
        last_node = {}
        for j in range(n):
            users = g.users[j]
            last_node[j] = max(j, users[-1]) if users else j
        for j in g.outputs:
            last_node[j] = n
        last = {}
        for s in self.dynamic:
            storage = g.storages[s]
            if storage.cached:  # autocast's cache holds a parameter cast to the end of forward
                last[s] = n
                continue
            aliases = self._alias_nodes.get(s, [])
            last[s] = max([last_node[a] for a in aliases if a >= storage.producer] + [storage.producer])
        return last

    def forward_events(self) -> None:
        """Each forward op: what the plain forward holds, plus retained storages past their use."""
        m, g = self.m, self.g
        last = self.last_forward_use()
        starts_at: dict[int, list[int]] = defaultdict(list)
        retired_after: dict[int, list[int]] = defaultdict(list)
        for s in self.dynamic:
            starts_at[g.storages[s].producer].append(s)
            if last[s] < self.n:
                retired_after[last[s]].append(s)
        program = 0
        retained: list = []
        for i in range(self.n):
            program += sum(g.storages[s].nbytes for s in starts_at[i])
            live = self.resident + program + g.nodes[i].fwd_workspace_bytes
            row = (live + sum(retained) + self.stash_held[i], [])
            self.event(("forward", i), lambda row=row: row)
            for s in retired_after[i]:
                program -= g.storages[s].nbytes
                retained.append(g.storages[s].nbytes * self.held[s])
            if len(retained) > tuning.FOLD_TERMS:  # keep each constraint short: fold the running sum into a var
                folded = m.NewIntVar(0, self.upper, f"retained_{i}")
                m.Add(folded == sum(retained))
                retained = [folded]

    def held_originals(self, i: int) -> list:
        """Terms for the original storages alive at node i's backward event."""
        terms = []
        for s in self.dynamic:
            var = self.alive_at(s, i)
            if var is not self.false:
                terms.append(self.g.storages[s].nbytes * var)
        return terms

    def backward_events(self) -> None:
        for i in self.base.runs:
            self.event(("backward", i), lambda i=i: (
                self.resident + self.base.during[i] + sum(self.held_originals(i)) + sum(self._copy_terms(i))
                + sum(self._again_terms(i)) + self.stash_held[i], []))

    def _again_terms(self, i: int) -> list:
        """What recomputing rematerialised nodes in saver i's backward allocates (``again``, and
        ``chain`` for the inputs of chains, bounded from above)."""
        g = self.g
        return [(g.new_bytes(x) + g.nodes[x].fwd_workspace_bytes) * var
                for x, var in (*self.again.get(i, ()), *self.chain.get(i, ()))]

    def _copy_terms(self, i: int) -> list:
        """Terms for ``copy_{s}_{i}``, made here (only backward event i reads them): s was
        recomputed in i's region and a saver at or before i holds it."""
        m, g, W = self.m, self.g, self.W
        terms = []
        for p in range(max(0, i - W + 1), i + 1):
            for s in self.by_producer.get(p, ()):
                first = self.first_saver.get(s)
                if first is None or first - p >= W or i < first:
                    continue
                var = m.NewBoolVar(f"copy_{s}_{i}")
                self.implies([self._keep_var(p).Not(), self.same(p, i), self.trigafter[i]], var)
                terms.append(g.storages[s].nbytes * var)
        return terms

    def recompute_events(self) -> None:
        """Each region's recompute runs its nodes from the start to the early stop, while backward
        holds what it held just before the region's last trigger."""
        n = self.n
        self.trigger_bytes: dict[int, cp_model.IntVar] = {}
        if "recompute" not in self.deferred_phases:
            self._make_trigger_bytes(0, n)
        self.users_of = self._storage_users()
        self.made_at_stop: dict[int, frozenset[int]] = {}
        self.saved_in = self._saved_in_region()
        for t in range(n):
            self.event(("recompute", t), lambda t=t: self._recompute_row(t))

    def _make_trigger_bytes(self, lo: int, hi: int) -> None:
        """``trigger_bytes_{u}`` for u in [lo, hi) not yet made: equal along each region (under
        ``cont``), and at a region's last trigger at least what backward holds just before it.
        The recompute row of t reads only those of t's region, within a window of t."""
        m, tb = self.m, self.trigger_bytes
        new = [u for u in range(lo, hi) if u not in tb]
        for u in new:
            tb[u] = m.NewIntVar(0, self.upper, f"trigger_bytes_{u}")
        made = set(new)
        for u in new:
            # Each neighbouring pair once: with u-1 whenever it exists, with u+1 if made earlier.
            for a, b in ((u - 1, u), (u, u + 1)):
                if a in tb and b in tb and (b == u or b not in made):
                    m.Add(tb[b] >= tb[a]).OnlyEnforceIf(self.cont[b])
                    m.Add(tb[a] >= tb[b]).OnlyEnforceIf(self.cont[b])
            lt = self.last_trig.get(u)
            if lt is not None:
                m.Add(tb[u] >= self.base.before[u] + sum(self.held_originals(u)) + self.stash_held[u]).OnlyEnforceIf(lt)

    def _recompute_row(self, t: int) -> Row:
        """The recompute running node t: the bytes held at its region's last trigger, the
        recomputed copies and kept caches live at t (``_rc_terms``, ``_cachelive_terms``) and
        t's workspace unless t is kept."""
        work = self.g.nodes[t].fwd_workspace_bytes
        self._make_trigger_bytes(max(0, t - self.W + 1), min(self.n, t + self.W))
        live = self.resident + self.trigger_bytes[t] + sum(self._rc_terms(t)) + sum(self._cachelive_terms(t))
        if self.randreg[t] is not self.false:
            live += self.g.rng_state_bytes * self.randreg[t]  # fork_rng's copy while recomputing
        if work:
            live += work - work * self._keep_var(t)
        return live, [self.rec[t], self.stopafter[t], self.hastrig[t]]

    def _rc_terms(self, t: int) -> list:
        """Terms for ``rc_{s}_{t}``, made here (only recompute event t reads them): the
        recomputed copy of s is live while the recompute runs t."""
        m, g, W = self.m, self.g, self.W
        terms = []
        for p in range(max(0, t - W + 1), t + 1):
            storages = self.by_producer.get(p, ())
            if not storages:
                continue
            fresh = self._keep_var(p).Not()
            made_at_stop = self.made_at_stop.get(p)  # what exists when p's early stop fires
            if made_at_stop is None:
                made_at_stop = self.made_at_stop[p] = made_at_early_stop(g, p)
            for s in storages:
                storage = g.storages[s]
                first_saver = self.first_saver.get(s)
                reasons = []  # literal lists: all true => rc
                if t == p:
                    if s in made_at_stop:
                        reasons.append([fresh, self.rec[p], self.stopafter[p]])
                    else:  # made after p's last save: only if p is not where the recompute stops
                        reasons.append([fresh, self.rec[p], self.next_stop[p]])
                if first_saver is not None and t >= first_saver:
                    reasons.append([fresh, self.same(p, t), self.stopafter[t]])
                for u in self.users_of.get(s, ()):
                    if t > p and t <= u < p + W:
                        reasons.append([fresh, self.same(p, u), self.stopafter[u]])
                if storage.cached and t > p:
                    # autocast's cache holds a parameter cast until the recompute ends
                    reasons.append([fresh, self.same(p, t), self.stopafter[t]])
                if not reasons:
                    continue
                var = m.NewBoolVar(f"rc_{s}_{t}")
                for literals in reasons:
                    self.implies(literals, var)
                terms.append(storage.nbytes * var)
        return terms

    def _saved_in_region(self) -> dict[tuple[int, int], cp_model.IntVar]:
        """``savedin_{s}_{j}`` by (j, s), for kept node j and each s of its cache: a node of j's
        region saves s (``savedby_{s}_{j}_{jp}``: node jp does), so ``alive`` counts s there."""
        m, W = self.m, self.W
        found = {}
        for j, storages in self.cache.items():
            for s in storages:
                pairs = []
                for jp in self.savers.get(s, ()):
                    if jp >= j and jp - j < W:
                        pair = m.NewBoolVar(f"savedby_{s}_{j}_{jp}")
                        m.AddImplication(pair, self.keep[j])
                        m.AddImplication(pair, self.same(j, jp))
                        pairs.append(pair)
                saved_in = found[j, s] = m.NewBoolVar(f"savedin_{s}_{j}")
                m.AddBoolOr([saved_in.Not(), *pairs])
        return found

    def _cachelive_terms(self, t: int) -> list:
        """Terms for ``cachelive_{s}_{j}_{t}``, made here (only recompute event t reads them):
        kept node j's cached s is live while its region's recompute runs t: in the cache until
        j, then while the recompute still reads it (unless ``savedin_{s}_{j}``, or the caller
        holds s: then ``alive`` counts it in ``trigger_bytes``)."""
        m, W = self.m, self.W
        terms = []
        kept = self.kept_order
        for j in kept[bisect_left(kept, t - W + 1):bisect_left(kept, t + W)]:
            kj = self.keep[j]
            for s in self.cache[j]:
                if s in self.caller_held:  # the cached tensor is the caller's: ``alive`` counts it
                    continue
                reasons = []
                # (Past the early stop the cache is never consumed: ``alive`` counts it.)
                if t <= j:
                    reasons.append([kj, self.same(t, j), self.stopafter[j]])
                for u in self.users_of.get(s, ()):
                    if j < t <= u and u - j < W:
                        reasons.append([kj, self.same(j, u), self.stopafter[u]])
                if not reasons:
                    continue
                var = m.NewBoolVar(f"cachelive_{s}_{j}_{t}")
                for literals in reasons:
                    self.implies([*literals, self.saved_in[j, s].Not()], var)
                terms.append(self.g.storages[s].nbytes * var)
        return terms

    def _storage_users(self) -> dict[int, list[int]]:
        """Nodes after a storage's producer that read it through any alias, or are aliases."""
        g = self.g
        found: dict[int, set[int]] = defaultdict(set)
        for s, aliases in self._alias_nodes.items():
            p = g.storages[s].producer
            for a in aliases:
                if a > p:
                    found[s].add(a)
                found[s].update(u for u in g.users[a] if u > p)
        return {s: sorted(u) for s, u in found.items()}

    def objective(self) -> cp_model.LinearExpr:
        m, g = self.m, self.g
        terms = []
        recomputed = {}
        for t, node in enumerate(g.nodes):
            cost = round(node.fwd_cost * COST_SCALE)
            if cost <= 0:
                continue
            var = recomputed[t] = m.NewBoolVar(f"recomputed_{t}")
            self.implies([self.rec[t], self._keep_var(t).Not(), self.stopafter[t], self.hastrig[t]], var)
            terms.append(cost * var)
        self.recomputed = recomputed
        self.bounding_clauses = self.hold_or_recompute(recomputed)
        for pairs in (*self.again.values(), *self.chain.values()):
            for x, var in pairs:
                cost = round((g.nodes[x].fwd_cost + g.remat_cost) * COST_SCALE)
                if cost > 0:
                    terms.append(cost * var)
        return sum(terms) + self._machinery_cost()

    def hold_or_recompute(self, recomputed: dict[int, cp_model.IntVar]) -> list[tuple[cp_model.IntVar, ...]]:
        """Literals for redundant clauses ``held_s or recomputed_p`` (p the producer of s; ``or
        remat_p`` when p is a rematerialisation candidate, whose savers then hold nothing): a storage
        that some node at or after p saves, for a backward that runs, is either held from the
        forward or made again by recomputing p. Every plan satisfies them (a saver outside
        regions holds s; one in another region than p makes s that region's input; one in p's
        region, p not kept, is a trigger there and so recomputes p). In the LP relaxation they
        tie the forward's memory rows to the objective: at least the cheapest fractional choice
        of producers to recompute that frees enough bytes (a knapsack). Left out of the model
        ``build_model`` returns, for one worker's search (docs/tuning.md, "ilp"); ``solve_flat``
        adds them for its proof phase."""
        pairs = []
        for s in self.dynamic:
            p = self.g.storages[s].producer
            if p in recomputed and any(j >= p and j in self.runs_backward for j in self.savers.get(s, ())):
                dropped = self.remat_of.get(s)
                pairs.append((self.held[s], recomputed[p]) if dropped is None else (self.held[s], recomputed[p], dropped))
        return pairs

    def _machinery_cost(self) -> cp_model.LinearExpr:
        """``simulation.checkpoint_cost_seconds``: ``graph.region_cost`` per region (each true
        ``start``), ``graph.region_op_cost`` per node in a region (each true ``rec``) and
        ``2·graph.policy_op_cost`` per kept node (each true ``keep``)."""
        g = self.g
        terms = []
        for seconds, family in (
            (g.region_cost, self.start), (g.region_op_cost, self.rec), (2 * g.policy_op_cost, self.keep.values())
        ):
            units = round(seconds * COST_SCALE)
            if units > 0:
                terms += [units * var for var in family]
        return sum(terms)


def add_events(v: IlpVars, keys: Iterable[tuple[str, int]]) -> None:
    """Add the memory rows of the events ``keys`` that ``build_model`` deferred to the model it
    returned with ``v`` (and forget them in ``v.deferred``); keys without a deferred row are
    skipped."""
    for key in keys:
        add = v.deferred.pop(key, None)
        if add is not None:
            add()
    v.link_alive()


def add_bounding_clauses(model: cp_model.CpModel, v: IlpVars) -> None:
    """Add ``v.bounding_clauses`` to ``model`` (see ``_Builder.hold_or_recompute``)."""
    for pair in v.bounding_clauses:
        model.AddBoolOr(pair)


def keepable(graph: ComputeGraph, t: int) -> bool:
    """What a keep-set may name (``simulation.why_not_keep``) and is worth naming: an op that
    allocates (keeping a view saves nothing, its storage is its base's)."""
    return bool(graph.produced_by(t)) and why_not_keep(graph, t) is None


def region_window(graph: ComputeGraph, window: int | None) -> int:
    """The most nodes one region may span in the model ``build_model(graph, window=window)``."""
    n = len(graph.nodes)
    return max(1, min(tuning.DEFAULT_WINDOW if window is None else window, n))


def build_model(
    graph: ComputeGraph, budget_bytes: int | None = None, *, window: int | None = None,
    deferred_phases: frozenset[str] = frozenset(), remat: Sequence[int] = (),
) -> tuple[cp_model.CpModel, IlpVars]:
    """The CP-SAT model of one-level plans for ``graph`` whose simulated peak is at most ``peak``
    (bounded by ``budget_bytes`` when given). The objective is left to the caller: minimise
    ``vars.cost`` (recompute cost, ``COST_SCALE`` units per second) for the cheapest plan, or
    ``vars.peak`` for the least reachable peak.

    ``window``: the most nodes one region may span (default: all of them on graphs of up to
    ``tuning.DEFAULT_WINDOW`` nodes, else ``tuning.DEFAULT_WINDOW``); the model grows as nodes × window.

    ``deferred_phases``: simulator phases (``"forward"``, ``"backward"``, ``"recompute"``) whose
    memory rows are left out of the model and kept in ``vars.deferred`` by event
    (``(phase, node)``, as ``simulation.Event`` names them), for ``add_events``: without them the
    model is a relaxation (``solvers.ilp_lazy`` adds the rows plans violate).

    ``remat``: rematerialisation candidates (``ckptplan.remat.candidates``) the plan may
    rematerialise beside its regions (``remat_{x}``); none by default.
    """
    b = _Builder(graph, budget_bytes, region_window(graph, window), deferred_phases, remat)
    b.decisions()
    b.rematerialisation()
    b.structure()
    b.retention()
    b.forward_events()
    b.backward_events()
    b.recompute_events()
    cost = b.objective()
    b.link_alive()
    proto = b.m.Proto()
    variables = IlpVars(
        rec=b.rec,
        start=b.start,
        keep=b.keep,
        peak=b.peak,
        cost=cost,
        window=b.W,
        counts={"variables": len(proto.variables), "constraints": len(proto.constraints)},
        bounding_clauses=b.bounding_clauses,
        recomputed=b.recomputed,
        deferred=b.deferred,
        link_alive=b.link_alive,
        remat=b.remat,
    )
    return b.m, variables
