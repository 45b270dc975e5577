"""``torch.compile`` of an emitted module: one compiled training step gives the eager
original's outputs, gradients and buffers, and the plan's regions and keep-sets reach the
compiled graphs as recomputation and saved tensors.

Most tests use the ``aot_eager`` backend (dynamo and AOTAutograd with its min-cut partitioner,
ops run by eager kernels): it exercises everything the emitter controls in seconds, and its
kernels are eager's, so results must match eager exactly. Inductor is tested where a C++
compiler is available, and marked slow.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import ckptplan
from ckptplan import Region
from ckptplan.profiler.loss import training_loss
from tests import models
from tests.conftest import load_example

EXACT = {"rtol": 0.0, "atol": 0.0}
HAS_CXX = any(shutil.which(name) for name in ("g++", "c++", "clang++"))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _split(graph: ckptplan.ComputeGraph, kind: str) -> list[Region]:
    """Two top-level regions split at the allowed boundary nearest the middle; with ``kind ==
    "keep"`` the first keeps every third deterministic node that nothing modifies in place."""
    n = len(graph.nodes)
    half = min(e for e in graph.boundaries if e >= n // 2)
    keep: tuple[str, ...] = ()
    if kind == "keep":
        keep = tuple(node.name for node in graph.nodes[:half] if not node.random and not node.inplace)[1::3]
        assert keep
    return [Region(0, half, keep=keep), Region(half, n)]


def _step(module: nn.Module, args: tuple, seed: int = 7) -> tuple[torch.Tensor, object]:
    torch.manual_seed(seed)
    out = module(*args)
    loss = training_loss(out)
    loss.backward()
    return loss.detach(), out


def _assert_same_state(model: nn.Module, reference: nn.Module, **tolerance: float) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=f"gradient of {name}", **tolerance)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=f"buffer {name}", **tolerance)


def _compiled_step_equals(
    model: nn.Module, args: tuple, reference: nn.Module, regions: list[Region], backend: str, **tolerance: float
) -> None:
    """One step of ``model``'s emitted module, compiled with ``backend`` in one graph (no graph
    breaks: every region is a compiled checkpoint), against one step of ``reference``."""
    graph = ckptplan.profile(model, args)
    compiled = torch.compile(ckptplan.emit(graph, regions), backend=backend, fullgraph=True)
    ref_loss, ref_out = _step(reference, args)
    loss, out = _step(compiled, args)
    torch.testing.assert_close(loss, ref_loss, **tolerance)
    torch.testing.assert_close(out, ref_out, **tolerance)
    _assert_same_state(model, reference, **tolerance)


@pytest.mark.parametrize("plan_kind", ["sqrt", "keep"])
def test_compiled_gpt_step_equals_eager_original(plan_kind: str) -> None:
    """The small GPT (dropout included: aot_eager runs the random ops in eager's order, and the
    partitioner replays the RNG state for the dropouts backward recomputes) under a solved plan
    of plain regions and under a plan with a keep-set. Two layers: compile time grows with them."""
    torch.manual_seed(0)
    model = load_example("gpt").GPT(n_layer=2, block_size=64)
    args = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    graph = ckptplan.profile(model, args)
    if plan_kind == "sqrt":
        regions = list(ckptplan.solve(graph, 0.8, solver="sqrt").regions)
        assert regions and not any(region.keep for region in regions)
    else:
        regions = _split(graph, "keep")
    reference = copy.deepcopy(model)
    _compiled_step_equals(model, args, reference, regions, "aot_eager", **EXACT)


def test_compiled_nested_regions_equal_eager_original() -> None:
    torch.manual_seed(0)
    model, args = models.mlp(depth=6, width=32), (torch.randn(8, 32),)
    graph = ckptplan.profile(model, args)
    n = len(graph.nodes)
    regions = [Region(0, n, children=(Region(1, 4), Region(6, 9, keep=("linear_4",))))]
    _compiled_step_equals(model, args, copy.deepcopy(model), regions, "aot_eager", **EXACT)


@pytest.mark.parametrize("plan_kind", ["halves", "keep"])
def test_compiled_batchnorm_buffers_update_once(plan_kind: str) -> None:
    """Compiled, the emitter's recompute guards step aside: AOTAutograd turns BatchNorm's buffer
    updates into outputs of the forward graph, applied once; what backward recomputes only
    feeds gradients. Running statistics and ``num_batches_tracked`` equal the original's."""
    torch.manual_seed(0)
    model, args = models.ConvBN(), (torch.randn(4, 8, 8, 8),)
    graph = ckptplan.profile(model, args)
    regions = _split(graph, plan_kind)
    if plan_kind == "keep":
        assert any(graph.nodes[graph.index_of[name]].op == "aten.batch_norm.default" for name in regions[0].keep)
    _compiled_step_equals(model, args, copy.deepcopy(model), regions, "aot_eager", **EXACT)
    assert all(bn.num_batches_tracked.item() == 1 for bn in model.modules() if isinstance(bn, nn.BatchNorm2d))


@pytest.mark.parametrize("plan_kind", ["halves", "keep"])
def test_compiled_dropout_equals_eager_original_under_aot_eager(plan_kind: str) -> None:
    """Dropout after every op. With aot_eager the masks are eager's (same kernels, same order on
    the global generator) and the partitioner replays the generator's state for the dropouts
    backward recomputes, so the step equals the eager original's exactly. Inductor draws its
    own random numbers; see ``test_inductor_dropout_equals_compiled_original``."""
    torch.manual_seed(0)
    model, args = models.DropoutEverywhere(width=32, depth=3), (torch.randn(8, 32),)
    graph = ckptplan.profile(model, args)
    _compiled_step_equals(model, args, copy.deepcopy(model), _split(graph, plan_kind), "aot_eager", **EXACT)


class _GraphCapture:
    """An aot_eager-like backend that keeps the partitioned forward and backward graphs."""

    def __init__(self) -> None:
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        self.backend = aot_autograd(
            fw_compiler=self._keep("forward"),
            bw_compiler=self._keep("backward"),
            partition_fn=min_cut_rematerialization_partition,
        )

    def _keep(self, name: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            self.graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    def count(self, name: str, target: object) -> int:
        return sum(1 for node in self.graphs[name].graph.nodes if node.target is target)


@pytest.mark.parametrize(("plan_kind", "recomputed_matmuls"), [("none", 0), ("plain", 4), ("keep", 3)])
def test_compiled_graphs_recompute_the_plan(plan_kind: str, recomputed_matmuls: int) -> None:
    """The plan reaches the partitioned graphs: with one region over four Linear+tanh layers the
    backward graph recomputes all four matmuls (``addmm``; the backward's own are ``mm``); with
    ``linear_1`` kept it recomputes three, and the forward graph saves the kept one's output."""
    torch.manual_seed(0)
    model, args = models.mlp(depth=4, width=16), (torch.randn(8, 16),)
    graph = ckptplan.profile(model, args)
    n = len(graph.nodes)
    plan = {"none": [], "plain": [Region(0, n)], "keep": [Region(0, n, keep=("linear_1",))]}[plan_kind]
    capture = _GraphCapture()
    compiled = torch.compile(ckptplan.emit(graph, plan), backend=capture.backend, fullgraph=True)
    _step(compiled, args)
    assert capture.count("backward", torch.ops.aten.addmm.default) == recomputed_matmuls
    saved = [str(node) for node in capture.graphs["forward"].graph.output_node().args[0]]
    assert any(name.startswith("addmm") for name in saved) == (plan_kind == "keep")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CXX, reason="inductor on CPU needs a C++ compiler")
def test_inductor_batchnorm_keep_plan_equals_eager_original() -> None:
    """Inductor's fused kernels may round differently from eager's: float32 tolerances."""
    torch.manual_seed(0)
    model, args = models.ConvBN(), (torch.randn(4, 8, 8, 8),)
    graph = ckptplan.profile(model, args)
    _compiled_step_equals(model, args, copy.deepcopy(model), _split(graph, "keep"), "inductor")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CXX, reason="inductor on CPU needs a C++ compiler")
def test_inductor_dropout_equals_compiled_original() -> None:
    """Inductor replaces each random op by its own generator, seeded per graph from the global
    one, so its masks are not eager's and the step cannot equal the eager original's. What
    holds: the emitted module compiled equals the original compiled, from the same seed — the
    checkpointed graph draws the same numbers, and backward's recomputation reuses the
    forward's masks (a different mask would change every gradient)."""
    torch.manual_seed(0)
    model, args = models.DropoutEverywhere(width=32, depth=3), (torch.randn(8, 32),)
    graph = ckptplan.profile(model, args)
    reference = torch.compile(copy.deepcopy(model), backend="inductor", fullgraph=True)
    _compiled_step_equals(model, args, reference, _split(graph, "keep"), "inductor")
