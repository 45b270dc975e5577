"""Predictions against measurement: the simulator's peak vs MemTracker's over a real CPU step.

The examples run at their Quickstart shapes, at budgets from 90% to 60% of the no-checkpoint peak,
plus hand-made nested and selective plans.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

import ckptplan
from ckptplan import Region
from ckptplan.errors import InfeasibleBudgetError, PlanFormatError
from ckptplan.profiler.loss import training_loss
from ckptplan.simulation import baseline_peak_bytes
from ckptplan.solvers.ilp_model import keepable
from tests import models
from tests.conftest import load_example
from tests.ilp_oracles import model_peak

TOLERANCE = 0.03  # relative: docs/design.md, "Memory and time"
# Scalars the model does not place exactly: the loss and seed beside MemTracker's, and under the
# allocator's count the 0-dim tensors ops make of Python numbers (a GPT-2 step: 43 bytes at its peak).
SCALAR_SLACK_BYTES = 64


def _assert_close(predicted: int, measured: int, what: str) -> None:
    error = abs(predicted - measured) / measured
    assert error <= TOLERANCE, f"{what}: predicted {predicted} vs measured {measured} ({100 * error:.2f}%)"


# The examples at a quarter of their default batch (a quarter of the step's time): the same graph,
# with activations still most of the step's peak.
SMALLER = {"gpt": {"batch": 4}, "resnet": {"batch": 8}, "unet": {"batch": 2}}


def test_examples_predicted_peak_matches_memtracker(example_name: str) -> None:
    """The sqrt solver's plans at 90% and 75% of the baseline, and ``auto``'s at 60% (the
    Quickstart's budget, whose measured peak must fit), each measured in
    a real step: within 3% of the prediction, and sqrt's falling with the budget (auto spends a
    budget on recomputing less, so its peak may sit above a plan made for a larger one)."""
    model, args = load_example(example_name).build(**SMALLER.get(example_name, {}))
    graph = ckptplan.profile(model, args)
    _assert_close(baseline_peak_bytes(graph), ckptplan.measure_step(model, args).peak_bytes, "no checkpoint")
    measured_peaks = []
    for fraction, solver in ((0.9, "sqrt"), (0.75, "sqrt"), (0.6, "auto")):
        try:
            plan = ckptplan.solve(graph, fraction, solver=solver, time_limit=1)  # auto with a shorter search
        except InfeasibleBudgetError:
            assert solver == "sqrt", "auto must reach the Quickstart's budget"
            continue
        measured = ckptplan.measure_step(ckptplan.emit(graph, plan), args).peak_bytes
        _assert_close(plan.prediction.peak_bytes, measured, f"{example_name}: {solver} at {fraction}")
        assert measured <= plan.budget.bytes * (1 if solver == "auto" else 1 + TOLERANCE)
        if solver == "sqrt":
            measured_peaks.append(measured)
    assert measured_peaks, "the sqrt solver should reach at least 90% of the baseline"
    assert measured_peaks == sorted(measured_peaks, reverse=True), "sqrt's measured peak must fall with the budget"


@pytest.mark.parametrize(
    "regions",
    [
        [Region(0, 12), Region(12, 24)],
        [Region(0, 12, children=(Region(0, 6), Region(6, 12))), Region(12, 24, children=(Region(12, 18),))],
        [Region(2, 11, keep=("linear_2", "linear_4")), Region(13, 22, keep=("tanh_8",))],
        [Region(0, 24, children=(Region(4, 8, keep=("linear_3",)), Region(12, 20)))],
        [Region(3, 4), Region(5, 6)],
    ],
    ids=["flat", "nested", "keep", "nested_keep", "single_ops"],
)
def test_hand_made_plans_match_memtracker(regions: list[Region]) -> None:
    torch.manual_seed(0)
    model = models.mlp(depth=12, width=256)
    args = (torch.randn(1024, 256),)
    graph = ckptplan.profile(model, args)
    plan = ckptplan.make_plan(graph, regions)
    measured = ckptplan.measure_step(ckptplan.emit(graph, plan), args).peak_bytes
    _assert_close(plan.prediction.peak_bytes, measured, str(regions))


def test_transformers_gpt2_prediction_and_gradients() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (4, 32))
    kwargs = {"labels": ids}
    graph = ckptplan.profile(model, (ids,), kwargs)
    plan = ckptplan.solve(graph, 0.9, solver="sqrt")
    emitted = ckptplan.emit(graph, plan)
    out = emitted(ids, **kwargs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    measured = ckptplan.measure_step(emitted, (ids,), kwargs).peak_bytes
    _assert_close(plan.prediction.peak_bytes, measured, "GPT-2")


def _transformers_case(name: str):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (4, 32))
    if name == "bert":
        config = tf.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=64)
        return tf.BertForSequenceClassification(config), (ids,), {"labels": torch.randint(0, 2, (4,))}
    if name == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=100, use_cache=False,
                               bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(config), (ids,), {"labels": ids}
    if name == "llama":
        config = tf.LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                use_cache=False)
        return tf.LlamaForCausalLM(config), (ids,), {"labels": ids}
    config = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, num_labels=3)
    return tf.ViTForImageClassification(config), (torch.randn(4, 3, 32, 32),), {"labels": torch.randint(0, 3, (4,))}


# The zoo, at sizes where a step's fixed few hundred bytes (index temporaries, scalars)
# are small against its tensors, and `transformers` models from small configs: model, args, kwargs.
ZOO = {
    "mlp": lambda: (models.mlp(depth=6, width=256), (torch.randn(512, 256),), {}),
    "dropout": lambda: (models.DropoutEverywhere(width=256, depth=4), (torch.randn(512, 256),), {}),
    "conv_bn": lambda: (models.ConvBN(), (torch.randn(16, 8, 32, 32),), {}),
    "inplace_views_frozen": lambda: (
        torch.nn.Sequential(models.InplaceAndViews(width=256), models.InplaceAndViews(width=256)),
        (torch.randn(512, 256),),
        {},
    ),
    "kwargs_dataclass_tied": lambda: (
        models.KwargsAndDataclass(vocab=64, width=256),
        (torch.randint(0, 64, (8, 64)),),
        {"targets": torch.randint(0, 64, (8, 64)), "temperature": 0.5},
    ),
    "scoped_blocks": lambda: (models.ScopedBlocks(width=256), (torch.randn(512, 256),), {}),
    "unet": lambda: (*load_example("unet").build(batch=1, size=64), {}),
    **{name: functools.partial(_transformers_case, name) for name in ("gpt2", "bert", "llama", "vit")},
}


@pytest.mark.parametrize("case", sorted(ZOO))
def test_every_solver_plan_trains_equally_within_budget(case: str) -> None:
    """Every model of the zoo and every solver: profile -> solve -> emit -> one step.
    The emitted module's loss, gradients and buffers equal the original's (dropout replayed), and
    its measured peak is within the budget and within 3% of the prediction. The budget is 70% of
    the no-checkpoint peak, or the least the solver reaches. One profile serves every solver; the
    model's state is restored before each one's step, since batch norm's statistics move."""
    torch.manual_seed(0)
    model, args, kwargs = ZOO[case]()
    reference = copy.deepcopy(model)
    state = copy.deepcopy(model.state_dict())
    graph = ckptplan.profile(model, args, kwargs)
    torch.manual_seed(1)
    reference_loss = training_loss(reference(*args, **kwargs))
    reference_loss.backward()
    for solver in ("sqrt", "dp", "ilp", "auto"):
        try:
            plan = ckptplan.solve(graph, 0.7, solver=solver, time_limit=1)
        except InfeasibleBudgetError as error:
            plan = ckptplan.solve(graph, error.min_peak_bytes, solver=solver, time_limit=1)
        emitted = ckptplan.emit(graph, plan)
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = training_loss(emitted(*args, **kwargs))
        loss.backward()
        torch.testing.assert_close(loss, reference_loss, msg=f"{solver}: loss")
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"{solver}: {name}"
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=f"{solver}: gradient of {name}")
        for (name, b), c in zip(model.named_buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(b, c, msg=f"{solver}: buffer {name}")
        measured = ckptplan.measure_step(emitted, args, kwargs).peak_bytes
        # A few bytes of scalars are not modelled exactly (docs/limits.md): at a budget equal to the
        # least peak, the step may use up to SCALAR_SLACK_BYTES more.
        assert measured <= plan.budget.bytes + SCALAR_SLACK_BYTES, (
            f"{solver} on {case}: measured {measured} over budget {plan.budget.bytes}"
        )
        _assert_close(plan.prediction.peak_bytes, measured, f"{solver} on {case}")


def test_gradient_added_to_a_slice_of_cat_s_gradient_frees_that_gradient() -> None:
    """A U-Net skip's gradient first arrives as a slice of ``cat``'s gradient; autograd cannot add
    the next one into a view, so it adds out of place and the whole ``cat`` gradient goes. The
    simulator once kept it to the skip's backward: 1 MiB (3.5%) too high on this plan at the
    benchmark's shape, where the recompute of the first region is the step's peak."""
    model, args = load_example("unet").build(batch=1, size=64)
    graph = ckptplan.profile(model, args)
    assert graph.nodes[44].op == "aten.cat.default" and 5 in graph.nodes[44].inputs
    plan = ckptplan.make_plan(graph, [Region(0, 13), Region(30, 43), Region(46, 49)])
    measured = ckptplan.measure_step(ckptplan.emit(graph, plan), args).peak_bytes
    assert plan.prediction.peak_bytes == measured


def test_a_node_that_frees_what_its_ops_return_is_never_kept() -> None:
    """``torch.diff(x, prepend=...)`` (as transformers' GPT-2 mask code calls it) runs a ``cat``
    that it frees before it returns; a selective policy keeping ``diff`` caches that ``cat`` too,
    which the memory model does not count (it measured 1,056 bytes over the prediction, and over
    the budget, on the zoo's GPT-2). The profiler records the bytes, and no keep-set may name
    the node."""

    class Diff(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(torch.diff(h, dim=1, prepend=h[:, :1]))

    torch.manual_seed(0)
    graph = ckptplan.profile(Diff(), (torch.randn(8, 64),))
    diff = next(n for n in graph.nodes if n.op == "aten.diff.default")
    assert diff.fwd_freed_bytes >= 8 * 65 * 4  # the cat of the prepended column and h
    assert not keepable(graph, diff.index)
    with pytest.raises(PlanFormatError, match="cannot be kept: its op frees"):
        ckptplan.make_plan(graph, [Region(0, len(graph.nodes), keep=(diff.name,))])
    assert all(n.fwd_freed_bytes == 0 for n in graph.nodes if n is not diff)


class _ChannelsLastConv(torch.nn.Module):
    """A wide convolution after a channels-last permute (ConvNeXt's downsampling): its weight
    gradient comes channels-last, and autograd copies it into the weight's layout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.conv = torch.nn.Conv2d(64, 256, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.conv(h)


def test_gradient_layout_copies_are_counted() -> None:
    """The copy of a gradient made in another layout than its parameter's is where this step
    peaks, as tensors count it (the convolution's kernel temporaries left out). The simulator
    counts it during the convolution's backward, where autograd makes it just after, once the
    convolution's saved input is freed: never under the measured peak, over it by at most that
    input; the prediction would fall short without it."""
    torch.manual_seed(0)
    model, args = _ChannelsLastConv(), (torch.randn(2, 64, 8, 8),)
    graph = ckptplan.profile(model, args, workspaces=False)
    (conv,) = [node for node in graph.nodes if node.param_grad_copies]
    weight = graph.storages[conv.param_grad_copies[0]]
    assert weight.nbytes == model.conv.weight.numel() * 4
    measured = ckptplan.measure_step(model, args, counter="tensors").peak_bytes
    saved_input = sum(graph.storages[s].nbytes for s in conv.saved if not graph.storages[s].is_static)
    assert measured <= baseline_peak_bytes(graph) <= measured + saved_input
    nodes = tuple(dataclasses.replace(node, param_grad_copies=()) for node in graph.nodes)
    without = dataclasses.replace(graph, nodes=nodes)
    assert ckptplan.simulate(without).peak_bytes <= measured - weight.nbytes // 2
    # As the allocator counts it: the kernel's temporaries (its dense copy of the loss's
    # broadcast seed among them), then the layout copy once they are freed; to the byte.
    with_workspaces = ckptplan.profile(model, args)
    assert baseline_peak_bytes(with_workspaces) == ckptplan.measure_step(model, args).peak_bytes


class _PatchEmbedding(torch.nn.Module):
    """ViT's patch embedding: the convolution's output is flattened, transposed and
    concatenated after a class token, so the gradient it receives is a strided slice of the
    concatenation's, which the CPU convolution's backward copies before it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 64, 8, stride=8)
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, 64))
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.conv(x).flatten(2).transpose(1, 2)
        return self.head(torch.cat([self.cls.expand(x.size(0), -1, -1), patches], dim=1))


def test_a_kernel_handed_a_gradient_in_another_layout_has_its_copy_counted() -> None:
    """The profile runs the step's backward on fake tensors to learn the layout of each node's
    incoming gradient, and measures each kernel's workspace from a gradient of that layout."""
    torch.manual_seed(0)
    model, args = _PatchEmbedding(), (torch.randn(4, 3, 32, 32),)
    graph = ckptplan.profile(model, args)
    (conv,) = [node for node in graph.nodes if node.op == "aten.conv2d.default"]
    seen = []

    def note_gradient(module: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: seen.append(grad.stride()))

    model.conv.register_forward_hook(note_gradient)
    training_loss(model(*args)).backward()
    assert seen == [(17 * 64, 1, 4 * 64, 64)]  # a slice of the (4, 17, 64) gradient, channels last
    region = Region(start=conv.index, end=conv.index + 3)
    plan = ckptplan.solve(graph, 1.0)
    for regions in ((), (region,)):
        emitted = ckptplan.emit(graph, plan.model_copy(update={"regions": regions}))
        predicted = ckptplan.simulate(graph, regions).peak_bytes
        assert ckptplan.measure_step(emitted, args).peak_bytes == predicted


def test_regions_that_draw_random_numbers_hold_the_rng_state_they_replay() -> None:
    """Checkpoint stashes the CPU generator's state (5,056 bytes) for a region with dropout, holds
    it with the region's inputs and copies it while recomputing; a region without random ops
    stashes nothing. The allocator's count of the step is the prediction, to the byte, and the
    ilp model's peak is the simulator's."""
    torch.manual_seed(0)
    model, args = models.DropoutEverywhere(width=256), (torch.randn(512, 256),)
    graph = ckptplan.profile(model, args)
    assert graph.rng_state_bytes == torch.get_rng_state().nbytes == 5056
    plain = ckptplan.profile(models.mlp(depth=4, width=256), args)
    for g, regions in ((graph, [Region(0, 4), Region(4, 8, keep=("linear_1",))]), (plain, [Region(0, 4), Region(4, 8)])):
        emitted = ckptplan.emit(g, regions)
        torch.manual_seed(0)
        measured = ckptplan.measure_step(emitted, args).peak_bytes
        assert measured == ckptplan.simulate(g, regions).peak_bytes == model_peak(g, tuple(regions))
    with_stash = ckptplan.simulate(graph, [Region(0, 4)]).peak_bytes
    without = ckptplan.simulate(dataclasses.replace(graph, rng_state_bytes=0), [Region(0, 4)]).peak_bytes
    assert with_stash - without == 5056


def test_the_allocator_counts_the_compiled_step_not_eager() -> None:
    """``measure_step`` reads the allocator, which sees the step ``torch.compile`` runs: the
    partitioner's memory budget moves the measured peak (under ``MemTracker``, a dispatch mode,
    Dynamo falls back to eager and the knob would change nothing)."""
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(4)
    ])  # normalisation and GELU: pointwise work the partitioner recomputes under a budget
    args = (torch.randn(1024, 64),)
    peaks = {}
    for budget in (1.0, 0.1):
        torch._dynamo.reset()
        with functorch_config.patch(activation_memory_budget=budget):
            compiled = torch.compile(model, backend="aot_eager_decomp_partition")
            ckptplan.measure_step(compiled, args)  # compiles
            peaks[budget] = ckptplan.measure_step(compiled, args).peak_bytes
    torch._dynamo.reset()
    assert peaks[0.1] < peaks[1.0]


def test_a_loop_that_keeps_the_outputs_is_planned_and_measured_with_them() -> None:
    """``outputs_live``: a loop holding ``out`` through backward keeps a classifier's logits
    (4 MiB here) alive there; the prediction with them is what the allocator counts for that
    loop, with and without a plan, and so is the one without them for a loop that drops them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 2048),
    )
    args = (torch.randn(512, 64),)
    graphs = {live: ckptplan.profile(model, args, outputs_live=live) for live in (False, True)}
    assert baseline_peak_bytes(graphs[True]) > baseline_peak_bytes(graphs[False])
    for live, graph in graphs.items():
        unplanned = ckptplan.measure_step(model, args, outputs_live=live).peak_bytes
        assert abs(unplanned - baseline_peak_bytes(graph)) <= 0.01 * unplanned, live
        plan = ckptplan.solve(graph, 0.95, solver="dp")
        assert plan.regions and plan.model.outputs_live == live
        assert ('"outputs_live"' in plan.to_json()) == live  # written only when the loop keeps them
        measured = ckptplan.measure_step(ckptplan.emit(graph, plan), args, outputs_live=live).peak_bytes
        assert abs(measured - plan.prediction.peak_bytes) <= 0.01 * measured, live
