"""The torch side of sharding: which nodes and parameter bytes each FSDP unit owns."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from ckptplan.errors import CkptPlanError
from ckptplan.graph import ComputeGraph, ShardLayout, ShardSpec, ShardUnit
from ckptplan.repeats import find_blocks


def shard_layout(model: nn.Module, graph: ComputeGraph, spec: ShardSpec) -> ShardLayout:
    """Units in execution order (``spec.units``, default the graph's repeated blocks), the bytes of
    the parameters each owns (a parameter shared by several counts in the first), the root's
    remaining bytes, and the master copy's bytes per model byte."""
    if spec.stage == 0:  # DDP: no units, nothing sharded
        return ShardLayout(spec, (), 0)
    paths = list(spec.units) if spec.units is not None else [b.path for b in find_blocks(graph)[0]]
    counted: set[int] = set()
    units = []
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise CkptPlanError(f"The model has no module {path!r} to shard as a unit; check --shard-units.") from None
        indices = [n.index for n in graph.nodes if n.module == path or n.module.startswith(path + ".")]
        if not indices:
            raise CkptPlanError(f"Module {path!r} runs no op of the traced step, so it cannot be a shard unit.")
        units.append(ShardUnit(path, min(indices), max(indices) + 1, _param_bytes(module, counted)))
    units.sort(key=lambda u: u.start)
    for before, after in itertools.pairwise(units):
        if after.start < before.end:
            raise CkptPlanError(f"Shard units {before.path!r} and {after.path!r} overlap in execution order.")
    root_bytes = _param_bytes(model, counted)
    return ShardLayout(spec, tuple(units), root_bytes, _master_scale(model, spec))


def _param_bytes(module: nn.Module, counted: set[int]) -> int:
    total = 0
    for p in module.parameters():
        if id(p) not in counted:
            counted.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _master_scale(model: nn.Module, spec: ShardSpec) -> float:
    if spec.master_dtype is None:
        return 1.0
    master = getattr(torch, spec.master_dtype, None)
    if not isinstance(master, torch.dtype):
        raise CkptPlanError(f"Unknown master dtype {spec.master_dtype!r}; use e.g. 'float32'.")
    first = next(model.parameters(), None)
    if first is None:
        return 1.0
    return torch.empty((), dtype=master).element_size() / first.element_size()
