"""Target kernels: ``profile(..., target="cuda")`` records dropout as CUDA runs it.

ATen's ``dropout`` on CUDA calls ``native_dropout``, whose backward keeps a ``torch.bool`` mask
(1 byte per element); on CPU and meta it keeps its scaling noise in the input's dtype. A model
planned on the meta device for a GPU must count the former.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckptplan
from ckptplan.profiler.record import _dropout_as
from tests.conftest import assert_same_gradients

BATCH, WIDTH = 512, 64  # activations dominate: a budget of 0.9 needs checkpointing


class DropoutMLP(nn.Module):
    """Three dropouts of (BATCH, WIDTH) activations, one in-place (the unfused path everywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.drop_in_place = nn.Dropout(0.1, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.a(x)))
        h = self.drop(torch.tanh(self.b(h)))
        return self.c(self.drop_in_place(h * 2.0))  # the scaling saves nothing the in-place op would overwrite


def build(device: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    with torch.device(device):
        model = DropoutMLP().to(dtype)
        x = torch.randn(BATCH, WIDTH, dtype=dtype)
    return model, (x,)


def dropout_saved_bytes(graph: ckptplan.ComputeGraph) -> list[int]:
    """Bytes each dropout node keeps for backward beyond its inputs, in execution order."""
    dropouts = [n for n in graph.nodes if "dropout" in n.op.lower()]
    assert dropouts, "the model's dropouts are nodes"
    return [sum(graph.storages[s].nbytes for s in n.saved if graph.storages[s].kind == "hidden") for n in dropouts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("trace", ["export", "symbolic"])
def test_on_meta_a_cuda_target_keeps_one_byte_masks(dtype: torch.dtype, trace: str) -> None:
    model, args = build("meta", dtype)
    default = ckptplan.profile(model, args, trace=trace)
    cuda = ckptplan.profile(model, args, trace=trace, target="cuda")
    elements, size = BATCH * WIDTH, dtype.itemsize
    # unchanged by default: the noise in the input's dtype; in-place dropout keeps it on CUDA too
    assert default.target == "cpu" and dropout_saved_bytes(default) == [elements * size] * 3
    assert cuda.target == "cuda" and dropout_saved_bytes(cuda) == [elements, elements, elements * size]
    assert cuda.activation_bytes == default.activation_bytes - 2 * elements * (size - 1)
    # the graph is the same: same nodes, outputs and flags, only what dropout saves differs
    assert [(n.name, n.op, n.outputs, n.output_bytes, n.random) for n in cuda.nodes] == [
        (n.name, n.op, n.outputs, n.output_bytes, n.random) for n in default.nodes
    ]
    assert all(n.random for n in cuda.nodes if "dropout" in n.op.lower())
    assert cuda.fingerprint != default.fingerprint
    assert ckptplan.profile(model, args, trace=trace, target="cpu").fingerprint == default.fingerprint


def test_a_cuda_target_profiles_a_cpu_model_as_the_same_model_on_meta() -> None:
    cpu = ckptplan.profile(*build("cpu", torch.bfloat16), target="cuda")
    meta = ckptplan.profile(*build("meta", torch.bfloat16), target="cuda")
    assert cpu.nodes == meta.nodes and cpu.storages == meta.storages and cpu.fingerprint == meta.fingerprint


def test_a_cuda_target_keeps_one_byte_masks_under_autocast() -> None:
    model, args = build("cpu")
    graph = ckptplan.profile(model, args, autocast=torch.bfloat16, target="cuda")
    assert (graph.autocast, graph.target) == ("bfloat16", "cuda")
    assert dropout_saved_bytes(graph)[:2] == [BATCH * WIDTH] * 2


def test_dropout_that_runs_no_kernel_is_left_alone() -> None:
    """p = 0 returns the input itself; in eval mode the export has no dropout at all."""

    class NoDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(nn.functional.dropout(x, 0.0, training=True))

    model, args = NoDrop(), (torch.randn(BATCH, WIDTH),)
    # Kernel workspaces are measured only for the device the model is on: left out of both.
    default = ckptplan.profile(model, args, workspaces=False)
    cuda = ckptplan.profile(model, args, target="cuda")
    assert cuda.nodes == default.nodes and cuda.storages == default.storages


def test_the_cpu_path_is_atens_unfused_dropout() -> None:
    """``_dropout_as("cpu", ...)`` (what a CPU target runs on CUDA tensors) draws the same noise and
    saves the same tensors as ``aten.dropout`` on a CPU tensor; the CUDA path saves a bool mask."""
    x = torch.randn(BATCH, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    torch.manual_seed(1)
    reference = torch.ops.aten.dropout.default(x, 0.25, True)
    torch.manual_seed(1)
    emulated = _dropout_as("cpu", x, 0.25, True)
    torch.testing.assert_close(emulated, reference, rtol=0, atol=0)
    assert type(emulated.grad_fn) is type(reference.grad_fn)
    assert emulated.grad_fn._saved_other.dtype == reference.grad_fn._saved_other.dtype == torch.bfloat16
    fused = _dropout_as("cuda", x, 0.25, True)
    assert fused.grad_fn.name() == "NativeDropoutBackward0" and fused.grad_fn._saved_result1.dtype == torch.bool


def test_a_plan_made_on_meta_for_cuda_applies_to_the_model() -> None:
    meta_model, meta_args = build("meta")
    plan = ckptplan.solve(ckptplan.profile(meta_model, meta_args, target="cuda"), 0.9, solver="sqrt")
    plan = ckptplan.Plan.from_json(plan.to_json())
    assert plan.model.target == "cuda" and plan.regions
    model, args = build("cpu")
    module = ckptplan.apply(model, args, plan)  # profiled for the plan's target: same fingerprint
    assert_same_gradients(model, module, args)
    old = plan.model_copy(update={"model": plan.model.model_copy(update={"target": None})})
    with pytest.raises(ckptplan.FingerprintMismatchError):  # a plan without a target is a CPU one
        ckptplan.apply(model, args, old)


def test_checkpoint_takes_a_target() -> None:
    model, args = build("cpu")
    module = ckptplan.checkpoint(model, args, budget=0.9, solver="sqrt", target="cuda")
    assert module.ckptplan_plan.model.target == "cuda"
    assert_same_gradients(model, module, args)


def test_an_unknown_target_is_one_sentence() -> None:
    model, args = build("cpu")
    with pytest.raises(ckptplan.CkptPlanError, match=r"^target must be 'cpu', 'cuda' or None, not 'tpu'\.$"):
        ckptplan.profile(model, args, target="tpu")
