"""What runs in every training step of an emitted module (``planner.emit`` writes the graph that
calls it once): checkpoint regions and their selective policies for kept nodes, the guards that
keep state updates to once per step when a region is recomputed, the hooks that rematerialise
ops, and the calls of FSDP units' bodies.

Under ``torch.compile`` the regions are checkpoint higher-order ops: dynamo traces each body
into a subgraph and AOTAutograd's partitioner, not a Python replay, decides what backward
recomputes. Kept nodes then mark their ops with an ``fx.traceback.annotate`` tag that the
compile-time policy reads, and the recompute guards step aside (see ``_run_kept`` and
``batch_norm_once``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ckptplan.errors import CkptPlanError

_STATE = threading.local()  # the recompute depth and the open checkpoint calls with keep-sets, per thread
# The ``fx.traceback.annotate`` key that tags a kept node's ops with its region's id under
# torch.compile, where ``_STATE`` is not set while the policy runs.
_KEEP_ANNOTATION = "ckptplan_keep"
# Dynamo records ``fx.traceback.annotate`` in its nodes' meta from torch 2.10 (pytorch#164916).
_COMPILE_SEES_ANNOTATIONS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 10)


def _recomputing() -> bool:
    """True while a checkpoint region is being recomputed in backward."""
    return getattr(_STATE, "recompute_depth", 0) > 0


@contextlib.contextmanager
def _recompute_scope() -> Iterator[None]:
    _STATE.recompute_depth = getattr(_STATE, "recompute_depth", 0) + 1
    try:
        yield
    finally:
        _STATE.recompute_depth -= 1


def _save_non_views(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy inside a kept node: save every op's output but a view's.

    A cached view would hold its base alive (``aten.linear`` on a 3-D input views the input
    before its matmul), which the memory model, counting storages the node allocates, does not
    expect."""
    return CheckpointPolicy.PREFER_RECOMPUTE if getattr(op, "is_view", False) else CheckpointPolicy.MUST_SAVE


class _KeptOutputs:
    """What one checkpoint call of a region with a keep-set saves: for each kept node, its own
    pair of selective-checkpoint dispatch modes (``create_selective_checkpoint_contexts``), made
    when the node first runs. The caching mode is entered around the node in forward, the cached
    one around it in the recompute, and nothing around the other nodes, so only kept nodes pay
    for Python dispatch. One pair per node, not one per region entered per node, because the
    cached mode restarts its per-op counters each time it is entered."""

    def __init__(self, region_id: int) -> None:
        self.region_id = region_id
        self._modes: dict[str, tuple[Any, Any]] = {}

    def mode(self, node: str, recomputing: bool) -> contextlib.AbstractContextManager:
        if node not in self._modes:
            self._modes[node] = create_selective_checkpoint_contexts(_save_non_views, allow_cache_entry_mutation=True)
        return self._modes[node][recomputing]

    @contextlib.contextmanager
    def active(self, recomputing: bool) -> Iterator[None]:
        """checkpoint's forward (``recomputing=False``) or recompute context: while it is open,
        this region's kept nodes find this call's modes (``_run_kept``)."""
        frames = _active_keeps()
        frames.append((self, recomputing))
        try:
            yield
        finally:
            frames.pop()


def _active_keeps() -> list[tuple[_KeptOutputs, bool]]:
    """The checkpoint calls with keep-sets open on this thread, innermost last (a region's
    recompute reruns its nested regions' forwards)."""
    if not hasattr(_STATE, "keeps"):
        _STATE.keeps = []
    return _STATE.keeps


def _run_kept(region_id: int, node: str, target: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``node``, kept by region ``region_id``: ``target`` is its function, module, or (a
    string) the method it calls on ``args[0]``.

    Eager: inside the node's caching mode in forward, its cached mode in the recompute (see
    ``_KeptOutputs``); outside a checkpoint call (grad disabled) as is. Under torch.compile
    dynamo traces this function and cannot carry thread-local state into the graph; the ops are
    tagged with ``fx.traceback.annotate`` instead, which dynamo records in each node's meta and
    AOTAutograd makes current while it replays the node, when the compile-time policy
    (``CheckpointRegion._compiled_policy``) runs.
    """
    if torch.compiler.is_compiling():
        if not _COMPILE_SEES_ANNOTATIONS:  # CheckpointRegion.compiled_contexts says why
            return _call_target(target, args, kwargs)
        with fx_traceback.annotate({_KEEP_ANNOTATION: region_id}):
            return _call_target(target, args, kwargs)
    for kept, recomputing in reversed(_active_keeps()):
        if kept.region_id == region_id:
            with kept.mode(node, recomputing):
                return _call_target(target, args, kwargs)
    return _call_target(target, args, kwargs)


def _call_target(target: Any, args: tuple, kwargs: dict) -> Any:
    if isinstance(target, str):
        return getattr(args[0], target)(*args[1:], **kwargs)
    return target(*args, **kwargs)


def kept_call(region_id: int, node: str, target: Any) -> Callable[..., Any]:
    """The fx target of kept node ``node``: ``target`` run through ``_run_kept`` (fx code cannot
    pass a plain function as an argument, so the node calls this closure instead)."""

    def kept(*args: Any, **kwargs: Any) -> Any:
        return _run_kept(region_id, node, target, *args, **kwargs)

    kept.__name__ = f"kept_{target if isinstance(target, str) else getattr(target, '__name__', 'node')}"
    return kept


def call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def batch_norm_once(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """``aten.batch_norm`` that updates running statistics in forward only, not when recomputed.

    The recompute runs the same op on the same tensors with momentum 0, which writes each
    running statistic back as it is (``r * (1 - 0) + 0 * batch``), so the ops and the tensors
    autograd saves are those of forward, and nothing is allocated for it. In training mode the
    output uses batch statistics either way.

    Under torch.compile the plain op runs: AOTAutograd functionalizes the buffer update and
    applies it once, after the compiled forward; recomputation in the backward graph repeats
    only the functional op, whose updated statistics nothing reads.
    """
    if training and running_mean is not None and _recomputing() and not torch.compiler.is_compiling():
        momentum = 0.0
    return torch.ops.aten.batch_norm.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
    )


def mutate_once(op, target, *args, **kwargs):
    """An in-place update of model state (``num_batches_tracked += 1``) skipped when recomputing:
    ``op`` is the OpOverload, or the name of the tensor method (``"add_"``) a symbolic trace calls.

    Under torch.compile the update is functionalized and applied once (see ``batch_norm_once``).
    """
    if not torch.compiler.is_compiling() and _recomputing():
        return target
    if isinstance(op, str):
        return getattr(target, op)(*args, **kwargs)
    return op(target, *args, **kwargs)


def batch_norm_module_once(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """A BatchNorm module call (symbolic traces) that does not update its buffers when recomputed
    (momentum 0: see ``batch_norm_once``, also for torch.compile)."""
    if not module.training or module.running_mean is None or torch.compiler.is_compiling() or not _recomputing():
        return module(input)
    return nn.functional.batch_norm(
        input, module.running_mean, module.running_var, module.weight, module.bias, True, 0.0, module.eps
    )


class CheckpointRegion(nn.Module):
    """Runs ``body`` under non-reentrant checkpoint, saving only the ops of nodes in its keep-set.

    ``body`` is held outside the module tree: it owns no state (parameters arrive as arguments),
    so the emitted module's ``state_dict`` is exactly the model's.
    """

    def __init__(self, body: torch.fx.GraphModule, region_id: int, keep: tuple[str, ...], random: bool) -> None:
        super().__init__()
        self.__dict__["body"] = body
        self.region_id = region_id
        self.keep = keep
        self.random = random  # it draws random numbers: checkpoint stashes the RNG state to replay them

    def _compiled_policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        """The selective policy under torch.compile (eager runs ``_save_non_views`` inside kept
        nodes instead): AOTAutograd calls it for each ATen op while it replays the region's
        subgraph node by node, with the node's meta as ``fx.traceback.current_meta``;
        ``_run_kept`` tagged the kept nodes' meta. The policies it returns tag the joint graph's
        nodes, and the partitioner saves or recomputes them accordingly."""
        owner = fx_traceback.current_meta.get("custom", {}).get(_KEEP_ANNOTATION)
        if owner == self.region_id:
            return _save_non_views(ctx, op, *args, **kwargs)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """checkpoint's ``context_fn``: where the kept nodes find their dispatch modes (if the
        region keeps anything) and the recompute marker."""
        if not self.keep:
            return contextlib.nullcontext(), _recompute_scope()
        # A kept node's own ops may write into tensors they just made (dropout fills its mask
        # in place), hence ``allow_cache_entry_mutation``; keeps whose outputs later nodes
        # modify are rejected when the plan is built.
        kept = _KeptOutputs(self.region_id)
        return kept.active(recomputing=False), _chain(kept.active(recomputing=True), _recompute_scope())

    def compiled_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """checkpoint's ``context_fn`` under torch.compile, for a region with a keep-set: the
        selective policy's two dispatch modes, as compile requires (nothing recomputes in Python
        there, so no recompute marker)."""
        if not _COMPILE_SEES_ANNOTATIONS:
            raise CkptPlanError(
                f"torch.compile of a plan with keep-sets needs torch 2.10 or later (this is {torch.__version__}); "
                "upgrade torch, run the emitted module eagerly, or plan without keep-sets (solver dp or sqrt)."
            )
        return create_selective_checkpoint_contexts(self._compiled_policy, allow_cache_entry_mutation=True)

    def forward(self, *args: Any) -> Any:
        return run_region(self, *args)

    def extra_repr(self) -> str:
        return f"region_id={self.region_id}, keep={list(self.keep)}"


def _region_contexts(region: CheckpointRegion) -> tuple[contextlib.AbstractContextManager, ...]:
    # A plain function (not a bound method) as context_fn, which torch.compile traces reliably.
    return region.contexts()


def _compiled_region_contexts(region: CheckpointRegion) -> tuple[contextlib.AbstractContextManager, ...]:
    return region.compiled_contexts()


def run_region(region: CheckpointRegion, *args: Any) -> Any:
    """Call ``region``'s body under checkpoint.

    The emitted graph calls this function rather than the region module, and checkpoint calls
    ``body.forward``, so global module hooks (``ModTracker``, ``MemTracker``) never see
    parameters passed as region arguments and cannot leave gradient hooks on them.

    Under torch.compile (dynamo tracing this call), ``context_fn`` must give two dispatch
    modes: a region without keeps uses checkpoint's default, which compile turns into "recompute
    every op"; a region with keeps uses its policy's modes without the recompute marker.
    """
    if not torch.compiler.is_compiling():
        context_fn = functools.partial(_region_contexts, region)
    elif region.keep:
        context_fn = functools.partial(_compiled_region_contexts, region)
    else:
        # Left out rather than passed: dynamo sees a passed ``noop_context_fn`` as a custom one.
        return checkpoint(region.body.forward, *args, use_reentrant=False, preserve_rng_state=region.random)
    return checkpoint(region.body.forward, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=region.random)


@contextlib.contextmanager
def _chain(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


class CheckpointedModule(torch.fx.GraphModule):
    """The emitted module: the traced training graph with checkpoint regions.

    Shares the profiled model's submodules, parameters and buffers; in eval mode it calls the
    model itself.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            model = self.__dict__["_ckptplan_model"]
            model.training = False
            return model(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class _Recompute:
    """How to make a rematerialised node's output again: its function, arguments (detached; the
    output of another rematerialised node as that node's recipe, a chain: ``ckptplan.remat``),
    the autocast state it ran under (``None``: autocast off), and what it returned (dtype, shape,
    strides). Called only from ``_unpack``, so under no_grad."""

    __slots__ = ("args", "autocast_dtype", "chained", "device", "dtype", "fn", "kwargs", "shape", "stride")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        self.fn = fn
        found: list[_Recompute] = []
        self.args, self.kwargs = _map_args(functools.partial(_recipe_or_detached, found), (tuple(args), dict(kwargs)))
        self.chained = bool(found)
        self.device = out.device.type
        self.autocast_dtype = torch.get_autocast_dtype(self.device) if _autocast_on(self.device) else None
        self.dtype, self.shape, self.stride = out.dtype, out.shape, out.stride()

    def __call__(self) -> torch.Tensor:
        args, kwargs = self.args, self.kwargs
        if self.chained:  # inputs first, each once; they are dropped when this returns
            made_inputs: dict[int, torch.Tensor] = {}

            def materialise(value: Any) -> Any:
                if not isinstance(value, _Recompute):
                    return value
                if id(value) not in made_inputs:
                    made_inputs[id(value)] = value()
                return made_inputs[id(value)]

            args, kwargs = _map_args(materialise, (args, kwargs))
        if self.autocast_dtype is None and not _autocast_on(self.device):
            made = self.fn(*args, **kwargs)  # the common case: no context to enter
        else:
            with torch.autocast(self.device, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                made = self.fn(*args, **kwargs)
        if made.dtype != self.dtype or made.shape != self.shape or made.stride() != self.stride:
            raise RuntimeError(
                f"A rematerialised op recomputed a {made.dtype} tensor of shape {tuple(made.shape)} where forward made "
                f"{self.dtype} {tuple(self.shape)}; run the module as it was profiled, or solve with remat=False."
            )
        return made


def _recipe_or_detached(found: list[_Recompute], value: Any) -> Any:
    """A recipe's argument: a rematerialised output as its own recipe (added to ``found``),
    other tensors detached."""
    if not isinstance(value, torch.Tensor):
        return value
    recipe = value.__dict__.get(_RECOMPUTE_ATTR)  # a plain dict lookup: a missing tensor attribute raises inside
    if recipe is None:
        return value.detach()
    found.append(recipe)
    return recipe


def _map_args(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to the leaves of an op's arguments (tuples, lists and dicts of them); a
    few times cheaper than ``torch.utils._pytree.tree_map``, which runs once per rematerialised
    op per forward."""
    if isinstance(value, (tuple, list)):
        return type(value)([_map_args(fn, v) for v in value])
    if isinstance(value, dict):
        return {k: _map_args(fn, v) for k, v in value.items()}
    return fn(value)


@functools.cache
def _autocast_available(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type)


def _autocast_on(device_type: str) -> bool:
    return _autocast_available(device_type) and torch.is_autocast_enabled(device_type)


class _Unpacks:
    """One saver call's tensors living in one rematerialised output: recomputed at the first
    unpack, shared by the others, dropped after the last (so each saver recomputes it once, as
    ``ckptplan.remat`` models). A second backward (``retain_graph``) recomputes per unpack."""

    __slots__ = ("made", "pending", "recipe")

    def __init__(self, recipe: _Recompute) -> None:
        self.recipe = recipe
        self.pending = 0
        self.made: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        made = self.made if self.made is not None else self.recipe()
        self.pending -= 1
        self.made = made if self.pending > 0 else None
        return made


_RECOMPUTE_ATTR = "_ckptplan_recompute"


def remat_source(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for a rematerialised node: its output carries how to recompute it (``_Recompute``),
    for the hooks of the ops that save it (``remat_saver``)."""

    def remat(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if (isinstance(out, torch.Tensor) and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and _storage_key(out) is not None):
            setattr(out, _RECOMPUTE_ATTR, _Recompute(fn, args, kwargs, out))
        return out

    remat.__name__ = f"remat_{getattr(fn, '__name__', 'node')}"
    return remat


def remat_saver(fn: Callable[..., Any], sources: int) -> Callable[..., Any]:
    """``fn`` for an op whose backward saves rematerialised outputs, called with those outputs
    prepended to its arguments: it runs under saved-tensor hooks that store, instead of a saved
    tensor living in one of them, how to recompute it (``_pack``)."""

    def saver(*args: Any, **kwargs: Any) -> Any:
        made, args = args[:sources], args[sources:]
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        groups = {
            _storage_key(t): _Unpacks(getattr(t, _RECOMPUTE_ATTR)) for t in made if hasattr(t, _RECOMPUTE_ATTR)
        }
        groups.pop(None, None)
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, groups), _unpack):
            return fn(*args, **kwargs)

    saver.__name__ = f"saves_remat_{getattr(fn, '__name__', 'node')}"
    return saver


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, data pointer) of the storage ``t`` lives in; None for tensors without one of
    their own (wrapper subclasses, meta tensors, empty storages)."""
    if t.layout != torch.strided or type(t) not in (torch.Tensor, nn.Parameter):
        return None
    try:
        pointer = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (str(t.device), pointer) if pointer else None


def _pack(groups: dict[tuple[str, int], _Unpacks], t: torch.Tensor) -> Any:
    """A saved tensor living in a rematerialised output becomes its recipe and view geometry."""
    group = groups.get(_storage_key(t)) if groups else None
    if group is None:
        return t
    group.pending += 1
    return group, t.dtype, t.size(), t.stride(), t.storage_offset()


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    if torch.is_grad_enabled():
        # Only a backward with create_graph=True unpacks under grad mode; the recompute below has
        # no autograd history, so higher-order gradients through it would be silently wrong.
        raise RuntimeError(
            "This module rematerialises ops (its plan's remat), which supports one backward, not a double "
            "backward (create_graph=True); solve with remat=False (--no-remat) for that."
        )
    group, dtype, size, stride, offset = packed
    made = group.take()
    if dtype != made.dtype:
        made = made.view(dtype)
    return made.as_strided(size, stride, offset)


class ShardUnitBody(nn.Module):
    """The ops of one FSDP unit, run as the unit module's ``forward`` (``run_unit``).

    ``body`` reads the unit's parameters itself, through the live module tree, when it runs:
    FSDP2 swaps sharded and gathered parameters on the modules around each call, so they must
    not be read before it. ``body`` is held outside the module tree, so ``state_dict`` is the
    model's.
    """

    def __init__(self, body: torch.fx.GraphModule, path: str) -> None:
        super().__init__()
        self.__dict__["body"] = body
        self.path = path

    def extra_repr(self) -> str:
        return f"unit={self.path!r}"


def run_unit(unit_module: nn.Module, unit: ShardUnitBody, *args: Any) -> Any:
    """Call ``unit_module`` with ``unit``'s body as its forward, so that hooks on the module —
    FSDP2's all-gather before and reshard after, its backward hooks on inputs and outputs —
    run around the ops it owns, as when the model calls it."""
    saved = unit_module.__dict__.get("forward")
    unit_module.__dict__["forward"] = unit.body.forward
    try:
        return unit_module(*args)
    finally:
        if saved is None:
            del unit_module.__dict__["forward"]
        else:
            unit_module.__dict__["forward"] = saved


class ModelState(nn.Module):
    """Reads attributes of the model (held outside the module tree, so nothing is registered
    twice): what a region body reads the model's top-level buffers through, as it reads a
    submodule's buffers through that submodule (``read_state``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.__dict__["model"] = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)


def read_state(module: nn.Module, name: str) -> torch.Tensor:
    """Read a buffer at call time, so the region sees what ``.to()`` or ``load_state_dict`` put there."""
    return getattr(module, name)
