"""Synthetic ``ComputeGraph``s built straight from ``Node`` / ``Storage`` records, without torch.

They mimic what the profiler records for simple PyTorch models, so the simulator and solvers can
be tested on graphs whose every byte is known:

* ``chain_graph``: Linear → ReLU → Linear → ... where node i reads node i-1. A "linear" node
  saves its input (autograd keeps ``x`` for ``grad_weight = grad_out.T @ x``) and owns a
  trainable weight; a "relu" node saves its own output (``threshold_backward`` uses the result).
* ``skip_graph``: a small U-Net-like graph whose encoder output is read again near the end,
  with a dropout that saves a hidden mask.
* ``dag_graph``: any DAG of plain nodes, each reading the earlier nodes it is given and saving
  what it reads (random skips, residual streams, graphs of thousands of nodes).

Storage indices are positions in ``storages``; static storages (``param``, ``input``) have
producer -1. Costs are dyadic (``flops * 2**-40`` seconds, about 1 TFLOP/s) so sums of
recompute seconds are exact and comparisons between plans never hinge on rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckptplan.graph import ComputeGraph, Node, StaticMemory, Storage, TensorSpec

SECONDS_PER_FLOP = 2.0**-40


def _cost(flops: int) -> float:
    return flops * SECONDS_PER_FLOP


def chain_graph(
    act_bytes: Sequence[int],
    *,
    param_bytes: int = 64,
    input_bytes: int = 32,
    saves_output: bool = False,
    fwd_flops: Sequence[int] | None = None,
    name: str = "chain",
) -> ComputeGraph:
    """A chain of ``len(act_bytes)`` nodes alternating ``linear`` (even index) and ``relu`` (odd).

    ``act_bytes[i]``: bytes of node i's one fresh output storage (also its ``output_bytes``).
    ``param_bytes``: bytes of each linear node's trainable weight storage.
    ``input_bytes``: bytes of the graph input node 0 reads (static, held by the caller).
    ``saves_output``: every node also saves its own output (as ``tanh``/``sigmoid`` do), on top
    of what it saves by its kind (linear: its input; relu: its output).
    ``fwd_flops[i]``: forward FLOPs of node i; default ``2 * act_bytes[i]`` for linear and
    ``act_bytes[i]`` for relu. Backward FLOPs and costs are twice the forward ones.
    """
    n = len(act_bytes)
    if fwd_flops is None:
        fwd_flops = [2 * b if i % 2 == 0 else b for i, b in enumerate(act_bytes)]
    storages: list[Storage] = [Storage(index=0, nbytes=input_bytes, kind="input")]
    param_of: dict[int, int] = {}
    for i in range(0, n, 2):
        param_of[i] = len(storages)
        storages.append(Storage(index=len(storages), nbytes=param_bytes, kind="param", trainable=True))
    out_of: dict[int, int] = {}
    for i, nbytes in enumerate(act_bytes):
        out_of[i] = len(storages)
        storages.append(Storage(index=len(storages), nbytes=nbytes, kind="activation", producer=i))

    nodes: list[Node] = []
    for i in range(n):
        is_linear = i % 2 == 0
        read = out_of[i - 1] if i > 0 else 0  # storage of what node i reads
        saved: list[int] = [read] if is_linear else [out_of[i]]
        if saves_output and out_of[i] not in saved:
            saved.append(out_of[i])
        nodes.append(
            Node(
                index=i,
                name=f"{'linear' if is_linear else 'relu'}_{i}",
                op="aten.linear.default" if is_linear else "aten.relu.default",
                module=f"layers.{i // 2}" if is_linear else "",
                inputs=(i - 1,) if i > 0 else (),
                outputs=(out_of[i],),
                saved=tuple(saved),
                grad_inputs=(i - 1,) if i > 0 else (),
                param_grads=(param_of[i],) if is_linear else (),
                requires_grad=True,
                output_bytes=act_bytes[i],
                fwd_flops=fwd_flops[i],
                bwd_flops=2 * fwd_flops[i],
                fwd_cost=_cost(fwd_flops[i]),
                bwd_cost=_cost(2 * fwd_flops[i]),
            )
        )
    total_param_bytes = param_bytes * len(param_of)
    return ComputeGraph(
        name=name,
        nodes=tuple(nodes),
        storages=tuple(storages),
        static=StaticMemory(
            param_bytes=total_param_bytes, buffer_bytes=0, input_bytes=input_bytes, grad_bytes=total_param_bytes
        ),
        outputs=(n - 1,) if n else (),
        loss_nodes=(n - 1,) if n else (),
        inputs=(TensorSpec(shape=(input_bytes // 4,), dtype="float32"),),
    )


# (name, op, inputs, output bytes, saved: "in" = its inputs' storages, "out" = its output,
#  "mask" = a hidden mask storage it allocates, fwd_flops, has a trainable weight)
_SKIP_LAYOUT: tuple[tuple[str, str, tuple[int, ...], int, tuple[str, ...], int, bool], ...] = (
    ("enc", "aten.linear.default", (), 400, ("in",), 800, True),  # 0 reads the graph input
    ("enc_relu", "aten.relu.default", (0,), 400, ("out",), 400, False),  # 1: the skip source
    ("down", "aten.linear.default", (1,), 200, ("in",), 400, True),  # 2
    ("drop", "aten.dropout.default", (2,), 200, ("mask",), 200, False),  # 3: mask is hidden
    ("mid", "aten.linear.default", (3,), 200, ("in",), 400, True),  # 4
    ("up", "aten.linear.default", (4,), 400, ("in",), 800, True),  # 5
    ("cat", "aten.cat.default", (5, 1), 800, (), 0, False),  # 6: reads the skip; saves nothing
    ("head", "aten.linear.default", (6,), 100, ("in",), 800, True),  # 7
    ("loss", "aten.mse_loss.default", (7,), 4, ("in",), 100, False),  # 8
)


def skip_graph(*, param_bytes: int = 48, input_bytes: int = 400, mask_bytes: int = 50) -> ComputeGraph:
    """A 9-node U-Net-like graph: ``enc_relu`` (node 1) is read by ``down`` (2) and again by
    ``cat`` (6), so its output lives across nodes 2..5; ``drop`` (3) draws random numbers (so it
    cannot be kept) and saves a hidden mask of ``mask_bytes``; the loss (8) is the only output
    and the backward root."""
    return layout_graph(_SKIP_LAYOUT, name="skip", param_bytes=param_bytes, input_bytes=input_bytes,
                        mask_bytes=mask_bytes)


def dag_graph(reads: Sequence[Sequence[int]], act_bytes: Sequence[int], *, outputs: Sequence[int] = ()) -> ComputeGraph:
    """Node i reads the outputs of nodes ``reads[i]`` (each earlier than i; none: the graph input),
    saves what it reads, and makes one fresh activation of ``act_bytes[i]`` bytes. ``outputs``:
    the nodes the model returns besides the last, which is the loss."""
    n = len(act_bytes)
    storages: list[Storage] = [Storage(index=0, nbytes=32, kind="input")]
    storages += [Storage(index=1 + i, nbytes=b, kind="activation", producer=i) for i, b in enumerate(act_bytes)]
    nodes = []
    for i in range(n):
        inputs = tuple(dict.fromkeys(reads[i]))
        assert all(0 <= j < i for j in inputs), (i, inputs)
        flops = act_bytes[i]
        nodes.append(
            Node(
                index=i, name=f"op_{i}", op="aten.add.default", module="", inputs=inputs, outputs=(1 + i,),
                saved=tuple(1 + j for j in inputs) or (0,), grad_inputs=inputs, requires_grad=True,
                output_bytes=act_bytes[i], fwd_flops=flops, bwd_flops=2 * flops,
                fwd_cost=_cost(flops), bwd_cost=_cost(2 * flops),
            )
        )
    last = (n - 1,) if n else ()
    return ComputeGraph(
        name="dag", nodes=tuple(nodes), storages=tuple(storages),
        static=StaticMemory(param_bytes=0, buffer_bytes=0, input_bytes=32, grad_bytes=0),
        outputs=tuple(sorted({*outputs, *last})), loss_nodes=last, inputs=(TensorSpec(shape=(8,), dtype="float32"),),
    )


def check_consistent(graph: ComputeGraph) -> None:
    """Raise ``AssertionError`` if ``graph``'s records do not index each other consistently."""
    for position, storage in enumerate(graph.storages):
        assert storage.index == position, storage
        if storage.is_static:
            assert storage.producer == -1, storage
        else:
            assert 0 <= storage.producer < len(graph.nodes), storage
    for node in graph.nodes:
        assert all(0 <= j < node.index for j in node.inputs), node
        assert set(node.grad_inputs) <= set(node.inputs), node
        for s in (*node.outputs, *node.saved, *node.param_grads):
            assert 0 <= s < len(graph.storages), node
        assert all(graph.storages[p].kind == "param" and graph.storages[p].trainable for p in node.param_grads)


def without_modules(graph: ComputeGraph) -> ComputeGraph:
    """``graph`` with every node's module path cleared: no module structure, no repeated blocks."""
    return dataclasses.replace(graph, nodes=tuple(dataclasses.replace(n, module="") for n in graph.nodes))


# (name, op, inputs, output bytes (0: its output lives in its first input's storage, as for a
#  view or an in-place op), saved as in ``_SKIP_LAYOUT``, fwd_flops, has a trainable weight)
Layout = tuple[tuple[str, str, tuple[int, ...], int, tuple[str, ...], int, bool], ...]

# Four residual blocks: x -> linear -> relu_ (in place, on the linear's output) -> add(x, .).
# The block input is read again by the add (a skip over two nodes); each in-place ReLU forbids
# a region edge between it and its linear and makes that linear unkeepable.
RESIDUAL_LAYOUT: Layout = tuple(
    row
    for b in range(4)
    for row in (
        (f"fc{b}", "aten.linear.default", (3 * b - 1,) if b else (), 64 * (b + 1), ("in",), 128 * (b + 1), True),
        (f"relu{b}", "aten.relu_.default", (3 * b,), 0, ("out",), 16 * (b + 1), False),
        (f"add{b}", "aten.add.Tensor", (3 * b + 1, 3 * b - 1) if b else (3 * b + 1,), 64 * (b + 1), (), 8, False),
    )
)

# A 12-node U-Net with two skip levels: ``relu1`` is read again by ``cat1`` (a skip over eight
# nodes), the in-place ``relu2`` by ``cat2`` (over four); ``flat`` is a view, ``drop`` draws
# random numbers and saves a hidden mask.
UNET_LAYOUT: Layout = (
    ("enc1", "aten.linear.default", (), 256, ("in",), 512, True),  # 0 reads the graph input
    ("relu1", "aten.relu.default", (0,), 256, ("out",), 256, False),  # 1: the outer skip source
    ("enc2", "aten.linear.default", (1,), 128, ("in",), 256, True),  # 2
    ("relu2", "aten.relu_.default", (2,), 0, ("out",), 128, False),  # 3: in place; the inner skip source
    ("drop", "aten.dropout.default", (3,), 128, ("mask",), 128, False),  # 4
    ("mid", "aten.linear.default", (4,), 128, ("in",), 256, True),  # 5
    ("flat", "aten.view.default", (5,), 0, (), 0, False),  # 6: a view of mid's output
    ("up2", "aten.linear.default", (6,), 128, ("in",), 256, True),  # 7
    ("cat2", "aten.cat.default", (7, 3), 256, (), 0, False),  # 8: reads the inner skip
    ("up1", "aten.linear.default", (8,), 256, ("in",), 512, True),  # 9
    ("cat1", "aten.cat.default", (9, 1), 512, (), 0, False),  # 10: reads the outer skip
    ("loss", "aten.mse_loss.default", (10,), 4, ("in",), 64, False),  # 11
)


def layout_graph(
    layout: Layout, *, name: str = "dag", param_bytes: int = 48, input_bytes: int = 128, mask_bytes: int = 32
) -> ComputeGraph:
    """A graph laid out as ``_SKIP_LAYOUT`` is, where an op named ``aten.<x>_.default`` writes in
    place into its first input's storage, ``aten.view.default`` is a view of it, and
    ``aten.dropout.default`` draws random numbers and saves a hidden mask of ``mask_bytes``. The
    last node is the loss."""
    storages: list[Storage] = [Storage(index=0, nbytes=input_bytes, kind="input")]
    nodes: list[Node] = []
    out_of: dict[int, int] = {}
    for i, (node_name, op, inputs, nbytes, saves, flops, has_weight) in enumerate(layout):
        param: tuple[int, ...] = ()
        if has_weight:
            param = (len(storages),)
            storages.append(Storage(index=len(storages), nbytes=param_bytes, kind="param", trainable=True))
        inplace = op.endswith("_.default")
        view = op == "aten.view.default"
        if inplace or view:
            out_of[i] = out_of[inputs[0]]
        else:
            out_of[i] = len(storages)
            storages.append(Storage(index=len(storages), nbytes=nbytes, kind="activation", producer=i))
        saved: list[int] = []
        if "in" in saves:
            saved.extend([out_of[j] for j in inputs] or [0])  # storage 0: the graph input
        if "out" in saves:
            saved.append(out_of[i])
        if "mask" in saves:
            saved.append(len(storages))
            storages.append(Storage(index=len(storages), nbytes=mask_bytes, kind="hidden", producer=i))
        nodes.append(
            Node(
                index=i,
                name=node_name,
                op=op,
                module=node_name if has_weight else "",
                inputs=inputs,
                outputs=(out_of[i],),
                saved=tuple(saved),
                grad_inputs=inputs,
                param_grads=param,
                requires_grad=True,
                inplace=inplace,
                writes=(out_of[i],) if inplace else (),
                random=op == "aten.dropout.default",
                grad_aliases_output=view,
                grad_aliased_inputs=inputs if view else (),
                output_bytes=storages[out_of[i]].nbytes,
                fwd_flops=flops,
                bwd_flops=2 * flops,
                fwd_cost=_cost(flops),
                bwd_cost=_cost(2 * flops),
            )
        )
    total_param_bytes = sum(s.nbytes for s in storages if s.kind == "param")
    last = len(nodes) - 1
    return ComputeGraph(
        name=name,
        nodes=tuple(nodes),
        storages=tuple(storages),
        static=StaticMemory(
            param_bytes=total_param_bytes, buffer_bytes=0, input_bytes=input_bytes, grad_bytes=total_param_bytes
        ),
        outputs=(last,),
        loss_nodes=(last,),
        inputs=(TensorSpec(shape=(input_bytes // 4,), dtype="float32"),),
    )
