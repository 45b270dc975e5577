"""Repeated blocks of a graph: the layers of a transformer, the stages of a ResNet.

A *block* is the execution-order range of one module ``<parent>.<i>`` (a child of a ``ModuleList``
or ``Sequential``) whose family ``<parent>`` has at least two members. Blocks whose node
signatures (ops, edges inside the block, bytes, FLOPs) are equal form a *class*; the first block
of a stack often differs a little and is a class of its own. The ``ilp`` solver decides block by
block (``solvers.blocks``), and sharding treats blocks as FSDP units (``ckptplan.sharding``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptplan.graph import ComputeGraph

_INDEXED = re.compile(r"^((?:.*?\.)??\d+)(?:\.|$)")  # shortest "<parent>.<i>" (or "<i>") prefix of a path


@dataclass(frozen=True)
class Block:
    """Nodes ``[start, end)``, all run by module ``path`` (or by its parents between its ops)."""

    path: str
    start: int
    end: int


def find_blocks(graph: ComputeGraph) -> tuple[list[Block], list[int]]:
    """Repeated blocks in execution order and the class of each (see the module docstring)."""
    spans: dict[str, list[int]] = {}
    for node in graph.nodes:
        match = _INDEXED.match(node.module)
        if match:
            span = spans.setdefault(match.group(1), [node.index, node.index])
            span[1] = node.index
    families: dict[str, int] = {}
    for path in spans:
        parent = path.rpartition(".")[0]
        families[parent] = families.get(parent, 0) + 1
    blocks = []
    owner = [""] * len(graph.nodes)
    for path, (first, last) in spans.items():
        for i in range(first, last + 1):
            owner[i] = path if not owner[i] else "!"
    for path, (first, last) in sorted(spans.items(), key=lambda item: item[1][0]):
        if families[path.rpartition(".")[0]] < 2:
            continue
        own = all(owner[i] == path or not _INDEXED.match(graph.nodes[i].module) for i in range(first, last + 1))
        if own and first in graph.boundaries and last + 1 in graph.boundaries:
            blocks.append(Block(path, first, last + 1))
    signatures: dict[tuple, int] = {}
    return blocks, [signatures.setdefault(_signature(graph, b), len(signatures)) for b in blocks]


def _signature(graph: ComputeGraph, block: Block) -> tuple:
    # Workspace bytes are left out: the profiler's measure of them can differ between identical
    # ops by a few hundred KiB, and the policies measured on one block are checked on the whole
    # graph by the simulator anyway.
    def local(i: int) -> int:
        return i - block.start if block.start <= i < block.end else -1

    return tuple(
        (
            n.op, tuple(local(i) for i in n.inputs), tuple(local(i) for i in n.grad_inputs),
            graph.new_bytes(n.index), graph.saved_bytes(n.index), n.output_bytes, n.fwd_flops, n.bwd_flops,
            n.random, n.inplace, n.requires_grad,
            n.grad_aliases_output, len(n.param_grads),
        )
        for n in graph.nodes[block.start:block.end]
    )
