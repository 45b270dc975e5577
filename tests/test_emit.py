"""The emitted module is a drop-in replacement: outputs, gradients, buffers, RNG, parameters,
state_dict and nn.Module behaviour equal the original's, for every kind of plan."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ckptplan
from ckptplan import Region
from ckptplan.errors import PlanFormatError
from ckptplan.profiler.loss import training_loss
from tests import models
from tests.conftest import load_example


def _regions(graph: ckptplan.ComputeGraph, kind: str) -> list[Region]:
    n = len(graph.nodes)
    edges = sorted(graph.boundaries)

    def at(k: int) -> int:  # nearest allowed region boundary at or after k
        return next(e for e in edges if e >= k)

    if kind == "none":
        return []
    half = at(n // 2)
    if kind == "halves":
        return [Region(0, half), Region(half, n)]
    if kind == "nested":
        inner = at(1)
        return [Region(0, at(n - 1), children=(Region(inner, at(inner + 1)), Region(half, at(half + 2))))]
    if kind == "keep":
        keepable = [node.name for node in graph.nodes[:half] if not node.random and not node.inplace]
        return [Region(0, half, keep=tuple(keepable[1::3])), Region(half, n)]
    raise AssertionError(kind)


def _step(module: nn.Module, args: tuple, kwargs: dict, seed: int = 7) -> tuple[torch.Tensor, object]:
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    loss = training_loss(out)
    loss.backward()
    return loss.detach(), out


def _assert_same_step(model: nn.Module, args: tuple, kwargs: dict, regions: list[Region], trace: str = "export") -> None:
    reference = copy.deepcopy(model)
    graph = ckptplan.profile(model, args, kwargs, trace=trace)
    emitted = ckptplan.emit(graph, regions)
    ref_loss, _ = _step(reference, args, kwargs)
    loss, _ = _step(emitted, args, kwargs)
    torch.testing.assert_close(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=f"gradient of {name}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=f"buffer {name}")


CASES = {
    "mlp": lambda: (models.mlp(), (torch.randn(16, 64),), {}),
    "dropout": lambda: (models.DropoutEverywhere(), (torch.randn(16, 64),), {}),
    "conv_bn": lambda: (models.ConvBN(), (torch.randn(4, 8, 8, 8),), {}),
    "inplace_views_frozen": lambda: (models.InplaceAndViews(), (torch.randn(8, 32),), {}),
    "scoped_blocks": lambda: (models.ScopedBlocks(), (torch.randn(8, 32),), {}),
    "kwargs_dataclass_tied": lambda: (
        models.KwargsAndDataclass(),
        (torch.randint(0, 50, (4, 6)),),
        {"targets": torch.randint(0, 50, (4, 6))},
    ),
}


@pytest.mark.parametrize("kind", ["none", "halves", "nested", "keep"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_step_equals_original(case: str, kind: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = CASES[case]()
    graph = ckptplan.profile(model, args, kwargs)
    _assert_same_step(model, args, kwargs, _regions(graph, kind))


@pytest.mark.parametrize("case", ["mlp", "dropout", "conv_bn"])
def test_symbolic_trace_emits_equal_step(case: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = CASES[case]()
    graph = ckptplan.profile(model, args, kwargs, trace="symbolic")
    _assert_same_step(model, args, kwargs, _regions(graph, "halves"), trace="symbolic")


SMALL_SHAPES = {"gpt": {"batch": 4, "seq": 64}, "resnet": {"batch": 4, "size": 32}, "unet": {"batch": 2, "size": 64}}


def test_examples_equal_under_solved_plan(example_name: str) -> None:
    model, args = load_example(example_name).build(**SMALL_SHAPES[example_name])
    graph = ckptplan.profile(model, args)
    plan = ckptplan.solve(graph, 0.8, solver="sqrt")
    assert plan.regions, "an 80% budget should need checkpointing"
    _assert_same_step(model, args, {}, list(plan.regions))


def test_batchnorm_updates_once_per_step() -> None:
    torch.manual_seed(0)
    model = models.ConvBN()
    args = (torch.randn(4, 8, 8, 8),)
    graph = ckptplan.profile(model, args)
    emitted = ckptplan.emit(graph, [Region(0, len(graph.nodes) - 2)])
    bn = model.blocks[0][1]
    before = bn.num_batches_tracked.item()
    training_loss(emitted(*args)).backward()
    assert bn.num_batches_tracked.item() == before + 1


def test_profiling_leaves_model_state_untouched() -> None:
    torch.manual_seed(0)
    model = models.ConvBN()
    state = copy.deepcopy(model.state_dict())
    model.eval()
    ckptplan.profile(model, (torch.randn(4, 8, 8, 8),))
    assert not model.training, "profile must restore the model's mode"
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_emitted_module_shares_parameters_and_state_dict() -> None:
    torch.manual_seed(0)
    model, args, kwargs = CASES["kwargs_dataclass_tied"]()
    graph = ckptplan.profile(model, args, kwargs)
    emitted = ckptplan.emit(graph, _regions(graph, "halves"))
    assert isinstance(emitted, torch.fx.GraphModule)
    assert [id(p) for p in emitted.parameters()] == [id(p) for p in model.parameters()]
    assert list(emitted.state_dict()) == list(model.state_dict())
    optimizer = torch.optim.SGD(emitted.parameters(), lr=0.1)
    before = model.mix.weight.detach().clone()
    training_loss(emitted(*args, **kwargs)).backward()
    optimizer.step()
    assert not torch.equal(model.mix.weight, before), "optimizer on the emitted module must move the model"
    other = models.KwargsAndDataclass()
    emitted.load_state_dict(other.state_dict())
    torch.testing.assert_close(model.mix.weight, other.mix.weight)


def test_non_persistent_buffers_stay_out_of_state_dict() -> None:
    model, args, kwargs = CASES["inplace_views_frozen"]()
    graph = ckptplan.profile(model, args, kwargs)
    emitted = ckptplan.emit(graph, _regions(graph, "halves"))
    assert "scale" not in emitted.state_dict()
    assert list(emitted.state_dict()) == list(model.state_dict())


def test_eval_mode_and_to_follow_the_model() -> None:
    torch.manual_seed(0)
    model, args, kwargs = CASES["dropout"]()
    graph = ckptplan.profile(model, args, kwargs)
    emitted = ckptplan.emit(graph, _regions(graph, "halves"))
    emitted.eval()
    assert not model.layers[0].training
    with torch.no_grad():
        torch.testing.assert_close(emitted(*args), model.eval()(*args))
    emitted.train()
    emitted.to(torch.float64)
    assert model.layers[0].weight.dtype == torch.float64
    out = emitted(args[0].double())
    assert out.dtype == torch.float64


def test_dataclass_output_and_kwargs_preserved() -> None:
    model, args, kwargs = CASES["kwargs_dataclass_tied"]()
    graph = ckptplan.profile(model, args, kwargs)
    out = ckptplan.emit(graph, _regions(graph, "nested"))(*args, **kwargs)
    assert isinstance(out, models.Output)
    assert out.loss.ndim == 0


def test_emit_rejects_bad_regions() -> None:
    model, args, kwargs = CASES["mlp"]()
    graph = ckptplan.profile(model, args, kwargs)
    n = len(graph.nodes)
    with pytest.raises(PlanFormatError):
        ckptplan.emit(graph, [Region(0, n + 1)])
    with pytest.raises(PlanFormatError):
        ckptplan.emit(graph, [Region(0, 3, keep=("no_such_node",))])


def test_checkpoint_one_call_and_apply_refuses_foreign_plan() -> None:
    torch.manual_seed(0)
    model = models.mlp(depth=12)
    args = (torch.randn(512, 64),)
    module = ckptplan.checkpoint(model, args, budget=0.7, solver="sqrt")
    plan = module.ckptplan_plan
    assert plan.prediction.peak_bytes <= plan.budget.bytes
    applied = ckptplan.apply(model, args, plan)
    assert applied.ckptplan_plan == plan
    with pytest.raises(ckptplan.FingerprintMismatchError):
        ckptplan.apply(model, (torch.randn(128, 64),), plan)
    with pytest.raises(ckptplan.FingerprintMismatchError):
        ckptplan.apply(models.mlp(depth=11), args, plan)


def test_a_recompute_stopping_inside_a_kept_node_leaves_the_next_step_alone() -> None:
    # Early stop fires at the region's last saved tensor: here the kept linear's input, packed
    # inside the kept node. The next step (and any other emitted module) must still save only
    # the kept node, so every step's measured peak is the predicted one.
    torch.manual_seed(0)
    model = models.mlp(depth=6, width=256)
    args = (torch.randn(512, 256),)
    graph = ckptplan.profile(model, args)
    kept = graph.nodes[2]
    assert kept.op == "aten.linear.default"
    plan = ckptplan.make_plan(graph, [Region(0, 3, keep=(kept.name,))])
    emitted = ckptplan.emit(graph, plan)
    peaks = [ckptplan.measure_step(emitted, args).peak_bytes for _ in range(3)]
    assert peaks == [peaks[0]] * 3
    assert abs(peaks[0] - plan.prediction.peak_bytes) <= 64

