"""Rematerialisation: an op's output dropped after forward and recomputed in backward from tensors
its own backward keeps anyway, without a checkpoint region.

A checkpoint region can only stop a later op ``C`` from storing ``X = f(Y)`` (the input ``C``'s
backward reads) by putting ``C`` in the region too, and then ``C`` itself runs again in the
recompute, or is kept under a selective policy at a dispatch cost per op. AOTAutograd's
partitioner, with a flat backward graph, saves ``Y`` and recomputes ``X`` in ``C``'s backward
instead. The emitter gets the same effect in eager mode with public hooks
(``torch.autograd.graph.saved_tensors_hooks`` around ``C``): ``C``'s backward receives ``X``
recomputed from ``Y`` when it unpacks it (``planner.emit``).

A node ``X`` may be rematerialised (``candidates``, ``why_not``) when its only output is a fresh
activation that nothing writes in place and the model does not return, it draws no random
numbers, its own backward does not save that output (``tanh`` does, so it would not be freed)
and does save every activation it reads (``gelu``, ``layer_norm``, ``silu``, a ``mul`` of two
tensors): then holding those inputs until a later op's backward costs no memory, since ``X``'s
backward, which runs after, holds them longer. Ops that update state when run (batch norm's
running statistics) are never candidates, nor are ops that run before an in-place write into
model state or an input (they might read it).

The model of one step (``apply``, which ``simulation.simulate`` uses for a plan's ``remat``):
each *saver* of ``X`` (a node outside every region whose backward saves ``X``'s output storage)
holds ``X``'s inputs in its place; in the saver's backward ``X`` is recomputed (its fresh
storages, and its forward workspace) and freed when that backward returns. Each saver recomputes
``X`` once: savers' backwards do not overlap, and the emitter caches the recomputed tensor only
while a backward holds it. Savers inside a region are left to the region.

*Chains.* When a rematerialised ``X`` reads a rematerialised ``Y``'s output as an argument of its
own (not through a view node), ``X``'s recipe holds ``Y``'s recipe instead of ``Y``'s output, so
both are freed: ``X``'s savers hold the *roots* of ``X`` (the activations its recompute reads,
through rematerialised inputs down to ones that are not) and recompute the whole *closure*
(``Y``, then ``X``). This is how AOTAutograd's partitioner recomputes a norm and its activation
from the convolution before them. The roots cost nothing to hold for the same reason as above:
``Y``'s backward, which runs after ``X``'s, keeps them. ``X`` read through a view node of ``Y``
keeps ``Y``'s output alive (``conflicts``: such pairs are never chosen together). Chains are
at most two deep (``deep_chains``: no ``Z`` under ``Y`` as well), which is what the joint model in
``solvers.ilp_model`` prices.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import cached_property

from ckptplan.errors import PlanFormatError
from ckptplan.graph import ComputeGraph, Node
from ckptplan.region import Region

# Ops that update module state when they run: recomputing them would update it twice.
_STATEFUL_OPS = ("batch_norm", "instance_norm")


def savers(graph: ComputeGraph, index: int) -> tuple[int, ...]:
    """Nodes other than ``index`` whose backward saves ``index``'s output storage."""
    return tuple(c for s in graph.nodes[index].outputs[:1] for c in graph.saved_by.get(s, ()) if c != index)


def why_not(graph: ComputeGraph, index: int) -> str | None:
    """Why node ``index`` cannot be rematerialised, or None when it can."""
    node = graph.nodes[index]
    if graph.trace != "export":
        return "rematerialisation needs a torch.export trace"
    if graph.autocast is not None:
        return "rematerialisation under autocast is not supported"
    if graph.sharding is not None:
        return "rematerialisation in a sharded step is not supported"
    if node.random:
        return "it draws random numbers"
    if node.inplace:
        return "it writes in place"
    if any(word in node.op for word in _STATEFUL_OPS):
        return "it updates module state"
    if len(node.outputs) != 1:
        return "it has more than one output storage"
    s = node.outputs[0]
    storage = graph.storages[s]
    if storage.producer != index or storage.kind != "activation":
        return "its output is not a fresh activation (a view, or an input)"
    if s in node.saved:
        return "its own backward saves its output"
    if s in graph.inplace_writers:
        return "a later op writes into its output"
    if any(o == index or s in graph.nodes[o].outputs for o in graph.outputs):
        return "the model returns its output, which the caller may hold through backward"
    if any(graph.storages[t].is_static and w > index for t, writers in graph.inplace_writers.items() for w in writers):
        return "a later op writes in place into model state or an input, which it may read"
    reads = roots(graph, index, frozenset())
    if any(r not in node.saved for r in reads):
        return "its backward does not keep every activation it reads"
    if any(w > index for r in reads for w in graph.inplace_writers.get(r, ())):
        return "a later op writes into one of its inputs"
    if not savers(graph, index):
        return "no later op saves its output"
    return None


def candidates(graph: ComputeGraph) -> tuple[int, ...]:
    """Nodes that may be rematerialised (see the module docstring), in execution order."""
    return tuple(node.index for node in graph.nodes if why_not(graph, node.index) is None)


def conflicts(graph: ComputeGraph, nodes: Sequence[int]) -> list[tuple[int, int]]:
    """Pairs (x, y) of ``nodes`` where x reads y's output through a view: rematerialising both
    frees only one of the two (x's recipe holds y's output through the view)."""
    output_of = {graph.nodes[y].outputs[0]: y for y in nodes}
    return [(x, output_of[s]) for x in nodes for s in _view_reads(graph, graph.nodes[x]) if s in output_of]


def chains(graph: ComputeGraph, nodes: Sequence[int]) -> list[tuple[int, int]]:
    """Pairs (x, y) of ``nodes`` where x reads y's output directly: rematerialised together, a
    chain (module docstring)."""
    chosen = set(nodes)
    return [(x, y) for x in nodes for y in dict.fromkeys(graph.nodes[x].inputs) if y in chosen]


def deep_chains(graph: ComputeGraph, nodes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Triples (x, y, z) of ``nodes`` where x reads y's output directly and y reads z's: chains
    deeper than two, which no plan here chooses."""
    pairs = chains(graph, nodes)
    below: dict[int, list[int]] = {}
    for y, z in pairs:
        below.setdefault(y, []).append(z)
    return [(x, y, z) for x, y in pairs for z in below.get(y, ())]


def _view_reads(graph: ComputeGraph, node: Node) -> tuple[int, ...]:
    """Activation storages ``node`` reads through a node that did not make them (a view): a
    recipe holds those whether or not their maker is rematerialised."""
    found: dict[int, None] = {}
    for j in node.inputs:
        for s in graph.nodes[j].outputs:
            if not graph.storages[s].is_static and graph.storages[s].producer != j:
                found[s] = None
    return tuple(found)


def closure(graph: ComputeGraph, index: int, chosen: frozenset[int] | set[int]) -> tuple[int, ...]:
    """The nodes a recompute of ``index`` runs when ``chosen`` are rematerialised: its chosen
    inputs' closures (in argument order, each input once), then ``index``."""
    # Recursion, not a networkx DFS: docs/design.md, "Where networkx is used and where not".
    order: list[int] = []
    for j in dict.fromkeys(graph.nodes[index].inputs):
        if j in chosen:
            order += closure(graph, j, chosen)
    return (*order, index)


def roots(graph: ComputeGraph, index: int, chosen: frozenset[int] | set[int]) -> tuple[int, ...]:
    """Activation storages a recompute of ``index`` reads (``closure``'s leaves): what a recipe
    holds. With nothing chosen, the activations the node reads: its input nodes' outputs (graph
    inputs and parameters are not nodes; they stay resident anyway)."""
    found: dict[int, None] = {}
    for j in dict.fromkeys(graph.nodes[index].inputs):
        if j in chosen:
            found.update(dict.fromkeys(roots(graph, j, chosen)))
        else:
            found.update(dict.fromkeys(s for s in graph.nodes[j].outputs if not graph.storages[s].is_static))
    return tuple(found)


def recompute_peak_bytes(graph: ComputeGraph, index: int, chosen: frozenset[int] | set[int]) -> int:
    """Most bytes a recompute of ``index`` holds at once beyond its roots: each chosen input
    recomputed in turn beside those made before it, then ``index``'s fresh storages and forward
    workspace beside all of them (a recipe drops its inputs when it returns)."""
    made = peak = 0
    for j in dict.fromkeys(graph.nodes[index].inputs):
        if j in chosen:
            peak = max(peak, made + recompute_peak_bytes(graph, j, chosen))
            made += graph.new_bytes(j)
    node = graph.nodes[index]
    return max(peak, made + graph.new_bytes(index) + node.fwd_workspace_bytes)


def by_price(graph: ComputeGraph) -> tuple[int, ...]:
    """Candidates cheapest first, in the order a greedy choice takes them: each step takes the
    one whose marginal recompute seconds per byte it frees is least, chains allowed (module
    docstring).

    Marginal seconds of ``x`` beside the set ``S`` taken so far: ``times(x)`` recomputes of
    ``closure(x, S)``, each costing its nodes' forward seconds and the hooks' fixed
    ``graph.remat_cost`` apiece, where ``times(x)`` counts ``x``'s savers plus, for each ``z`` in
    ``S`` that reads ``x`` directly, ``times(z)`` (each recompute of ``z`` now recomputes ``x``).
    Both only grow with ``S``, so a stale price is a lower bound and the choice is lazy (a heap,
    each popped entry repriced). A node is left out when it reads another taken one's output
    through a view, or a taken one reads its output so (``conflicts``: only one of the two would
    free anything), or it would make a chain deeper than two (``deep_chains``)."""
    readers: dict[int, list[int]] = {}  # y -> chosen nodes reading y's output directly
    cands = candidates(graph)
    chosen: set[int] = set()
    times: dict[int, int] = {}
    order: list[int] = []

    def closure_seconds(x: int) -> float:
        return sum(graph.nodes[t].fwd_cost + graph.remat_cost for t in closure(graph, x, chosen))

    def times_of(x: int) -> int:
        return len(savers(graph, x)) + sum(times[z] for z in readers.get(x, ()))

    def price(x: int) -> float:
        return times_of(x) * closure_seconds(x) / max(1, graph.storages[graph.nodes[x].outputs[0]].nbytes)

    heap = [(price(x), x) for x in cands]
    heapq.heapify(heap)
    while heap:
        stale, x = heapq.heappop(heap)
        trial = (*order, x)
        if conflicts(graph, trial) or deep_chains(graph, trial):
            continue  # for good: the set only grows
        fresh = price(x)
        if heap and fresh > stale and (fresh, x) > heap[0]:
            heapq.heappush(heap, (fresh, x))
            continue
        chosen.add(x)
        order.append(x)
        for j in dict.fromkeys(graph.nodes[x].inputs):
            readers.setdefault(j, []).append(x)
        for y in sorted(chosen, reverse=True):  # readers come after what they read
            times[y] = times_of(y)
    return tuple(order)


class _Covered:
    """Which nodes some region (at any depth) contains."""

    def __init__(self, graph: ComputeGraph, regions: Sequence[Region]) -> None:
        self._inside = [False] * len(graph.nodes)
        for top in regions:
            for i in range(top.start, min(top.end, len(graph.nodes))):
                self._inside[i] = True

    def __contains__(self, index: int) -> bool:
        return self._inside[index]


def outside(graph: ComputeGraph, nodes: Iterable[int], regions: Sequence[Region]) -> tuple[int, ...]:
    """Those of ``nodes`` that no region contains."""
    covered = _Covered(graph, regions)
    return tuple(x for x in nodes if x not in covered)


def indices(graph: ComputeGraph, names: Iterable[str]) -> tuple[int, ...]:
    """``names`` as node indices, ascending; unknown or unfit names are a ``PlanFormatError``."""
    found = []
    for name in names:
        index = graph.index_of.get(name)
        if index is None:
            raise PlanFormatError(f"The plan rematerialises {name!r}, which is not a node of this graph.")
        reason = why_not(graph, index)
        if reason is not None:
            raise PlanFormatError(f"The plan rematerialises {name!r}, which cannot be: {reason}.")
        found.append(index)
    return tuple(sorted(set(found)))


class Remat:
    """Rematerialised nodes under a plan's regions: who recomputes what, and the graph the
    simulator runs (``graph``, the savers' records rewritten as the module docstring says)."""

    def __init__(self, graph: ComputeGraph, nodes: Sequence[int], regions: Sequence[Region]) -> None:
        self.original = graph
        covered = _Covered(graph, regions)
        for x in nodes:
            if x in covered:
                raise PlanFormatError(
                    f"The plan rematerialises {graph.nodes[x].name!r}, which a region contains; a region "
                    "recomputes it already."
                )
        self.nodes = tuple(nodes)
        self._chosen = frozenset(self.nodes)
        # recomputed_by[c]: the rematerialised nodes saver c's backward recomputes.
        self.recomputed_by: dict[int, tuple[int, ...]] = {}
        for x in self.nodes:
            for c in savers(graph, x):
                if c not in covered:
                    self.recomputed_by[c] = (*self.recomputed_by.get(c, ()), x)

    @cached_property
    def graph(self) -> ComputeGraph:
        if not self.recomputed_by:
            return self.original
        g = self.original
        nodes = list(g.nodes)
        for c, xs in self.recomputed_by.items():
            node = nodes[c]
            dropped = {g.nodes[x].outputs[0] for x in xs}
            held = [s for s in node.saved if s not in dropped]
            for x in xs:
                held += [s for s in roots(g, x, self._chosen) if s not in held]
            # Each recomputed output (and, conservatively, its workspace) stays for the whole
            # backward; a chain's inputs only while the unpack recomputes them, before the
            # backward allocates anything (at most one chain's at a time).
            back_bytes = sum(g.new_bytes(x) + g.nodes[x].fwd_workspace_bytes for x in xs)
            chain_bytes = max(recompute_peak_bytes(g, x, self._chosen) - g.new_bytes(x) - g.nodes[x].fwd_workspace_bytes
                              for x in xs)
            nodes[c] = replace(node, saved=tuple(held), bwd_workspace_bytes=node.bwd_workspace_bytes + back_bytes,
                               bwd_unpack_bytes=(back_bytes + chain_bytes) if chain_bytes > 0 else 0)
        return replace(g, nodes=tuple(nodes), traced=g.traced, model=g.model)

    @property
    def recomputations(self) -> list[int]:
        """Each recomputation of a rematerialised node, one per saver (a chain's inputs with it),
        in backward order."""
        return [t for c in sorted(self.recomputed_by, reverse=True) for x in self.recomputed_by[c]
                for t in closure(self.original, x, self._chosen)]
