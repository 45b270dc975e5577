"""Plans meet in-place ops, views and aliases: every plan the validator accepts trains exactly
as the model does (gradients and buffers equal), and every one it refuses says why.

The property test draws regions (nested ones too) and keep-sets naming any node of a region,
keepable or not, over graphs with in-place activations, views of in-place results, in-place
writes through views, ops that alias their inputs and constants lifted by ``torch.export``,
traced both ways."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import ckptplan
from ckptplan import Region
from ckptplan.errors import PlanFormatError
from ckptplan.profiler.loss import training_loss
from tests.architectures import SqueezeExcite, build_efficientnet, stochastic_depth


class SqueezeExciteBlock(nn.Module):
    """The reduced EfficientNet block: conv, then squeeze-excitation with ``SiLU(inplace=True)``."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.se = SqueezeExcite(channels, 4)
        self.out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.se(self.conv(x)))


class ViewsOfInplace(nn.Module):
    """In-place writes through views, views of in-place results, and aliasing ops (``expand``,
    ``chunk``, ``transpose``, a slice of an earlier activation)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        v = h.view(h.shape[0], 2, -1)
        v.relu_()
        t = v.transpose(1, 2).reshape(h.shape[0], -1)
        u = self.b(t)
        u[:, :4].mul_(2.0)
        k = u.unsqueeze(1).expand(-1, 3, -1).sum(1)
        p, q = self.c(k).chunk(2, dim=-1)
        return torch.cat([p.tanh(), q * h[:, :8]], -1)


class ResidualInplace(nn.Module):
    """Pre-norm residual blocks whose sum is written in place (``r += h``, then ``clamp_``)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        for layer in self.layers:
            r = F.gelu(layer(self.norm(h)))
            r += h
            h = r
            h.clamp_(-3.0, 3.0)
        return h


class DenseInplace(nn.Module):
    """Concatenated features after in-place ReLUs, an in-place ``masked_fill_`` on the
    concatenation, batch norm, in-place dropout and stochastic depth."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width * (k + 1), width) for k in range(3))
        self.norm = nn.BatchNorm1d(width * 4)
        self.drop = nn.Dropout(0.2, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(F.relu(layer(torch.cat(features, -1)), inplace=True))
        z = torch.cat(features, -1)
        z.masked_fill_(z > 2.0, 2.0)
        return stochastic_depth(self.drop(self.norm(z) * 1.5), 0.3, self.training)


class Constants(nn.Module):
    """Index tables: one built in forward (``torch.tensor``, which export lifts) and one a plain
    tensor attribute, read in two submodules."""

    class Gather(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.proj = nn.Linear(width, width)
            self.table = torch.arange(width).flip(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
            h = self.proj(x)
            return h[:, self.table] + h[:, order].repeat(1, h.shape[1] // 8)

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = self.Gather(width), self.Gather(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class WritesItsInputAndState(nn.Module):
    """Overwrites the caller's input after reading it, and bumps a step counter of its own (a
    top-level buffer) in the middle of forward."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x * 1.0))
        y = x * 2.0
        x.mul_(0.5)
        self.steps.add_(1)
        return self.b(h) * 3.0 + self.c(x) + y


MODELS = {
    "squeeze_excite": (SqueezeExciteBlock, (2, 8, 6, 6)),
    "views_of_inplace": (ViewsOfInplace, (4, 16)),
    "residual_inplace": (ResidualInplace, (4, 16)),
    "dense_inplace": (DenseInplace, (6, 8)),
    "constants": (Constants, (4, 16)),
    "writes_input_and_state": (WritesItsInputAndState, (4, 16)),
}
TRACES = ("export", "symbolic")
# torch.fx runs a write into the model's own state at trace time (refused: see the test below).
CASES = [(name, trace) for name in sorted(MODELS) for trace in TRACES
         if (name, trace) != ("writes_input_and_state", "symbolic")]


@functools.cache
def _profiled(name: str, trace: str) -> tuple[nn.Module, dict, tuple, ckptplan.ComputeGraph]:
    """The model (seeded), its initial state, inputs and graph: profiled once per test session."""
    torch.manual_seed(0)
    cls, shape = MODELS[name]
    model = cls().train()
    args = (torch.randn(*shape),)
    graph = ckptplan.profile(model, args, trace=trace)
    return model, copy.deepcopy(model.state_dict(keep_vars=False)), args, graph


def _trained(module: nn.Module, args: tuple) -> None:
    torch.manual_seed(3)
    training_loss(module(*(x.clone() for x in args))).backward()  # a clone: the model may write into it


def _assert_exact(name: str, trace: str, regions: list[Region]) -> None:
    """One step of the emitted module leaves the gradients and buffers a step of the model does."""
    model, state, args, graph = _profiled(name, trace)
    model.load_state_dict(state)
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    _trained(ckptplan.emit(graph, regions), args)
    _trained(reference, args)
    for (param, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=f"gradient of {param} under {regions}")
    for (buffer, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=f"buffer {buffer} under {regions}")


@st.composite
def _plans(draw: st.DrawFn, graph: ckptplan.ComputeGraph) -> list[Region]:
    """Disjoint regions on the graph's boundaries, some with one nested child, each keeping a
    random subset of the nodes directly in it, whatever the validator will say of them."""
    n, edges = len(graph.nodes), sorted(graph.boundaries)
    regions: list[Region] = []
    position = 0
    while True:
        starts = [e for e in edges if position <= e < n]
        if not starts or not draw(st.booleans()):
            break
        start = draw(st.sampled_from(starts))
        end = draw(st.sampled_from([e for e in edges if e > start][:6]))
        children: tuple[Region, ...] = ()
        inside = [e for e in edges if start <= e <= end]
        if len(inside) >= 3 and draw(st.booleans()):
            lo = draw(st.sampled_from(inside[:-1]))
            hi = draw(st.sampled_from([e for e in inside if e > lo]))
            if (lo, hi) != (start, end):
                children = (Region(lo, hi),)
        direct = [graph.nodes[j].name for j in range(start, end) if not any(c.start <= j < c.end for c in children)]
        keep = tuple(draw(st.lists(st.sampled_from(direct), unique=True, max_size=4))) if direct else ()
        regions.append(Region(start, end, keep=tuple(sorted(keep, key=graph.index_of.__getitem__)), children=children))
        position = end
    return regions


@pytest.mark.parametrize(("name", "trace"), CASES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_accepted_plan_trains_exactly(name: str, trace: str, data: st.DataObject) -> None:
    graph = _profiled(name, trace)[3]
    regions = data.draw(_plans(graph))
    try:
        ckptplan.make_plan(graph, regions)
    except PlanFormatError as exc:
        assert "cannot" in str(exc) or "not directly" in str(exc), exc
        return
    _assert_exact(name, trace, regions)


@pytest.mark.parametrize("trace", TRACES)
def test_inplace_activations_are_seen_however_traced(trace: str) -> None:
    """``nn.SiLU(inplace=True)`` is a module call under symbolic tracing and ``aten.silu_`` under
    export: both are in-place nodes writing into ``fc1``'s output."""
    graph = _profiled("squeeze_excite", trace)[3]
    inplace = [node for node in graph.nodes if node.inplace]
    assert len(inplace) == 1
    (node,) = inplace
    assert graph.storages[node.outputs[0]].producer == node.index - 1  # fc1 made what it writes


def test_keeping_an_inplace_op_is_refused_with_the_reason() -> None:
    """The EfficientNet report: keeping ``silu_`` made every gradient wrong. Refused, and the
    plan keeping what it writes into (``fc1``, overwritten later) is refused too."""
    graph = _profiled("squeeze_excite", "export")[3]
    silu = next(node for node in graph.nodes if node.inplace)
    region = (0, len(graph.nodes))
    with pytest.raises(PlanFormatError, match="writes in place into a tensor made before it"):
        ckptplan.make_plan(graph, [Region(*region, keep=(silu.name,))])
    fc1 = graph.nodes[silu.index - 1]
    with pytest.raises(PlanFormatError, match=f"{silu.name!r} later modifies its output in place"):
        ckptplan.make_plan(graph, [Region(*region, keep=(fc1.name,))])
    fc2 = graph.nodes[silu.index + 1]
    _assert_exact("squeeze_excite", "export", [Region(*region, keep=(fc2.name,))])


def test_solvers_never_keep_an_inplace_op() -> None:
    """``auto`` on an EfficientNet-like model (where the report's plan kept ``silu_``) at a tight
    budget: its plan keeps no in-place node and trains exactly."""
    model, args, kwargs = build_efficientnet()
    reference = copy.deepcopy(model)
    graph = ckptplan.profile(model, args, kwargs)
    plan = ckptplan.solve(graph, budget=0.6, time_limit=1)
    kept = {name for region in plan.regions for name in region.keep}
    assert kept and not kept & {node.name for node in graph.nodes if node.inplace}
    _trained(ckptplan.emit(graph, plan), args)
    _trained(reference, args)
    for (param, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=f"gradient of {param}")


@pytest.mark.parametrize("trace", TRACES)
def test_constants_the_trace_reads_are_carried(trace: str) -> None:
    """Lifted constants and plain tensor attributes reach the emitted module, which trains
    exactly, keeps the model's ``state_dict`` keys, and moves them with ``.to()``."""
    n = len(_profiled("constants", trace)[3].nodes)
    _assert_exact("constants", trace, [Region(0, n // 2), Region(n // 2, n)])
    model = Constants().train()
    graph = ckptplan.profile(model, (torch.randn(4, 16),), trace=trace)
    module = ckptplan.emit(graph, [Region(0, n // 2), Region(n // 2, n)])
    assert module.state_dict().keys() == model.state_dict().keys()
    module.to("meta")
    assert all(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def test_symbolic_tracing_refuses_a_model_that_writes_its_own_state() -> None:
    """torch.fx reads buffers as real tensors: the counter's ``add_`` would run while tracing
    and never in the traced step."""
    with pytest.raises(ckptplan.TraceError, match="in-place update of 'steps' while tracing.*trace='export'"):
        ckptplan.profile(WritesItsInputAndState().train(), (torch.randn(4, 16),), trace="symbolic")


def test_writes_into_the_input_and_the_model_state_stay_once_per_step() -> None:
    """No region may hold or precede the write into the caller's input; the counter, a top-level
    buffer, is updated once per step however regions are placed around it."""
    graph = _profiled("writes_input_and_state", "export")[3]
    write = next(node.index for node in graph.nodes if node.inplace and graph.storages[node.outputs[0]].kind == "input")
    assert min(graph.boundaries) == write + 1
    counter = next(node.index for node in graph.nodes if node.writes and graph.storages[node.writes[0]].kind == "buffer")
    n = len(graph.nodes)
    _assert_exact("writes_input_and_state", "export", [Region(write + 1, n)])
    assert counter > write
    _assert_exact("writes_input_and_state", "export", [Region(counter, counter + 1), Region(counter + 1, n)])
