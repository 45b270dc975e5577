"""The profiler: what it records per op, static memory, meta-device profiling, trace errors."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

import ckptplan
from ckptplan.errors import TraceError
from ckptplan.simulation import baseline_peak_bytes
from tests import models
from tests.conftest import load_example


def test_nodes_are_compute_ops_in_execution_order() -> None:
    model = models.mlp(depth=3)
    graph = ckptplan.profile(model, (torch.randn(8, 64),))
    assert [n.op for n in graph.nodes] == ["aten.linear.default", "aten.tanh.default"] * 3
    assert [n.index for n in graph.nodes] == list(range(6))
    assert graph.nodes[1].inputs == (0,)
    assert graph.nodes[0].module == "0" and graph.nodes[5].module == "5"
    assert graph.loss_nodes == (5,) and graph.outputs == (5,)


def test_saved_bytes_include_hidden_tensors_and_exclude_parameters() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)
            self.ln = nn.LayerNorm(32)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.ln(self.fc(x)))

    batch = 16
    graph = ckptplan.profile(Block(), (torch.randn(batch, 32),))
    by_op = {n.op: n for n in graph.nodes}
    dropout, layer_norm, linear = by_op["aten.dropout.default"], by_op["aten.layer_norm.default"], by_op["aten.linear.default"]
    activation = batch * 32 * 4
    # dropout saves its mask, a tensor no node returns (float mask on CPU)
    hidden = [graph.storages[s] for s in dropout.saved if graph.storages[s].kind == "hidden"]
    assert hidden and sum(s.nbytes for s in hidden) >= batch * 32
    # layer norm saves its input plus per-row mean and rstd
    assert graph.saved_bytes(layer_norm.index) == activation + 2 * batch * 4
    # linear saves its (graph) input; the weight it also saves is a parameter
    assert all(graph.storages[s].kind in ("input", "param") for s in linear.saved)
    assert graph.activation_bytes == sum(
        graph.storages[s].nbytes for s in {s for n in graph.nodes for s in n.saved} if not graph.storages[s].is_static
    )
    assert graph.activation_bytes < graph.static.param_bytes + sum(graph.saved_bytes(n.index) for n in graph.nodes) + 1


def test_flops_match_flop_counter_and_pointwise_ops_cost_time() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    graph = ckptplan.profile(model, (x,))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert sum(n.fwd_flops + n.bwd_flops for n in graph.nodes) == counter.get_total_flops()
    assert graph.nodes[0].fwd_flops == 2 * 32 * 64 * 128
    gelu = graph.nodes[1]
    assert gelu.fwd_flops == 0 and gelu.fwd_cost > 0 and gelu.bytes_moved == 2 * 32 * 128 * 4


def test_static_memory_and_optimizer_state() -> None:
    model = models.mlp(depth=2)
    x = torch.randn(8, 64)
    params = sum(p.numel() * 4 for p in model.parameters())
    plain = ckptplan.profile(model, (x,))
    adamw = ckptplan.profile(model, (x,), optimizer="adamw")
    sgd = ckptplan.profile(model, (x,), optimizer="sgd")
    assert plain.static.param_bytes == params == plain.static.grad_bytes
    assert plain.static.input_bytes == x.numel() * 4
    assert adamw.static.optimizer_bytes == 2 * params + 4 * len(list(model.parameters()))
    assert sgd.static.optimizer_bytes == params
    assert baseline_peak_bytes(adamw) == baseline_peak_bytes(plain) + adamw.static.optimizer_bytes
    with pytest.raises(ckptplan.CkptPlanError, match="Unknown optimizer"):
        ckptplan.profile(model, (x,), optimizer="lion")


def test_frozen_parameters_get_no_gradient_memory() -> None:
    model = models.mlp(depth=2)
    model[0].requires_grad_(False)
    graph = ckptplan.profile(model, (torch.randn(8, 64),))
    assert graph.static.grad_bytes == sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert graph.nodes[0].param_grads == ()


def test_fingerprint_is_stable_and_shape_sensitive() -> None:
    model = models.mlp(depth=2)
    a = ckptplan.profile(model, (torch.randn(8, 64),))
    b = ckptplan.profile(model, (torch.randn(8, 64),))
    c = ckptplan.profile(model, (torch.randn(16, 64),))
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_meta_device_profiles_a_large_model_without_allocating() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(16384, 16384) for _ in range(8)])  # 8.6 GB of fp32 weights
        x = torch.randn(65536, 16384)  # 4 GiB per activation
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    graph = ckptplan.profile(model, (x,))
    rss_growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert graph.static.param_bytes == 8 * (16384 * 16384 + 16384) * 4
    assert rss_growth_kib < 512 * 1024, f"profiling on meta grew RSS by {rss_growth_kib} KiB"
    plan = ckptplan.solve(graph, 0.8, solver="sqrt")
    assert plan.prediction.peak_bytes <= plan.budget.bytes


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            return F.relu(h)
        return h


def test_untraceable_model_names_the_construct_where_it_is_and_what_to_do() -> None:
    """A branch on tensor values stops both tracers: the error names it, the module and the line,
    and how to rewrite it, never sending the user from one tracer to the other. A construct only
    one tracer cannot follow sends the user to the other."""
    line = DataDependent.forward.__code__.co_firstlineno + 2  # the ``if``
    for trace in ("export", "symbolic"):
        with pytest.raises(TraceError) as info:
            ckptplan.profile(DataDependent(), (torch.randn(4, 8),), trace=trace)
        message = str(info.value)
        assert "data-dependent control flow" in message and "(DataDependent.forward)" in message
        assert f"test_profiler.py:{line}" in message and "torch.where" in message
        assert "try trace" not in message

    class SizedNoise(nn.Module):  # torch.empty with a traced size: export follows it, symbolic tracing cannot
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.empty(x.shape[0], 1).bernoulli_(0.5)

    with pytest.raises(TraceError, match="try trace='export'"):
        ckptplan.profile(SizedNoise(), (torch.randn(4, 8),), trace="symbolic")
    assert ckptplan.profile(SizedNoise(), (torch.randn(4, 8),)).nodes


def test_symbolic_trace_records_the_same_memory_as_export() -> None:
    model = models.mlp(depth=3)
    x = torch.randn(32, 64)
    exported = ckptplan.profile(model, (x,))
    symbolic = ckptplan.profile(model, (x,), trace="symbolic")
    assert symbolic.trace == "symbolic"
    assert symbolic.activation_bytes == exported.activation_bytes
    assert baseline_peak_bytes(symbolic) == baseline_peak_bytes(exported)


def test_repeated_profiles_in_one_process_record_identical_nodes() -> None:
    """Workspaces are a function of the graph, not of which storage addresses the allocator
    hands out again: a freed saved tensor's address reused inside a backward must not hide the
    allocation that gets it, or the attention's backward workspace would change from run to run."""
    model, args = load_example("gpt").build(batch=2, seq=64)
    graphs = [ckptplan.profile(model, args) for _ in range(3)]
    first = graphs[0]
    for graph in graphs[1:]:
        workspaces = [(n.name, n.fwd_workspace_bytes, n.bwd_workspace_bytes) for n in graph.nodes]
        assert workspaces == [(n.name, n.fwd_workspace_bytes, n.bwd_workspace_bytes) for n in first.nodes]
        assert graph.nodes == first.nodes
        assert graph.storages == first.storages and graph.static == first.static
        assert graph.fingerprint == first.fingerprint


def test_measured_times_price_each_op_and_leave_no_trace() -> None:
    """``measure_times`` prices ops by their time on this machine, backward by the roofline's
    ratio scaled to one measured backward, and timing the step changes nothing a training run
    could see: batch-norm statistics, the RNG stream, gradients, the bytes."""
    torch.manual_seed(0)
    model, x = models.ConvBN(), torch.randn(4, 8, 16, 16)
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    plain = ckptplan.profile(model, (x,))
    measured = ckptplan.profile(model, (x,), measure_times=True)
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    scales = {
        round((m.bwd_cost / m.fwd_cost) / (p.bwd_cost / p.fwd_cost), 9)
        for m, p in zip(measured.nodes, plain.nodes, strict=True) if p.bwd_cost > 0
    }
    assert len(scales) == 1 and next(iter(scales)) not in (0.0, 1.0)  # 1.0: no backward measured
    assert measured.fingerprint == plain.fingerprint and baseline_peak_bytes(measured) == baseline_peak_bytes(plain)
    assert all(n.fwd_cost > 0 for n in measured.nodes)
    convs = [n.fwd_cost for n in measured.nodes if n.op == "aten.conv2d.default"]
    assert convs and [n.fwd_cost for n in measured.nodes] != [n.fwd_cost for n in plain.nodes]


def test_measured_times_need_real_tensors() -> None:
    with torch.device("meta"):
        model = models.mlp(depth=2, width=8)
        x = torch.randn(4, 8)
    with pytest.raises(ckptplan.CkptPlanError, match="real tensors"):
        ckptplan.profile(model, (x,), measure_times=True)


def test_measured_roofline_carries_this_machine_s_fixed_costs_into_plans() -> None:
    """``measure_roofline`` times the host; the graph carries its region, per-op, policy and
    rematerialisation costs, so ``simulate`` charges them to a plan with regions and keep-sets."""
    roofline = ckptplan.measure_roofline(repeats=5)
    assert roofline.peak_flops_per_s > 0 and roofline.bandwidth_bytes_per_s > 0 and roofline.op_seconds > 0
    assert min(roofline.region_seconds, roofline.region_op_seconds, roofline.policy_op_seconds,
               roofline.remat_seconds) >= 0
    model, x = models.mlp(depth=4, width=16), torch.randn(8, 16)
    graph = ckptplan.profile(model, (x,), roofline=roofline)
    assert (graph.region_cost, graph.region_op_cost, graph.policy_op_cost, graph.remat_cost) == (
        roofline.region_seconds, roofline.region_op_seconds, roofline.policy_op_seconds, roofline.remat_seconds)
    plan = ckptplan.make_plan(graph, [ckptplan.Region(0, 4, keep=(graph.nodes[0].name,))])
    expected = roofline.region_seconds + 4 * roofline.region_op_seconds + 2 * roofline.policy_op_seconds
    assert plan.prediction.checkpoint_seconds == pytest.approx(expected)


def test_a_transformers_cache_gets_the_fix_not_a_circle() -> None:
    """GPT-2 with its default ``use_cache=True``: both tracers say to turn the cache off (neither
    sends the user to the other), and with it off the model profiles."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model, ids = transformers.GPT2LMHeadModel(config), torch.randint(0, 64, (2, 16))
    for trace in ("export", "symbolic"):
        with pytest.raises(TraceError, match=r"use_cache=True.*model.config.use_cache = False") as info:
            ckptplan.profile(model, (ids,), trace=trace)
        assert "try trace" not in str(info.value)
    model.config.use_cache = False
    assert ckptplan.profile(model, (ids,)).nodes


def test_a_model_in_eval_mode_is_profiled_training_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Profiling plans a training step: an eval-mode model is traced in training mode (dropout
    draws masks), says so, and keeps its mode; a training model's frozen batch norm stays frozen."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8)).eval()
    with caplog.at_level("WARNING", logger="ckptplan"):
        graph = ckptplan.profile(model, (torch.randn(4, 8),))
    assert "Sequential is in eval mode" in caplog.text
    assert not model.training and not any(m.training for m in model.modules())
    assert any(node.random for node in graph.nodes)
    model.train()
    model[2].eval()
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckptplan"):
        frozen = ckptplan.profile(model, (torch.randn(4, 8),))
    assert "eval mode" not in caplog.text and not model[2].training
    assert frozen.fingerprint != graph.fingerprint  # batch norm with running statistics, not batch ones
