"""Read the joint forward-backward graph AOTAutograd hands a partitioner into a ``JointGraph``.

Every node carries its value on fake tensors (``node.meta["val"]``): storages and their sizes
come from those (a view shares its base's storage), FLOPs from ``torch.utils.flop_counter``'s
formulas, time from the roofline. A node that depends on a tangent is the backward's; any other
is the forward's, which the backward may compute again unless it draws random numbers or
writes into a tensor. A dropout the backward reads may be replayed instead
(``replayable_dropouts``; ``ckptplan.joint`` on replays).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from ckptplan.joint import JointGraph, JointValue, Phase
from ckptplan.profiler.cost import Roofline
from ckptplan.profiler.workspace import Call, call_key, measure_workspaces


def read_joint(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    roofline: Roofline,
    *,
    name: str = "joint",
    outputs_live: bool = True,
    workspaces: torch.device | None = None,
    resident_bytes: int = 0,
) -> JointGraph:
    """The ``JointGraph`` of ``joint``, whose output node returns the forward's
    ``num_fwd_outputs`` outputs, then the gradients of its primals. ``workspaces``: run each
    distinct op once for real on this device to measure its kernel's workspace
    (``profiler.workspace``). ``resident_bytes``: the model's state and the step's inputs, as
    the caller holds them (``JointGraph.resident_bytes``)."""
    storage_of: dict[Any, int] = {}
    storage_bytes: list[int] = []
    index: dict[fx.Node, int] = {}
    values: list[JointValue] = []
    backward = backward_nodes(joint)
    output = None
    for node in joint.graph.nodes:
        if node.op == "output":
            output = node
            break
        tensors = _tensors(node.meta.get("val"))
        base = _viewed(node)
        storages = []
        for t in tensors:
            key = StorageWeakRef(t.untyped_storage())
            if key not in storage_of:
                if base is not None and base in index and values[index[base]].storages:
                    # A view whose fake value lost its base's storage (a graph pass made it anew).
                    storage_of[key] = values[index[base]].storages[0]
                else:
                    storage_of[key] = len(storage_bytes)
                    storage_bytes.append(t.untyped_storage().nbytes())
            if storage_of[key] not in storages:
                storages.append(storage_of[key])
        phase: Phase
        if node.op == "placeholder":
            phase = "tangent" if is_tangent(node) else "primal"
        else:
            phase = "backward" if node in backward else "forward"
        flops = _flops(node) if node.op == "call_function" else 0
        moved = sum(_nbytes(t) for a in node.all_input_nodes for t in _tensors(a.meta.get("val")))
        moved += sum(_nbytes(t) for t in tensors)
        index[node] = len(values)
        values.append(JointValue(
            index=len(values),
            name=node.name,
            op=_op_name(node),
            phase=phase,
            inputs=tuple(dict.fromkeys(index[n] for n in node.all_input_nodes)),
            storages=tuple(storages),
            cost=roofline.seconds(flops, moved, _drawn(node)) if node.op == "call_function" else 0.0,
            flops=flops,
            recomputable=node.op == "call_function" and not _random(node) and not _writes(node),
            multi_output=isinstance(node.meta.get("val"), (tuple, list)),
            replay=_replay(node) or bool(node.meta.get(_REMAKES)),
        ))
    if output is None:
        raise ValueError("joint graph without an output node")
    if workspaces is not None:
        # A partitioner runs inside AOTAutograd's tracing, under its fake mode: step out of it.
        with unset_fake_temporarily():
            found = measure_workspaces(_calls(joint), workspaces)
        values = [
            replace(v, workspace_bytes=found[v.name].fwd_bytes) if v.name in found else v for v in values
        ]
    returned = list(output.args[0])
    forward_outputs = [index[n] for n in returned[:num_fwd_outputs] if isinstance(n, fx.Node)]
    backward_outputs = [index[n] for n in returned[num_fwd_outputs:] if isinstance(n, fx.Node)]
    effects = [index[n] for n in joint.graph.nodes
               if n.op == "call_function" and n in index and not n.users and _writes(n) and n not in backward]
    names = {n.name: n for n in index}
    replays = [(index[n], index[names[n.meta[_REPLAYS]]]) for n in index if n.meta.get(_REPLAYS) in names]
    caller_held, caller_bytes = _callers_loss(joint, returned[:num_fwd_outputs], index)
    return JointGraph(
        name=name,
        values=tuple(values),
        storage_bytes=tuple(storage_bytes),
        forward_outputs=tuple(dict.fromkeys(forward_outputs)),
        backward_outputs=tuple(dict.fromkeys(backward_outputs)),
        outputs_live=outputs_live,
        effects=tuple(effects),
        priced_on=roofline.source,
        replays=tuple(replays),
        caller_held=caller_held,
        caller_bytes=caller_bytes,
        resident_bytes=resident_bytes,
    )


def _callers_loss(
    joint: fx.GraphModule, returned: Sequence[Any], index: dict[fx.Node, int]
) -> tuple[tuple[int, ...], int]:
    """What the caller's training step (``profiler.loss.training_loss``, then ``backward()``)
    holds until backward ends: ``JointGraph.caller_held`` and ``caller_bytes``. The tangents are
    the gradients of the outputs the loss is made of. One scalar output is the loss itself (a
    view of it), and its tangent the seed ``backward()`` makes and holds; otherwise the loss is a
    new scalar of the outputs' promoted dtype, and its seed another, which the backward of the
    sums expands into each output's tangent."""
    tangents = [n for n in joint.graph.find_nodes(op="placeholder") if is_tangent(n)]
    vals = [n.meta.get("val") for n in tangents]
    if not tangents or not all(isinstance(v, torch.Tensor) for v in vals):
        return (), 0
    if len(vals) == 1 and vals[0].numel() == 1:
        scalars = [n for n in returned if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
                   and n.meta["val"].numel() == 1 and n.meta["val"].dtype == vals[0].dtype]
        if len(scalars) == 1:
            return (index[scalars[0]], index[tangents[0]]), 0
    dtype = functools.reduce(torch.promote_types, [v.dtype for v in vals])
    return (), 2 * dtype.itemsize


def is_tangent(node: fx.Node) -> bool:
    """A placeholder of the joint graph for the gradient of a forward output."""
    return node.op == "placeholder" and "tangents" in str(node.target)


def backward_nodes(joint: fx.GraphModule) -> set[fx.Node]:
    """The tangents and every node that depends on one: the backward's nodes."""
    found: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if is_tangent(node) or any(n in found for n in node.all_input_nodes):
            found.add(node)
    return found


REPLAY_OP = "run_with_rng_state"  # a ``JointValue.op`` that draws a forward's random numbers again

# ``node.meta`` keys: on a twin (a node that computes for the backward what a forward node
# holds: a replayed mask or dropout output, a value computed from one, a dropout's output made
# from its mask), that node's name; on a twin that repeats the forward's work, True; on every
# node added for the backward to make a value again, True.
_REPLAYS = "ckptplan_replays"
_REMAKES = "ckptplan_remakes"
_REPLAY_PART = "ckptplan_replay_part"


def _training_dropouts(
    graph: fx.Graph, backward: set[fx.Node]
) -> Iterator[tuple[fx.Node, fx.Node, float, dict[int, fx.Node]]]:
    """The forward's ``native_dropout`` nodes in training with a constant probability in (0, 1),
    in graph order, each with its input, its probability and its ``getitem`` parts by index
    (read as each is reached, so the caller may rewrite the graph between them)."""
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.native_dropout.default or node in backward:
            continue
        source, p, train = (list(node.args) + [None])[:3]
        if not train or not isinstance(p, float) or not 0 < p < 1 or node.kwargs:
            continue
        yield node, source, p, {user.args[1]: user for user in node.users if user.target is operator.getitem}


def mask_scale(p: float, dtype: torch.dtype, device: torch.device) -> float:
    """The factor ``native_dropout`` multiplies a kept element by on ``device``, as the Python
    number whose ``aten.mul`` with a ``dtype`` tensor gives the kernel's rounding. On CPU
    (``native_dropout_cpu``: ``input.mul(mask).mul_(scale)``) the in-place multiply rounds
    ``1 / (1 - p)`` to ``dtype`` first: 1.109375 in bfloat16 for ``p`` = 0.1, where an
    out-of-place multiply by the double would compute with 1.1111112 and round about a third of
    the kept elements differently. On CUDA (``fused_dropout_kernel``, read from its source;
    ``tests/test_compiled.py`` checks it where a GPU is present) the factor is ``1.0 / keep``
    with ``keep = 1 - p`` held in the kernel's accumulate type (float, or double for float64
    tensors), the product taken in that type, as ``aten.mul`` takes a Python factor."""
    with unset_fake_temporarily():  # a partitioner runs under AOTAutograd's fake mode
        if device.type == "cpu":
            return torch.tensor(1.0 / (1.0 - p), dtype=dtype).item()
        if dtype == torch.float64:
            return 1.0 / (1.0 - p)
        return 1.0 / torch.tensor(1.0 - p, dtype=torch.float32).item()


def dropout_from_masks(joint: fx.GraphModule) -> int:
    """Let the backward make a dropout's output again from its mask: where the backward reads
    ``native_dropout``'s output, it reads ``input * mask * scale`` instead (``mask_scale``), new
    nodes that depend on no tangent, so the partition may save the one-byte mask (and the input,
    often saved anyway) rather than the output, and never draws the mask again. The product is
    the kernel's own (a kept element is ``input * scale``, a dropped one a zero of its sign), bit
    for bit in every floating dtype. It is the output's twin (as ``replayable_dropouts`` makes
    twins): saving it saves the output, and computing it counts as recomputation. Returns how
    many dropouts were rewritten."""
    graph = joint.graph
    backward = backward_nodes(joint)
    rewritten = 0
    for node, source, p, parts in _training_dropouts(graph, backward):
        output = parts.get(0)
        readers = [user for user in output.users if user in backward] if output is not None else []
        if not readers:
            continue
        if 1 not in parts:
            with graph.inserting_after(output):
                parts[1] = graph.call_function(operator.getitem, (node, 1))
            parts[1].meta["val"] = node.meta["val"][1]
        first = min(readers, key=list(graph.nodes).index)
        fake = output.meta["val"]
        scale = mask_scale(p, fake.dtype, fake.device)
        with graph.inserting_before(first):
            kept = graph.call_function(torch.ops.aten.mul.Tensor, (source, parts[1]))
            again = graph.call_function(torch.ops.aten.mul.Tensor, (kept, scale))
        with fake.fake_mode:
            kept.meta["val"] = source.meta["val"] * parts[1].meta["val"]
            again.meta["val"] = kept.meta["val"] * scale
        for reader in readers:
            reader.replace_input_with(output, again)
        again.meta[_REPLAYS], again.meta[_REMAKES] = output.name, True
        kept.meta[_REPLAY_PART] = again.meta[_REPLAY_PART] = True
        rewritten += 1
    if rewritten:
        graph.lint()
        joint.recompile()
    return rewritten


def replayable_dropouts(joint: fx.GraphModule) -> int:
    """Let the backward draw a dropout's mask again instead of holding what depends on it.

    Each forward ``native_dropout`` in training runs as ``run_and_save_rng_state``, which keeps
    the random number generator's state before the draw (5,056 bytes on CPU, 16 on CUDA). Beside
    it, ``run_with_rng_state`` draws the same mask again from that state, on a fresh tensor of
    the input's layout (the mask depends on the input's shape and strides, not its values; the
    generator is restored after it), and a second replay on the input gives the output again, bit
    for bit (the kernel's own). Every other forward node computed from a draw, directly or
    through others (the residual sum after a dropout, the layer norm and projections after it),
    gets a twin computed from the replays and from its inputs' twins, and the backward reads the
    twins instead: so the partition may recompute anything downstream of a dropout, as it may
    anything else, without ever drawing a new mask (PyTorch's partitioner reaches the same
    freedom by re-drawing, which changes the gradients). The forward never computes the twins:
    a partition that saves one saves its original (``JointGraph.reading_drawn``; the cut reads
    the original, ``read_drawn_masks``); one that saves neither has the backward compute it
    again from what is saved and the generator states. Random ops and writes get no twin, and
    the graph's outputs keep reading the originals. Dropouts with symbolic shapes are left
    alone. Returns how many dropouts were rewritten."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    graph = joint.graph
    backward = backward_nodes(joint)
    twins: dict[fx.Node, fx.Node] = {}  # a forward node -> its twin, which the backward reads
    replays_on_input: list[tuple[fx.Node, fx.Node]] = []  # (replay of the output, the dropout's input)
    replay_parts: set[fx.Node] = set()  # the replays and their blank inputs: removed by the cut when unread
    rewritten = 0
    for node, source, p, parts in _training_dropouts(graph, backward):
        fake = source.meta.get("val")
        if 1 not in parts or not isinstance(fake, torch.Tensor):
            continue
        if not all(isinstance(d, int) for d in (*fake.shape, *fake.stride())):
            continue
        order = {n: k for k, n in enumerate(graph.nodes)}
        drawn, op = node.meta["val"], node.target
        with graph.inserting_before(node):
            saving = graph.call_function(run_and_save_rng_state, (op, *node.args))
            state = graph.call_function(operator.getitem, (saving, 0))
            draw = graph.call_function(operator.getitem, (saving, 1))
        with fake.fake_mode:
            state_val = run_and_save_rng_state(op, *pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], node.args))[0]
        if not isinstance(state_val, FakeTensor):
            state_val = fake.fake_mode.from_tensor(state_val, static_shapes=True)
        saving.meta["val"], state.meta["val"], draw.meta["val"] = (state_val, drawn), state_val, drawn
        node.replace_all_uses_with(draw)
        graph.erase_node(node)
        last = max(parts.values(), key=lambda n: order[n])
        # The mask's replay: on a fresh tensor of the dropout input's layout, so that replaying
        # the mask never needs the input itself.
        with graph.inserting_after(last):
            blank = graph.call_function(
                torch.ops.aten.empty_strided.default, (list(fake.shape), list(fake.stride())),
                {"dtype": fake.dtype, "device": fake.device},
            )
        with fake.fake_mode:
            blank.meta["val"] = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device)
        with graph.inserting_after(blank):
            replay = graph.call_function(run_with_rng_state, (state, op, blank, p, True))
        with graph.inserting_after(replay):
            replayed = graph.call_function(operator.getitem, (replay, 1))
        made = [blank, replay, replayed]
        twins[parts[1]] = replayed
        if 0 in parts:  # the output's replay, on the input (or the input's twin: set below)
            with graph.inserting_after(replayed):
                on_input = graph.call_function(run_with_rng_state, (state, op, source, p, True))
            with graph.inserting_after(on_input):
                output = graph.call_function(operator.getitem, (on_input, 0))
            replays_on_input.append((on_input, source))
            twins[parts[0]] = output
            made += [on_input, output]
        with fake.fake_mode:
            for n in made:
                if n.target is run_with_rng_state:
                    n.meta["val"] = tuple(torch.empty_like(t) for t in drawn)
        replayed.meta["val"] = replay.meta["val"][1]
        if 0 in parts:
            output.meta["val"] = on_input.meta["val"][0]
        replay_parts.update(n for n in made if n.target is not operator.getitem)
        rewritten += 1
    if not rewritten:
        return 0
    # Twins of the forward nodes computed from a draw, in graph order (a twin's inputs come first).
    for n in list(graph.nodes):
        # (The replays are not twinned: the output's reads the input's twin, set below.)
        if n in backward or n.op != "call_function" or n in replay_parts or n in twins.values():
            continue
        if _random(n) or _writes(n) or not any(a in twins for a in n.all_input_nodes):
            continue
        with graph.inserting_after(n):
            copy = graph.node_copy(n, lambda a: twins.get(a, a))
        value = n.meta.get("val")
        fake_mode = next((t.fake_mode for t in pytree.tree_leaves(value) if isinstance(t, FakeTensor)), None)
        args, kwargs = pytree.tree_map_only(fx.Node, lambda a: a.meta["val"], (copy.args, copy.kwargs))
        try:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                copy.meta["val"] = copy.target(*args, **kwargs)  # its own storage, or a view of its input twin's
        except Exception:  # noqa: BLE001 (an op fake tensors cannot run: no twin; the backward reads the original)
            graph.erase_node(copy)
            continue
        twins[n] = copy
    for on_input, source in replays_on_input:
        if source in twins:
            on_input.replace_input_with(source, twins[source])
    for original, twin in twins.items():
        twin.meta[_REPLAY_PART] = True
        if not isinstance(original.meta.get("val"), (tuple, list)):  # a tuple's parts stand for it
            twin.meta[_REPLAYS] = original.name
        if twin.target is not operator.getitem or not _replay(twin):
            twin.meta[_REMAKES] = True  # never computed by the forward (a replay's part is one already)
        for user in list(original.users):
            if user in backward and user.op != "output":
                user.replace_input_with(original, twin)
    for n in replay_parts:
        n.meta[_REPLAY_PART] = True
    graph.lint()
    joint.recompile()
    return rewritten


def read_drawn_masks(joint: fx.GraphModule, saved: Iterable[str]) -> None:
    """Where ``saved`` (node names) holds a forward node that has twins (``dropout_from_masks``,
    ``replayable_dropouts``), let whatever reads a twin read it, so that the cut saves it; the
    nodes added to make values again that nothing reads then are removed
    (``JointGraph.reading_drawn``)."""
    saved = set(saved)
    graph = joint.graph
    nodes = {n.name: n for n in graph.nodes}

    def original(node: fx.Node) -> str:
        name = node.meta[_REPLAYS]
        while name in nodes and _REPLAYS in nodes[name].meta:  # a twin of a twin
            name = nodes[name].meta[_REPLAYS]
        return name

    swaps = [(node, original(node)) for node in graph.nodes if _REPLAYS in node.meta]
    changed = False
    for node, name in swaps:
        if name in saved:
            node.replace_all_uses_with(nodes[name])
            changed = True
    if not changed:
        return
    for node in reversed(list(graph.nodes)):
        if node.meta.get(_REPLAY_PART) and not node.users:
            graph.erase_node(node)
    graph.lint()
    joint.recompile()


def _calls(joint: fx.GraphModule) -> list[Call]:
    """Each op node as ``measure_workspaces`` runs it: on fresh tensors of its arguments'
    shapes, strides and dtypes (stand-ins on ``meta``, which need no gradient)."""

    def stand_in(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return value

    calls = []
    for node in joint.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
        args, kwargs = pytree.tree_map(stand_in, (args, kwargs))
        target = node.target
        if _replay(node):  # its state argument must be a generator's state: the one there is
            device = node.args[2].meta["val"].device

            def prepare(target: Any = target, device: torch.device = device) -> tuple[Any, tuple]:
                state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
                return (lambda a, k: target(state, *a[1:], **k)), ()
        else:

            def prepare(target: Any = target) -> tuple[Any, tuple]:
                return (lambda a, k: target(*a, **k)), ()

        calls.append(Call(node.name, call_key(target, args, kwargs), prepare, args, kwargs))
    return calls


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        return "getitem" if node.target is operator.getitem else str(node.target).replace("torch.ops.", "")
    return node.op


def _flops(node: fx.Node) -> int:
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    try:
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # noqa: BLE001 (a formula that does not fit this call counts nothing)
        return 0


def _viewed(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output views, by its op's schema (``permute``,
    ``view``, ``t``, ``expand``, ...); None for an op that returns new storage or writes."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns:
        return None
    alias = schema.returns[0].alias_info
    if alias is None or alias.is_write:
        return None
    for k, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.before_set == alias.before_set:
            value = node.args[k] if k < len(node.args) else node.kwargs.get(argument.name)
            return value if isinstance(value, fx.Node) else None
    return None


def _drawn(node: fx.Node) -> int:
    """How many random numbers ``node`` draws: the elements of a random op's (or its replay's)
    first tensor out; 0 for the parts of a tuple (the call that makes them draws)."""
    from torch._prims.rng_prims import run_and_save_rng_state

    if node.target is operator.getitem or not (_random(node) or _replay(node)):
        return 0
    value = node.meta.get("val")
    if node.target is run_and_save_rng_state:  # (generator state, the op's value)
        value = value[1] if isinstance(value, (tuple, list)) and len(value) == 2 else None
    tensors = _tensors(value)
    return tensors[0].numel() if tensors else 0


def _random(node: fx.Node) -> bool:
    from torch._prims.rng_prims import run_and_save_rng_state

    return node.target is run_and_save_rng_state or torch.Tag.nondeterministic_seeded in getattr(
        node.target, "tags", ())


def _replay(node: fx.Node) -> bool:
    """A replayed random draw, or a part of one."""
    from torch._prims.rng_prims import run_with_rng_state

    if node.target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.target is run_with_rng_state


def _writes(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)
