"""Rewrite the traced graph so a plan runs: regions become submodules called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, keep-sets become selective
checkpoint policies (``create_selective_checkpoint_contexts``).

Under ``torch.compile`` the regions are checkpoint higher-order ops: dynamo traces each body
into a subgraph and AOTAutograd's partitioner, not a Python replay, decides what backward
recomputes. Kept nodes then mark their ops with an ``fx.traceback.annotate`` tag that the
compile-time policy reads, and the recompute guards step aside (see ``_run_kept`` and
``_batch_norm_once``).

The emitted module is a drop-in replacement for the profiled model: it shares the model's
submodules, ``Parameter`` objects and buffers (so ``state_dict`` keys are identical and an
optimizer built on either works), trains with the checkpointed graph, and in eval mode calls
the model's own ``forward`` (the traced graph is a training-mode graph).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ckptplan.errors import CkptPlanError, PlanFormatError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Plan, Region
from ckptplan.profiler.record import iter_compute_nodes
from ckptplan.remat import Remat, indices
from ckptplan.sharding import fsdp_units
from ckptplan.simulation import build_region_tree

_STATE = threading.local()

# The fx meta key marking nodes that draw random numbers (``Node.random``): only regions holding
# one have checkpoint stash and replay the RNG state, which costs memory (5,056 bytes on CPU).
_RANDOM = "ckptplan_random"
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


def _kept_call(region_id: int, node: str, target: Any) -> Callable[..., Any]:
    """The fx target of kept node ``node``: ``target`` run through ``_run_kept`` (fx code cannot
    pass a plain function as an argument, so the node calls this closure instead)."""

    def kept(*args: Any, **kwargs: Any) -> Any:
        return _run_kept(region_id, node, target, *args, **kwargs)

    kept.__name__ = f"kept_{target if isinstance(target, str) else getattr(target, '__name__', 'node')}"
    return kept


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def _batch_norm_once(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
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


def _mutate_once(op, target, *args, **kwargs):
    """An in-place update of model state (``num_batches_tracked += 1``) skipped when recomputing:
    ``op`` is the OpOverload, or the name of the tensor method (``"add_"``) a symbolic trace calls.

    Under torch.compile the update is functionalized and applied once (see ``_batch_norm_once``).
    """
    if not torch.compiler.is_compiling() and _recomputing():
        return target
    if isinstance(op, str):
        return getattr(target, op)(*args, **kwargs)
    return op(target, *args, **kwargs)


def _batch_norm_module_once(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """A BatchNorm module call (symbolic traces) that does not update its buffers when recomputed
    (momentum 0: see ``_batch_norm_once``, also for torch.compile)."""
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
        return _run_region(self, *args)

    def extra_repr(self) -> str:
        return f"region_id={self.region_id}, keep={list(self.keep)}"


def _region_contexts(region: CheckpointRegion) -> tuple[contextlib.AbstractContextManager, ...]:
    # A plain function (not a bound method) as context_fn, which torch.compile traces reliably.
    return region.contexts()


def _compiled_region_contexts(region: CheckpointRegion) -> tuple[contextlib.AbstractContextManager, ...]:
    return region.compiled_contexts()


def _run_region(region: CheckpointRegion, *args: Any) -> Any:
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


def emit(graph: ComputeGraph, plan: Plan | Sequence[Region]) -> CheckpointedModule:
    """A ``torch.fx.GraphModule`` that runs ``graph``'s model under ``plan``'s regions."""
    if graph.traced is None or graph.model is None:
        raise PlanFormatError("This ComputeGraph has no traced module to rewrite; profile the model again.")
    regions = tuple(plan.regions) if isinstance(plan, Plan) else tuple(plan)
    build_region_tree(graph, regions)  # validates bounds, nesting, keep-sets and in-place edges
    source: torch.fx.GraphModule = graph.traced
    model: nn.Module = graph.model
    new_graph = torch.fx.Graph()
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    output = new_graph.graph_copy(source.graph, value_map)
    new_graph.output(output)
    new_graph._codegen = source.graph._codegen
    compute = list(iter_compute_nodes(source))
    if [n.name for n in compute] != [n.name for n in graph.nodes]:
        raise PlanFormatError("The traced module no longer matches its ComputeGraph; profile the model again.")
    by_index = [value_map[n] for n in compute]

    for node, fx_node in zip(graph.nodes, by_index):
        fx_node.meta[_RANDOM] = node.random
    if isinstance(plan, Plan) and plan.remat:
        _rematerialise(graph, plan, by_index)
    counter = [0]
    wrappers: dict[str, nn.Module] = {}
    owner_modules = dict(source.named_modules())
    owner_modules[_MODEL_STATE] = _ModelState(model)
    constants = _carry_constants(new_graph, model, owner_modules)
    if constants is not None:
        wrappers[_CONSTANTS] = constants
    units = fsdp_units(graph)
    in_unit = _regions_by_unit(regions, units)
    for k, unit in enumerate(units):
        unit_wrappers = _outline_unit(new_graph, by_index, unit, in_unit[k], counter, owner_modules, model)
        wrappers.update(unit_wrappers)
    for region in in_unit[len(units)]:
        name, wrapper = _outline(new_graph, by_index, region, counter, owner_modules)
        wrappers[name] = wrapper
    _erase_unused_attrs(new_graph)
    new_graph.lint()
    if any(fx_node.op == "get_attr" and fx_node.target == _MODEL_STATE for fx_node in new_graph.nodes):
        wrappers[_MODEL_STATE] = owner_modules[_MODEL_STATE]

    root: dict[str, Any] = {**wrappers}
    for fx_node in new_graph.nodes:
        if fx_node.op in ("get_attr", "call_module") and fx_node.target not in root:
            if fx_node.op == "call_module":
                root[fx_node.target] = owner_modules[fx_node.target]
            else:
                root[fx_node.target] = _fetch_from(owner_modules, fx_node.target)
    module = CheckpointedModule(root, new_graph, class_name=f"Checkpointed{graph.name}")
    _share_state(module, model, source, wrappers)
    return module


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


def _remat_source(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for a rematerialised node: its output carries how to recompute it (``_Recompute``),
    for the hooks of the ops that save it (``_remat_saver``)."""

    def remat(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if (isinstance(out, torch.Tensor) and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and _storage_key(out) is not None):
            setattr(out, _RECOMPUTE_ATTR, _Recompute(fn, args, kwargs, out))
        return out

    remat.__name__ = f"remat_{getattr(fn, '__name__', 'node')}"
    return remat


def _remat_saver(fn: Callable[..., Any], sources: int) -> Callable[..., Any]:
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


def _rematerialise(graph: ComputeGraph, plan: Plan, by_index: list[torch.fx.Node]) -> None:
    """Rewrite the nodes ``plan`` rematerialises, and the ops outside regions that save their
    outputs, before regions are outlined (see ``ckptplan.remat``)."""
    remat = Remat(graph, indices(graph, plan.remat), plan.regions)
    for i in (*remat.nodes, *remat.recomputed_by):
        if by_index[i].op != "call_function":
            raise PlanFormatError(
                f"Node {graph.nodes[i].name!r} is a {by_index[i].op} node; rematerialisation rewrites only "
                "call_function nodes (profile with trace='export')."
            )
    for x in remat.nodes:
        if not isinstance(by_index[x].meta.get("val"), torch.Tensor):
            raise PlanFormatError(
                f"Node {graph.nodes[x].name!r} does not return one tensor, so it cannot be rematerialised."
            )
    for x in remat.nodes:
        by_index[x].target = _remat_source(by_index[x].target)
    for c, xs in remat.recomputed_by.items():
        saver = by_index[c]
        saver.target = _remat_saver(saver.target, len(xs))
        saver.args = (*(by_index[x] for x in xs), *saver.args)


def _share_state(module: CheckpointedModule, model: nn.Module, source: torch.fx.GraphModule,
                 wrappers: dict[str, nn.Module]) -> None:
    """Make ``module``'s module tree the model's: same children, parameters and buffers."""
    children: dict[str, nn.Module] = dict(model._modules)
    # Submodules that exist only in the traced module: export's guard function and the bodies of
    # higher-order ops (``torch.autocast``/``torch.no_grad`` blocks become
    # ``wrap_with_autocast(submod_1, ...)``), which the graph reads with get_attr.
    for name, child in source.named_children():
        children.setdefault(name, child)
    clash = set(children) & set(wrappers)
    if clash:
        raise PlanFormatError(f"The model has a submodule named {min(clash)!r}, which ckptplan reserves.")
    children.update(wrappers)
    module.__dict__["_modules"] = children
    module.__dict__["_parameters"] = model._parameters
    module.__dict__["_buffers"] = model._buffers
    module.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
    module.__dict__["_ckptplan_model"] = model
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(source, attr):
            module.__dict__[attr] = getattr(source, attr)
    module.training = True


def _outline(
    graph: torch.fx.Graph,
    by_index: list[torch.fx.Node],
    region: Region,
    counter: list[int],
    owner_modules: dict[str, nn.Module],
) -> tuple[str, CheckpointRegion]:
    """Move ``region``'s nodes out of ``graph`` into a body graph called through a region module."""
    counter[0] += 1
    region_id = counter[0]
    members = by_index[region.start:region.end]
    member_set = set(members)
    inputs: list[torch.fx.Node] = []
    for fx_node in members:
        for used in fx_node.all_input_nodes:
            if used not in member_set and used not in inputs:
                inputs.append(used)
    outputs = [n for n in members if any(user not in member_set for user in n.users)]

    # Buffers are not checkpoint arguments: checkpoint saves its tensor arguments and checks
    # their version on recompute, but BatchNorm updates its buffers in place. The region gets
    # the owning module instead and reads the buffer inside (``_read_state``).
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    call_args: list[torch.fx.Node] = []
    owner_placeholders: dict[torch.fx.Node, torch.fx.Node] = {}
    state_reads: list[tuple[torch.fx.Node, torch.fx.Node, str]] = []
    for fx_input in inputs:
        owner_ref = _buffer_owner(graph, fx_input, owner_modules)
        if owner_ref is None:
            env[fx_input] = body.placeholder(fx_input.name)
            env[fx_input].meta = dict(fx_input.meta)
            call_args.append(fx_input)
        else:
            owner_node, attr = owner_ref
            state_reads.append((fx_input, owner_node, attr))
    for fx_input, owner_node, attr in state_reads:
        if owner_node not in owner_placeholders:
            owner_placeholders[owner_node] = body.placeholder(f"{owner_node.name}_module")
            call_args.append(owner_node)
        env[fx_input] = body.call_function(_read_state, (owner_placeholders[owner_node], attr))
        env[fx_input].meta = dict(fx_input.meta)
    keep = set(region.keep)
    body_modules: dict[str, Any] = {}
    for fx_node in members:
        copied = body.node_copy(fx_node, lambda n: env[n])
        env[fx_node] = copied
        _guard_state_updates(body, copied, owner_modules, body_modules)
        if copied.op == "call_module" and copied.target not in body_modules:
            body_modules[copied.target] = owner_modules[copied.target]
        if fx_node.name in keep:
            _mark_kept(body, copied, region_id)
    body.output(tuple(env[n] for n in outputs))

    # Nested regions: outline the children inside the body.
    body_index = {fx_node: env[fx_node] for fx_node in members}
    child_wrappers: dict[str, CheckpointRegion] = {}
    local_by_index = list(by_index)
    for position in range(region.start, region.end):
        local_by_index[position] = body_index[by_index[position]]
    for child in region.children:
        name, wrapper = _outline(body, local_by_index, child, counter, owner_modules)
        child_wrappers[name] = wrapper
    body.lint()
    root = {**body_modules, **child_wrappers}
    for fx_node in body.nodes:
        if fx_node.op == "get_attr" and fx_node.target not in root:
            root[fx_node.target] = _fetch_from(owner_modules, fx_node.target)
    body_module = torch.fx.GraphModule(root, body, class_name=f"Region{region_id}")
    random = any(fx_node.meta.get(_RANDOM, False) for fx_node in members)
    wrapper = CheckpointRegion(body_module, region_id, tuple(region.keep), random)
    name = f"_ckptplan_region_{region_id}"

    # Replace the members in the parent graph by one call and getitems. Attribute reads
    # interleaved with the members move up so the call sees them.
    first = members[0]
    for fx_input in call_args:
        if fx_input.op == "get_attr" and fx_input > first:
            first.prepend(fx_input)
    with graph.inserting_before(first):
        region_module = graph.get_attr(name)
        call = graph.call_function(_run_region, (region_module, *call_args))
        call.meta["ckptplan_region"] = region_id
        results = [graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
    _replace_members(graph, members, outputs, results)
    for position in range(region.start, region.end):
        by_index[position] = call
    return name, wrapper


def _replace_members(
    graph: torch.fx.Graph, members: list[torch.fx.Node], outputs: list[torch.fx.Node], results: list[torch.fx.Node]
) -> None:
    """Outside ``members``, use ``results`` (the outlined call's items) for ``outputs``; then erase
    the members."""
    member_set = set(members)
    for original, result in zip(outputs, results):
        result.meta = dict(original.meta)
        original.replace_all_uses_with(result, delete_user_cb=lambda user: user not in member_set)
    for fx_node in reversed(members):
        graph.erase_node(fx_node)


class ShardUnitBody(nn.Module):
    """The ops of one FSDP unit, run as the unit module's ``forward`` (``_run_unit``).

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


def _run_unit(unit_module: nn.Module, unit: ShardUnitBody, *args: Any) -> Any:
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


def _regions_by_unit(regions: Sequence[Region], units: Sequence[Any]) -> list[list[Region]]:
    """Top-level regions per unit (index ``len(units)``: outside every unit). A region must lie
    inside one unit or outside all of them: a checkpoint cannot span two FSDP units."""
    grouped: list[list[Region]] = [[] for _ in range(len(units) + 1)]
    for region in regions:
        home = len(units)
        for k, unit in enumerate(units):
            if region.start < unit.end and unit.start < region.end:
                if not (unit.start <= region.start and region.end <= unit.end):
                    raise PlanFormatError(
                        f"Region [{region.start}, {region.end}) crosses the edge of shard unit {unit.path!r} "
                        f"(nodes [{unit.start}, {unit.end})); solve with the sharded graph's ilp, whose regions "
                        "stay inside blocks, or plan without --shard-degree."
                    )
                home = k
        grouped[home].append(region)
    return grouped


def _outline_unit(
    graph: torch.fx.Graph,
    by_index: list[torch.fx.Node],
    unit: Any,
    regions: Sequence[Region],
    counter: list[int],
    owner_modules: dict[str, nn.Module],
    model: nn.Module,
) -> dict[str, nn.Module]:
    """Move the unit's nodes into a body called as the unit module's forward, outline its
    regions inside that body, and return the wrappers made (the unit's and its regions')."""
    members = by_index[unit.start:unit.end]
    member_set = set(members)
    inputs: list[torch.fx.Node] = []
    attrs: list[torch.fx.Node] = []
    for fx_node in members:
        for used in fx_node.all_input_nodes:
            if used in member_set or used in inputs or used in attrs:
                continue
            live = used.op == "get_attr" and "." in str(used.target) and str(used.target).split(".")[0] in model._modules
            (attrs if live else inputs).append(used)
    outputs = [n for n in members if any(user not in member_set for user in n.users)]
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for fx_input in inputs:
        env[fx_input] = body.placeholder(fx_input.name)
        env[fx_input].meta = dict(fx_input.meta)
    for attr in attrs:
        env[attr] = body.get_attr(attr.target)
        env[attr].meta = dict(attr.meta)
    for fx_node in members:
        env[fx_node] = body.node_copy(fx_node, lambda n: env[n])
    body.output(tuple(env[n] for n in outputs))
    local_by_index = list(by_index)
    for position in range(unit.start, unit.end):
        local_by_index[position] = env[by_index[position]]
    wrappers: dict[str, nn.Module] = {}
    for region in regions:
        name, wrapper = _outline(body, local_by_index, region, counter, owner_modules)
        wrappers[name] = wrapper
    body.lint()
    root: dict[str, Any] = {}
    for fx_node in body.nodes:
        if fx_node.op in ("get_attr", "call_module") and fx_node.target not in root:
            target = str(fx_node.target)
            root[target] = wrappers[target] if target in wrappers else _fetch_from(owner_modules, target)
    body_module = torch.fx.GraphModule(root, body, class_name="ShardUnit")
    for top in {str(t).split(".")[0] for t in root if "." in str(t)}:
        # Read through the model's own modules at call time (see ShardUnitBody).
        body_module._modules.pop(top, None)
        body_module.__dict__[top] = model._modules[top]
    counter[0] += 1
    name = f"_ckptplan_unit_{counter[0]}"
    wrappers[name] = ShardUnitBody(body_module, unit.path)

    with graph.inserting_before(members[0]):
        unit_node = graph.get_attr(unit.path)
        body_node = graph.get_attr(name)
        call = graph.call_function(_run_unit, (unit_node, body_node, *inputs))
        results = [graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
    _replace_members(graph, members, outputs, results)
    for position in range(unit.start, unit.end):
        by_index[position] = call
    return wrappers


def _erase_unused_attrs(graph: torch.fx.Graph) -> None:
    """Attribute reads that moved into unit bodies leave unused copies behind."""
    for fx_node in list(graph.nodes):
        if fx_node.op == "get_attr" and not fx_node.users:
            graph.erase_node(fx_node)


# The emitted module's child holding the constant tensors its graph reads (``_carry_constants``).
_CONSTANTS = "_ckptplan_constants"


def _carry_constants(
    graph: torch.fx.Graph, model: nn.Module, owner_modules: dict[str, nn.Module]
) -> nn.Module | None:
    """Move the tensors ``graph`` reads that are not the model's parameters or buffers — the
    constants ``torch.export`` lifts (``a.lifted_tensor_0``: an index table built in forward) and
    plain tensor attributes — into one child module of their own, as non-persistent buffers, and
    point the reads there. The emitted module shares the model's modules, parameters and buffers,
    where the traced module's constants do not live; held here they follow ``.to()`` and stay out
    of ``state_dict``. Returns that child (also added to ``owner_modules``), or None if there are
    none."""
    state = {id(t) for t in (*model.parameters(), *model.buffers())}
    holder = nn.Module()
    names: dict[int, str] = {}
    for fx_node in graph.nodes:
        if fx_node.op != "get_attr":
            continue
        value = _fetch_from(owner_modules, str(fx_node.target))
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter) or id(value) in state:
            continue
        name = names.get(id(value))
        if name is None:
            name = base = str(fx_node.target).replace(".", "_")
            while hasattr(holder, name):
                name = f"{base}_{len(names)}"
            holder.register_buffer(name, value, persistent=False)
            names[id(value)] = name
        fx_node.target = f"{_CONSTANTS}.{name}"
    if not names:
        return None
    owner_modules[_CONSTANTS] = holder
    return holder


# The emitted module's child through which region bodies read the model's top-level buffers.
_MODEL_STATE = "_ckptplan_model_state"


class _ModelState(nn.Module):
    """Reads attributes of the model (held outside the module tree, so nothing is registered
    twice): what a region body reads the model's top-level buffers through, as it reads a
    submodule's buffers through that submodule (``_read_state``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.__dict__["model"] = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)


def _read_state(module: nn.Module, name: str) -> torch.Tensor:
    """Read a buffer at call time, so the region sees what ``.to()`` or ``load_state_dict`` put there."""
    return getattr(module, name)


def _buffer_owner(
    graph: torch.fx.Graph, fx_input: torch.fx.Node, owner_modules: dict[str, nn.Module]
) -> tuple[torch.fx.Node, str] | None:
    """For a region input that is a submodule's buffer, the node giving its owning module and
    the buffer's name; None for anything else (parameters, activations, top-level buffers)."""
    if fx_input.op == "call_function" and fx_input.target is _read_state:
        return fx_input.args[0], fx_input.args[1]
    if fx_input.op != "get_attr":
        return None
    owner_path, _, attr = str(fx_input.target).rpartition(".")
    owner = owner_modules.get(owner_path)
    if owner is None or attr not in owner._buffers:
        return None
    if not owner_path:  # the model's own buffer: read through the model (``_ModelState``)
        owner_path = _MODEL_STATE
    with graph.inserting_before(fx_input):
        owner_node = graph.get_attr(owner_path)
    return owner_node, attr


def _fetch_from(modules: dict[str, nn.Module], target: str) -> Any:
    """The attribute ``target`` ("layers.0.weight", or a submodule path) of the traced module."""
    if target in modules:
        return modules[target]
    owner, _, attr = target.rpartition(".")
    return getattr(modules[owner], attr)


def _guard_state_updates(
    body: torch.fx.Graph,
    copied: torch.fx.Node,
    owner_modules: dict[str, nn.Module],
    body_modules: dict[str, Any],
) -> None:
    """Keep buffer updates to once per step: recomputation must not repeat them."""
    target = copied.target
    first = copied.args[0] if copied.args else None
    external = isinstance(first, torch.fx.Node) and (
        first.op == "placeholder" or (first.op == "call_function" and first.target is _read_state)
    )
    if copied.op == "call_function" and target is torch.ops.aten.batch_norm.default:
        copied.target = _batch_norm_once
    elif copied.op == "call_function" and isinstance(target, torch._ops.OpOverload) and _mutates_first_arg(target):
        if external:
            copied.target = _mutate_once
            copied.args = (target, *copied.args)
    elif copied.op == "call_method" and str(target).endswith("_") and not str(target).startswith("_"):
        if external:
            copied.op = "call_function"
            copied.target = _mutate_once
            copied.args = (str(target), *copied.args)
    elif copied.op == "call_module" and isinstance(owner_modules.get(copied.target), nn.modules.batchnorm._BatchNorm):
        module_node = body.get_attr(copied.target)
        copied.prepend(module_node)
        body_modules[copied.target] = owner_modules[copied.target]
        copied.op = "call_function"
        copied.args = (module_node, *copied.args)
        copied.target = _batch_norm_module_once


def _mark_kept(body: torch.fx.Graph, copied: torch.fx.Node, region_id: int) -> None:
    """Make ``copied`` (a kept node) call its target through ``_run_kept``."""
    target = copied.target
    if copied.op == "call_module":
        module_node = body.get_attr(copied.target)
        copied.prepend(module_node)
        copied.args = (module_node, *copied.args)
        target = _call_module
    elif copied.op != "call_method" and copied.op != "call_function":
        return
    copied.op = "call_function"
    copied.target = _kept_call(region_id, copied.name, target)


def _mutates_first_arg(op: torch._ops.OpOverload) -> bool:
    arguments = op._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
