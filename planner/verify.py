"""Check a plan against reality: run real training steps of the model and of the emitted module
(or, for a compiled step's plan, of the model compiled with that partition), compare their
gradients, measure both peaks and step times."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ckptplan.errors import CkptPlanError
from ckptplan.plan import PartitionPlan, Plan
from ckptplan.planner.api import apply
from ckptplan.planner.measure import forward_autocast, measure_step
from ckptplan.profiler.loss import training_loss

GRAD_TOLERANCE = (1e-4, 1e-6)  # (rtol, atol): the emitted module runs the model's own kernels
# A compiled step runs inductor's decompositions (of layer norm, GELU, softmax), which round
# differently from eager's kernels; a different dropout mask differs by whole activations.
COMPILED_GRAD_TOLERANCE = (1e-3, 1e-4)


@dataclass(frozen=True)
class Verification:
    """``within_budget``: the emitted module's measured peak is at most the plan's budget.
    ``max_grad_error``: largest absolute difference between the two modules' gradients.
    ``original_step_seconds`` / ``emitted_step_seconds``: the medians of the timed steps, which
    ``original_step_times`` / ``emitted_step_times`` hold in the order they ran (step ``i`` of
    each one after the other, so both see the same state of the machine)."""

    device: str
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    original_peak_bytes: int
    gradients_equal: bool
    max_grad_error: float
    original_step_seconds: float
    emitted_step_seconds: float
    original_step_times: tuple[float, ...] = ()
    emitted_step_times: tuple[float, ...] = ()

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def prediction_error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def step_overhead(self) -> float:
        """The emitted module's median step time over the original's, less 1."""
        return self.emitted_step_seconds / self.original_step_seconds - 1.0

    @property
    def step_overhead_range(self) -> tuple[float, float] | None:
        """The least and the most overhead of one step over its paired original step: how far
        the timing noise reaches (``step_overhead`` lies between them). None without timed
        steps."""
        pairs = [e / o - 1.0 for o, e in zip(self.original_step_times, self.emitted_step_times, strict=True) if o > 0]
        return (min(pairs), max(pairs)) if pairs else None

    def to_dict(self) -> dict[str, Any]:
        spread = self.step_overhead_range
        return {
            **asdict(self),
            "within_budget": self.within_budget,
            "prediction_error": self.prediction_error,
            "step_overhead": self.step_overhead,
            "step_overhead_range": list(spread) if spread is not None else None,
        }


def verify(
    model: nn.Module,
    args: Any,
    plan: Plan | PartitionPlan,
    kwargs: dict[str, Any] | None = None,
    *,
    steps: int = 5,
    device: str = "cpu",
) -> Verification:
    """Apply ``plan`` to ``model`` and measure it: the step's peak as the allocator counts it
    (``measure_step``: the CPU profiler's memory events, or ``torch.cuda.max_memory_allocated``
    above what was allocated before the step), with the module's state and inputs; and
    ``steps`` training steps of each module, timed in pairs (original, then emitted), after the
    steps that measured gradients and peaks have warmed both up.

    Each step is the step the plan was made for: with ``plan.model.autocast``, forward and loss
    run under ``torch.autocast`` with that dtype on the model's device and backward outside it.
    A compiled step's plan (``PartitionPlan``) runs as ``ckptplan.compile(..., plan=plan,
    backend="aot_eager")``, whose peak the plan predicts, against the eager model; its gradients
    are compared to the rounding of inductor's decompositions (``COMPILED_GRAD_TOLERANCE``), with
    the eager model's, or under autocast (where the decompositions' half-precision rounding
    differs from eager kernels' by more) with those of the same compiled step recomputing nothing
    (``nothing_recomputed``)."""
    if steps < 1:
        raise CkptPlanError("--steps must be at least 1.")
    if device not in ("cpu", "cuda"):
        raise CkptPlanError(f"Unknown device {device!r}; use 'cpu' or 'cuda'.")
    if device == "cuda" and not torch.cuda.is_available():
        raise CkptPlanError("CUDA is not available on this machine; verify with --device cpu.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    if any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers(), *_tensors((args, kwargs)))):
        raise CkptPlanError(
            f"{type(model).__name__} is on the meta device, which holds no data to run a step on; verify runs real "
            "steps, so build the model and its inputs on cpu or cuda (plans made on meta apply there unchanged)."
        )
    if device == "cuda":
        model = model.to(device)
        args, kwargs = _to(args, device), _to(kwargs, device)
    reference = copy.deepcopy(model)
    compared = reference  # what the gradients are compared with
    if isinstance(plan, PartitionPlan):
        # Imported here: it imports inductor's configuration.
        from ckptplan.planner.compiled import compile as compile_step
        from ckptplan.planner.compiled import nothing_recomputed

        unchanged = copy.deepcopy(model) if plan.model.autocast is not None else None
        emitted = compile_step(model, args, kwargs, plan=plan, backend="aot_eager")
        if unchanged is not None:
            compared = compile_step(unchanged, args, kwargs, plan=nothing_recomputed(emitted.ckptplan_plan),
                                    backend="aot_eager")
        tolerance = COMPILED_GRAD_TOLERANCE
    else:
        emitted = apply(model, args, plan, kwargs)
        tolerance = GRAD_TOLERANCE
    step = _Step(args, kwargs, getattr(torch, plan.model.autocast) if plan.model.autocast is not None else None,
                 plan.model.outputs_live)
    grads_equal, error = _compare_gradients(compared, emitted, model, step, tolerance)
    measured = _peak(emitted, step)
    original = _peak(reference, step)
    original_times, emitted_times = _paired_step_times(reference, emitted, step, steps, device)
    return Verification(
        device=device,
        budget_bytes=plan.budget.bytes,
        predicted_peak_bytes=plan.prediction.peak_bytes,
        measured_peak_bytes=measured,
        original_peak_bytes=original,
        gradients_equal=grads_equal,
        max_grad_error=error,
        original_step_seconds=statistics.median(original_times),
        emitted_step_seconds=statistics.median(emitted_times),
        original_step_times=original_times,
        emitted_step_times=emitted_times,
    )


def _to(value: Any, device: str) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


@dataclass(frozen=True)
class _Step:
    """One training step's inputs, the autocast dtype its forward runs under (None: none), and
    whether the loop keeps the outputs through backward (``profile(..., outputs_live=...)``)."""

    args: tuple
    kwargs: dict
    autocast: torch.dtype | None
    outputs_live: bool = False

    def run(self, module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        with forward_autocast(module, self.args, self.kwargs, self.autocast):
            loss = training_loss(module(*self.args, **self.kwargs))
        loss.backward()


def _compare_gradients(
    reference: nn.Module, emitted: nn.Module, model: nn.Module, step: _Step, tolerance: tuple[float, float]
) -> tuple[bool, float]:
    for module in (reference, emitted):
        torch.manual_seed(0)  # same dropout masks in both
        step.run(module)
    equal, worst = True, 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return False, float("inf")
        if p.grad is None:
            continue
        worst = max(worst, float((p.grad - q.grad).abs().max()))
        equal = equal and torch.allclose(p.grad, q.grad, rtol=tolerance[0], atol=tolerance[1])
    return equal, worst


def _peak(module: nn.Module, step: _Step) -> int:
    """The step's peak as the allocator counts it, with the module's state and inputs."""
    return measure_step(module, step.args, step.kwargs, autocast=step.autocast,
                        outputs_live=step.outputs_live).peak_bytes


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _paired_step_times(
    reference: nn.Module, emitted: nn.Module, step: _Step, steps: int, device: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Seconds of ``steps`` steps of each module, one of each in turn, so that a slower or
    faster stretch of the machine weighs on both alike."""
    original, planned = [], []
    for _ in range(steps):
        original.append(_step_seconds(reference, step, device))
        planned.append(_step_seconds(emitted, step, device))
    return tuple(original), tuple(planned)


def _step_seconds(module: nn.Module, step: _Step, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    step.run(module)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started
