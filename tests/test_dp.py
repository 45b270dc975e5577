"""The ``dp`` solver: optimal on chains (checked against exhaustive search through the
simulator), never worse than ``sqrt`` on chains, and every plan fits when measured."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptplan
from ckptplan import Region
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers.chain import build_chain, stage_starts
from ckptplan.solvers.dp import INF, solve_chain, solve_dp
from ckptplan.solvers.dp_curve import cost_curve
from ckptplan.solvers.sqrt import solve_sqrt
from tests import models
from tests.conftest import assert_same_gradients, load_example
from tests.plan_spaces import one_level_plans
from tests.synthetic import chain_graph
from tests.test_simulation_props import dags


def nested_plans(lo: int, hi: int, forbid_whole: bool = False):
    """Every laminar family of regions over nodes [lo, hi): the slow, obvious reference space."""
    if lo >= hi:
        yield ()
        return
    yield from nested_plans(lo + 1, hi)
    for end in range(lo + 1, hi + 1):
        if forbid_whole and end == hi:
            continue
        for inner in list(nested_plans(lo, end, forbid_whole=True)):
            for rest in nested_plans(end, hi):
                yield (Region(lo, end, children=inner), *rest)


def random_chain(rng: random.Random, n: int):
    sizes = [rng.choice([16, 32, 48, 64, 100, 128, 256]) for _ in range(n)]
    return chain_graph(sizes, saves_output=rng.random() < 0.3, param_bytes=rng.choice([8, 64]))


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([16, 32, 48, 64, 100, 128, 256]), min_size=1, max_size=5),
    saves_output=st.booleans(),
    param_bytes=st.sampled_from([8, 64]),
)
def test_dp_matches_exhaustive_nested_search(sizes: list[int], saves_output: bool, param_bytes: int) -> None:
    graph = chain_graph(sizes, saves_output=saves_output, param_bytes=param_bytes)
    reports = [(simulate(graph, plan), plan) for plan in set(nested_plans(0, len(graph.nodes)))]
    chain = build_chain(graph)
    assert len(chain) == len(graph.nodes), "a pure chain keeps one stage per node"
    for budget in sorted({report.peak_bytes for report, _ in reports}):
        best = min(report.recompute_seconds for report, _ in reports if report.peak_bytes <= budget)
        cost, regions = solve_chain(chain, budget, mem_unit=1)
        assert cost == best, f"budget {budget}"
        report = simulate(graph, regions)
        assert report.peak_bytes <= budget and report.recompute_seconds == cost


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([16, 32, 48, 64, 100, 128, 256]), min_size=1, max_size=9),
    saves_output=st.booleans(),
    param_bytes=st.sampled_from([8, 64]),
    mem_unit=st.sampled_from([1, 8, 24]),
    region_nodes=st.sampled_from([0, 1, 3]),
    unit_stages=st.sampled_from([0, 2, 3]),
)
def test_cost_curve_matches_the_reference_dp_at_every_budget(
    sizes: list[int], saves_output: bool, param_bytes: int, mem_unit: int, region_nodes: int, unit_stages: int
) -> None:
    """The vectorised DP (one pass, every budget) against the memoised reference, one budget
    at a time: equal costs and the same plans; each region may cost as much as
    ``region_nodes`` recomputed nodes, and each node in it a third of one; with ``unit_stages``,
    no region may span an edge placed every that many stages (FSDP units)."""
    graph = chain_graph(sizes, saves_output=saves_output, param_bytes=param_bytes)
    node_cost = max(n.fwd_cost for n in graph.nodes)
    graph = replace(graph, region_cost=region_nodes * node_cost, region_op_cost=(region_nodes > 0) * node_cost / 3)
    chain = build_chain(graph)
    if unit_stages:
        last = tuple(min(len(chain), (k // unit_stages + 1) * unit_stages) - 1 for k in range(len(chain)))
        chain = replace(chain, region_last_stage=last)
    top = baseline_peak_bytes(graph) + 2 * mem_unit
    curve = cost_curve(chain, top, mem_unit)
    for budget in range(graph.static.resident_bytes - mem_unit, top + 1, max(1, mem_unit // 2)):
        cost, regions = solve_chain(chain, budget, mem_unit)
        assert curve.cost(budget) == cost, f"budget {budget}"
        if cost < INF:
            assert curve.regions(budget) == regions
            for region in regions:
                first = chain.starts.index(region.start)
                assert region.end <= chain.span(chain.last_region_stage(first))[1]


def test_cost_curve_matches_the_reference_dp_on_a_graph_with_skips() -> None:
    """The U-Net's finest stage chain: nested regions, skips and merged stages exercise every
    state the reference memoises. (Without measured kernel workspaces: at this size the
    convolutions' put the chain's least plan above the unplanned peak, and the curve is empty.)"""
    model, args = load_example("unet").build(batch=1, size=32)
    graph = ckptplan.profile(model, args, workspaces=False)
    chain = build_chain(graph, stage_starts(graph, max_stages=12, skip_share=1.0))
    span = baseline_peak_bytes(graph) - graph.static.resident_bytes
    unit = -(-span // 200)
    curve = cost_curve(chain, baseline_peak_bytes(graph), unit)
    least = curve.least_units()
    assert least is not None
    for units in range(least - 1, 201, 7):
        budget = graph.static.resident_bytes + units * unit
        cost, regions = solve_chain(chain, budget, unit)
        assert curve.cost(budget) == cost
        if cost < INF:
            assert curve.regions(budget) == regions


@settings(max_examples=60, deadline=None)
@given(graph=dags(), share=st.sampled_from([0.0, 1 / 16, 1 / 4, 1.0]))
def test_stage_cuts_match_edge_cuts_of_the_dataflow_graph(graph: ckptplan.ComputeGraph, share: float) -> None:
    """``stage_starts``'s sweep over storage lifetimes against networkx's edge boundaries: a cut k
    carries the outputs of the nodes before k with an edge to a node at or after k (a sink n
    reads the graph outputs); it is clean when those made before the previous cut are at most
    ``share`` of its bytes (none at share 0: no edge jumps over the stage before k)."""
    import networkx as nx

    n = len(graph)
    g = graph.to_networkx()
    g.add_edges_from((j, n) for j in graph.outputs)
    cuts: list[int] = []
    for k in range(1, n):
        previous = cuts[-1] if cuts else 0
        tails = {u for u, _ in nx.edge_boundary(g, range(k), range(k, n + 1))}
        crossing = sum(graph.new_bytes(u) for u in tails)
        if sum(graph.new_bytes(u) for u in tails if u < previous) <= share * crossing:
            cuts.append(k)
    assert stage_starts(graph, max_stages=n + 1, skip_share=share) == [0, *cuts]


@pytest.mark.parametrize("seed", range(8))
def test_dp_never_worse_than_any_one_level_plan_or_sqrt(seed: int) -> None:
    """Seeds 6 and 7 give each region a cost of its own (``graph.region_cost``), seed 7 also
    each node in a region (``graph.region_op_cost``)."""
    rng = random.Random(100 + seed)
    graph = random_chain(rng, rng.randint(6, 8))
    if seed >= 6:
        node_cost = max(n.fwd_cost for n in graph.nodes)
        graph = replace(graph, region_cost=(seed - 5) * node_cost, region_op_cost=(seed == 7) * node_cost / 4)
    reports = [simulate(graph, plan) for plan in one_level_plans(graph, max_keeps=0)]
    peaks = sorted({r.peak_bytes for r in reports})
    for budget in peaks:
        best_one_level = min(r.cost_seconds for r in reports if r.peak_bytes <= budget)
        plan = solve_dp(graph, budget)
        assert plan.status == "optimal"
        assert simulate(graph, plan).peak_bytes == plan.peak_bytes <= budget
        assert plan.cost_seconds <= best_one_level
        try:
            sqrt_plan = solve_sqrt(graph, budget)
        except InfeasibleBudgetError:
            continue
        assert plan.cost_seconds <= sqrt_plan.cost_seconds


def test_dp_reaches_budgets_sqrt_cannot() -> None:
    torch.manual_seed(0)
    graph = ckptplan.profile(models.mlp(depth=12, width=256), (torch.randn(1024, 256),))
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_sqrt(graph, 1)
    sqrt_least = info.value.min_peak_bytes
    plan = solve_dp(graph, sqrt_least - 1)
    assert plan.peak_bytes < sqrt_least


def test_infeasible_budget_names_the_least_peak_and_it_is_reachable() -> None:
    graph = chain_graph([64, 64, 128, 128, 64, 64])
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_dp(graph, 1)
    least = info.value.min_peak_bytes
    assert solve_dp(graph, least).peak_bytes <= least
    with pytest.raises(InfeasibleBudgetError):
        solve_dp(graph, least - 1)


def test_dp_is_deterministic() -> None:
    model, args = load_example("gpt").build(batch=4, seq=64)
    graph = ckptplan.profile(model, args)

    def plan_json(plan: ckptplan.Plan) -> str:
        return plan.model_copy(update={"solver": plan.solver.model_copy(update={"seconds": 0.0})}).to_json()

    again = replace(graph)  # an equal graph without the first solve's kept work
    assert plan_json(ckptplan.solve(graph, 0.7, solver="dp")) == plan_json(ckptplan.solve(again, 0.7, solver="dp"))


def test_skip_connections_merge_stages() -> None:
    model, args = load_example("unet").build(batch=2, size=32)
    graph = ckptplan.profile(model, args)
    chain = build_chain(graph)
    assert 1 < len(chain) < len(graph.nodes)
    assert math.isclose(sum(chain.cost), sum(n.fwd_cost for n in graph.nodes))


def test_coarse_memory_units_stay_within_budget() -> None:
    model, args = load_example("gpt").build(batch=4, seq=64)
    graph = ckptplan.profile(model, args)
    budget = int(0.6 * baseline_peak_bytes(graph))
    fine_unit = 4096
    coarse = solve_dp(graph, budget, mem_unit=64 * fine_unit)
    fine = solve_dp(graph, budget, mem_unit=fine_unit)
    assert coarse.peak_bytes <= budget and fine.peak_bytes <= budget
    assert fine.cost_seconds <= coarse.cost_seconds
    cost, _ = solve_chain(build_chain(graph), graph.static.resident_bytes, mem_unit=1)
    assert cost == INF


def test_nested_dp_plan_runs_with_equal_gradients_and_measured_peak() -> None:
    torch.manual_seed(0)
    model = models.mlp(depth=12, width=256)
    args = (torch.randn(1024, 256),)
    graph = ckptplan.profile(model, args)
    least = None
    try:
        solve_dp(graph, 1)
    except InfeasibleBudgetError as error:
        least = error.min_peak_bytes
    plan = ckptplan.solve(graph, least, solver="dp")
    assert any(region.children for region in plan.regions)
    emitted = ckptplan.emit(graph, plan)
    measured = ckptplan.measure_step(emitted, args).peak_bytes
    assert abs(measured - plan.prediction.peak_bytes) <= 0.03 * measured
    assert_same_gradients(model, emitted, args)


def _least_peaks(graph: ckptplan.ComputeGraph) -> dict[str, int]:
    """The least peak ``sqrt`` and ``dp`` each name when asked for an impossible budget (what
    every plan holds: ``solve`` refuses less at once)."""
    least = {}
    for solver in ("sqrt", "dp"):
        with pytest.raises(InfeasibleBudgetError) as info:
            ckptplan.solve(graph, graph.static.floor_bytes, solver=solver)
        least[solver] = info.value.min_peak_bytes
    return least


def test_gpt_example_dp_never_costs_more_than_sqrt_and_reaches_lower() -> None:
    """On the Quickstart GPT's graph (a quarter of its batch): dp never costs more than sqrt, and
    reaches lower budgets."""
    model, args = load_example("gpt").build(batch=4)
    graph = ckptplan.profile(model, args)
    least = _least_peaks(graph)
    assert least["dp"] < least["sqrt"]
    for fraction in (0.9, 0.7, 0.5, 0.35):
        dp_plan = ckptplan.solve(graph, fraction, solver="dp")
        sqrt_plan = ckptplan.solve(graph, fraction, solver="sqrt")
        assert dp_plan.prediction.cost_seconds <= sqrt_plan.prediction.cost_seconds
    plan = ckptplan.solve(graph, (least["dp"] + least["sqrt"]) // 2, solver="dp")
    measured = ckptplan.measure_step(ckptplan.emit(graph, plan), args).peak_bytes
    assert measured <= plan.budget.bytes


@pytest.mark.parametrize("example", ["unet", "resnet"])
def test_graphs_with_skips_dp_never_costs_more_than_sqrt_and_its_least_peak_is_reachable(example: str) -> None:
    """Skip connections: ``dp`` solves several stage chains (skips charged per stage, and the
    chain at ``sqrt``'s cuts), so it reaches at least as low as ``sqrt`` and costs no more at the
    budgets both reach; the least peak it names is a budget at which it returns a plan."""
    model, args = load_example(example).build(batch=1, size=32) if example == "unet" else load_example(example).build()
    graph = ckptplan.profile(model, args)
    least = _least_peaks(graph)
    assert least["dp"] <= least["sqrt"]
    plan = ckptplan.solve(graph, least["dp"], solver="dp")
    assert plan.prediction.peak_bytes <= least["dp"]
    for fraction in (0.9, 0.7, 0.5):
        budget = int(graph.static.resident_bytes + fraction * (baseline_peak_bytes(graph) - graph.static.resident_bytes))
        try:
            sqrt_plan = ckptplan.solve(graph, budget, solver="sqrt")
        except InfeasibleBudgetError:
            continue
        dp_plan = ckptplan.solve(graph, budget, solver="dp")
        assert simulate(graph, dp_plan).peak_bytes <= budget
        assert dp_plan.prediction.cost_seconds <= sqrt_plan.prediction.cost_seconds


def test_later_solves_of_a_graph_reuse_its_budget_independent_work_and_give_a_fresh_solve_s_plans() -> None:
    """``dp`` and ``sqrt`` keep each graph's budget-independent work (``solvers.memo``, on the
    graph); the plans they then give at other budgets are those of solves with nothing kept."""
    unet, args = load_example("unet").build(batch=1)
    graph = ckptplan.profile(unet, args)
    fractions = (0.7, 0.6, 0.8)
    budgets = [int(baseline_peak_bytes(graph) * f) for f in fractions]
    kept = [solver(graph, b) for b in budgets for solver in (solve_dp, solve_sqrt)]
    assert set(graph.memo) == {"dp", "sqrt"}
    fresh = []
    for budget in budgets:
        for solver in (solve_dp, solve_sqrt):
            copy = replace(graph)  # an equal graph, with nothing kept
            assert not copy.memo
            fresh.append(solver(copy, budget))
    assert [p.regions for p in fresh] == [p.regions for p in kept]
