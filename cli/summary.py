"""What the commands report, in the model's terms: ``profile``'s bytes and FLOPs grouped by
module and by op, and what a plan recomputes, by module path."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckptplan.graph import ComputeGraph, Node
from ckptplan.plan import NodeDecision, Plan
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


OPS_SHOWN = 3  # op names listed in a cell of ``recomputed_by_module`` before "N more"
NOTHING = "-"


@dataclass(frozen=True)
class RecomputeRow:
    """One line of what a plan recomputes. ``module``: the module path the recomputed ops run
    in, with the index of repeated modules collapsed (``blocks.0..4.attn`` for five checkpoint
    regions, one in each block's ``attn``; ``blocks.{0,2}.attn`` where the indices skip).
    ``recomputed`` and ``kept``: the ops recomputed in backward and those kept in memory inside
    the same regions (by op name, the ones that store the most for backward first). ``how``:
    ``"checkpoint"`` for checkpoint regions, ``"remat"`` for an op recomputed without one, in the
    backward of each op that saved its output. ``count``: regions, or rematerialised ops, it
    stands for."""

    module: str
    recomputed: str
    kept: str
    how: str
    count: int


def recomputed_by_module(plan: Plan) -> list[RecomputeRow]:
    """``plan``'s top-level checkpoint regions, then its rematerialised ops, one row per module
    path (rows that differ only in one index of a path are merged), in execution order. Empty
    for a plan that recomputes nothing, or that has no per-node records to name modules with."""
    nodes = plan.nodes
    if not nodes:
        return []
    rows: list[tuple[tuple[str, ...], str, str, str]] = []
    for region in plan.regions:
        inside = nodes[region.start:region.end]
        recomputed = [n for n in inside if n.decision == "recompute"]
        kept = [n for n in inside if n.decision == "keep"]
        rows.append((_region_module(inside), _ops(recomputed, whole=not kept), _ops(kept), "checkpoint"))
    for node in nodes:
        if node.decision == "remat":
            rows.append((_path(node.module), _ops([node]), NOTHING, "remat"))
    return _merge_indices(rows)


def op_name(op: str) -> str:
    """``aten.scaled_dot_product_attention.default`` -> ``scaled_dot_product_attention``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") else op


def _ops(nodes: Sequence[NodeDecision], *, whole: bool = False) -> str:
    """Op names with counts (``linear ×2, gelu``), those saving the most for backward first, at
    most ``OPS_SHOWN`` of them; ``whole``: all of a region's ops, said so when they are many."""
    if not nodes:
        return NOTHING
    counts: dict[str, list[int]] = {}
    for node in nodes:
        entry = counts.setdefault(op_name(node.op), [0, 0])
        entry[0] += 1
        entry[1] += node.saved_bytes
    if whole and len(counts) > OPS_SHOWN:
        return f"all {len(nodes)} ops"
    names = sorted(counts, key=lambda name: -counts[name][1])  # stable: execution order breaks ties
    items = [f"{name} ×{counts[name][0]}" if counts[name][0] > 1 else name for name in names]
    if len(items) > OPS_SHOWN:
        items = [*items[:OPS_SHOWN], f"{len(items) - OPS_SHOWN} more"]
    return ", ".join(items)


def _path(module: str) -> tuple[str, ...]:
    return tuple(module.split(".")) if module else ("(top level)",)


def _region_module(inside: Sequence[NodeDecision]) -> tuple[str, ...]:
    """The module path a region runs in: the deepest path holding all its ops; where that is a
    list of numbered children (a ``ModuleList`` of blocks), the span of them (``blocks.0..1``);
    where the region starts at the top level, its first and last module."""
    paths = [tuple(n.module.split(".")) if n.module else () for n in inside]
    common = paths[0]
    for path in paths[1:]:
        length = next((i for i, (a, b) in enumerate(zip(common, path)) if a != b), min(len(common), len(path)))
        common = common[:length]
    children = {path[len(common)] for path in paths if len(path) > len(common)}
    if children and all(child.isdigit() for child in children):
        numbers = sorted(int(child) for child in children)
        span = str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}..{numbers[-1]}"
        return (*common, span)
    if common:
        return common
    named = [n.module for n in inside if n.module]
    if not named:
        return _path("")
    return _path(named[0]) if named[0] == named[-1] else (f"{named[0]} to {named[-1]}",)


def _merge_indices(rows: Sequence[tuple[tuple[str, ...], str, str, str]]) -> list[RecomputeRow]:
    """Rows whose module paths differ only in their first numeric part, with the same ops, as
    one row naming the indices (``blocks.0..4.attn``), at the first one's place."""
    groups: dict[tuple, list[int]] = {}
    counts: dict[tuple, int] = {}
    for parts, recomputed, kept, how in rows:
        at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if at is None:
            key: tuple = (tuple(parts), None, recomputed, kept, how)
        else:
            key = (tuple(parts[:at]), tuple(parts[at + 1:]), recomputed, kept, how)
        numbers = groups.setdefault(key, [])
        if at is not None:
            numbers.append(int(parts[at]))
        counts[key] = counts.get(key, 0) + 1
    merged = []
    for key, numbers in groups.items():
        prefix, suffix, recomputed, kept, how = key
        path = list(prefix) if suffix is None else [*prefix, _indices(numbers), *suffix]
        merged.append(RecomputeRow(".".join(path), recomputed, kept, how, counts[key]))
    return merged


def _indices(numbers: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0..3``; ``[0, 1, 2, 5]`` -> ``{0..2,5}``; ``[4]`` -> ``4``."""
    runs: list[list[int]] = []
    for number in sorted(set(numbers)):
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    spans = [str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs]
    return spans[0] if len(spans) == 1 else "{" + ",".join(spans) + "}"
