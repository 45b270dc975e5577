"""Rematerialisation (``ckptplan.remat``): outputs of cheap ops dropped after forward and
recomputed in the backward of the ops that saved them. The simulator's peak is checked against
a real step's (MemTracker), the emitted module's gradients against the original's, and
``solve(..., remat=True)``'s choice against the plans it chose from."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from ortools.sat.python import cp_model

import ckptplan
from ckptplan import Region, remat
from ckptplan.build import make_plan
from ckptplan.errors import PlanFormatError
from ckptplan.profiler.loss import training_loss
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import remat_plans, tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp_lazy import search_lazily
from ckptplan.solvers.ilp_model import COST_SCALE, build_model
from ckptplan.solvers.polish import polish
from ckptplan.solvers.remat_ilp import search_with_remat
from ckptplan.solvers.remat_plans import shed_remat
from ckptplan.solvers.solution import solution
from ckptplan.solvers.sqrt import solve_sqrt
from tests import models
from tests.conftest import assert_same_gradients, load_example

SCALAR_SLACK_BYTES = 16  # the loss scalars MemTracker and the simulator may place differently (test_measured)


def _assert_matches(graph: ckptplan.ComputeGraph, plan: ckptplan.Plan, measured: int) -> None:
    """The prediction is the measured peak, or above it by at most the hidden tensors (layer
    norm's statistics) a recompute makes and drops at once, which the model counts for the
    whole backward of the op that unpacks it."""
    hidden = sum(s.nbytes for name in plan.remat for s in graph.produced_by(graph.index_of[name])
                 if s.kind == "hidden")
    assert measured - SCALAR_SLACK_BYTES <= plan.prediction.peak_bytes <= measured + hidden + SCALAR_SLACK_BYTES


@pytest.fixture(scope="module")
def gpt() -> tuple[torch.nn.Module, tuple, ckptplan.ComputeGraph]:
    model, args = load_example("gpt").build(batch=2, seq=64)
    return model, args, ckptplan.profile(model, args)


def _names(graph: ckptplan.ComputeGraph, indices: tuple[int, ...]) -> list[str]:
    return [graph.nodes[i].name for i in indices]


def test_candidates_are_ops_whose_backward_keeps_what_they_read(gpt) -> None:
    _, _, graph = gpt
    found = remat.candidates(graph)
    ops = {graph.nodes[i].op for i in found}
    assert {"aten.gelu.default", "aten.layer_norm.default"} <= ops
    for i in found:
        node = graph.nodes[i]
        assert not node.random and node.outputs[0] not in node.saved
        assert remat.savers(graph, i)
    dropout = next(n.index for n in graph.nodes if n.random)
    assert remat.why_not(graph, dropout) == "it draws random numbers"


def test_an_op_that_saves_its_own_output_is_not_a_candidate() -> None:
    torch.manual_seed(0)
    model, args = models.mlp(depth=3, width=16), (torch.randn(4, 16),)
    graph = ckptplan.profile(model, args)
    tanh = next(n.index for n in graph.nodes if "tanh" in n.op)
    assert remat.why_not(graph, tanh) == "its own backward saves its output"
    assert remat.candidates(graph) == ()


@pytest.mark.parametrize("with_region", [False, True])
def test_predicted_peak_is_the_measured_one_and_gradients_match(gpt, with_region: bool) -> None:
    """Every candidate outside the region is rematerialised; MemTracker's peak over a real step
    equals the prediction to the byte, below the plan without rematerialisation."""
    model, args, graph = gpt
    n = len(graph.nodes)
    regions = [Region(min(b for b in graph.boundaries if b >= n // 3), max(b for b in graph.boundaries if b <= n // 2))]
    regions = regions if with_region else []
    names = _names(graph, remat.outside(graph, remat.by_price(graph), regions))
    plan = make_plan(graph, regions, remat=names)
    assert plan.remat and plan.prediction.peak_bytes < simulate(graph, regions).peak_bytes
    assert plan.prediction.recompute_seconds > simulate(graph, regions).recompute_seconds
    emitted = ckptplan.emit(graph, plan)
    _assert_matches(graph, plan, ckptplan.measure_step(emitted, args).peak_bytes)
    assert_same_gradients(model, emitted, args)


def test_each_recompute_is_charged_the_hooks_fixed_cost(gpt) -> None:
    """``graph.remat_cost`` (``Roofline.remat_seconds``) is charged once per recompute, that is
    per saver of each rematerialised node, as machinery beside the op's own time."""
    _, _, graph = gpt
    names = _names(graph, remat.by_price(graph))
    free = make_plan(graph, [], remat=names)
    charged = make_plan(replace(graph, remat_cost=1e-3), [], remat=names)
    recomputes = len(remat.Remat(graph, remat.indices(graph, names), ()).recomputations)
    assert recomputes >= len(names) > 0
    assert free.prediction.checkpoint_seconds == 0
    assert charged.prediction.checkpoint_seconds == pytest.approx(1e-3 * recomputes)
    assert charged.prediction.recompute_seconds == free.prediction.recompute_seconds


def test_a_saver_inside_a_region_is_left_to_the_region(gpt) -> None:
    """A rematerialised layer norm whose savers a region covers costs nothing in backward:
    the region recomputes from its inputs, and the prediction still matches the step."""
    model, args, graph = gpt
    norms = [i for i in remat.candidates(graph) if graph.nodes[i].op == "aten.layer_norm.default"]
    x = norms[1]
    first, last = min(remat.savers(graph, x)), max(remat.savers(graph, x))
    start = min(b for b in graph.boundaries if b > x)
    end = min(b for b in graph.boundaries if b > last)
    assert start <= first
    plan = make_plan(graph, [Region(start, end)], remat=[graph.nodes[x].name])
    assert not remat.Remat(graph, (x,), plan.regions).recomputed_by
    assert plan.prediction.peak_bytes == simulate(graph, plan.regions).peak_bytes
    emitted = ckptplan.emit(graph, plan)
    _assert_matches(graph, plan, ckptplan.measure_step(emitted, args).peak_bytes)
    assert_same_gradients(model, emitted, args)


def test_bad_remat_names_are_refused(gpt) -> None:
    _, _, graph = gpt
    gelu = next(i for i in remat.candidates(graph) if graph.nodes[i].op == "aten.gelu.default")
    with pytest.raises(PlanFormatError, match="not a node"):
        simulate(graph, (), remat=["no_such_node"])
    dropout = next(n.name for n in graph.nodes if n.random)
    with pytest.raises(PlanFormatError, match="random numbers"):
        simulate(graph, (), remat=[dropout])
    start = max(b for b in graph.boundaries if b <= gelu)
    with pytest.raises(PlanFormatError, match="a region contains"):
        make_plan(graph, [Region(start, gelu + 1)], remat=[graph.nodes[gelu].name])


def test_plan_json_round_trips_remat_and_omits_it_when_empty(gpt) -> None:
    _, _, graph = gpt
    names = _names(graph, remat.by_price(graph)[:3])
    plan = make_plan(graph, [], remat=names)
    loaded = ckptplan.Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.remat == tuple(sorted(names, key=graph.index_of.__getitem__))
    assert {n.name for n in plan.nodes if n.decision == "remat"} == set(names)
    assert "remat" not in json.loads(make_plan(graph, []).to_json())


def test_solve_with_remat_takes_the_shortest_prefix_that_fits(gpt) -> None:
    """At a budget between the peak with every candidate rematerialised and the peak without,
    solve may answer with rematerialisation alone: then the shortest cheapest-first prefix that
    fits, and never a dearer plan than the solver's own."""
    _, _, graph = gpt
    order = _names(graph, remat.by_price(graph))
    lowest = simulate(graph, (), remat=order).peak_bytes
    budget = (lowest + baseline_peak_bytes(graph)) // 2
    plain = ckptplan.solve(graph, budget, solver="dp")
    plan = ckptplan.solve(graph, budget, solver="dp", remat=True)
    assert plan.prediction.cost_seconds <= plain.prediction.cost_seconds
    assert plan.prediction.peak_bytes <= budget
    if not plan.regions:
        k = len(plan.remat)
        assert set(plan.remat) == set(order[:k])
        assert simulate(graph, (), remat=order[: k - 1]).peak_bytes > budget


def test_solve_with_remat_below_what_remat_alone_reaches(gpt) -> None:
    """Below the rematerialised graph's own peak, regions are solved on that graph; the plan the
    simulator confirms for the real graph fits the budget."""
    _, _, graph = gpt
    plan = ckptplan.solve(graph, 0.75, solver="dp", remat=True)
    assert plan.prediction.peak_bytes <= plan.budget.bytes
    assert plan.prediction.peak_bytes == simulate(graph, plan).peak_bytes


def test_shedding_drops_the_rematerialisations_a_plan_fits_without(gpt) -> None:
    """``shed_remat`` keeps only what the budget needs: all of them at the peak they reach
    together, none at the peak the regions reach alone; what it keeps always fits, at no more
    cost than rematerialising everything."""
    _, _, graph = gpt
    n = len(graph.nodes)
    regions = (Region(min(b for b in graph.boundaries if b >= n // 3), max(b for b in graph.boundaries if b <= n // 2)),)
    every = list(remat.outside(graph, remat.by_price(graph), regions))
    together = make_plan(graph, regions, remat=_names(graph, tuple(every)))
    alone = simulate(graph, regions).peak_bytes
    assert together.prediction.peak_bytes < alone
    assert shed_remat(graph, regions, every, alone) == []
    for budget in (together.prediction.peak_bytes, (together.prediction.peak_bytes + alone) // 2):
        kept = shed_remat(graph, regions, every, budget)
        assert set(kept) <= set(every)
        plan = make_plan(graph, regions, remat=_names(graph, tuple(kept)))
        assert plan.prediction.peak_bytes <= budget
        assert plan.prediction.cost_seconds <= together.prediction.cost_seconds
    assert len(shed_remat(graph, regions, every, (together.prediction.peak_bytes + alone) // 2)) < len(every)


def test_joint_search_improves_on_its_start_reproducibly(gpt) -> None:
    """The joint model's neighbourhood search (``remat_ilp``) from ``sqrt``'s plan returns a
    cheaper plan that fits (the simulator's word), with regions, rematerialisation or both, and
    the same one on a second run when a step count, not the wall clock, ends it."""
    _, _, graph = gpt
    budget = int(0.8 * baseline_peak_bytes(graph))
    start = solve_sqrt(graph, budget)
    found = [search_with_remat(graph, budget, start, SolveContext.limited(120), max_steps=2) for _ in range(2)]
    assert found[0] is not None
    assert found[0].cost_seconds < start.cost_seconds
    assert simulate(graph, found[0]).peak_bytes == found[0].peak_bytes <= budget
    assert (found[0].regions, found[0].remat) == (found[1].regions, found[1].remat)


def test_compiled_emitted_module_with_remat_equals_eager_original(gpt) -> None:
    """Under torch.compile the rematerialisation wrappers step aside (the partitioner decides
    what backward recomputes); the step equals the eager original's."""
    model, args, graph = gpt
    plan = make_plan(graph, [], remat=_names(graph, remat.by_price(graph)))
    torch._dynamo.reset()
    compiled = torch.compile(ckptplan.emit(graph, plan), backend="aot_eager", fullgraph=True)
    assert_same_gradients(model, compiled, args)


def test_double_backward_through_a_rematerialised_op_is_refused(gpt) -> None:
    """Recomputed without autograd, a rematerialised output has no history for higher-order
    gradients: create_graph=True raises instead of returning wrong ones."""
    model, args, graph = gpt
    emitted = ckptplan.emit(graph, make_plan(graph, [], remat=_names(graph, remat.by_price(graph))))
    loss = training_loss(emitted(*args))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


class _Squares(torch.nn.Module):
    """A GELU whose output one op saves twice (``g * g``) and a ``linear`` saves once."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.side = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.nn.functional.gelu(self.up(x))
        return self.down(g * g) + self.side(g)


def test_each_saver_recomputes_once_even_when_it_saves_the_output_twice() -> None:
    """Backward runs the GELU again once per saver: the mul unpacks two tensors living in its
    output and shares one recompute."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGelus(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountGelus.count += func is torch.ops.aten.gelu.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model, args = _Squares(), (torch.randn(64, 16),)
    graph = ckptplan.profile(model, args)
    gelu = next(i for i in remat.candidates(graph) if graph.nodes[i].op == "aten.gelu.default")
    assert len(remat.savers(graph, gelu)) == 2  # the mul, which saves it as both operands, and side
    plan = make_plan(graph, [], remat=[graph.nodes[gelu].name])
    emitted = ckptplan.emit(graph, plan)
    loss = emitted(*args).sum()
    with CountGelus():
        loss.backward()
    assert CountGelus.count == len(remat.savers(graph, gelu))
    assert_same_gradients(model, emitted, args)


def test_rematerialised_ops_recompute_under_the_autocast_they_ran_in(gpt) -> None:
    """A module emitted from an fp32 profile and run under bf16 autocast recomputes its layer
    norms and GELUs as forward ran them (else backward would reinterpret fp32 bytes as bf16)."""
    model, args, graph = gpt
    emitted = ckptplan.emit(graph, make_plan(graph, [], remat=_names(graph, remat.by_price(graph))))
    reference = copy.deepcopy(model)
    grads = []
    for module, owner in ((emitted, model), (reference, reference)):
        owner.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = training_loss(module(*args))
        loss.backward()
        grads.append([p.grad for p in owner.parameters()])
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs)


class _ConvNormSilu(torch.nn.Module):
    """Convolution, group norm and SiLU, three times: the pattern a chain rematerialises."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.GroupNorm(2, width),
                                torch.nn.SiLU())
            for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.mean()


@pytest.fixture(scope="module")
def conv_norm_silu() -> tuple[torch.nn.Module, tuple, ckptplan.ComputeGraph]:
    torch.manual_seed(0)
    model, args = _ConvNormSilu(), (torch.randn(2, 8, 32, 32),)
    return model, args, ckptplan.profile(model, args)


def test_a_chain_frees_the_norm_and_its_activation(conv_norm_silu) -> None:
    """Rematerialising a group norm and the SiLU that reads it frees both outputs: the next
    convolution's backward recomputes the norm, then the SiLU, from the convolution output the
    norm's backward keeps, and the SiLU's backward recomputes the norm. The prediction is the
    measured peak, below rematerialising either alone, and the gradients are the original's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountNorms(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountNorms.count += func is torch.ops.aten.native_group_norm.default
            return func(*args, **(kwargs or {}))

    model, args, graph = conv_norm_silu
    norm = next(i for i in remat.candidates(graph) if "group_norm" in graph.nodes[i].op)
    silu = next(i for i in remat.candidates(graph) if "silu" in graph.nodes[i].op and i > norm)
    assert norm in graph.nodes[silu].inputs and remat.chains(graph, [norm, silu]) == [(silu, norm)]
    assert not remat.conflicts(graph, [norm, silu])
    both = make_plan(graph, [], remat=_names(graph, (norm, silu)))
    for alone in ((norm,), (silu,)):
        assert both.prediction.peak_bytes < make_plan(graph, [], remat=_names(graph, alone)).prediction.peak_bytes
    assert remat.closure(graph, silu, {norm, silu}) == (norm, silu)
    assert sorted(remat.Remat(graph, (norm, silu), ()).recomputations) == [norm, norm, silu]
    emitted = ckptplan.emit(graph, both)
    _assert_matches(graph, both, ckptplan.measure_step(emitted, args).peak_bytes)
    loss = emitted(*args)
    with CountNorms():
        loss.backward()
    assert CountNorms.count == 2
    assert_same_gradients(model, emitted, args)


def test_price_order_takes_chains_and_its_prefixes_match_a_real_step(conv_norm_silu) -> None:
    """``by_price`` orders candidates with chains at most two deep, and each prefix it gives
    frees more and trains as the simulator predicts."""
    model, args, graph = conv_norm_silu
    order = remat.by_price(graph)
    assert set(order) < set(remat.candidates(graph))  # a convolution under a chain would make it three deep
    assert remat.chains(graph, order) and not remat.deep_chains(graph, order)
    last = None
    for k in (len(order) // 2, len(order) - 1, len(order)):
        plan = make_plan(graph, [], remat=_names(graph, order[:k]))
        assert last is None or plan.prediction.peak_bytes < last
        last = plan.prediction.peak_bytes
        emitted = ckptplan.emit(graph, plan)
        _assert_matches(graph, plan, ckptplan.measure_step(emitted, args).peak_bytes)
        assert_same_gradients(model, emitted, args)


def test_solve_reaches_a_chain_only_plan_where_chain_free_sets_cannot(conv_norm_silu) -> None:
    """At a budget only chains reach without regions, ``solve(remat=True)`` answers with
    rematerialisation alone, cheaper than its plain plan. (Planned without the convolutions'
    measured workspaces, which make the backward of the first the peak whatever is freed.)"""
    model, args, _ = conv_norm_silu
    graph = ckptplan.profile(model, args, workspaces=False)
    order = remat.by_price(graph)
    budget = simulate(graph, (), remat=_names(graph, order)).peak_bytes
    heads = {x for x, _ in remat.chains(graph, order)}  # without them no chain is left
    assert budget < simulate(graph, (), remat=_names(graph, tuple(x for x in order if x not in heads))).peak_bytes
    plan = ckptplan.solve(graph, budget, solver="dp", remat=True)
    plain = ckptplan.solve(graph, budget, solver="dp")
    assert not plan.regions and remat.chains(graph, remat.indices(graph, plan.remat))
    assert plan.prediction.peak_bytes <= budget
    assert plan.prediction.cost_seconds < plain.prediction.cost_seconds


@pytest.mark.parametrize("fraction", [0.7, 0.75, 0.85])
def test_the_lazy_joint_search_proves_the_whole_joint_model_s_optimum(conv_norm_silu, fraction: float) -> None:
    """Regions and rematerialisation searched together with rows added as plans break them
    (``ilp_lazy.search_lazily(remat=...)``, the joint portfolio's search) end where CP-SAT on the
    whole joint model ends: the same least cost, proven, on a plan the simulator confirms within
    the budget, never dearer than the least plan without rematerialisation."""
    _, _, graph = conv_norm_silu
    candidates = remat.candidates(graph)
    budget = int(fraction * baseline_peak_bytes(graph))
    model, v = build_model(graph, budget, remat=candidates)
    model.Minimize(v.cost)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 60
    solver.parameters.num_workers = 2
    assert solver.Solve(model) == cp_model.OPTIMAL
    whole = solver.ObjectiveValue() / COST_SCALE
    joint = search_lazily(graph, budget, None, SolveContext.limited(60), seconds=60, workers=2, remat=candidates)
    plain = search_lazily(graph, budget, None, SolveContext.limited(60), seconds=60, workers=2)
    assert joint.status == plain.status == "OPTIMAL"
    report = simulate(graph, joint.regions, remat=joint.remat)
    assert report.peak_bytes <= budget and report.cost_seconds * COST_SCALE == pytest.approx(joint.cost)
    slack = 4 * len(graph.nodes) / COST_SCALE  # the model rounds each cost term to a whole unit
    assert abs(report.cost_seconds - whole) <= slack
    assert report.cost_seconds <= plain.cost / COST_SCALE
    assert set(joint.remat) <= {graph.nodes[x].name for x in candidates}


def test_the_joint_portfolio_returns_a_plan_that_fits_from_a_start_that_rematerialises(gpt) -> None:
    """``polish(joint=True)`` from a plan rematerialising the cheapest prefix of candidates that
    fits (no regions) returns a plan the simulator confirms within the budget, no dearer than
    its start, rematerialising only candidates."""
    _, _, graph = gpt
    names = _names(graph, remat.by_price(graph))
    lowest = simulate(graph, (), remat=names).peak_bytes
    budget = (lowest + baseline_peak_bytes(graph)) // 2
    k = next(k for k in range(len(names) + 1) if simulate(graph, (), remat=names[:k]).peak_bytes <= budget)
    begin = solution(graph, (), "remat", remat=names[:k])
    found = polish(graph, budget, begin, SolveContext.limited(6), joint=True)
    report = simulate(graph, found.regions, remat=found.remat)
    assert report.peak_bytes == found.peak_bytes <= budget
    assert report.cost_seconds == pytest.approx(found.cost_seconds, rel=1e-12)
    assert found.cost_seconds <= begin.cost_seconds
    assert set(found.remat) <= set(_names(graph, remat.candidates(graph)))  # by_price leaves some out
    if found is not begin:
        assert found.solver == "ilp" and "rematerialisation chosen together" in found.note


def test_with_the_joint_portfolio_the_rematerialised_graph_is_solved_only_when_the_plain_solve_fits_nothing(
    gpt,
) -> None:
    """Under ``auto``'s joint portfolio the solve on the rematerialised graph is skipped when the
    plain solve has a plan, and runs when it has none: its plan, made one of the model's graph,
    is the portfolio's start and what comes back fits."""
    _, _, graph = gpt
    order = remat.by_price(graph)
    names = _names(graph, order)
    rematerialised = remat.Remat(graph, order, ()).graph
    for fraction in (0.8, 0.75, 0.85, 0.9, 0.7):  # rematerialisation alone does not fit; sqrt's plans do
        budget = int(fraction * baseline_peak_bytes(graph))
        try:
            solve_sqrt(rematerialised, int(0.97 * budget))
            solve_sqrt(graph, budget)
        except ckptplan.InfeasibleBudgetError:
            continue
        if simulate(graph, (), remat=names).peak_bytes > budget:
            break
    assert simulate(graph, (), remat=names).peak_bytes > budget
    for plain_fits in (True, False):
        solved = []

        def run(g, phase, plain_fits=plain_fits, solved=solved):
            solved.append("plain" if g is graph else "rematerialised")
            if g is graph and not plain_fits:
                raise ckptplan.InfeasibleBudgetError("no plan", budget_bytes=budget, min_peak_bytes=budget + 1)
            # the other graph's plan with room for what it rematerialises on the model's graph
            return solve_sqrt(g, budget if g is graph else int(0.97 * budget))

        found = remat_plans.with_remat(graph, budget, run, SolveContext.limited(4), "auto")
        assert solved == (["plain"] if plain_fits else ["plain", "rematerialised"])
        assert simulate(graph, found.regions, remat=found.remat).peak_bytes == found.peak_bytes <= budget


def _recording_polish(calls: list) -> object:
    """``polish``, appending ``(joint, on another graph, start, plan returned)`` to ``calls`` for
    each search ``with_remat`` runs."""

    def recording(graph, budget_bytes, best, ctx, **kwargs):
        found = polish(graph, budget_bytes, best, ctx, **kwargs)
        calls.append((kwargs.get("joint", False), kwargs.get("solved_on") is not None, best, found))
        return found

    return recording


def test_where_most_nodes_are_candidates_a_portfolio_of_regions_alone_runs_first(conv_norm_silu, gpt) -> None:
    """Under ``auto``'s joint portfolio, a graph whose nodes are mostly candidates (convolution,
    norm and SiLU) gets a portfolio of regions alone first, and the joint one starts from the
    cheaper of its plan and the start; a graph with few (the GPT example) gets the joint one
    alone. What comes back fits and is the simulator's."""
    for (_, _, graph), dense in ((conv_norm_silu, True), (gpt, False)):
        assert (len(remat.candidates(graph)) > tuning.ALONE_FIRST_DENSITY * len(graph.nodes)) is dense
        budget = int(0.8 * baseline_peak_bytes(graph))
        calls = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(remat_plans, "polish", _recording_polish(calls))
            found = remat_plans.with_remat(graph, budget, lambda g, phase, budget=budget: solve_sqrt(g, budget),
                                           SolveContext.limited(4), "auto")
        assert [joint for joint, *_ in calls] == ([False, True] if dense else [True])
        if dense:
            (_, _, start, alone), (_, _, joint_start, _) = calls
            assert joint_start.cost_seconds == min(start.cost_seconds, alone.cost_seconds)
        assert simulate(graph, found.regions, remat=found.remat).peak_bytes == found.peak_bytes <= budget
        assert found.cost_seconds <= calls[0][2].cost_seconds


@pytest.mark.parametrize("hinted", [True, False])
def test_above_the_joint_portfolio_s_size_a_start_it_cannot_hint_gets_regions_alone_first(gpt, hinted) -> None:
    """On graphs above ``JOINT_PORTFOLIO_MAX_NODES`` (lowered here) the joint portfolio runs from
    the cheaper of the plain and rematerialised-graph plans; from a start it cannot take as a
    hint (``polish.hints``, forced here), after a portfolio of regions alone, on the graph that
    start was solved on, whose plan it starts from where cheaper. What comes back fits."""
    _, _, graph = gpt
    budget = int(0.8 * baseline_peak_bytes(graph))
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "JOINT_PORTFOLIO_MAX_NODES", len(graph.nodes) - 1)
        patch.setattr(remat_plans, "polish", _recording_polish(calls))
        patch.setattr(remat_plans, "hints", lambda g, plan: hinted)
        found = remat_plans.with_remat(graph, budget, lambda g, phase: solve_sqrt(g, budget),
                                       SolveContext.limited(4), "auto")
    assert [joint for joint, *_ in calls] == ([True] if hinted else [False, True])
    if not hinted:
        (_, on_rematerialised, start, alone), (_, _, joint_start, _) = calls
        assert joint_start.cost_seconds == min(start.cost_seconds, alone.cost_seconds)
        assert on_rematerialised == bool(start.remat)  # the rematerialised graph's plan is searched there
    assert simulate(graph, found.regions, remat=found.remat).peak_bytes == found.peak_bytes <= budget
    assert found.cost_seconds <= calls[0][2].cost_seconds
