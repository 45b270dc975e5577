"""What ``ckptplan profile`` reports: a graph's bytes and FLOPs grouped by module and by op."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptplan.graph import ComputeGraph, Node
from ckptplan.simulation import baseline_peak_bytes


@dataclass
class GroupRow:
    """Totals over the nodes of one module or one op. ``output_bytes``: storages the nodes
    allocate in forward; ``saved_bytes``: what autograd keeps of them for backward."""

    key: str
    nodes: int = 0
    output_bytes: int = 0
    saved_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0


@dataclass(frozen=True)
class ProfileSummary:
    model: str
    fingerprint: str
    node_count: int
    autocast: str | None
    target: str | None
    static: dict[str, Any]
    activation_bytes: int
    baseline_peak_bytes: int
    by_module: list[GroupRow]
    by_op: list[GroupRow]

    def to_dict(self) -> dict[str, Any]:
        """The ``profile --json`` object."""
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "nodes": self.node_count,
            "autocast": self.autocast,
            "target": self.target,
            "static": self.static,
            "activation_bytes": self.activation_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "by_module": [_row_dict("module", row) for row in self.by_module],
            "by_op": [_row_dict("op", row) for row in self.by_op],
        }


def summarize(graph: ComputeGraph) -> ProfileSummary:
    """Group ``graph``'s nodes; modules keep first-appearance execution order, ops are sorted by
    saved bytes (largest first, then name) so the heaviest ops lead."""
    by_op = _group(graph, lambda node: node.op)
    by_op.sort(key=lambda row: (-row.saved_bytes, row.key))
    return ProfileSummary(
        model=graph.name,
        fingerprint=graph.fingerprint,
        node_count=len(graph.nodes),
        autocast=graph.autocast,
        target=graph.target,
        static=dataclasses.asdict(graph.static),
        activation_bytes=graph.activation_bytes,
        baseline_peak_bytes=baseline_peak_bytes(graph),
        by_module=_group(graph, lambda node: node.module),
        by_op=by_op,
    )


def _group(graph: ComputeGraph, key: Callable[[Node], str]) -> list[GroupRow]:
    rows: dict[str, GroupRow] = {}  # dicts keep insertion order: first appearance in execution
    for node in graph.nodes:
        row = rows.setdefault(key(node), GroupRow(key(node)))
        row.nodes += 1
        row.output_bytes += graph.new_bytes(node.index)
        row.saved_bytes += graph.saved_bytes(node.index)
        row.fwd_flops += node.fwd_flops
        row.bwd_flops += node.bwd_flops
    return list(rows.values())


def _row_dict(key_name: str, row: GroupRow) -> dict[str, Any]:
    fields = dataclasses.asdict(row)
    return {key_name: fields.pop("key"), **fields}
