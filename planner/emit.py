"""Rewrite the traced graph so a plan runs, once: regions become submodules called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, keep-sets selective checkpoint
policies, rematerialised ops and state updates calls of ``planner.runtime``, which holds what
runs in every step.

The emitted module is a drop-in replacement for the profiled model: it shares the model's
submodules, ``Parameter`` objects and buffers (so ``state_dict`` keys are identical and an
optimizer built on either works), trains with the checkpointed graph, and in eval mode calls
the model's own ``forward`` (the traced graph is a training-mode graph).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptplan.errors import PlanFormatError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Plan, Region
from ckptplan.planner.runtime import (
    CheckpointedModule,
    CheckpointRegion,
    ModelState,
    ShardUnitBody,
    batch_norm_module_once,
    batch_norm_once,
    call_module,
    kept_call,
    mutate_once,
    read_state,
    remat_saver,
    remat_source,
    run_region,
    run_unit,
)
from ckptplan.profiler.record import iter_compute_nodes
from ckptplan.remat import Remat, indices
from ckptplan.sharding import ShardUnit, fsdp_units
from ckptplan.simulation import build_region_tree

# The fx meta key marking nodes that draw random numbers (``Node.random``): only regions holding
# one have checkpoint stash and replay the RNG state, which costs memory (5,056 bytes on CPU).
_RANDOM = "ckptplan_random"


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
    owner_modules[_MODEL_STATE] = ModelState(model)
    constants = _carry_constants(new_graph, model, owner_modules)
    if constants is not None:
        wrappers[_CONSTANTS] = constants
    units = fsdp_units(graph)
    in_unit = _regions_by_unit(regions, units)
    for k, unit in enumerate(units):
        unit_wrappers = _outline_unit(new_graph, by_index, unit, in_unit[k], counter, owner_modules, model)
        wrappers.update(unit_wrappers)
    for region in in_unit[len(units)]:
        name, wrapper = _outline_region(new_graph, by_index, region, counter, owner_modules)
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
        by_index[x].target = remat_source(by_index[x].target)
    for c, xs in remat.recomputed_by.items():
        saver = by_index[c]
        saver.target = remat_saver(saver.target, len(xs))
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


def _regions_by_unit(regions: Sequence[Region], units: Sequence[ShardUnit]) -> list[list[Region]]:
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


# Binds a body's inputs: the env entries of the body nodes standing for them, and the parent's
# nodes the body's call passes (see ``_bind_region_inputs``, ``_bind_unit_inputs``).
_Bind = Callable[[torch.fx.Graph, list[torch.fx.Node]], tuple[dict[torch.fx.Node, torch.fx.Node], list[torch.fx.Node]]]
# Adjusts a member's copy in the body, given the body, the member and its copy.
_Prepare = Callable[[torch.fx.Graph, torch.fx.Node, torch.fx.Node], None]


@dataclass(frozen=True)
class _Body:
    """Nodes ``[start, end)`` of a graph copied into ``module``'s graph, not yet replaced there:
    ``members`` (the nodes), ``outputs`` (members used after them), ``call_args`` (what a call of
    the body passes), and ``wrappers`` (the modules of the regions outlined inside it, by name)."""

    start: int
    end: int
    members: list[torch.fx.Node]
    outputs: list[torch.fx.Node]
    call_args: list[torch.fx.Node]
    module: torch.fx.GraphModule
    wrappers: dict[str, CheckpointRegion]


def _outline(
    graph: torch.fx.Graph, by_index: list[torch.fx.Node], start: int, end: int, regions: Sequence[Region],
    counter: list[int], owner_modules: dict[str, nn.Module], bind: _Bind, prepare: _Prepare | None, class_name: str,
) -> _Body:
    """Copy nodes ``[start, end)`` of ``graph`` into a body graph whose inputs ``bind`` makes, with
    ``prepare`` applied to each copy, outline ``regions`` (which lie inside the range) in the body,
    and build its module. The members stay in ``graph`` until ``_call_body`` replaces them."""
    members = by_index[start:end]
    member_set = set(members)
    inputs: list[torch.fx.Node] = []
    for fx_node in members:
        for used in fx_node.all_input_nodes:
            if used not in member_set and used not in inputs:
                inputs.append(used)
    outputs = [n for n in members if any(user not in member_set for user in n.users)]
    body = torch.fx.Graph()
    env, call_args = bind(body, inputs)
    for fx_node in members:
        env[fx_node] = body.node_copy(fx_node, lambda n: env[n])
        if prepare is not None:
            prepare(body, fx_node, env[fx_node])
    body.output(tuple(env[n] for n in outputs))

    local_by_index = list(by_index)
    for position in range(start, end):
        local_by_index[position] = env[by_index[position]]
    wrappers: dict[str, CheckpointRegion] = {}
    for region in regions:
        name, wrapper = _outline_region(body, local_by_index, region, counter, owner_modules)
        wrappers[name] = wrapper
    body.lint()
    root: dict[str, Any] = {}
    for fx_node in body.nodes:
        if fx_node.op in ("get_attr", "call_module") and fx_node.target not in root:
            target = str(fx_node.target)
            root[target] = wrappers[target] if target in wrappers else _fetch_from(owner_modules, target)
    module = torch.fx.GraphModule(root, body, class_name=class_name)
    return _Body(start, end, members, outputs, call_args, module, wrappers)


def _call_body(
    graph: torch.fx.Graph, by_index: list[torch.fx.Node], outlined: _Body, run: Callable[..., Any], attrs: Sequence[str]
) -> torch.fx.Node:
    """Replace ``outlined``'s members in ``graph`` by one call ``run(*attrs, *call_args)`` (the
    attributes read with get_attr) and getitems of its results, and point the members' positions
    in ``by_index`` at the call, which is returned. Attribute reads interleaved with the members
    move up so the call sees them."""
    first = outlined.members[0]
    for fx_input in outlined.call_args:
        if fx_input.op == "get_attr" and fx_input > first:
            first.prepend(fx_input)
    with graph.inserting_before(first):
        attr_nodes = [graph.get_attr(attr) for attr in attrs]
        call = graph.call_function(run, (*attr_nodes, *outlined.call_args))
        results = [graph.call_function(operator.getitem, (call, k)) for k in range(len(outlined.outputs))]
    member_set = set(outlined.members)
    for original, result in zip(outlined.outputs, results):
        result.meta = dict(original.meta)
        original.replace_all_uses_with(result, delete_user_cb=lambda user: user not in member_set)
    for fx_node in reversed(outlined.members):
        graph.erase_node(fx_node)
    for position in range(outlined.start, outlined.end):
        by_index[position] = call
    return call


def _outline_region(
    graph: torch.fx.Graph,
    by_index: list[torch.fx.Node],
    region: Region,
    counter: list[int],
    owner_modules: dict[str, nn.Module],
) -> tuple[str, CheckpointRegion]:
    """Move ``region``'s nodes out of ``graph`` into a body called through a checkpoint region
    module (``run_region``), with its state updates guarded, its kept nodes marked and its
    children outlined inside; returns the module's attribute name and the module."""
    counter[0] += 1
    region_id = counter[0]
    bind = functools.partial(_bind_region_inputs, graph, owner_modules)
    prepare = functools.partial(_prepare_region_member, owner_modules, frozenset(region.keep), region_id)
    outlined = _outline(
        graph, by_index, region.start, region.end, region.children, counter, owner_modules, bind, prepare,
        f"Region{region_id}",
    )
    random = any(fx_node.meta.get(_RANDOM, False) for fx_node in outlined.members)
    wrapper = CheckpointRegion(outlined.module, region_id, tuple(region.keep), random)
    name = f"_ckptplan_region_{region_id}"
    call = _call_body(graph, by_index, outlined, run_region, (name,))
    call.meta["ckptplan_region"] = region_id
    return name, wrapper


def _outline_unit(
    graph: torch.fx.Graph,
    by_index: list[torch.fx.Node],
    unit: ShardUnit,
    regions: Sequence[Region],
    counter: list[int],
    owner_modules: dict[str, nn.Module],
    model: nn.Module,
) -> dict[str, nn.Module]:
    """Move the unit's nodes into a body called as the unit module's forward (``run_unit``),
    outline its regions inside that body, and return the wrappers made (the unit's and its
    regions')."""
    bind = functools.partial(_bind_unit_inputs, model)
    outlined = _outline(graph, by_index, unit.start, unit.end, regions, counter, owner_modules, bind, None, "ShardUnit")
    body_module = outlined.module
    targets = {str(n.target) for n in body_module.graph.nodes if n.op in ("get_attr", "call_module")}
    for top in {target.split(".")[0] for target in targets if "." in target}:
        # Read through the model's own modules at call time (see ShardUnitBody).
        body_module._modules.pop(top, None)
        body_module.__dict__[top] = model._modules[top]
    counter[0] += 1
    name = f"_ckptplan_unit_{counter[0]}"
    wrappers: dict[str, nn.Module] = {**outlined.wrappers, name: ShardUnitBody(body_module, unit.path)}
    _call_body(graph, by_index, outlined, run_unit, (unit.path, name))
    return wrappers


def _bind_region_inputs(
    graph: torch.fx.Graph, owner_modules: dict[str, nn.Module], body: torch.fx.Graph, inputs: list[torch.fx.Node]
) -> tuple[dict[torch.fx.Node, torch.fx.Node], list[torch.fx.Node]]:
    """A region body's inputs (a ``_Bind``): a placeholder for each input, passed as it is, but
    for buffers, which are not checkpoint arguments: checkpoint saves its tensor arguments and
    checks their version on recompute, but BatchNorm updates its buffers in place. The region
    gets the owning module instead (one placeholder per module, after the others) and reads the
    buffer inside (``read_state``)."""
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    call_args: list[torch.fx.Node] = []
    state_reads: list[tuple[torch.fx.Node, torch.fx.Node, str]] = []
    for fx_input in inputs:
        owner_ref = _buffer_owner(graph, fx_input, owner_modules)
        if owner_ref is None:
            env[fx_input] = _placeholder(body, fx_input)
            call_args.append(fx_input)
        else:
            state_reads.append((fx_input, *owner_ref))
    owner_placeholders: dict[torch.fx.Node, torch.fx.Node] = {}
    for fx_input, owner_node, attr in state_reads:
        if owner_node not in owner_placeholders:
            owner_placeholders[owner_node] = body.placeholder(f"{owner_node.name}_module")
            call_args.append(owner_node)
        env[fx_input] = body.call_function(read_state, (owner_placeholders[owner_node], attr))
        env[fx_input].meta = dict(fx_input.meta)
    return env, call_args


def _bind_unit_inputs(
    model: nn.Module, body: torch.fx.Graph, inputs: list[torch.fx.Node]
) -> tuple[dict[torch.fx.Node, torch.fx.Node], list[torch.fx.Node]]:
    """A unit body's inputs (a ``_Bind``): a placeholder for each input, passed as it is, but for
    attributes of the model's submodules (the unit's parameters and buffers), which the body
    reads itself with get_attr (after the placeholders) when it runs: see ``ShardUnitBody``."""
    live = {n for n in inputs if n.op == "get_attr" and "." in str(n.target) and str(n.target).split(".")[0] in model._modules}
    call_args = [n for n in inputs if n not in live]
    env = {fx_input: _placeholder(body, fx_input) for fx_input in call_args}
    for attr in (n for n in inputs if n in live):
        env[attr] = body.get_attr(attr.target)
        env[attr].meta = dict(attr.meta)
    return env, call_args


def _placeholder(body: torch.fx.Graph, fx_input: torch.fx.Node) -> torch.fx.Node:
    """A placeholder of ``body`` standing for ``fx_input``, named and annotated as it is."""
    placeholder = body.placeholder(fx_input.name)
    placeholder.meta = dict(fx_input.meta)
    return placeholder


def _prepare_region_member(
    owner_modules: dict[str, nn.Module], keep: frozenset[str], region_id: int,
    body: torch.fx.Graph, fx_node: torch.fx.Node, copied: torch.fx.Node,
) -> None:
    """A region member's copy (a ``_Prepare``): state updates guarded, and a kept node run
    through its region's selective policy."""
    _guard_state_updates(body, copied, owner_modules)
    if fx_node.name in keep:
        _mark_kept(body, copied, region_id)


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


def _buffer_owner(
    graph: torch.fx.Graph, fx_input: torch.fx.Node, owner_modules: dict[str, nn.Module]
) -> tuple[torch.fx.Node, str] | None:
    """For a region input that is a submodule's buffer, the node giving its owning module and
    the buffer's name; None for anything else (parameters, activations, top-level buffers)."""
    if fx_input.op == "call_function" and fx_input.target is read_state:
        return fx_input.args[0], fx_input.args[1]
    if fx_input.op != "get_attr":
        return None
    owner_path, _, attr = str(fx_input.target).rpartition(".")
    owner = owner_modules.get(owner_path)
    if owner is None or attr not in owner._buffers:
        return None
    if not owner_path:  # the model's own buffer: read through the model (``ModelState``)
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
) -> None:
    """Keep buffer updates to once per step: recomputation must not repeat them."""
    target = copied.target
    first = copied.args[0] if copied.args else None
    external = isinstance(first, torch.fx.Node) and (
        first.op == "placeholder" or (first.op == "call_function" and first.target is read_state)
    )
    if copied.op == "call_function" and target is torch.ops.aten.batch_norm.default:
        copied.target = batch_norm_once
    elif copied.op == "call_function" and isinstance(target, torch._ops.OpOverload) and _mutates_first_arg(target):
        if external:
            copied.target = mutate_once
            copied.args = (target, *copied.args)
    elif copied.op == "call_method" and str(target).endswith("_") and not str(target).startswith("_"):
        if external:
            copied.op = "call_function"
            copied.target = mutate_once
            copied.args = (str(target), *copied.args)
    elif copied.op == "call_module" and isinstance(owner_modules.get(copied.target), nn.modules.batchnorm._BatchNorm):
        module_node = body.get_attr(copied.target)
        copied.prepend(module_node)
        copied.op = "call_function"
        copied.args = (module_node, *copied.args)
        copied.target = batch_norm_module_once


def _mark_kept(body: torch.fx.Graph, copied: torch.fx.Node, region_id: int) -> None:
    """Make ``copied`` (a kept node) call its target through ``_run_kept``."""
    target = copied.target
    if copied.op == "call_module":
        module_node = body.get_attr(copied.target)
        copied.prepend(module_node)
        copied.args = (module_node, *copied.args)
        target = call_module
    elif copied.op != "call_method" and copied.op != "call_function":
        return
    copied.op = "call_function"
    copied.target = kept_call(region_id, copied.name, target)


def _mutates_first_arg(op: torch._ops.OpOverload) -> bool:
    arguments = op._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
