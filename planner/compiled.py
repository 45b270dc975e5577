"""``ckptplan.compile``: ``torch.compile`` with ckptplan deciding what the backward recomputes.

AOTAutograd traces one joint forward-backward graph and hands it to a partitioner, which
decides which forward values the forward saves for the backward; the backward computes every
other one it needs again. Here that partitioner reads the joint graph (``profiler.joint``),
solves for the saved set under an absolute byte budget (``solvers.orchestrate.solve_partition_step``:
a greedy search, then an exact CP-SAT model, each partition checked by the model of the two
graphs, ``ckptplan.partition``), and cuts the graphs with PyTorch's own
``_extract_fwd_bwd_modules``, the backward ordered as ``reordering_to_mimic_autograd_engine``
orders it, which the model assumes (checked at every partition).

``backend="aot_eager"`` runs both graphs eagerly (what the model predicts, each op's kernel
workspace measured by running it once); ``backend="inductor"`` compiles them with inductor,
whose kernels hold fewer buffers than the model counts (fusion) or more (a layout change, a
buffer computed early for a later kernel): ``compile`` measures that step, and partitions
again for less while it is over the budget.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from ckptplan.errors import CkptPlanError, FingerprintMismatchError, InfeasibleBudgetError
from ckptplan.graph import TensorSpec
from ckptplan.joint import JointGraph
from ckptplan.partition import PartitionReport, simulate_partition
from ckptplan.plan import (
    BudgetInfo,
    InputInfo,
    ModelInfo,
    PartitionPlan,
    PartitionPrediction,
    SolverInfo,
    load_any_plan,
)
from ckptplan.planner.measure import forward_autocast, measure_step, own_bytes
from ckptplan.profiler.cost import A100, Roofline
from ckptplan.profiler.joint import (
    REPLAY_OP,
    dropout_from_masks,
    is_tangent,
    read_drawn_masks,
    read_joint,
    replayable_dropouts,
)
from ckptplan.profiler.trace import model_device_type
from ckptplan.solvers.orchestrate import check_partition_solver, solve_partition_step
from ckptplan.solvers.partition import Partition, no_recompute
from ckptplan.units import format_bytes, parse_budget

log = logging.getLogger(__name__)

Backend = Literal["inductor", "aot_eager"]


@dataclass(frozen=True)
class CompiledPlan:
    """What a compiled step saves and recomputes, named as in the joint graph.

    ``budget_bytes``: the budget asked; ``baseline_peak_bytes``: the predicted peak with nothing
    recomputed; ``peak_bytes``: the predicted peak of the partition chosen (what
    ``measure_step`` counts: the step's allocations plus the model's state and inputs).
    ``recompute_seconds`` and ``recompute_flops``: the work the backward repeats, priced on
    ``priced_on`` (the graph's roofline). ``solver``: the search that found the partition
    (``greedy`` or ``exact``); ``status``: what is proved of it (``solvers.partition.Partition``);
    ``seconds``: the time the search took. ``asked``: the solver asked for (``"plan"``: the
    saved set came from a plan file); ``requested``: the budget as asked; ``inputs``: the
    shapes and dtypes of the step's tensor inputs; ``autocast``: the dtype its forward ran under
    ``torch.autocast`` with (``"bfloat16"``, ``"float16"`` or None). ``measured_peak_bytes``: the
    compiled step's peak as the allocator counted it when ``compile`` ran it (inductor's steps;
    None where it did not); ``margin_bytes``: how far below the budget the partition was solved
    for, so that the measured step fits (``compile``); ``inductor_options``: the inductor settings
    the step was compiled with besides inductor's defaults (``MODELLED_INDUCTOR``, where ``compile``
    set them). ``to_plan`` makes it a plan file's ``PartitionPlan``."""

    graph: JointGraph
    budget_bytes: int
    baseline_peak_bytes: int
    report: PartitionReport
    solver: str = "greedy"
    status: str = "heuristic"
    seconds: float = 0.0
    asked: str = "greedy"
    requested: str = ""
    inputs: tuple[TensorSpec, ...] = ()
    autocast: str | None = None
    measured_peak_bytes: int | None = None
    margin_bytes: int = 0
    inductor_options: dict[str, bool] = dataclasses.field(default_factory=dict)

    def to_plan(self) -> PartitionPlan:
        """This partition as a plan file's ``PartitionPlan`` (``ckptplan.plan``)."""
        graph, report = self.graph, self.report
        status = {"optimal": "optimal", "infeasible": "infeasible"}.get(self.status, "feasible")
        return PartitionPlan(
            model=ModelInfo(name=graph.name, fingerprint=graph.fingerprint, node_count=len(graph.values),
                            inputs=tuple(InputInfo(shape=t.shape, dtype=t.dtype) for t in self.inputs),
                            outputs_live=graph.outputs_live, autocast=self.autocast),
            budget=BudgetInfo(requested=self.requested or str(self.budget_bytes), bytes=self.budget_bytes),
            solver=SolverInfo(name=self.asked, status=status, seconds=round(self.seconds, 3), origin=self.solver),
            prediction=PartitionPrediction(
                peak_bytes=report.peak_bytes, forward_peak_bytes=report.forward_peak_bytes,
                backward_peak_bytes=report.backward_peak_bytes, baseline_peak_bytes=self.baseline_peak_bytes,
                recompute_flops=report.recompute_flops, recompute_seconds=report.recompute_seconds,
                priced_on=graph.priced_on,
                replayed_masks=sum(1 for i in report.recomputed if graph.values[i].op == REPLAY_OP),
            ),
            saved=self.saved,
            recomputed=self.recomputed,
            inductor_options=dict(self.inductor_options),
        )

    @property
    def priced_on(self) -> str | None:
        return self.graph.priced_on

    @property
    def peak_bytes(self) -> int:
        return self.report.peak_bytes

    @property
    def saved(self) -> tuple[str, ...]:
        return tuple(self.graph.values[i].name for i in self.report.saved)

    @property
    def recomputed(self) -> tuple[str, ...]:
        return tuple(self.graph.values[i].name for i in self.report.recomputed)

    @property
    def recompute_seconds(self) -> float:
        return self.report.recompute_seconds

    @property
    def recompute_flops(self) -> int:
        return self.report.recompute_flops


def nothing_recomputed(plan: CompiledPlan) -> PartitionPlan:
    """The plan file that saves, on ``plan``'s joint graph, every forward value the backward
    reads (nothing recomputed), at a budget of its own peak."""
    report = simulate_partition(plan.graph, no_recompute(plan.graph))
    return dataclasses.replace(
        plan, report=report, budget_bytes=report.peak_bytes, requested=str(report.peak_bytes), asked="plan",
        solver="plan", status="heuristic",
    ).to_plan()


class Partitioner:
    """The partition function handed to AOTAutograd (``partition_fn``) or to inductor
    (``custom_partitioner_fn``). Each graph it partitions leaves its ``CompiledPlan`` in
    ``plans``; a budget no partition meets leaves the least-peak one there and the error in
    ``error``, raised by ``compile`` (an exception inside ``torch.compile`` reaches the caller
    wrapped in Dynamo's own)."""

    def __init__(
        self, budget: str | float, *, roofline: Roofline, outputs_live: bool, name: str, solver: str = "auto",
        time_limit: float | None = None, follow: PartitionPlan | None = None, inputs: tuple[TensorSpec, ...] = (),
        autocast: str | None = None, margin_bytes: int = 0, resident_bytes: int = 0,
    ) -> None:
        self.budget, self.roofline, self.outputs_live, self.name = budget, roofline, outputs_live, name
        self.solver, self.time_limit = solver, time_limit
        self.follow = follow  # a plan file's saved set, used instead of solving
        self.inputs = inputs  # the step's tensor inputs, for the plan file
        self.autocast = autocast  # the dtype the forward runs under torch.autocast with, for the plan file
        self.margin_bytes = margin_bytes  # solve for the budget less this (compile's measured check)
        self.resident_bytes = resident_bytes  # the model's state and the step's inputs, each storage once
        self.plans: list[CompiledPlan] = []
        self.starts: list[list[int]] = []  # the last search's starts (PyTorch's partitions), as value indices
        self.error: CkptPlanError | None = None

    def __call__(
        self, joint: fx.GraphModule, joint_inputs: Sequence[object], *, num_fwd_outputs: int, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch import config as functorch_config
        from torch._functorch import partitioners
        from torch._functorch.compile_utils import fx_graph_cse, raise_getitems

        if functorch_config.cse:
            # As the min-cut partitioner does first: the backward's copies of forward
            # computations (a GELU's derivative recomputing its input's scaling) become one.
            joint.graph = fx_graph_cse(joint.graph)
            joint.recompile()
        dropout_from_masks(joint)
        searching = self.follow is None
        # PyTorch's partitions of the step as it would cut it, dropouts drawn once (its own
        # choices), then, where a dropout was made replayable, of the step whose backward may
        # replay them (choices only twins allow; without one the graph and its partitions are
        # the same).
        starts = _min_cut_starts(joint, num_fwd_outputs, kwargs) if searching else []
        replayed = replayable_dropouts(joint)
        if searching and replayed:
            starts += _min_cut_starts(joint, num_fwd_outputs, kwargs)
        graph = read_joint(
            joint, num_fwd_outputs, self.roofline, name=self.name, outputs_live=self.outputs_live,
            workspaces=_real_device(joint), resident_bytes=self.resident_bytes,
        )
        baseline = simulate_partition(graph, no_recompute(graph))
        budget_bytes = parse_budget(self.budget, baseline.peak_bytes)
        started = time.perf_counter()
        if not searching:
            found = self._followed(graph, budget_bytes)
        else:
            names = {v.name: v.index for v in graph.values if v.phase == "forward" and not v.multi_output}
            self.starts = [[names[name] for name in start if name in names] for start in starts]
            found = solve_partition_step(
                graph, budget_bytes - self.margin_bytes, solver=self.solver, time_limit=self.time_limit,
                starts=self.starts,
            )
        requested = self.budget if isinstance(self.budget, str) else repr(self.budget)
        plan = CompiledPlan(graph, budget_bytes, baseline.peak_bytes, found.report, solver=found.origin,
                            status=found.status, seconds=time.perf_counter() - started,
                            asked="plan" if self.follow is not None else self.solver, requested=requested,
                            inputs=self.inputs, autocast=self.autocast, margin_bytes=self.margin_bytes)
        self.plans.append(plan)
        if not found.feasible:
            proved = " (no partition fits it: proved by the exact model)" if found.status == "infeasible" else ""
            margin, measured = "", ""
            if self.margin_bytes:
                margin = (f" less the {format_bytes(self.margin_bytes)} by which inductor's step measured above the "
                          "model's peak")
                measured = f", so about {format_bytes(found.report.peak_bytes + self.margin_bytes)} measured"
            self.error = InfeasibleBudgetError(
                f"Budget {format_bytes(budget_bytes)} ({budget_bytes:,} bytes){margin} is below the least peak the "
                f"compiled step reached, {format_bytes(found.report.peak_bytes)} ({found.report.peak_bytes:,} "
                f"bytes){proved}{measured}; raise the budget.",
                budget_bytes=budget_bytes, min_peak_bytes=found.report.peak_bytes + self.margin_bytes,
                least_plan=plan,
            )
        read_drawn_masks(joint, plan.saved)
        nodes = {n.name: n for n in joint.graph.nodes}
        in_backward = {graph.values[i].name for i in found.report.backward_order}
        primals = [
            n for n in joint.graph.find_nodes(op="placeholder")
            if not is_tangent(n) and any(user.name in in_backward for user in n.users)
        ]
        saved = primals + [nodes[name] for name in plan.saved]
        static = kwargs.get("static_lifetime_input_indices") or []
        info = partitioners.classify_nodes(joint, static, num_fwd_outputs)
        forward, backward = partitioners._extract_fwd_bwd_modules(
            joint, saved, [], num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_nodes=info.static_lifetime_input_nodes,
        )
        forward.graph.eliminate_dead_code(is_impure_node=partitioners.is_not_collective)
        backward.graph.eliminate_dead_code(is_impure_node=partitioners.is_not_collective)
        backward = partitioners.reordering_to_mimic_autograd_engine(backward)
        forward, backward = raise_getitems(forward), raise_getitems(backward)
        _check_order(forward, [graph.values[i].name for i in found.report.forward_order], "forward")
        _check_order(backward, [graph.values[i].name for i in found.report.backward_order], "backward")
        return forward, backward

    def _followed(self, graph: JointGraph, budget_bytes: int) -> Partition:
        """The partition ``self.follow`` names, on the joint graph it was made for."""
        plan = self.follow
        if graph.fingerprint != plan.model.fingerprint:
            self.error = FingerprintMismatchError(
                f"The plan is for another compiled step (joint graph {plan.model.fingerprint}; this model's is "
                f"{graph.fingerprint}): the model, its input shapes or dtypes, or torch differ; solve again."
            )
            raise self.error
        report = simulate_partition(graph, [graph.index_of(name) for name in plan.saved])
        return Partition(report=report, feasible=report.peak_bytes <= budget_bytes,
                         origin=plan.solver.origin or plan.solver.name)


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """The model's buffers (a batch norm's running statistics) and the random number generators
    as they were before the block: the forward that ``compile`` runs to partition the step is
    not one of the user's training steps."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _real_device(joint: fx.GraphModule) -> torch.device | None:
    """The device the step's tensors are on, where kernels can run to measure workspaces."""
    for node in joint.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device if value.device.type in ("cpu", "cuda") else None
    return None


# How many times ``compile`` partitions an inductor step whose measured peak is over the budget,
# each time for a budget lower by 1.5 times the overshoot so far (docs/limits.md, "Compiled steps").
MEASURED_TRIES = 3

# Inductor settings under which its step holds what the model of the two graphs counts: the
# backward's kernels in the graph's order (not reordered by inductor's own estimate of peak
# memory) and convolutions in the graph's layouts. ``compile`` compiles a partition measured over
# the budget once more with them, before partitioning again (docs/limits.md, "Compiled steps").
MODELLED_INDUCTOR = MappingProxyType({"reorder_for_peak_memory": False, "layout_optimization": False})

# The memory-budget settings of PyTorch's min-cut partitioner whose partitions start the search:
# the settings benchmarks/compile_compare.py sets ckptplan against (docs/tuning.md, "Cost models").
_MIN_CUT_STARTS = (1.0, 0.8, 0.5, 0.2, 0.0)


def _min_cut_starts(joint: fx.GraphModule, num_fwd_outputs: int, kwargs: dict[str, Any]) -> list[list[str]]:
    """What PyTorch's min-cut partitioner saves at a few memory budgets (at 1.0 it saves the
    inputs of cheap pointwise chains rather than their outputs), as node names: starts for the
    search, which makes them valid first (where min-cut recomputes a random op, the search
    saves what the backward needs of it instead). Each runs on a copy, since it tags the graph
    it cuts; one that fails is left out."""
    from torch._functorch import config as functorch_config
    from torch._functorch import partitioners

    starts = []
    for budget in _MIN_CUT_STARTS:
        try:
            with functorch_config.patch(activation_memory_budget=budget):
                forward, _ = partitioners.min_cut_rematerialization_partition(
                    copy.deepcopy(joint), None, num_fwd_outputs=num_fwd_outputs, **kwargs
                )
        except Exception as exc:  # noqa: BLE001 (only a start for the search; the search runs without it)
            log.debug("min-cut partition at budget %s failed (%s); not a start", budget, exc)
            continue
        returned = list(forward.graph.output_node().args[0])[num_fwd_outputs:]
        starts.append([n.name for n in returned if isinstance(n, fx.Node)])
    return starts


def _check_order(module: fx.GraphModule, predicted: list[str], which: str) -> None:
    ran = [n.name for n in module.graph.nodes if n.op == "call_function"]
    if ran != predicted:
        raise CkptPlanError(
            f"The {which} graph PyTorch cut runs {len(ran)} nodes in another order than the {len(predicted)} "
            "the memory model assumes; please report this model."
        )


def choose_loss_functions(model: nn.Module) -> None:
    """A ``transformers`` model picks its loss function on first use and may log a warning as
    it does, which Dynamo cannot trace inside a whole graph: pick it now, as that first use
    would (the property's setter keeps it). Whatever else compiles the model whole needs it too
    (``benchmarks/compile_compare.py``'s peers)."""
    for module in model.modules():
        attribute = getattr(type(module), "loss_function", None)
        if isinstance(attribute, property) and attribute.fset is not None and "_loss_function" not in vars(module):
            module.loss_function = module.loss_function


def _inductor_partitioner(partitioner: Partitioner) -> Any:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    token = f"ckptplan-partitioner-{uuid.uuid4().hex}"

    class InductorPartitioner(CustomPartitionerFn):
        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
            return partitioner(gm, joint_inputs, **kwargs)

        def uuid(self) -> str:
            # Inductor's and AOTAutograd's caches key on this: one partitioner's partitions may be
            # reused, never another's (another budget).
            return token

        def __reduce__(self) -> tuple:
            return (str, (token,))  # what the caches pickle of the config

    return InductorPartitioner()


def compile(
    model: nn.Module,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    budget: str | float | None = None,
    solver: str = "auto",
    backend: Backend = "inductor",
    time_limit: float | None = None,
    outputs_live: bool | None = None,
    roofline: Roofline | None = None,
    plan: PartitionPlan | str | Path | None = None,
    autocast: torch.dtype | None = None,
) -> nn.Module:
    """``torch.compile(model)`` whose training step saves what ckptplan chooses for ``budget``.

    ``budget``: bytes, a size (``"8GB"``) or a fraction of the compiled step's peak with nothing
    recomputed, as the plan's peak counts it (the step's allocations plus the model's state and
    inputs). The model is compiled whole (``fullgraph=True``) and run once on ``args`` and
    ``kwargs`` to partition it; the returned module's ``ckptplan_plan`` is the
    ``CompiledPlan`` of that partition (later recompilations, for other shapes, solve again);
    that run leaves the model's buffers and the random number generators as it found them.
    ``solver``: ``"auto"`` (a greedy search, then the exact CP-SAT model, which proves the least
    recomputation where it can, in ``time_limit`` seconds, 30 by default), ``"exact"`` (the
    same, 120 s by default) or ``"greedy"`` (the greedy search alone); see
    ``solvers.orchestrate.solve_partition_step``. ``outputs_live``: the training loop keeps the
    outputs until backward ends (None: the plan's, else True, ``profile``'s default).
    ``plan``: a compiled step's plan (a ``PartitionPlan`` or its file, ``CompiledPlan.to_plan``)
    whose saved set to use instead of solving, on the joint graph it was made for; its budget
    unless ``budget`` is given. ``autocast`` (``torch.bfloat16``, ``torch.float16`` or None):
    compile the mixed-precision step whose forward and loss run under ``torch.autocast`` with
    that dtype (None: the plan's, else the autocast already in force around this call, if any);
    run the returned module under the same autocast, since Dynamo compiles, and ckptplan
    partitions, again for another. Raises ``InfeasibleBudgetError`` when no partition found (or
    the plan's) fits the budget.

    With ``backend="inductor"``, ``compile`` also runs two training steps on
    ``args`` and measures the second one's peak as the allocator counts it (``measure_step``):
    inductor's kernels may hold more than the model of the two graphs counts (a layout change
    for convolutions, kernels reordered by inductor's own estimate of peak memory, a buffer
    computed early for a later kernel). A step measured over the budget is compiled once more with
    the same partition under ``MODELLED_INDUCTOR`` (inductor kept to the graphs' order and
    layouts), then, while still over, partitioned and compiled again for the budget less 1.5 times
    the overshoot so far, under the settings that measured less, up to ``MEASURED_TRIES``
    partitions. A plan's partition is not made again: over the budget under its own and the
    modelled settings, it raises. A step that runs out of device memory there raises
    ``CkptPlanError``. ``ckptplan_plan.measured_peak_bytes`` is the step's measured peak,
    ``ckptplan_plan.inductor_options`` the settings it was compiled with (its plan file keeps them),
    ``ckptplan_attempts`` every step measured. The steps leave the model's gradients, buffers and
    random number generators as they were (on CUDA they reset the peak-memory counter,
    ``torch.cuda.reset_peak_memory_stats``).
    """
    if backend not in ("inductor", "aot_eager"):
        raise CkptPlanError(f"Unknown backend {backend!r}; use 'inductor' or 'aot_eager'.")
    if not isinstance(model, nn.Module):
        raise CkptPlanError(f"Expected a torch.nn.Module to compile, got {type(model).__name__}.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    if plan is not None and not isinstance(plan, PartitionPlan):
        plan = load_any_plan(plan)
        if not isinstance(plan, PartitionPlan):
            raise CkptPlanError("The plan is an eager step's (regions); apply it with ckptplan.apply, not compile.")
    if budget is None:
        if plan is None:
            raise CkptPlanError("compile needs a budget, or a plan to follow.")
        budget = plan.budget.bytes
    if outputs_live is None:
        outputs_live = plan.model.outputs_live if plan is not None else True
    if autocast is None and plan is not None and plan.model.autocast is not None:
        autocast = getattr(torch, plan.model.autocast)
    device_type = model_device_type(model, pytree.tree_leaves((args, kwargs)))
    if autocast is None and torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        autocast = torch.get_autocast_dtype(device_type)
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise CkptPlanError(f"autocast={autocast}: use torch.bfloat16, torch.float16 or None.")
    choose_loss_functions(model)
    check_partition_solver(solver)
    tensors = [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    inputs = tuple(TensorSpec.of(t) for t in tensors)
    resident = own_bytes(model, tensors)
    attempts: list[CompiledPlan] = []

    def compiled_step(margin: int, options: dict[str, bool], same: CompiledPlan | None = None) -> tuple:
        """The model compiled with the partition solved for the budget less ``margin`` (``plan``'s,
        or ``same``'s partition again), under inductor's defaults and ``options``; an inductor
        step measured."""
        partitioner = Partitioner(
            budget, roofline=roofline or A100, outputs_live=outputs_live, name=type(model).__name__, solver=solver,
            time_limit=time_limit, follow=same.to_plan() if same is not None else plan, inputs=inputs,
            autocast=str(autocast).removeprefix("torch.") if autocast is not None else None, margin_bytes=margin,
            resident_bytes=resident,
        )
        with _recompiles_allowed(len(attempts)):  # a step compiled again does not use up the user's recompiles
            compiled = _compiled(model, args, kwargs or {}, partitioner, backend, autocast, options)
        found = dataclasses.replace(same or partitioner.plans[-1], inductor_options=dict(options))
        if same is not None and plan is None:
            partitioner.follow = None  # a later compile of the module (another shape) solves again
        if backend == "inductor":
            measured = _measured_peak(compiled, model, args, kwargs or {}, autocast, outputs_live)
            found = dataclasses.replace(found, measured_peak_bytes=measured)
            attempts.append(found)
        partitioner.plans[-1] = found
        return compiled, partitioner, found

    modelled_options = dict(MODELLED_INDUCTOR)
    options = dict(plan.inductor_options) if plan is not None and backend == "inductor" else {}
    compiled, partitioner, found = compiled_step(0, options)
    partitions, modelled_tried = 1, options == modelled_options
    while backend == "inductor" and found.measured_peak_bytes > found.budget_bytes:
        over = found.measured_peak_bytes - found.budget_bytes
        if not modelled_tried:
            # The same partition, inductor keeping to the order and layouts the model counts.
            log.info("inductor's step measured %s, %s over the budget: compiling the same partition with %s",
                     format_bytes(found.measured_peak_bytes), format_bytes(over), modelled_options)
            modelled_tried = True
            again = compiled_step(found.margin_bytes, modelled_options, same=found)
            if again[2].measured_peak_bytes < found.measured_peak_bytes:
                (compiled, partitioner, found), options = again, modelled_options
                over = found.measured_peak_bytes - found.budget_bytes
            if over <= 0:
                break
        if plan is not None:
            raise InfeasibleBudgetError(
                f"Inductor's compiled step with the plan's partition measured {format_bytes(found.measured_peak_bytes)} "
                f"({found.measured_peak_bytes:,} bytes), over the budget of {format_bytes(found.budget_bytes)}; "
                "compile with a budget instead of the plan (inductor's step is then measured and partitioned again), "
                "or with backend='aot_eager', whose step the plan predicts exactly.",
                budget_bytes=found.budget_bytes, min_peak_bytes=found.measured_peak_bytes, least_plan=found,
            )
        if partitions == MEASURED_TRIES:
            raise InfeasibleBudgetError(
                f"Inductor's compiled step measured {format_bytes(found.measured_peak_bytes)} "
                f"({found.measured_peak_bytes:,} bytes), over the budget of {format_bytes(found.budget_bytes)}, after "
                f"{partitions} partitions each solved for less; raise the budget, or compile with "
                "backend='aot_eager', whose step the model predicts exactly.",
                budget_bytes=found.budget_bytes, min_peak_bytes=found.measured_peak_bytes, least_plan=found,
            )
        log.info("inductor's step measured %s, %s over the budget: partitioning again with that margin",
                 format_bytes(found.measured_peak_bytes), format_bytes(over))
        margin = found.margin_bytes + over + over // 2  # the overshoot shrinks with the budget, not always as fast
        compiled, partitioner, found = compiled_step(margin, options)
        partitions += 1
    compiled.ckptplan_plan = found
    compiled.ckptplan_partitioner = partitioner
    compiled.ckptplan_attempts = tuple(attempts) or (found,)
    return compiled


def _compiled(
    model: nn.Module, args: tuple, kwargs: dict[str, Any], partitioner: Partitioner, backend: Backend,
    autocast: torch.dtype | None, inductor_options: dict[str, bool],
) -> nn.Module:
    """``model`` compiled with ``partitioner`` (inductor with ``inductor_options`` besides its
    defaults), run once on ``args`` and ``kwargs`` to partition its training graph."""
    if backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import select_decomp_table

        # Inductor's decompositions, its joint-graph passes and its input mutations kept in the
        # graph, so that the joint graph is the one inductor would partition; random ops as eager
        # runs them (``fallback_random``), so that dropout draws eager's masks.
        with inductor_config.patch(fallback_random=True):
            decompositions = select_decomp_table()
        backend_fn = aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=_as_inductor_partitions(partitioner),
            decompositions=decompositions, keep_inference_input_mutations=True,
        )
        compiled = torch.compile(model, backend=backend_fn, fullgraph=True)
    else:
        compiled = torch.compile(
            model, backend="inductor", fullgraph=True,
            options={"custom_partitioner_fn": _inductor_partitioner(partitioner), "fallback_random": True,
                     **inductor_options},
        )
    with _state_kept(model), torch.enable_grad(), forward_autocast(model, args, kwargs, autocast):
        try:
            compiled(*args, **kwargs)  # compiles, and partitions, the training graph
        except Exception as exc:
            if partitioner.error is not None:  # Dynamo wraps what the partitioner raised
                raise partitioner.error from None
            if "LimitHit" in type(exc).__name__:  # FailOnRecompileLimitHit (fullgraph=True)
                raise CkptPlanError(
                    f"Dynamo has compiled {type(model).__name__}'s forward as many times as "
                    f"torch._dynamo.config.{_recompile_limit_name()} allows (each compile call, and each partition "
                    "made again, compiles it once more); call torch.compiler.reset() before compiling it again."
                ) from None
            raise
    if not partitioner.plans:
        raise CkptPlanError(
            f"torch.compile ran {type(model).__name__} without a training graph to partition: "
            "does its output require grad?"
        )
    if partitioner.error is not None:
        raise partitioner.error
    return compiled


def _as_inductor_partitions(partitioner: Partitioner) -> Any:
    """``partitioner`` behind inductor's joint-graph passes (which fold transposes and drop
    clones, among others), as inductor runs them before its partitioner, so that ``aot_eager``
    partitions the joint graph inductor would: the same plan, the same fingerprint. Where torch
    has no way to put a partitioner behind them (``partitioner_fn_override``), ``partitioner``
    itself."""
    import inspect

    from torch._inductor import compile_fx

    if "partitioner_fn_override" not in inspect.signature(compile_fx.partition_fn).parameters:
        return partitioner
    return functools.partial(compile_fx.partition_fn, partitioner_fn_override=partitioner)


def _recompile_limit_name() -> str:
    """Dynamo's limit on compiles of one function (renamed in torch 2.7)."""
    from torch._dynamo import config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


@contextlib.contextmanager
def _recompiles_allowed(extra: int) -> Iterator[None]:
    """Dynamo's recompile limit raised by ``extra`` for the block."""
    from torch._dynamo import config as dynamo_config

    name = _recompile_limit_name()
    with dynamo_config.patch(**{name: getattr(dynamo_config, name) + extra}):
        yield


def _measured_peak(
    compiled: nn.Module, model: nn.Module, args: tuple, kwargs: dict[str, Any], autocast: torch.dtype | None,
    outputs_live: bool,
) -> int:
    """The peak of ``compiled``'s training step as the allocator counts it (``measure_step``),
    the second of two steps (the first compiles the backward); the model's gradients, buffers
    and the random number generators are left as they were."""
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        with _state_kept(model):
            measure_step(compiled, args, kwargs, autocast=autocast, outputs_live=outputs_live)
            return measure_step(compiled, args, kwargs, autocast=autocast, outputs_live=outputs_live).peak_bytes
    except torch.OutOfMemoryError:
        raise CkptPlanError(
            "Inductor's compiled step ran out of device memory when compile measured it; lower the budget, or "
            "compile with backend='aot_eager', whose step the model predicts exactly."
        ) from None
    finally:
        for p, grad in grads:
            p.grad = grad
