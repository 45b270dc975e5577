"""``ckptplan.compile``: the compiled step's partition is ckptplan's, its memory model is the
partitioned graphs' as they run, and its gradients are eager's."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
import torch
from torch import nn

import ckptplan
from ckptplan.errors import CkptPlanError, InfeasibleBudgetError
from ckptplan.joint import JointGraph, JointValue
from ckptplan.partition import simulate_partition
from ckptplan.profiler.loss import training_loss
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.partition import no_recompute, solve_partition
from tests import models
from tests.conftest import bits

# The tests that compile with inductor run in one pytest-xdist worker (``--dist loadgroup`` in
# pyproject.toml), which pays inductor's first compile (its C++ toolchain checks and headers) once.
INDUCTOR = pytest.mark.xdist_group("inductor")


def _mlp(dropout: float = 0.0, blocks: int = 4) -> nn.Module:
    """``models.norm_mlp``; two blocks where a test needs no more (each compile traces them all)."""
    return models.norm_mlp(dropout, blocks=blocks)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _measured(module: nn.Module, x: torch.Tensor) -> int:
    ckptplan.measure_step(module, (x,), outputs_live=False)
    return ckptplan.measure_step(module, (x,), outputs_live=False).peak_bytes


def _assert_trains_as_eager(compiled: nn.Module, model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """One seeded step of ``compiled`` (of ``model``) and of ``reference`` (an eager copy): the
    same gradients. Inductor's decompositions (of layer norm and GELU) round differently from
    eager's kernels; a different dropout mask would differ by whole activations (about 10 here)."""
    for module in (compiled, reference):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        training_loss(module(x)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)


def test_the_compiled_step_peaks_as_the_partition_model_says() -> None:
    """Under aot_eager the prediction is the allocator's count to the byte, and a lower budget
    recomputes more and measures less."""
    x = torch.randn(1024, 64)
    peaks = []
    for budget in (1.0, 0.8, 0.65):
        torch._dynamo.reset()
        compiled = ckptplan.compile(_mlp(), (x,), budget=budget, backend="aot_eager", outputs_live=False,
                                    solver="greedy")
        plan = compiled.ckptplan_plan
        assert plan.peak_bytes <= plan.budget_bytes
        assert bool(plan.recomputed) == (budget < 1.0)
        peaks.append(_measured(compiled, x))
        assert peaks[-1] == plan.peak_bytes
    assert peaks[0] > peaks[1] > peaks[2]


class _MeanSquare(nn.Module):
    """The model's output is its loss, a scalar; a buffer the step never reads."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("unread", torch.zeros(1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).pow(2).mean()


@pytest.mark.parametrize("scalar", [False, True])
def test_what_the_caller_holds_through_the_backward_is_in_the_prediction(scalar: bool) -> None:
    """The loss the caller calls backward() on and the seed backward() makes for it live through
    the backward (a scalar output is the loss itself), and state the step never reads is
    resident all along: at a budget whose peak is in the backward the prediction is the
    allocator's count to the byte. The greedy search alone runs until it is done, so the plan (and
    where it peaks) is the same on every run; the exact model's least recomputation may tie
    between partitions that peak in the forward and in the backward."""
    model, x = (_MeanSquare(_mlp()) if scalar else _mlp()), torch.randn(1024, 64)
    compiled = ckptplan.compile(model, (x,), budget=0.65, backend="aot_eager", outputs_live=False, solver="greedy")
    plan = compiled.ckptplan_plan
    assert plan.report.peak_in_backward
    assert (plan.graph.caller_held != (), plan.graph.caller_bytes) == ((True, 0) if scalar else (False, 8))
    assert plan.graph.unread_bytes == (4000 if scalar else 0)
    assert _measured(compiled, x) == plan.peak_bytes


def test_outputs_the_loop_holds_count_through_the_backward() -> None:
    """A loop that keeps ``out`` holds the forward's output through the backward, though the
    backward never reads it: the prediction counts it there, and is the allocator's count."""
    model, x = _mlp(blocks=2), torch.randn(1024, 64)
    compiled = ckptplan.compile(model, (x,), budget=0.8, backend="aot_eager", solver="greedy")
    plan = compiled.ckptplan_plan
    dropped = simulate_partition(dataclasses.replace(plan.graph, outputs_live=False), plan.report.saved)
    assert plan.report.backward_peak_bytes - dropped.backward_peak_bytes == x.numel() * 4
    ckptplan.measure_step(compiled, (x,))
    measured = ckptplan.measure_step(compiled, (x,)).peak_bytes
    assert measured == plan.peak_bytes


def test_convolution_workspaces_are_in_the_compiled_prediction() -> None:
    """The partitioner runs each op of the joint graph once for real to measure its kernel's
    workspace (a CPU convolution unfolds its input): with them, the prediction is the
    allocator's count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 16, 3, padding=1), nn.SiLU(),
                          nn.Conv2d(16, 8, 3, padding=1))
    x = torch.randn(8, 3, 32, 32)
    for budget in (1.0, 0.8):
        torch._dynamo.reset()
        compiled = ckptplan.compile(model, (x,), budget=budget, backend="aot_eager", outputs_live=False)
        plan = compiled.ckptplan_plan
        assert any(v.workspace_bytes for v in plan.graph.values if "convolution" in v.op)
        assert _measured(compiled, x) == plan.peak_bytes


def test_pytorch_s_partitions_of_the_replaying_step_are_asked_for_only_where_a_dropout_replays(monkeypatch) -> None:
    """The search starts from PyTorch's min-cut partitions of the step, and, where a dropout was
    made replayable, of the step whose backward may replay it too; without a dropout the two
    steps are one graph, whose partitions are made once."""
    from ckptplan.planner import compiled as compiled_module

    calls = []
    real = compiled_module._min_cut_starts

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compiled_module, "_min_cut_starts", counted)
    x = torch.randn(128, 64)
    for dropout, asked in ((0.0, 1), (0.1, 2)):
        calls.clear()
        torch._dynamo.reset()
        partitioner = ckptplan.compile(_mlp(dropout, blocks=2), (x,), budget=0.8, backend="aot_eager",
                                       solver="greedy").ckptplan_partitioner
        assert len(calls) == asked and partitioner.starts


def test_gradients_equal_eager_with_dropout() -> None:
    """Dropout masks are drawn as eager draws them and saved or replayed from the generator's
    saved state, never drawn anew: the compiled step's gradients are eager's for the same
    random stream."""
    model, x = _mlp(dropout=0.2, blocks=2), torch.randn(256, 64)
    reference = copy.deepcopy(model)
    compiled = ckptplan.compile(model, (x,), budget=0.8, backend="aot_eager", outputs_live=False)
    assert compiled.ckptplan_plan.recomputed
    random = [v for v in compiled.ckptplan_plan.graph.values if not v.recomputable and v.phase == "forward"]
    assert random and not {v.name for v in random} & set(compiled.ckptplan_plan.recomputed)
    _assert_trains_as_eager(compiled, model, reference, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_backward_makes_a_dropout_s_output_from_its_mask_bit_for_bit(monkeypatch, dtype: torch.dtype) -> None:
    """The backward's twin of a dropout's output, made from the mask (``dropout_from_masks``),
    has the bits of the kernel's output in every dtype: the joint graph run on real tensors
    computes both from the one draw. (A partition that saves the masked input instead of the
    output must train as the one that saves the output.)"""
    from torch import fx
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ckptplan.planner import compiled as compiled_module
    from ckptplan.profiler import joint as joint_module

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def checked(joint: fx.GraphModule) -> int:
        rewritten = joint_module.dropout_from_masks(joint)
        values: dict[str, torch.Tensor] = {}

        class Recorder(fx.Interpreter):
            def run_node(self, node: fx.Node) -> object:
                values[node.name] = super().run_node(node)
                return values[node.name]

        def real(node: fx.Node) -> torch.Tensor:
            fake = node.meta["val"]
            return torch.randn(fake.shape, dtype=fake.dtype) if fake.is_floating_point() else torch.zeros(
                fake.shape, dtype=fake.dtype)

        with unset_fake_temporarily():  # the partitioner runs under AOTAutograd's fake mode
            torch.manual_seed(3)
            Recorder(joint).run(*[real(n) for n in joint.graph.find_nodes(op="placeholder")])
        for node in joint.graph.nodes:
            twin_of = node.meta.get(joint_module._REPLAYS)
            if twin_of is not None and node.target is torch.ops.aten.mul.Tensor:
                pairs.append((values[node.name], values[twin_of]))
        return rewritten

    monkeypatch.setattr(compiled_module, "dropout_from_masks", checked)
    model, x = _mlp(dropout=0.1).to(dtype), torch.randn(128, 64, dtype=dtype)
    ckptplan.compile(model, (x,), budget=1.0, backend="aot_eager", solver="greedy", outputs_live=False)
    assert len(pairs) == 4
    for twin, output in pairs:
        assert torch.equal(bits(twin), bits(output))


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_mask_scale_gives_native_dropout_s_output_from_its_mask(device: str, dtype: torch.dtype) -> None:
    """``input * mask * mask_scale(p, ...)`` is ``native_dropout``'s output on the device, bit for
    bit, at probabilities whose scale rounds up, down or not at all, on strided inputs too."""
    from ckptplan.profiler.joint import mask_scale

    for p in (0.1, 1 / 3, 0.37, 0.77, 0.013):
        for x in (torch.randn(64, 257, dtype=dtype, device=device), torch.randn(96, 33, dtype=dtype, device=device).t()):
            output, mask = torch.ops.aten.native_dropout.default(x, p, True)
            again = x * mask * mask_scale(p, dtype, x.device)
            assert torch.equal(bits(again), bits(output)), (p, x.shape)


def _replayed(plan) -> list[str]:
    return [name for name in plan.recomputed if plan.graph.values[plan.graph.index_of(name)].replay]


def _step_and_generator(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    training_loss(module(x)).backward()
    return torch.get_rng_state()


@INDUCTOR
def test_a_replayed_dropout_mask_is_eager_s_and_the_generator_ends_as_eager_s() -> None:
    """Below the least peak that saving every dropout mask reaches (about 0.61 of the peak here),
    the backward draws masks again from the generator state the forward saved: the gradients
    are eager's, the generator ends where eager's does (the replay restores it), and the step
    peaks as predicted."""
    model, x = models.DropoutEverywhere(), torch.randn(512, 64)
    reference = copy.deepcopy(model)
    compiled = ckptplan.compile(model, (x,), budget=0.6, backend="aot_eager", outputs_live=False, solver="greedy")
    plan = compiled.ckptplan_plan
    assert _replayed(plan) and plan.peak_bytes <= plan.budget_bytes
    assert plan.to_plan().prediction.replayed_masks == sum(n.startswith("run_with_rng_state") for n in _replayed(plan))
    assert _measured(compiled, x) == plan.peak_bytes
    assert torch.equal(_step_and_generator(compiled, x), _step_and_generator(reference, x))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)
    # Inductor runs the same partition (its step measures more than the model: budget doubled).
    torch._dynamo.reset()
    inductor = ckptplan.compile(model, (x,), budget=2 * plan.budget_bytes, backend="inductor",
                                plan=compiled.ckptplan_plan.to_plan())
    assert _replayed(inductor.ckptplan_plan) == _replayed(plan)
    assert torch.equal(_step_and_generator(inductor, x), _step_and_generator(reference, x))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)


def test_the_backward_computes_again_what_follows_a_dropout_from_the_replayed_draws() -> None:
    """A residual stream and the projections after a dropout are computed from its draws: the
    backward computes them again from twins that read the replays (a projection of the next
    block among them), and the step still trains as eager's, generator included."""
    model, x = models.ResidualDropout(), torch.randn(512, 64)
    reference = copy.deepcopy(model)
    compiled = ckptplan.compile(model, (x,), budget=0.5, backend="aot_eager", outputs_live=False, solver="greedy")
    plan = compiled.ckptplan_plan
    graph = plan.graph
    again = [graph.index_of(name) for name in plan.recomputed]
    after = {graph.values[graph.drawn_for[i]].op for i in again if i in graph.drawn_for}
    assert "aten.addmm.default" in after and plan.peak_bytes <= plan.budget_bytes
    assert _measured(compiled, x) == plan.peak_bytes
    assert torch.equal(_step_and_generator(compiled, x), _step_and_generator(reference, x))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)


def test_a_view_holds_its_base_s_storage_in_the_backward_too() -> None:
    """Some backward views (the ``permute`` of a gradient before its weight's ``mm``) reach the
    partitioner with fake values of their own storage; the model still counts a view as its
    base's storage, as the step runs it, so a step peaking in the backward is not overcounted."""
    model, x = models.ResidualDropout(), torch.randn(512, 64)
    compiled = ckptplan.compile(model, (x,), budget=1.0, backend="aot_eager", outputs_live=False, solver="greedy")
    graph = compiled.ckptplan_plan.graph
    views = [v for v in graph.values if v.op in ("aten.permute.default", "aten.view.default", "aten.t.default")]
    assert any(v.phase == "backward" for v in views)
    for v in views:
        assert v.storages == graph.values[v.inputs[0]].storages, v.name


def test_a_budget_below_the_least_peak_says_so() -> None:
    x = torch.randn(1024, 64)
    with pytest.raises(InfeasibleBudgetError) as caught:
        ckptplan.compile(_mlp(blocks=2), (x,), budget=0.05, backend="aot_eager", time_limit=2)
    assert caught.value.min_peak_bytes > caught.value.budget_bytes
    with pytest.raises(CkptPlanError, match="backend"):
        ckptplan.compile(_mlp(), (x,), budget=0.5, backend="eager")


def test_the_solver_only_returns_what_the_model_checks() -> None:
    """Each returned partition is the model's own report of it, within budget when feasible,
    and recomputes nothing at the no-recompute peak."""
    model, x = _mlp(blocks=2), torch.randn(128, 64)
    compiled = ckptplan.compile(model, (x,), budget=1.0, backend="aot_eager")
    graph = compiled.ckptplan_plan.graph
    baseline = simulate_partition(graph, no_recompute(graph)).peak_bytes
    for fraction in (1.0, 0.8, 0.6, 0.4):
        found = solve_partition(graph, int(fraction * baseline))
        assert simulate_partition(graph, found.saved) == found.report
        assert found.feasible == (found.report.peak_bytes <= int(fraction * baseline))
    assert not solve_partition(graph, baseline).report.recomputed


def test_the_greedy_search_ends_by_the_deadline_with_the_partition_it_has() -> None:
    """With its context's deadline passed, the greedy search makes no move: it returns the
    partition it starts from (saving what the backward reads), the model's report of it; without
    a context it runs until it is done."""
    model, x = _mlp(), torch.randn(128, 64)
    graph = ckptplan.compile(model, (x,), budget=1.0, backend="aot_eager").ckptplan_plan.graph
    budget = int(0.6 * simulate_partition(graph, no_recompute(graph)).peak_bytes)
    stopped = solve_partition(graph, budget, ctx=SolveContext.limited(0.0))
    assert stopped.saved == no_recompute(graph) and stopped.report == simulate_partition(graph, stopped.saved)
    finished = solve_partition(graph, budget)
    assert finished.report.peak_bytes < stopped.report.peak_bytes


def test_ctrl_c_during_the_greedy_search_keeps_the_partition_so_far(monkeypatch) -> None:
    """A Ctrl-C that lands in one of its trial partitions sets the context's cancel flag, and the
    search returns the last partition it had made, the model's report of it."""
    from ckptplan.solvers import partition as greedy

    model, x = _mlp(), torch.randn(128, 64)
    graph = ckptplan.compile(model, (x,), budget=1.0, backend="aot_eager").ckptplan_plan.graph
    budget = int(0.6 * simulate_partition(graph, no_recompute(graph)).peak_bytes)
    calls = []

    def pressed(g, saved, *args, **kwargs):
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return simulate_partition(g, saved, *args, **kwargs)

    monkeypatch.setattr(greedy, "simulate_partition", pressed)
    ctx = SolveContext.limited(60.0)
    found = solve_partition(graph, budget, ctx=ctx)
    assert ctx.cancelled and len(calls) == 20
    assert found.report == simulate_partition(graph, found.saved)
    with pytest.raises(KeyboardInterrupt):  # without a context, Ctrl-C is the caller's
        calls.clear()
        solve_partition(graph, budget)


def _chain() -> JointGraph:
    """x → a → b → out (4 bytes each but a: 8); backward: t → gb(b, t) → ga(a, gb) = dx."""
    v = [
        JointValue(0, "x", "placeholder", "primal", storages=(0,)),
        JointValue(1, "a", "f", "forward", inputs=(0,), storages=(1,), cost=2.0),
        JointValue(2, "b", "f", "forward", inputs=(1,), storages=(2,), cost=1.0),
        JointValue(3, "out", "f", "forward", inputs=(2,), storages=(3,), cost=1.0),
        JointValue(4, "t", "placeholder", "tangent", storages=(4,)),
        JointValue(5, "gb", "g", "backward", inputs=(2, 4), storages=(5,)),
        JointValue(6, "ga", "g", "backward", inputs=(1, 5), storages=(6,)),
    ]
    return JointGraph("chain", tuple(v), (4, 8, 4, 4, 4, 4, 4), forward_outputs=(3,), backward_outputs=(6,),
                      outputs_live=False)


def test_the_partition_model_on_a_chain_by_hand() -> None:
    graph = _chain()
    everything = simulate_partition(graph, {1, 2})
    # forward: a(8) + b(4) + out(4) at out; backward: a, b, t, gb at gb = 8 + 4 + 4 + 4 = 20
    assert (everything.forward_peak_bytes, everything.backward_peak_bytes) == (4 + 16, 4 + 20)
    assert everything.recomputed == () and everything.backward_order == (5, 6)
    # Saving b only: the backward computes a again after gb, from x.
    b_only = simulate_partition(graph, {2})
    assert b_only.recomputed == (1,) and b_only.recompute_seconds == 2.0
    assert b_only.backward_order == (5, 1, 6)
    assert b_only.backward_peak_bytes == 4 + 4 + 8 + 4  # gb, a, ga (b and t freed after gb)
    # A value the backward never reads is not saved.
    assert simulate_partition(graph, {1, 2, 3}).saved == (1, 2)
    with pytest.raises(CkptPlanError):
        simulate_partition(graph, {5})
    random = dataclasses.replace(graph, values=tuple(
        dataclasses.replace(v, recomputable=False) if v.name == "a" else v for v in graph.values))
    with pytest.raises(CkptPlanError, match="cannot compute again"):
        simulate_partition(random, {2})
    assert no_recompute(random) == frozenset({1, 2})


@INDUCTOR
def test_the_inductor_backend_takes_the_partition(monkeypatch) -> None:
    """Inductor compiles the graphs ckptplan cut; its kernels hold other buffers than the model
    counts, so ``compile`` measures the step, and leaves no gradients behind."""
    model, x = _mlp(0.1, blocks=2), torch.randn(256, 64)
    reference = copy.deepcopy(model)
    compiled = ckptplan.compile(model, (x,), budget=0.8, backend="inductor", solver="greedy")
    plan = compiled.ckptplan_plan
    assert plan.recomputed
    assert all(p.grad is None for p in model.parameters())  # compile measured the step, and left no gradients
    assert plan.measured_peak_bytes <= plan.budget_bytes
    # The CPU allocator's count of this step varies between runs by up to one 64-KiB block.
    assert abs(plan.measured_peak_bytes - _measured(compiled, x)) <= 64 * 1024
    _assert_trains_as_eager(compiled, model, reference, x)
    # aot_eager partitions the same joint graph (after inductor's joint-graph passes): its plan
    # applies under inductor, where it is measured too, and refused over its budget (faked here).
    from ckptplan.planner import compiled as compiled_module

    eager = ckptplan.compile(model, (x,), budget=0.8, backend="aot_eager", solver="greedy").ckptplan_plan
    assert eager.graph.fingerprint == plan.graph.fingerprint
    monkeypatch.setattr(compiled_module, "_measured_peak", lambda *args: eager.budget_bytes + 1)
    with pytest.raises(InfeasibleBudgetError, match="with the plan's partition measured .* over the budget"):
        ckptplan.compile(model, (x,), backend="inductor", plan=eager.to_plan())


def test_an_inductor_step_measured_over_the_budget_is_compiled_as_modelled_then_partitioned_again(monkeypatch) -> None:
    """Inductor's kernels may hold more than the model counts (a layout change, kernels
    reordered, a buffer kept for a later kernel): a step measured over the budget is compiled
    again with the same partition under the settings the model counts, then, still over,
    partitioned again for the budget less 1.5 times the overshoot, until one fits or the tries
    run out; the settings it ran with go into the plan file, and a plan compiles with them."""
    from ckptplan.planner import compiled as compiled_module

    calls, readings, overshoots = [], [], []
    real_compiled, real_measured = compiled_module._compiled, compiled_module._measured_peak
    # The graphs run eagerly (aot_eager partitions the joint graph inductor would): what is under
    # test is which partition and settings each attempt gets; inductor's own step is measured in
    # test_the_inductor_backend_takes_the_partition.

    def compiled(model, args, kwargs, partitioner, backend, autocast, options):
        calls.append((partitioner, options, partitioner.follow))
        return real_compiled(model, args, kwargs, partitioner, "aot_eager", autocast, options)

    def measured(*args):
        peak = real_measured(*args)
        if overshoots:  # the step reads that many bytes over the budget
            peak = calls[-1][0].plans[-1].budget_bytes + overshoots.pop(0)
        readings.append(peak)
        return peak

    monkeypatch.setattr(compiled_module, "_compiled", compiled)
    monkeypatch.setattr(compiled_module, "_measured_peak", measured)
    model, x = _mlp(blocks=2), torch.randn(1024, 64)
    modelled = dict(compiled_module.MODELLED_INDUCTOR)
    assert modelled == {"reorder_for_peak_memory": False, "layout_optimization": False}
    torch.compile(nn.Identity(), backend="inductor", options=modelled)  # inductor knows both settings

    # Over by 4 KiB under inductor's defaults; the same partition under the modelled settings fits.
    overshoots[:] = [4096]
    module = ckptplan.compile(model, (x,), budget=0.8, backend="inductor", solver="greedy")
    plan = module.ckptplan_plan
    assert [options for _, options, _ in calls] == [{}, modelled]
    assert calls[1][2].saved == calls[0][0].plans[-1].saved  # the same partition
    assert module.ckptplan_partitioner is calls[1][0] and module.ckptplan_partitioner.follow is None  # other shapes solve
    assert plan.margin_bytes == 0 and plan.inductor_options == modelled and plan.asked == "greedy"
    assert plan.measured_peak_bytes == readings[-1] <= plan.budget_bytes
    written = plan.to_plan()
    assert written.inductor_options == {"layout_optimization": False, "reorder_for_peak_memory": False}
    assert '"inductor_options"' in written.to_json()
    assert '"inductor_options"' not in plan.to_plan().model_copy(update={"inductor_options": {}}).to_json()
    # aot_eager runs a plan's graphs eagerly: no inductor settings apply, none are recorded.
    calls.clear()
    torch._dynamo.reset()
    eager = ckptplan.compile(model, (x,), backend="aot_eager", plan=written).ckptplan_plan
    assert [options for _, options, _ in calls] == [{}] and eager.inductor_options == {}

    # Over under both (less under the modelled settings): partitioned again for 1.5 times that less,
    # compiled with the settings that measured less.
    calls.clear()
    readings.clear()
    torch._dynamo.reset()
    overshoots[:] = [4096, 2048]
    module = ckptplan.compile(model, (x,), budget=0.8, backend="inductor", solver="greedy")
    plan = module.ckptplan_plan
    assert [options for _, options, _ in calls] == [{}, modelled, modelled]
    assert plan.margin_bytes == 3072 and plan.report.peak_bytes <= plan.budget_bytes - 3072
    assert [a.measured_peak_bytes for a in module.ckptplan_attempts] == readings
    assert [a.inductor_options for a in module.ckptplan_attempts] == [{}, modelled, modelled]

    # Over under both, more under the modelled settings: partitioned again under inductor's defaults.
    calls.clear()
    readings.clear()
    torch._dynamo.reset()
    overshoots[:] = [2048, 4096]
    module = ckptplan.compile(model, (x,), budget=0.8, backend="inductor", solver="greedy")
    assert [options for _, options, _ in calls] == [{}, modelled, {}]
    assert module.ckptplan_plan.margin_bytes == 3072 and module.ckptplan_plan.inductor_options == {}
    assert '"inductor_options"' not in module.ckptplan_plan.to_plan().to_json()

    # A plan file compiles with the settings it records.
    calls.clear()
    readings.clear()
    torch._dynamo.reset()
    ckptplan.compile(model, (x,), backend="inductor", plan=plan.to_plan())
    assert [options for _, options, _ in calls] == [modelled]
    # ... and over its budget there it raises at once (the modelled settings were its own).
    calls.clear()
    overshoots[:] = [4096]
    with pytest.raises(InfeasibleBudgetError, match="with the plan's partition measured"):
        ckptplan.compile(model, (x,), backend="inductor", plan=plan.to_plan())
    assert [options for _, options, _ in calls] == [modelled]

    monkeypatch.setattr(compiled_module, "_measured_peak", lambda *args: 10**12)
    with pytest.raises(InfeasibleBudgetError, match="by which inductor's step measured above"):
        ckptplan.compile(model, (x,), budget=0.8, backend="inductor", solver="greedy")


def test_an_inductor_step_out_of_memory_when_measured_says_so_and_keeps_the_gradients(monkeypatch) -> None:
    from ckptplan.planner import compiled as compiled_module

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    model, x = _mlp(blocks=2), torch.randn(256, 64)
    training_loss(model(x)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    monkeypatch.setattr(compiled_module, "measure_step", out_of_memory)
    with pytest.raises(CkptPlanError, match="ran out of device memory when compile measured it; lower the budget"):
        ckptplan.compile(model, (x,), budget=0.8, backend="inductor", solver="greedy")
    for p, grad in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, grad)


@INDUCTOR
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor on CPU needs a C++ compiler")
def test_inductor_writes_batch_norm_statistics_once_and_the_model_runs_the_writes() -> None:
    """Inductor's joint graph writes the running statistics with ``copy_``, which nothing reads:
    the forward runs them (``JointGraph.effects``) whatever it saves, as the graphs PyTorch cuts
    do. Compiling leaves the statistics as they were; one step then updates them once."""
    torch.manual_seed(0)
    model, x = models.ConvBN(), torch.randn(8, 8, 16, 16)
    reference = copy.deepcopy(model)
    compiled = ckptplan.compile(model, (x,), budget=0.9, backend="inductor", solver="greedy")
    graph = compiled.ckptplan_plan.graph
    assert graph.effects and all(graph.values[i].op == "aten.copy_.default" for i in graph.effects)
    for b, r in zip(model.buffers(), reference.buffers(), strict=True):
        assert torch.equal(b, r)  # compiling is not a training step
    _assert_trains_as_eager(compiled, model, reference, x)
    for b, r in zip(model.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, r, atol=1e-4, rtol=1e-3)
    assert all(bn.num_batches_tracked.item() == 1 for bn in model.modules() if isinstance(bn, nn.BatchNorm2d))


def test_a_transformers_model_compiles_whole_and_measures_as_predicted() -> None:
    """A ``transformers`` model would log its loss-function warning inside the graph; compile
    picks the loss first, so the model compiles whole."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, n_positions=64, vocab_size=100, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    model, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 100, (4, 32))
    compiled = ckptplan.compile(model, (ids,), {"labels": ids}, budget=0.8, backend="aot_eager", outputs_live=False,
                                solver="greedy")
    ckptplan.measure_step(compiled, (ids,), {"labels": ids}, outputs_live=False)
    measured = ckptplan.measure_step(compiled, (ids,), {"labels": ids}, outputs_live=False).peak_bytes
    assert measured == compiled.ckptplan_plan.peak_bytes
    assert compiled.ckptplan_plan.peak_bytes <= compiled.ckptplan_plan.budget_bytes


def test_a_bfloat16_step_measures_as_predicted() -> None:
    """Weights and activations in bfloat16: the joint graph's bytes are bfloat16's, and the
    prediction is the allocator's count."""
    model, x = _mlp(dropout=0.1, blocks=2).to(torch.bfloat16), torch.randn(1024, 64, dtype=torch.bfloat16)
    compiled = ckptplan.compile(model, (x,), budget=0.7, backend="aot_eager", outputs_live=False, solver="greedy")
    plan = compiled.ckptplan_plan
    assert plan.recomputed and plan.peak_bytes <= plan.budget_bytes
    assert _measured(compiled, x) == plan.peak_bytes


def test_an_autocast_step_measures_as_predicted_and_trains_as_the_step_recomputing_nothing() -> None:
    """Forward and loss under bfloat16 autocast: the joint graph is the mixed-precision one, the
    plan says so, the prediction is the allocator's count, and recomputing leaves the gradients
    exactly those of the same compiled step saving everything."""
    from ckptplan.planner.compiled import nothing_recomputed

    torch.manual_seed(0)
    model, x = _mlp(dropout=0.1, blocks=2), torch.randn(1024, 64)
    unchanged = copy.deepcopy(model)
    compiled = ckptplan.compile(model, (x,), budget=0.7, backend="aot_eager", outputs_live=False, solver="greedy",
                                autocast=torch.bfloat16)
    plan = compiled.ckptplan_plan
    assert plan.autocast == plan.to_plan().model.autocast == "bfloat16"
    assert plan.recomputed and plan.peak_bytes <= plan.budget_bytes
    ckptplan.measure_step(compiled, (x,), outputs_live=False, autocast=torch.bfloat16)
    measured = ckptplan.measure_step(compiled, (x,), outputs_live=False, autocast=torch.bfloat16).peak_bytes
    assert measured == plan.peak_bytes
    saving = ckptplan.compile(unchanged, (x,), backend="aot_eager", plan=nothing_recomputed(plan))
    assert not saving.ckptplan_plan.recomputed and saving.ckptplan_plan.autocast == "bfloat16"
    for module in (compiled, saving):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = training_loss(module(x))
        loss.backward()
    for p, q in zip(model.parameters(), unchanged.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_compile_inside_an_autocast_context_plans_the_autocast_step() -> None:
    model, x = _mlp(blocks=2), torch.randn(256, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = ckptplan.compile(model, (x,), budget=1.0, solver="greedy", backend="aot_eager")
    assert compiled.ckptplan_plan.autocast == "bfloat16"
    with pytest.raises(CkptPlanError, match="autocast=torch.float64"):
        ckptplan.compile(model, (x,), budget=1.0, backend="aot_eager", autocast=torch.float64)


def test_dynamo_s_recompile_limit_reached_is_one_clear_sentence() -> None:
    """Each ``compile`` call compiles the model's forward once more; past Dynamo's limit a whole
    graph cannot fall back to eager, and the user is told how to go on."""
    from torch._dynamo import config as dynamo_config

    from ckptplan.planner.compiled import _recompile_limit_name

    model, x = _mlp(blocks=2), torch.randn(64, 64)
    with dynamo_config.patch(**{_recompile_limit_name(): 2}):
        for _ in range(2):
            ckptplan.compile(model, (x,), budget=1.0, solver="greedy", backend="aot_eager")
        with pytest.raises(CkptPlanError, match=r"call torch.compiler.reset\(\) before compiling it again"):
            ckptplan.compile(model, (x,), budget=1.0, solver="greedy", backend="aot_eager")
        torch.compiler.reset()
        ckptplan.compile(model, (x,), budget=1.0, solver="greedy", backend="aot_eager")
