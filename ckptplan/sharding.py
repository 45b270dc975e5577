"""Per-rank memory under data parallelism (DDP, ZeRO / FSDP2), as a transformed graph.

With sharding, a rank's peak is no longer the model's: parameters, gradients and optimizer state
are split ``degree`` ways, and the parameters of the unit being run are gathered whole for a
while. ``shard_graph`` rewrites a ``ComputeGraph`` so that the simulator, and with it every solver,
plans one rank's step; nothing else in ckptplan needs to know about sharding.

Terms, following ZeRO (Rajbhandari et al. 2020, §5: stage 1 shards optimizer state, stage 2 also
gradients, stage 3 also parameters) and FSDP2's ``fully_shard`` as it runs (measured with
``FSDPMemTracker`` on 2 ranks here; see ``tests/test_sharding.py``). ``P`` is a unit's parameter
bytes in the model's dtype, ``s`` the master copy's bytes per model byte (``master_dtype``: 2 for
fp32 masters of a bf16 model, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``), ``N`` the degree:

* resident: sharded parameters ``s·P_all/N`` (stage 3) and optimizer state ``s·O/N`` (stages 1-3),
  plus the root unit's gathered parameters, which FSDP2 keeps from the root's forward to the end
  of backward;
* gradients: each parameter's gradient, when backward first produces it, is its shard ``s·g/N``
  (stages 2-3; reduce-scattered at the end of its unit's backward);
* while unit k runs forward or is recomputed: its gathered parameters ``P_k``, plus ``P_{k-1}``
  (the next unit in backward order, whose all-gather FSDP2 prefetches) and ``s·P_{k+1}`` (the
  previous unit's reduce-scatter input, alive until the next reduce-scatter) — present during a
  recomputation; counted in forward too, which overstates the forward by those two;
* while unit k runs backward: ``P_k``, the prefetch and the reduce-scatter input as above, and
  the unsharded gradients its backward has produced so far (up to ``P_k``);
* stage 2 (no units): each node's backward also holds its parameters' unsharded gradients until
  they are reduce-scattered.

Stage 0 is plain ``DistributedDataParallel``: nothing is sharded, and each rank also holds DDP's
gradient buckets, one flat buffer per bucket covering every parameter that requires grad, made
when DDP wraps the model (``Reducer::initialize_buckets``; DDP's documentation of
``gradient_as_bucket_view``: the memory it saves "will be equal to the total gradients size").
That is DDP's default, which the model assumes; with ``gradient_as_bucket_view=True`` the
gradients are views into the buckets instead, and the plan overstates the peak by up to that much.
``tests/test_sharding.py`` checks the term against the bucket sizes DDP reports on 2 ranks.

Units are the modules FSDP wraps one by one (``fully_shard`` per transformer block): by default the
graph's repeated blocks (``ckptplan.repeats``); everything else is the root unit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from ckptplan.graph import ComputeGraph, ShardLayout, ShardUnit
from ckptplan.region import Region


def shard_graph(graph: ComputeGraph, layout: ShardLayout) -> ComputeGraph:
    """``graph`` as one rank of ``layout`` sees it (terms in the module docstring). The result
    keeps the unsharded graph's fingerprint: plans apply to the model either way."""
    spec, n, s = layout.spec, layout.spec.degree, layout.master_scale
    static = graph.static
    if spec.stage == 0:
        buckets = sum(st.nbytes for st in graph.storages if st.kind == "param" and st.trainable)
        return replace(graph, static=replace(static, bucket_bytes=buckets), sharding=layout, unsharded_static=static)

    def shard(nbytes: int) -> int:
        return math.ceil(nbytes * s / n)

    storages = graph.storages
    if spec.stage >= 2:
        storages = tuple(replace(st, nbytes=shard(st.nbytes)) if st.kind == "param" else st for st in storages)
    nodes = list(graph.nodes)
    if spec.stage == 3:
        for k, unit in enumerate(layout.units):
            before = layout.units[k - 1].param_bytes if k > 0 else 0
            after = math.ceil(s * layout.units[k + 1].param_bytes) if k + 1 < len(layout.units) else 0
            around = unit.param_bytes + before + after
            unsharded_grads = 0
            for i in reversed(range(unit.start, unit.end)):  # backward order
                node = nodes[i]
                unsharded_grads += sum(graph.storages[p].nbytes for p in node.param_grads)
                nodes[i] = replace(
                    node,
                    fwd_workspace_bytes=node.fwd_workspace_bytes + around,
                    bwd_workspace_bytes=node.bwd_workspace_bytes + around + unsharded_grads,
                )
    elif spec.stage == 2:
        for i, node in enumerate(nodes):
            unsharded = sum(graph.storages[p].nbytes for p in node.param_grads)
            nodes[i] = replace(node, bwd_workspace_bytes=node.bwd_workspace_bytes + unsharded)
    param_bytes = static.param_bytes
    if spec.stage == 3:
        param_bytes = shard(static.param_bytes) + layout.root_param_bytes
    sharded_static = replace(
        static,
        param_bytes=param_bytes,
        grad_bytes=sum(st.nbytes for st in storages if st.kind == "param" and st.trainable),
        optimizer_bytes=shard(static.optimizer_bytes),
    )
    return replace(
        graph, nodes=tuple(nodes), storages=storages, static=sharded_static, sharding=layout, unsharded_static=static
    )

def fsdp_units(graph: ComputeGraph) -> tuple[ShardUnit, ...]:
    """The units whose modules FSDP2 runs one by one: those of a stage-3 layout, else none."""
    layout = graph.sharding
    if layout is None or layout.spec.stage != 3:
        return ()
    return layout.units

def unit_edges(graph: ComputeGraph) -> tuple[int, ...]:
    """Positions where one FSDP unit's nodes meet another's or the root's: a checkpoint region
    may not contain one (the emitted module calls each unit's module around its own ops)."""
    return tuple(sorted({k for u in fsdp_units(graph) for k in (u.start, u.end) if 0 < k < len(graph.nodes)}))

def split_at_unit_edges(graph: ComputeGraph, regions: tuple[Region, ...]) -> tuple[Region, ...]:
    """``regions`` cut at every unit edge inside them (keep-sets and children follow their
    nodes); pieces left without a node are dropped. A no-op on an unsharded graph."""
    edges = unit_edges(graph)
    if not edges:
        return regions
    return tuple(piece for region in regions for piece in _split(graph, region, edges))

def _split(graph: ComputeGraph, region: Region, edges: tuple[int, ...]) -> list[Region]:
    cuts = [region.start, *(e for e in edges if region.start < e < region.end), region.end]
    pieces = []
    for lo, hi in itertools.pairwise(cuts):
        keep = tuple(name for name in region.keep if lo <= graph.index_of[name] < hi)
        children = tuple(
            piece
            for child in region.children
            for piece in _split(graph, child, edges)
            if lo <= piece.start and piece.end <= hi and (piece.start, piece.end) != (lo, hi)
        )
        pieces.append(Region(lo, hi, keep=keep, children=children))
    return pieces
