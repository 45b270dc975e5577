"""profiler: model + example inputs -> ``ComputeGraph``.

``profile`` traces the model (``torch.export`` by default, ``torch.fx.symbolic_trace`` on request),
optionally spells out composite kernels (math-kernel attention, CPU dropout: ``composite``),
then runs the graph once on fake tensors to record, per op, the bytes it allocates, the bytes
autograd saves for its backward (hidden tensors such as dropout masks included), forward and
backward FLOPs, and a roofline time estimate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ckptplan.errors import CkptPlanError
from ckptplan.graph import ComputeGraph, Node, ShardSpec, TensorSpec
from ckptplan.profiler.composite import spell_out_composites
from ckptplan.profiler.cost import A100, FLOPS, Roofline
from ckptplan.profiler.cuda_attention import cuda_backend
from ckptplan.profiler.loss import loss_leaves, training_loss
from ckptplan.profiler.masks import group_repeated_heads
from ckptplan.profiler.record import record_graph
from ckptplan.profiler.shard import shard_layout
from ckptplan.profiler.static import static_memory
from ckptplan.profiler.timing import StepTimes, measure_op_seconds
from ckptplan.profiler.trace import Autocast, Target, TraceMode, model_device, model_device_type, trace_model
from ckptplan.profiler.workspace import measure_workspaces
from ckptplan.sharding import shard_graph

log = logging.getLogger(__name__)

__all__ = ["A100", "FLOPS", "Roofline", "loss_leaves", "profile", "training_loss"]


def profile(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None = None,
    *,
    trace: TraceMode = "export",
    optimizer: str | None = None,
    roofline: Roofline = A100,
    shard: ShardSpec | None = None,
    autocast: torch.dtype | None = None,
    target: Target | None = None,
    measure_times: bool = False,
    spell_out: bool = False,
    workspaces: bool | None = None,
    outputs_live: bool = True,
) -> ComputeGraph:
    """Trace ``model(*args, **kwargs)`` for one training step and annotate it for planning.

    Works on real tensors and on the ``meta`` device alike: the graph is executed on fake
    tensors, so nothing is allocated and the model's parameters and buffers are not touched.
    ``optimizer`` (``"adamw"``, ``"adam"``, ``"sgd"`` or None) adds its state to resident memory.
    ``shard``: plan one rank of a sharded data-parallel group (``ckptplan.sharding``).
    ``autocast`` (``torch.bfloat16``, ``torch.float16`` or None): plan a mixed-precision step
    whose forward and loss run under ``torch.autocast(device_type, dtype=autocast)`` and whose
    backward runs outside it, as PyTorch's AMP recipe has it; run the emitted module the same way.
    The graph is traced and recorded under autocast, so the dtypes the model's code reads, saved
    tensors, workspaces and autocast's parameter casts are those of that step. Running backward
    inside the context as well keeps autocast's cache of parameter casts alive through it: up to
    the low-precision copies of all weights more than predicted.
    ``target`` (``"cuda"``, ``"cpu"`` or None): the device kind whose kernels the step runs on,
    where they save different tensors for backward: dropout keeps a 1-byte ``torch.bool`` mask
    per element on CUDA and its scaling noise in the input's dtype on CPU; for a CUDA target,
    scaled-dot-product attention runs the fused kernel CUDA would pick (``cuda_attention``), not
    the math kernel CPU takes with dropout. None means the device of the model's tensors, and
    ``"cpu"`` for a model on ``meta``: a meta model profiles as the same model on CPU (as it does
    under autocast), and keeps the bytes and fingerprint it had before targets existed. Give
    ``target="cuda"`` to plan a meta model for GPUs. Only dropout's and attention's kernels follow
    the target; other ops (and on a meta model autocast's casting rules) are those of the device
    the model's tensors are faked on.
    ``roofline``: the cost model that prices recomputation (default: an A100's datasheet;
    ``ckptplan.measure_roofline()`` measures this machine's, with the fixed costs of regions
    and selective policies; ``ckptplan.profiler.FLOPS`` prices ops by their FLOPs alone, as
    ``FlopCounterMode`` counts them). ``measure_times``: also run the model's forward a few times on its
    real tensors and price each op by its measured time (each op's backward by the roofline's
    backward-to-forward ratio, all of them scaled to the measured backward): for plans that
    will run on the machine profiling them.
    ``spell_out``: run composite kernels of the target as their parts, each a node a plan can keep
    or recompute (``profiler.composite``: attention that takes PyTorch's math kernel, and CPU
    dropout as a bool mask and a product), bitwise as the kernels run. Spelled-out CPU dropout
    keeps its one-byte mask for backward, not the kernel's noise in the input's dtype (a quarter
    of the bytes in fp32). More nodes give plans more choices and the solvers more work: at
    short time limits ``ilp`` then searches less.
    ``workspaces``: run each distinct op once more for real and take what the device's allocator
    counts inside it (``profiler.workspace``: a CPU convolution's temporaries, cuDNN's
    workspaces). None (the default) does when the model's tensors are real and on the device
    kind the plan is for; a model on ``meta``, or planned for another device, keeps the fake
    tensors' count.
    ``outputs_live`` (the default): the training loop keeps the model's outputs through
    backward, as ``out = model(**batch); out.loss.backward()`` does with ``out`` still bound (a
    causal LM's logits, say); False: it drops them once the loss is made, as ``Trainer``,
    Lightning and torchtitan do, so they die with forward unless backward needs them. The
    default is the assumption whose mistake costs memory to spare, not an out-of-memory error.
    """
    autocast_name = _autocast_name(autocast)
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    started = time.perf_counter()
    flat_inputs = pytree.tree_leaves((args, kwargs or {}))
    device_type = model_device_type(model, flat_inputs)
    target = _target(target, device_type)
    spec = None
    if autocast is not None:
        spec = Autocast.for_model(autocast, model, flat_inputs)
    traced = trace_model(model, args, kwargs, trace, spec)
    own_kernels = "cuda" if device_type == "cuda" else "cpu"
    if target == own_kernels:
        group_repeated_heads(traced.gm)  # grouped-query attention as the model calls it
    elif target == "cuda":
        # For CUDA's kernels from another device, only the calls CUDA's flash kernel takes grouped:
        # ``cuda_attention`` models no other grouped call (docs/limits.md).
        dtype = spec.dtype if spec is not None else None
        group_repeated_heads(traced.gm, only=lambda call: cuda_backend(call, autocast=dtype) == "flash")
    if spell_out:
        spell_out_composites(traced.gm, target, autocast=spec is not None)
    traced_seconds = time.perf_counter() - started
    if workspaces is None:
        workspaces = device_type in ("cpu", "cuda") and target == own_kernels
    recording = record_graph(
        traced.gm, traced.flat_inputs, roofline, loss_leaves, spec, target=None if target == own_kernels else target,
        grad_layouts=workspaces,
    )
    static = static_memory(recording.storages, optimizer)
    nodes = tuple(recording.nodes)
    if workspaces:
        # A loss node of a summed output gets the seed as a broadcast scalar (``training_loss``).
        broadcast = frozenset(nodes[i].name for i in recording.loss_nodes) if recording.loss_scalar_bytes else frozenset()
        measured = measure_workspaces(
            recording.calls, model_device(model, flat_inputs), spec, broadcast, recording.grad_strides
        )
        nodes = _with_workspaces(nodes, measured)
    if measure_times:
        nodes = _with_measured_times(nodes, measure_op_seconds(model, traced.gm, traced.flat_inputs, spec))
    graph = ComputeGraph(
        name=type(model).__name__,
        nodes=nodes,
        storages=tuple(recording.storages),
        static=static,
        outputs=tuple(recording.outputs),
        loss_nodes=tuple(recording.loss_nodes),
        loss_scalar_bytes=recording.loss_scalar_bytes,
        loss_is_output=recording.loss_is_output,
        outputs_live=outputs_live,
        seed_bytes=recording.seed_bytes,
        rng_state_bytes=_rng_state_bytes(target),
        region_cost=roofline.region_seconds,
        region_op_cost=roofline.region_op_seconds,
        policy_op_cost=roofline.policy_op_seconds,
        remat_cost=roofline.remat_seconds,
        priced_in=roofline.priced_in,
        priced_on="measured" if measure_times else roofline.source,
        inputs=tuple(TensorSpec.of(x) for x in traced.flat_inputs if isinstance(x, torch.Tensor)),
        trace=traced.mode,
        autocast=autocast_name,
        target=target,
        spelled_out=spell_out,
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


def _with_measured_times(nodes: tuple[Node, ...], times: StepTimes) -> tuple[Node, ...]:
    """``nodes`` priced by their measured forward seconds; backward by the roofline's ratio to
    forward, scaled so that the measured nodes' backward adds up to the measured backward.
    Nodes the timing run did not see keep their roofline costs."""
    seconds = times.op_seconds
    measured = [n for n in nodes if n.name in seconds]
    raw_bwd = {n.name: (n.bwd_cost / n.fwd_cost if n.fwd_cost > 0 else 0.0) * seconds[n.name] for n in measured}
    total = sum(raw_bwd.values())
    scale = times.backward_seconds / total if times.backward_seconds is not None and total > 0 else 1.0
    priced = tuple(
        replace(n, fwd_cost=seconds[n.name], bwd_cost=raw_bwd[n.name] * scale) if n.name in seconds else n
        for n in nodes
    )
    log.info("measured times of %d of %d ops; backward scaled by %.2f to the measured %s s",
             len(measured), len(nodes), scale, times.backward_seconds)
    return priced


# The dtypes torch.autocast lowers to on CPU and CUDA; any other makes it disable itself.
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def _autocast_name(dtype: Any) -> str | None:
    """``"bfloat16"`` for ``torch.bfloat16``; refuses what ``torch.autocast`` would ignore, which
    would otherwise profile a full-precision step under a mixed-precision name."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or dtype not in _AUTOCAST_DTYPES:
        raise CkptPlanError(f"autocast must be torch.bfloat16, torch.float16 or None, not {dtype!r}.")
    return str(dtype).removeprefix("torch.")


_TARGETS: tuple[Target, ...] = ("cpu", "cuda")


def _target(target: Any, device_type: str) -> Target:
    """``target`` checked, or the kernels of ``device_type`` (a meta model's are CPU's)."""
    if target is None:
        return "cuda" if device_type == "cuda" else "cpu"
    if target not in _TARGETS:
        raise CkptPlanError(f"target must be 'cpu', 'cuda' or None, not {target!r}.")
    return target


def _with_workspaces(nodes: tuple[Node, ...], measured: dict) -> tuple[Node, ...]:
    """Each node with the larger of its recorded and its measured workspaces."""
    found = []
    for node in nodes:
        ws = measured.get(node.name)
        if ws is not None and (ws.fwd_bytes > node.fwd_workspace_bytes or ws.bwd_bytes > node.bwd_workspace_bytes):
            node = replace(node, fwd_workspace_bytes=max(node.fwd_workspace_bytes, ws.fwd_bytes),
                           bwd_workspace_bytes=max(node.bwd_workspace_bytes, ws.bwd_bytes))
        found.append(node)
    return tuple(found)



def _rng_state_bytes(target: str) -> int:
    """Device bytes a random checkpoint region stashes (``ComputeGraph.rng_state_bytes``): the CPU
    generator's state on CPU; none on CUDA, where ``torch.cuda.get_rng_state()`` is a CPU tensor."""
    return torch.get_rng_state().nbytes if target == "cpu" else 0
