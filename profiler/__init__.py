"""profiler: model + example inputs -> ``ComputeGraph``.

``profile`` traces the model (``torch.export`` by default, ``torch.fx.symbolic_trace`` on request),
then runs the graph once on fake tensors to record, per op, the bytes it allocates, the bytes
autograd saves for its backward (hidden tensors such as dropout masks included), forward and
backward FLOPs, and a roofline time estimate.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from ckptplan.graph import ComputeGraph, TensorSpec
from ckptplan.profiler.cost import A100, Roofline
from ckptplan.profiler.loss import loss_leaves, training_loss
from ckptplan.profiler.record import record_graph
from ckptplan.profiler.shard import shard_layout
from ckptplan.profiler.static import static_memory
from ckptplan.profiler.trace import TraceMode, trace_model
from ckptplan.sharding import ShardSpec, shard_graph

log = logging.getLogger(__name__)

__all__ = ["Roofline", "loss_leaves", "profile", "training_loss"]


def profile(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None = None,
    *,
    trace: TraceMode = "export",
    optimizer: str | None = None,
    roofline: Roofline = A100,
    shard: ShardSpec | None = None,
) -> ComputeGraph:
    """Trace ``model(*args, **kwargs)`` for one training step and annotate it for planning.

    Works on real tensors and on the ``meta`` device alike: the graph is executed on fake
    tensors, so nothing is allocated and the model's parameters and buffers are not touched.
    ``optimizer`` (``"adamw"``, ``"adam"``, ``"sgd"`` or None) adds its state to resident memory.
    ``shard``: plan one rank of a sharded data-parallel group (``ckptplan.sharding``).
    """
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    started = time.perf_counter()
    traced = trace_model(model, args, kwargs, trace)
    traced_seconds = time.perf_counter() - started
    recording = record_graph(traced.gm, traced.flat_inputs, roofline, loss_leaves)
    static = static_memory(recording.storages, optimizer)
    graph = ComputeGraph(
        name=type(model).__name__,
        nodes=tuple(recording.nodes),
        storages=tuple(recording.storages),
        static=static,
        outputs=tuple(recording.outputs),
        loss_nodes=tuple(recording.loss_nodes),
        inputs=tuple(
            TensorSpec(shape=tuple(x.shape), dtype=str(x.dtype).removeprefix("torch."))
            for x in traced.flat_inputs
            if isinstance(x, torch.Tensor)
        ),
        trace=traced.mode,
        traced=traced.gm,
        model=model,
    )
    if shard is not None:
        graph = shard_graph(graph, shard_layout(model, graph, shard))
    log.info(
        "profiled %s: %d nodes, trace %.1fs, total %.1fs",
        graph.name, len(graph.nodes), traced_seconds, time.perf_counter() - started,
    )
    return graph
