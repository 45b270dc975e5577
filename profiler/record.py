"""Run a traced graph once on fake tensors, op by op, and record what each op allocates, saves
for backward, and costs.

Everything runs under ``FakeTensorMode``: shapes, dtypes, aliasing and autograd's saved tensors
are real, memory and compute are not, so a model on the ``meta`` device or too large for this
machine profiles the same way, and the model's own parameters and buffers are never touched.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn import functional as F
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ckptplan.errors import TraceError
from ckptplan.graph import Node, Storage, StorageKind
from ckptplan.profiler.composite import dropout_noise
from ckptplan.profiler.cost import Roofline
from ckptplan.profiler.cuda_attention import attention_as_cuda, sdpa_call
from ckptplan.profiler.loss import training_loss
from ckptplan.profiler.trace import Autocast, Target, fake_copy, named_state
from ckptplan.profiler.workspace import Call, call_key

log = logging.getLogger(__name__)

_SKIPPED_MODULES = frozenset({"_guards_fn"})


def storage_key(t: torch.Tensor) -> int:
    """Identity of the allocation behind ``t`` (views share it). Valid while ``t`` is alive."""
    return t.untyped_storage()._cdata


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class _AllocationMeter(TorchDispatchMode):
    """Peak bytes of storages allocated since ``start()`` and still alive, op by op.

    Lets the recorder see what an op allocates and frees *inside* itself (the temporaries of
    composite ops such as math attention or cross-entropy), which no node output shows.

    Storages are keyed by ``storage_key``, the address of their ``StorageImpl``, which the
    allocator hands out again once a storage dies. Two rules keep the count independent of
    which addresses get reused: a dead storage leaves ``_live`` (``_prune``) before any new
    output is looked up, and ``_known`` (storages not to count) only ever holds storages the
    caller keeps alive for the whole measurement, so no new allocation can share their key.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._known: tuple[Collection[int], ...] = ()
        self.current_bytes = 0
        self.peak_bytes = 0
        self.saw_random = False
        self.drawn = 0  # random numbers drawn since start(): the first tensor out of each random op
        self.cache_dtype: torch.dtype | None = None  # autocast's dtype, when its cache is on
        self.cached_casts: list[torch.Tensor] = []
        self.made_by_last_save: frozenset[int] = frozenset()  # keys allocated when autograd last saved
        self.freed = 0  # bytes of the storages allocated since start() that have died since
        self._watched: set[int] = set()  # keys of ``watch``'s live storages, not allocated since start()

    def start(self, *existing: Collection[int], watch: Iterable[torch.Tensor] = ()) -> None:
        """Measure from zero.

        ``existing``: collections of keys of storages that are not counted; the caller keeps
        each of them alive until the measurement is read (they are read, not copied, so the
        recorder's growing index costs nothing per op). ``watch``: storages that already exist
        and may die during the measurement; they count as freed (negative) when they do. They
        go into ``_live``, never ``_known``: once one dies, a new allocation may get its key and
        must be counted (counting it as known made backward workspaces depend on which
        addresses the allocator happened to reuse).
        """
        self._live.clear()
        self._known = existing
        self.current_bytes = self.peak_bytes = 0
        self.saw_random = False
        self.drawn = 0
        self.cached_casts = []
        self.made_by_last_save = frozenset()
        self.freed = 0
        self._watched = set()
        for t in watch:
            key = storage_key(t)
            if not self._is_known(key) and key not in self._live:
                self._watched.add(key)
                self._live[key] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())

    def saving(self) -> None:
        """Autograd is saving a tensor (a saved-tensor hook's pack): note what exists now."""
        self._prune()
        self.made_by_last_save = frozenset(self._live)

    def freed_bytes(self) -> int:
        """Bytes of the storages allocated since ``start()`` that are already freed."""
        self._prune()
        return self.freed

    def _is_known(self, key: int) -> bool:
        return any(key in keys for keys in self._known)

    def alive_bytes(self, keys: set[int]) -> int:
        """Bytes of storages allocated since ``start()`` whose keys are in ``keys``."""
        self._prune()
        return sum(nbytes for key, (_, nbytes) in self._live.items() if key in keys)

    def _prune(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            nbytes = self._live.pop(key)[1]
            self.current_bytes -= nbytes
            if key in self._watched:
                self._watched.discard(key)  # its key may now come back with a new allocation
            else:
                self.freed += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _as_eager(func, args, func(*args, **(kwargs or {})))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.saw_random = True
            self.drawn += next((t.numel() for t in _tensors(out)), 0)
        if self.cache_dtype is not None and _is_cached_cast(func, args, kwargs or {}, self.cache_dtype):
            self.cached_casts.append(out)
        self._prune()
        for t in _tensors(out):
            key = storage_key(t)
            if key not in self._live and not self._is_known(key):
                nbytes = t.untyped_storage().nbytes()
                self._live[key] = (StorageWeakRef(t.untyped_storage()), nbytes)
                self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out


_aten = torch.ops.aten


def _is_cached_cast(func: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> bool:
    """Whether ``func(*args, **kwargs)`` is a cast autocast keeps in its cache: to its
    lower-precision ``dtype``, of a float32 leaf that requires grad and is no view (the test of
    ``cached_cast`` in ATen's ``autocast_mode.cpp``). A frozen parameter's cast is not cached."""
    if func is not _aten._to_copy.default or kwargs.get("dtype") != dtype:
        return False
    x = args[0]
    return x.dtype == torch.float32 and x.requires_grad and x.is_leaf and not x._is_view()


# Normalisations: position of the input and of the weight among their arguments.
_NORMS = {
    _aten.native_layer_norm.default: (0, 2),
    _aten.native_group_norm.default: (0, 1),
    _aten.native_batch_norm.default: (0, 1),
}


def _as_eager(func: Any, args: tuple, out: Any) -> Any:
    """``out`` with the dtypes the eager kernels give where the fake ones differ (torch 2.13).

    On a low-precision input with a float32 weight, as CPU autocast leaves normalisations, the
    eager kernels return the statistics (mean, rstd) in float32 and group norm's backward returns
    the input gradient in the input's dtype; their fake kernels, decompositions, return the
    input's dtype for the former and float32 (then a cast) for the latter, which would put a
    float32 copy of the input into group norm's backward workspace."""
    if func in _NORMS:
        x, weight = args[_NORMS[func][0]], args[_NORMS[func][1]]
        if weight is not None and weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
            y, *stats = out
            return (y, *(torch.empty_like(s, dtype=torch.float32) for s in stats))
    elif func is _aten.native_group_norm_backward.default:
        grad_input, x = out[0], args[1]
        if grad_input is not None and grad_input.dtype != x.dtype:
            return (torch.empty_like(grad_input, dtype=x.dtype), *out[1:])
    return out


class _TargetKernels(TorchFunctionMode):
    """Runs dropout and attention as ``target``'s kernels do, on fake tensors of another device.
    Only the kernels change: the graph keeps its nodes, which the emitted module runs
    on the user's device.

    Dropout: ATen's ``dropout`` on CUDA, when training with 0 < p < 1 on a non-empty tensor,
    calls ``native_dropout``, whose backward keeps a ``torch.bool`` mask: 1 byte per element. On
    CPU and meta it takes the unfused path, ``input * empty_like(input).bernoulli_(1 - p).div_(1 - p)``,
    whose backward keeps that noise in the input's dtype: 2 or 4 bytes per element. In-place
    dropout takes the unfused path everywhere and is left alone.

    Attention, for a CUDA target: the fused kernel CUDA would pick (``cuda_attention``), where
    the fake tensors' device would take the math kernel and keep B·H·L·S tensors.
    """

    def __init__(self, target: Target) -> None:
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _dropout_call(func, args, kwargs)
        if call is not None:
            return _dropout_as(self.target, *call)
        attention = sdpa_call(func, args, kwargs) if self.target == "cuda" else None
        if attention is not None:
            out = attention_as_cuda(attention)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _dropout_call(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, float, bool] | None:
    """``(input, p, train)`` of an out-of-place dropout call, else None."""
    if func is _aten.dropout.default or func is torch.dropout:
        bound = dict(zip(("input", "p", "train"), args, strict=False)) | kwargs
        return bound["input"], bound["p"], bound["train"]
    if func is F.dropout:
        bound = dict(zip(("input", "p", "training", "inplace"), args, strict=False)) | kwargs
        if bound.get("inplace", False):
            return None
        return bound["input"], bound.get("p", 0.5), bound.get("training", True)
    return None


def _dropout_as(target: Target, x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``dropout(x, p, train)`` as ATen runs it on ``target`` (``at::native::dropout``)."""
    if not (train and 0 < p < 1 and x.numel() > 0):  # no kernel at all: x itself, or x * 0
        return _aten.dropout.default(x, p, train)
    if target == "cuda":
        return _aten.native_dropout.default(x, p, train)[0]
    return x * dropout_noise(x, p)


@dataclass
class _Meters:
    flops: FlopCounterMode
    alloc: _AllocationMeter


@dataclass
class Recording:
    """Result of one fake run: nodes, storages and the fx names of the compute nodes."""

    nodes: list[Node] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    loss_nodes: list[int] = field(default_factory=list)
    loss_scalar_bytes: int = 0
    loss_is_output: bool = False
    seed_bytes: int = 0
    output_value: Any = None
    calls: list[Call] = field(default_factory=list)  # each node's op and (fake) arguments, for ``workspace``
    # Node name -> the strides of the gradient each of its outputs that requires grad receives in
    # the step's backward (None where none reaches it); filled when ``record_graph`` is asked.
    grad_strides: dict[str, tuple[tuple[int, ...] | None, ...]] = field(default_factory=dict)


class _Recorder:
    def __init__(self, gm: torch.fx.GraphModule, roofline: Roofline) -> None:
        self.gm = gm
        self.roofline = roofline
        self.storage_of: dict[int, int] = {}  # storage_key -> storage index
        self.keep_alive: list[torch.Tensor] = []  # storage keys stay unique while these live
        self.rec = Recording()
        self.node_index: dict[torch.fx.Node, int] = {}
        self.value_owner: dict[int, int] = {}  # id(value) of a node's output -> node index
        self.autocast: Autocast | None = None
        self.target: Target | None = None  # whose dropout kernels to run, if not the fake tensors' device's
        self.mode: FakeTensorMode | None = None
        self.meta_as: torch.device | None = None
        self.constants: dict[int, torch.Tensor] = {}  # id(real constant) -> its fake copy
        self.grad_layouts = False  # record the gradient strides each node's outputs receive
        self.differentiable: dict[str, list[torch.Tensor]] = {}  # node name -> its outputs requiring grad

    def add_storage(
        self, t: torch.Tensor, kind: StorageKind, producer: int = -1, trainable: bool = False, cached: bool = False
    ) -> int:
        key = storage_key(t)
        index = self.storage_of.get(key)
        if index is None:
            index = len(self.rec.storages)
            self.rec.storages.append(
                Storage(
                    index=index, nbytes=t.untyped_storage().nbytes(), kind=kind, producer=producer,
                    trainable=trainable, cached=cached,
                )
            )
            self.storage_of[key] = index
            self.keep_alive.append(t)
        return index


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if node.op == "call_module":
        return str(node.target)
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path)


def _op_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    if target is operator.getitem:
        return "getitem"
    return torch.fx.node._get_qualified_name(target)


def _fake_state(
    gm: torch.fx.GraphModule, mode: FakeTensorMode, meta_as: torch.device | None = None
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    memo: dict[int, torch.Tensor] = {}
    for name, tensor in named_state(gm):
        fake = memo.get(id(tensor))
        if fake is None:
            fake = fake_copy(mode, tensor, meta_as)
            if isinstance(tensor, nn.Parameter):
                fake.requires_grad_(tensor.requires_grad)
            memo[id(tensor)] = fake
        state[name] = fake
    return state


def record_graph(
    gm: torch.fx.GraphModule,
    flat_inputs: list[Any],
    roofline: Roofline,
    loss_leaves_fn: Any,
    autocast: Autocast | None = None,
    target: Target | None = None,
    grad_layouts: bool = False,
) -> Recording:
    """Interpret ``gm`` node by node on fake copies of its state and ``flat_inputs``.

    ``autocast``: run each op's forward under it (and its local backward outside it), so every
    op goes through the autocast dispatch key: outputs, saved tensors and the parameter casts
    autocast makes get the dtypes and bytes of that step. A model on ``meta``, which has no
    autocast dispatch key, is then faked on ``autocast.meta_as``.
    ``target``: run dropout and attention as that device kind's kernels do (``_TargetKernels``),
    where it is not the fake tensors' own; None runs every op as their device does.
    ``grad_layouts``: also run the step's backward on the fake tensors and record the strides of
    the gradient each node's outputs receive (``Recording.grad_strides``): a kernel handed a
    gradient of another layout than its output's (a convolution whose output is flattened,
    transposed and concatenated) copies it, and its measured workspace must see that copy.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    recorder = _Recorder(gm, roofline)
    recorder.autocast = autocast
    recorder.target = target
    meta_as = autocast.meta_as if autocast is not None else None
    recorder.mode, recorder.meta_as = mode, meta_as
    recorder.grad_layouts = grad_layouts
    fake_state = _fake_state(gm, mode, meta_as)
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    for name, fake in fake_state.items():
        kind: StorageKind = "param" if name in params else "buffer"
        recorder.add_storage(fake, kind, trainable=kind == "param" and fake.requires_grad)
    fake_inputs = [fake_copy(mode, x, meta_as) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    for x in fake_inputs:
        if isinstance(x, torch.Tensor):
            recorder.add_storage(x, "input")
    forward = autocast.forward() if autocast is not None else contextlib.nullcontext()
    try:
        # One autocast context spans the whole run, as it spans a user's forward: its cache of
        # parameter casts then serves every later use of a parameter, as it does there.
        with _reparametrize_module(gm, fake_state), mode, forward:
            _interpret(recorder, fake_inputs, loss_leaves_fn)
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(
            f"Profiling failed while running the traced graph on fake tensors ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); try the other trace option."
        ) from exc
    return recorder.rec


def _interpret(recorder: _Recorder, fake_inputs: list[Any], loss_leaves_fn: Any) -> None:
    gm = recorder.gm
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(fake_inputs)
    saved_log: list[torch.Tensor] = []

    counter = _Meters(FlopCounterMode(display=False), _AllocationMeter())

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_log.append(t)
        counter.alloc.saving()
        return t

    if recorder.autocast is not None and torch.is_autocast_cache_enabled():
        counter.alloc.cache_dtype = recorder.autocast.dtype
    with counter.flops, counter.alloc, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for fx_node in gm.graph.nodes:
            if fx_node.op == "placeholder":
                env[fx_node] = next(inputs)
            elif fx_node.op == "get_attr":
                env[fx_node] = _fake_constant(recorder, _fetch_attr(gm, fx_node.target))
            elif fx_node.op == "output":
                _record_outputs(recorder, fx_node, env, loss_leaves_fn)
            elif fx_node.op == "call_module" and fx_node.target in _SKIPPED_MODULES:
                env[fx_node] = None
            else:
                saved_log.clear()
                env[fx_node] = _record_node(recorder, fx_node, env, saved_log, counter)


def _fake_constant(recorder: _Recorder, value: Any) -> Any:
    """A fake stand-in for a real tensor the graph reads as an attribute that is neither a
    parameter nor a buffer: a constant ``torch.export`` lifted (``lifted_tensor_0``, a table a
    model builds in forward) or a plain tensor attribute. It is model state for the memory model
    (a static ``buffer`` storage), made once per tensor."""
    if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
        return value
    fake = recorder.constants.get(id(value))
    if fake is None:
        fake = recorder.constants[id(value)] = fake_copy(recorder.mode, value, recorder.meta_as)
        recorder.add_storage(fake, "buffer")
    return fake


def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _run(recorder: _Recorder, fx_node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """Run one node's op, with the target's kernels when they are not the device's."""
    if recorder.target is None:
        return _call(recorder.gm, fx_node, args, kwargs)
    with _TargetKernels(recorder.target):
        return _call(recorder.gm, fx_node, args, kwargs)


def _workspace_call(gm: torch.fx.GraphModule, fx_node: torch.fx.Node, args: tuple, kwargs: dict) -> Call:
    """The node's op for ``profiler.workspace`` to run for real (a module call on a copy)."""

    def prepare() -> tuple[Any, tuple[torch.Tensor, ...]]:
        if fx_node.op != "call_module":
            return (lambda a, k: _call(gm, fx_node, a, k)), ()
        module = copy.deepcopy(gm.get_submodule(fx_node.target))
        return (lambda a, k: module(*a, **k)), tuple(p for p in module.parameters() if p.requires_grad)

    return Call(fx_node.name, call_key(fx_node.target, args, kwargs), prepare, args, kwargs)


def _call(gm: torch.fx.GraphModule, fx_node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    if fx_node.op == "call_function":
        return fx_node.target(*args, **kwargs)
    if fx_node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, fx_node.target)(*rest, **kwargs)
    if fx_node.op == "call_module":
        return gm.get_submodule(fx_node.target)(*args, **kwargs)
    raise AssertionError(f"unexpected fx op {fx_node.op}")


def _record_node(
    recorder: _Recorder,
    fx_node: torch.fx.Node,
    env: dict[torch.fx.Node, Any],
    saved_log: list[torch.Tensor],
    counter: _Meters,
) -> Any:
    gm, rec = recorder.gm, recorder.rec
    index = len(rec.nodes)
    args = torch.fx.node.map_arg(fx_node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(fx_node.kwargs, lambda n: env[n])
    rec.calls.append(_workspace_call(gm, fx_node, args, kwargs))
    flops_before = counter.flops.get_total_flops()
    counter.alloc.start(recorder.storage_of.keys())
    versions = _versions((args, kwargs))
    out = _run(recorder, fx_node, args, kwargs)
    written = _written(recorder, versions)
    made_keys = counter.alloc.made_by_last_save
    fwd_flops = counter.flops.get_total_flops() - flops_before
    casts = counter.alloc.cached_casts  # parameter casts autocast's cache holds past this op
    kept = {storage_key(t) for t in (*_tensors(out), *saved_log, *casts)}
    fwd_workspace = max(0, counter.alloc.peak_bytes - counter.alloc.alive_bytes(kept))
    fwd_freed = counter.alloc.freed_bytes()
    random, drawn = counter.alloc.saw_random, counter.alloc.drawn

    out_tensors = _tensors(out)
    outputs: list[int] = []
    for t in out_tensors:
        s = recorder.add_storage(t, "activation", producer=index)
        if s not in outputs:
            outputs.append(s)
    for t in casts:
        recorder.add_storage(t, "hidden", producer=index, cached=True)
    saved: list[int] = []
    for t in saved_log:
        s = recorder.add_storage(t, "hidden", producer=index)
        if s not in saved:
            saved.append(s)
    made_by_last_save = sorted({
        recorder.storage_of[storage_key(t)] for t in (*out_tensors, *saved_log, *casts)
        if storage_key(t) in made_keys and rec.storages[recorder.storage_of[storage_key(t)]].producer == index
    })

    input_nodes = [n for n in fx_node.all_input_nodes if n in recorder.node_index]
    inputs = tuple(dict.fromkeys(recorder.node_index[n] for n in input_nodes))
    grad_inputs = tuple(
        recorder.node_index[n] for n in dict.fromkeys(input_nodes)
        if any(t.requires_grad and t.is_floating_point() for t in _tensors(env[n]))
    )
    param_tensors = _param_inputs(recorder, fx_node, args, kwargs)
    param_grads = tuple(dict.fromkeys(recorder.storage_of[storage_key(p)] for p in param_tensors))
    grad_outputs = [t for t in out_tensors if t.requires_grad and t.is_floating_point()]
    requires_grad = bool(grad_outputs)

    in_tensors = _tensors((args, kwargs))
    bytes_moved = sum(tensor_bytes(t) for t in in_tensors) + sum(tensor_bytes(t) for t in out_tensors)
    local = _LocalBackward()
    if requires_grad and (grad_inputs or param_grads):
        local = _local_backward(recorder, fx_node, args, kwargs, param_tensors, counter, saved_log)
    grad_aliased_inputs = tuple(
        recorder.node_index[n] for n in dict.fromkeys(input_nodes)
        if recorder.node_index[n] in grad_inputs
        and all(id(t) in local.aliased_values for t in _tensors(env[n]) if t.requires_grad and t.is_floating_point())
    )
    bwd_flops, bwd_workspace = local.flops, local.workspace_bytes
    node = Node(
        index=index,
        name=fx_node.name,
        op=_op_name(fx_node, gm),
        module=_module_path(fx_node),
        inputs=inputs,
        outputs=tuple(outputs),
        saved=tuple(saved),
        grad_inputs=grad_inputs,
        param_grads=param_grads,
        param_grad_copies=tuple(recorder.storage_of[storage_key(p)] for p in param_tensors if id(p) in local.relayout),
        requires_grad=requires_grad,
        inplace=_is_inplace(fx_node) or any(rec.storages[w].kind not in ("param", "buffer") for w in written),
        writes=written,
        random=random,
        grad_aliases_output=local.aliases,
        grad_aliased_inputs=grad_aliased_inputs,
        output_bytes=sum(tensor_bytes(t) for t in grad_outputs),
        fwd_flops=int(fwd_flops),
        bwd_flops=int(bwd_flops),
        fwd_workspace_bytes=int(fwd_workspace),
        bwd_workspace_bytes=int(bwd_workspace),
        fwd_freed_bytes=int(fwd_freed),
        made_by_last_save=tuple(made_by_last_save),
        bytes_moved=int(bytes_moved),
        fwd_cost=recorder.roofline.seconds(fwd_flops, bytes_moved, drawn),
        bwd_cost=recorder.roofline.seconds(bwd_flops, 2 * bytes_moved) if requires_grad else 0.0,
    )
    rec.nodes.append(node)
    recorder.node_index[fx_node] = index
    recorder.keep_alive.extend(out_tensors)
    if requires_grad:
        recorder.differentiable[fx_node.name] = [t for t in out_tensors if t.requires_grad]
    return out


def _versions(value: Any) -> list[tuple[torch.Tensor, int]]:
    """Each tensor argument with its version counter, which every in-place write bumps (through
    any view of the same base): how a module call or a function with ``inplace=True``, whose
    schema the graph does not show, is seen writing into its inputs. Writes into parameters and
    buffers (running statistics) are state updates, which the emitter guards by op
    (``planner.emit._guard_state_updates``); writes into activations and graph inputs make the
    node ``inplace``."""
    return [(t, t._version) for t in _tensors(value) if not t.is_inference()]


def _written(recorder: _Recorder, versions: list[tuple[torch.Tensor, int]]) -> tuple[int, ...]:
    """The recorded storages the op just run wrote into, through the arguments it was given."""
    written: dict[int, None] = {}
    for t, version in versions:
        if t._version != version:
            index = recorder.storage_of.get(storage_key(t))
            if index is not None:
                written[index] = None
    return tuple(written)


def _is_inplace(fx_node: torch.fx.Node) -> bool:
    target = fx_node.target
    if fx_node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
    if fx_node.op == "call_method":
        return str(target).endswith("_") and not str(target).startswith("_")
    return False


def _param_inputs(recorder: _Recorder, fx_node: torch.fx.Node, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Trainable parameters the op reads: get_attr arguments, or a called module's own."""
    candidates = _tensors((args, kwargs))
    if fx_node.op == "call_module":
        candidates += list(recorder.gm.get_submodule(fx_node.target).parameters())
    found: dict[int, torch.Tensor] = {}
    for t in candidates:
        index = recorder.storage_of.get(storage_key(t))
        if index is not None and recorder.rec.storages[index].trainable and t.requires_grad:
            found.setdefault(index, t)
    return list(found.values())


@dataclass(frozen=True)
class _LocalBackward:
    """What the backward of one op alone does: its FLOPs; ``aliases``: every input gradient it
    produces is a view of the gradient it receives (view ops, ``cat``); ``aliased_values``: ids
    of the argument tensors whose gradient is such a view (for ``add`` of a float32 and a
    bfloat16 tensor, only the float32 one's); ``workspace_bytes``: its peak net allocation beyond
    the gradients it returns: temporaries, less hidden saved tensors freed on the way (so it may
    be negative)."""

    flops: int = 0
    aliases: bool = False
    aliased_values: frozenset[int] = frozenset()
    workspace_bytes: int = 0
    relayout: frozenset[int] = frozenset()  # ids of the parameters whose gradient comes in another layout


def _local_backward(
    recorder: _Recorder,
    fx_node: torch.fx.Node,
    args: tuple,
    kwargs: dict,
    params: list[torch.Tensor],
    counter: _Meters,
    saved_log: list[torch.Tensor],
) -> _LocalBackward:
    """Run the backward of this op alone (``_LocalBackward`` says what it measures).

    The op runs again on detached copies of its activation inputs, so the gradient stops at
    them instead of flowing back through the rest of the graph.
    """
    leaves: dict[int, torch.Tensor] = {}

    def detach(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad and not any(value is p for p in params):
            leaf = leaves.get(id(value))
            if leaf is None:
                leaf = leaves[id(value)] = value.detach().requires_grad_(True)
            return leaf
        return value

    try:
        local_args, local_kwargs = pytree.tree_map(detach, (args, kwargs))
        first_saved = len(saved_log)
        if isinstance(fx_node.target, torch._ops.HigherOrderOperator):
            # A higher-order op's body is a module, and the FLOP counter's module tracker hooks
            # its inputs for backward, which autograd.grad refuses on leaves: give it views.
            local_args, local_kwargs = pytree.tree_map(
                lambda v: v.view_as(v) if any(v is leaf for leaf in leaves.values()) else v, (local_args, local_kwargs)
            )
        local_out = [t for t in _tensors(_run(recorder, fx_node, local_args, local_kwargs)) if t.requires_grad]
        hidden = [t for t in saved_log[first_saved:] if storage_key(t) not in recorder.storage_of]
        del saved_log[first_saved:]
        targets = list(leaves.values()) + params
        seeds = [torch.ones_like(t) for t in local_out]
        before = counter.flops.get_total_flops()
        # Storages the recording already holds are not new either: a saved autocast weight cast
        # that backward unpacks (as a view) is one of them, and no parameter or argument.
        local_keys = {storage_key(t) for t in _tensors((local_out, seeds, targets))}
        counter.alloc.start(recorder.storage_of.keys(), local_keys, watch=hidden)
        del hidden
        backward = recorder.autocast.backward() if recorder.autocast is not None else contextlib.nullcontext()
        with backward:
            grads = torch.autograd.grad(local_out, targets, seeds, allow_unused=True)
    except RuntimeError as exc:  # e.g. in-place ops on a fresh leaf; fall back to "no aliasing"
        log.debug("local backward of %s failed (%s)", fx_node.name, exc)
        return _LocalBackward()
    flops = counter.flops.get_total_flops() - before
    returned = {storage_key(g) for g in grads if g is not None}
    workspace = counter.alloc.peak_bytes - counter.alloc.alive_bytes(returned)
    seed_keys = {storage_key(s) for s in seeds}
    activation_grads = [g for g in grads[: len(leaves)] if g is not None]
    aliased = frozenset(
        value_id for value_id, g in zip(leaves, grads) if g is not None and storage_key(g) in seed_keys
    )
    relayout = frozenset(id(p) for p, g in zip(params, grads[len(leaves):]) if g is not None and not _obeys_layout(g, p))
    return _LocalBackward(
        flops=int(flops),
        aliases=bool(activation_grads) and all(storage_key(g) in seed_keys for g in activation_grads),
        aliased_values=aliased,
        workspace_bytes=int(workspace),
        relayout=relayout,
    )


def _obeys_layout(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether autograd stores ``grad`` as ``param``'s first gradient as it is, rather than a copy
    in ``param``'s layout (``obeys_layout_contract`` in torch/csrc/autograd/functions/accumulate_grad.h:
    the strides of every dimension longer than one must match those of a dense parameter)."""
    if not is_non_overlapping_and_dense_or_false(param):
        return grad.is_contiguous()
    return all(
        (size == 1 and g_stride != 0) or (size != 1 and g_stride == p_stride)
        for size, g_stride, p_stride in zip(grad.shape, grad.stride(), param.stride())
    )


def _record_outputs(recorder: _Recorder, fx_node: torch.fx.Node, env: dict, loss_leaves_fn: Any) -> None:
    rec = recorder.rec
    flat_nodes = [n for n in pytree.tree_leaves(fx_node.args[0]) if isinstance(n, torch.fx.Node)]
    rec.outputs = sorted({recorder.node_index[n] for n in flat_nodes if n in recorder.node_index})
    value = torch.fx.node.map_arg(fx_node.args[0], lambda n: env[n])
    codegen = recorder.gm.graph._codegen
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    if out_spec is not None:
        value = pytree.tree_unflatten(list(value) if isinstance(value, (tuple, list)) else [value], out_spec)
    rec.output_value = value
    owners = {}
    for fx_out in flat_nodes:
        if fx_out in recorder.node_index:
            for t in _tensors(env[fx_out]):
                owners.setdefault(id(t), recorder.node_index[fx_out])
    leaves = loss_leaves_fn(value)
    rec.loss_nodes = sorted({owners[id(t)] for t in leaves if id(t) in owners})
    if rec.loss_nodes:
        # The scalar a real step calls backward on, made as the step makes it (under autocast
        # when the forward runs under it), for its dtype; a scalar loss is only reshaped (a view).
        loss = training_loss(value)
        rec.seed_bytes = loss.element_size()
        rec.loss_is_output = len(leaves) == 1 and leaves[0].numel() == 1
        rec.loss_scalar_bytes = 0 if rec.loss_is_output else loss.element_size()
        if recorder.grad_layouts and loss.requires_grad:
            rec.grad_strides = _grad_strides(recorder, loss)


def _grad_strides(recorder: _Recorder, loss: torch.Tensor) -> dict[str, tuple[tuple[int, ...] | None, ...]]:
    """Run the step's backward from ``loss`` on the fake tensors, noting the strides of the
    gradient each recorded output receives (a tensor hook sees the gradient summed over its uses,
    as the op's backward gets it). Empty if that backward fails."""
    seen: dict[tuple[str, int], tuple[int, ...]] = {}
    handles = []

    def note(name: str, position: int, grad: torch.Tensor) -> None:
        seen[(name, position)] = tuple(grad.stride())

    for name, outs in recorder.differentiable.items():
        for position, t in enumerate(outs):
            handles.append(t.register_hook(functools.partial(note, name, position)))
    leaves = {id(t): t for t in recorder.keep_alive if t.requires_grad and t.grad_fn is None}
    try:
        torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    except RuntimeError as exc:
        log.debug("backward on fake tensors failed (%s); gradients taken as dense", exc)
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return {
        name: tuple(seen.get((name, position)) for position in range(len(outs)))
        for name, outs in recorder.differentiable.items()
        if any((name, position) in seen for position in range(len(outs)))
    }


def iter_compute_nodes(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """The fx nodes that become ``ComputeGraph`` nodes, in execution order."""
    for fx_node in gm.graph.nodes:
        if fx_node.op in ("call_function", "call_method") or (
            fx_node.op == "call_module" and fx_node.target not in _SKIPPED_MODULES
        ):
            yield fx_node
