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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import cached_property

from ckptplan.errors import PlanFormatError
from ckptplan.graph import ComputeGraph, Node
from ckptplan.plan import Region

# Ops that update module state when they run: recomputing them would update it twice.
_STATEFUL_OPS = ("batch_norm", "instance_norm")


def _read_storages(graph: ComputeGraph, node: Node) -> tuple[int, ...]:
    """Activation storages ``node`` reads: its input nodes' outputs (graph inputs and parameters
    are not nodes; they stay resident anyway)."""
    found: dict[int, None] = {}
    for j in node.inputs:
        for s in graph.nodes[j].outputs:
            if not graph.storages[s].is_static:
                found[s] = None
    return tuple(found)


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
    reads = _read_storages(graph, node)
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
    """Pairs (x, y) of ``nodes`` where x reads y's output: rematerialising both frees only one of
    the two (x's backward, which would hold y's output for x's recompute, no longer holds it)."""
    output_of = {graph.nodes[y].outputs[0]: y for y in nodes}
    return [(x, output_of[s]) for x in nodes for s in _read_storages(graph, graph.nodes[x]) if s in output_of]


def by_price(graph: ComputeGraph) -> tuple[int, ...]:
    """Candidates cheapest first, by recompute seconds (once per saver, with the hooks' fixed
    ``graph.remat_cost``) per byte freed, leaving
    out any that reads another chosen one's output or whose output a chosen one reads: its
    holder would keep that output alive, and only one of the two frees anything."""

    def price(x: int) -> float:
        node = graph.nodes[x]
        return (node.fwd_cost + graph.remat_cost) * len(savers(graph, x)) / max(1, graph.storages[node.outputs[0]].nbytes)

    chosen: list[int] = []
    outputs: set[int] = set()
    reads: set[int] = set()
    for x in sorted(candidates(graph), key=lambda x: (price(x), x)):
        node = graph.nodes[x]
        x_reads = _read_storages(graph, node)
        if node.outputs[0] in reads or any(r in outputs for r in x_reads):
            continue
        chosen.append(x)
        outputs.add(node.outputs[0])
        reads.update(x_reads)
    return tuple(chosen)


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
                held += [s for s in _read_storages(g, g.nodes[x]) if s not in held]
            back_bytes = sum(g.new_bytes(x) + g.nodes[x].fwd_workspace_bytes for x in xs)
            nodes[c] = replace(node, saved=tuple(held), bwd_workspace_bytes=node.bwd_workspace_bytes + back_bytes)
        return replace(g, nodes=tuple(nodes), traced=g.traced, model=g.model)

    @property
    def recomputations(self) -> list[int]:
        """Each recomputation of a rematerialised node, one per saver, in backward order."""
        return [x for c in sorted(self.recomputed_by, reverse=True) for x in self.recomputed_by[c]]
