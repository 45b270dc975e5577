"""Block-by-block solving (``solvers.blocks``, the ``ilp`` solver's mode on large graphs): blocks
are found from module paths, block policies are measured exactly, the chosen plans fit under the
simulator, beat ``sqrt``, and run with equal gradients."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

import ckptplan
from ckptplan.repeats import find_blocks
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import blocks, ilp, tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp import keep_more, solve_hierarchical, solve_ilp
from ckptplan.solvers.solution import Solution, solution
from ckptplan.solvers.sqrt import solve_sqrt
from ckptplan.solvers.tuning import FLAT_MAX_NODES, LARGE_POLICY_SHARE, POLICY_SHARE
from ckptplan.units import parse_budget
from tests.conftest import assert_same_gradients, load_example
from tests.synthetic import chain_graph, without_modules


def small_gpt(n_layer: int = 6, batch: int = 4, seq: int = 64):
    example = load_example("gpt")
    torch.manual_seed(0)
    model = example.GPT(block_size=seq, n_layer=n_layer, n_embd=64, n_head=4)
    idx = torch.randint(0, 256, (batch, seq))
    return model, (idx, torch.randint(0, 256, (batch, seq)))


@pytest.fixture(scope="module")
def gpt() -> tuple[torch.nn.Module, tuple, ckptplan.ComputeGraph]:
    model, args = small_gpt()
    return model, args, ckptplan.profile(model, args)


def test_blocks_are_the_transformer_layers(gpt) -> None:
    _, _, graph = gpt
    found, class_of = find_blocks(graph)
    assert [b.path for b in found] == [f"blocks.{i}" for i in range(6)]
    assert all(a.end == b.start for a, b in itertools.pairwise(found))  # consecutive layers, nothing between
    assert len({b.end - b.start for b in found}) == 1
    assert class_of[1:] == [class_of[1]] * 5  # layers 1..5 are identical; layer 0 may differ slightly
    for block in found:
        assert {graph.nodes[i].module.split(".")[1] for i in range(block.start, block.end)} == {block.path[-1]}


def test_graphs_without_module_paths_have_no_blocks() -> None:
    assert find_blocks(without_modules(chain_graph([100] * 12))) == ([], [])
    # chain_graph names its linear nodes layers.0, layers.1, ...: one-node blocks between ReLUs
    assert [(b.start, b.end) for b in find_blocks(chain_graph([100] * 6))[0]] == [(0, 1), (2, 3), (4, 5)]


def test_block_graph_is_a_graph_of_its_own_with_the_ballast_as_loss(gpt) -> None:
    _, _, graph = gpt
    block = find_blocks(graph)[0][2]
    sub = blocks.block_graph(graph, block, ballast_bytes=10**6)
    assert len(sub.nodes) == block.end - block.start + 1
    assert sub.loss_nodes == (len(sub.nodes) - 1,) and sub.nodes[-1].name == "ballast"
    assert [n.name for n in sub.nodes[:-1]] == [n.name for n in graph.nodes[block.start:block.end]]
    # The ballast is live at its forward event, on top of everything the block stored.
    report = simulate(sub, ())
    ballast_event = next(e for e in report.timeline if e.phase == "forward" and e.node == len(sub.nodes) - 1)
    assert ballast_event.live_bytes >= 10**6 + sub.static.resident_bytes


def test_measured_effects_predict_a_uniform_plan(gpt) -> None:
    """The additive model's quantities come from the simulator: placing one policy on every
    block of its class frees, by the end of forward, the sum of what each placement frees."""
    _, _, graph = gpt
    dec, _ = blocks.decompose(graph, SolveContext.limited(4))
    c = dec.class_of[-1]
    members = [k for k, cls in enumerate(dec.class_of) if cls == c]
    base = simulate(graph, ())
    last_forward = max(i for i, e in enumerate(base.timeline) if e.phase == "forward")
    for p, effect in enumerate(dec.policies[c]):
        regions = tuple(r for k in members for r in dec.placements[k][p] or ())
        report = simulate(graph, regions)
        freed = base.timeline[last_forward].live_bytes - report.timeline[last_forward].live_bytes
        assert freed == len(members) * effect.freed_bytes
        assert report.cost_seconds == pytest.approx(len(members) * effect.cost_seconds)


def test_frontier_names_the_middle_of_the_widest_unexplored_gap(gpt) -> None:
    """A solve at budget x returning a plan that costs y rules out cheaper plans peaking at x or
    less, so the gap left between two frontier neighbours starts at the highest such x."""
    _, _, graph = gpt

    def plan(start: int, peak: int, cost: float) -> Solution:  # real plans, chosen numbers
        made = solution(graph, [ckptplan.Region(start, start + 1)], "made")
        return replace(made, report=replace(made.report, peak_bytes=peak, recompute_seconds=cost, checkpoint_seconds=0.0))

    frontier = blocks.Frontier()
    costly, free = plan(1, 1000, 10.0), plan(2, 2000, 0.0)
    frontier.add(1000, costly)
    frontier.add(2000, free)
    frontier.add(900, None)  # nothing within 900: below the frontier, rules nothing out between
    assert frontier.widest_gap(resolution=1) == 1500
    frontier.add(1500, costly)  # nothing cheaper up to 1500
    assert frontier.widest_gap(resolution=1) == 1750
    frontier.add(1750, plan(3, 1700, 4.0))  # gaps: (1500, 1700) × 6 = 1200 against (1750, 2000) × 4 = 1000
    assert frontier.widest_gap(resolution=1) == 1600
    assert frontier.widest_gap(resolution=110) == 1875  # the other gap is under twice the resolution
    assert frontier.widest_gap(resolution=130) is None
    frontier.add(1600, plan(1, 1000, 10.0))  # the same plan again: not a new one, but (1500, 1600] explored
    assert len(frontier.plans) == 3 and frontier.widest_gap(resolution=1) == 1875  # 100 × 6 < 250 × 4
    # A plan no cheaper than a lower-peaking one (a solve stopped early) is off the frontier.
    frontier.add(1740, plan(4, 1720, 5.0))
    assert len(frontier.plans) == 4 and frontier.widest_gap(resolution=1) == 1875


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_block_by_block_plans_fit_and_beat_sqrt(gpt, fraction: float) -> None:
    _, _, graph = gpt
    budget = parse_budget(fraction, baseline_peak_bytes(graph))
    plan = solve_hierarchical(graph, budget, SolveContext.limited(4), warm=())
    assert plan is not None and plan.solver == "ilp" and "block by block" in plan.note
    assert simulate(graph, plan).peak_bytes == plan.peak_bytes <= budget
    assert plan.cost_seconds <= solve_sqrt(graph, budget).cost_seconds


def test_menus_hold_attention_recomputed_alone_whatever_the_limit(gpt) -> None:
    """Recomputing attention's core alone frees most per second (Megatron's selective recompute);
    a region over the whole block reaches it only by keeping every other op, so without
    ``small_region_policies`` the block-by-block plan at 70% cost 7.3x (0.3 s) and 5.9x (4 s) this."""
    _, _, graph = gpt
    found, _ = find_blocks(graph)
    first = blocks.small_region_policies(graph, found[3], baseline_peak_bytes(blocks.block_graph(graph, found[3])))[0]
    assert [graph.nodes[found[3].start + r.start].op for r in first] == ["aten.scaled_dot_product_attention.default"]
    attention = tuple(ckptplan.Region(b.start + r.start, b.start + r.end) for b in found for r in first)
    alone = simulate(graph, attention)
    budget = parse_budget(0.7, baseline_peak_bytes(graph))
    assert alone.peak_bytes <= budget
    for seconds in (0.3, 4):  # menus without flat block solves, with one and with 24 refined warm plans
        plan = solve_hierarchical(graph, budget, SolveContext.limited(seconds), warm=())
        assert plan is not None and plan.peak_bytes <= budget
        assert plan.cost_seconds <= alone.cost_seconds * (1 + 1e-9)


@pytest.fixture(scope="module")
def gpt18() -> ckptplan.ComputeGraph:
    """A graph above ``FLAT_MAX_NODES``: 18 layers."""
    graph = ckptplan.profile(*small_gpt(n_layer=18))
    assert len(graph.nodes) > FLAT_MAX_NODES
    return graph


def test_large_graphs_of_blocks_are_solved_block_by_block_and_deterministically(gpt18) -> None:
    graph = gpt18

    def plan_json() -> str:
        plan = ckptplan.solve(graph, 0.6, solver="ilp", time_limit=3)
        return plan.model_copy(update={"solver": plan.solver.model_copy(update={"seconds": 0.0})}).to_json()

    first = plan_json()
    assert "block by block" in first and first == plan_json()
    auto = ckptplan.solve(graph, 0.6, time_limit=1)
    assert "dp skipped" in auto.solver.note


def test_block_policies_get_more_of_the_limit_when_warm_plans_are_given(gpt18, monkeypatch) -> None:
    """Without a proof phase to follow, ``ilp`` on a large graph gives the block policies
    ``POLICY_SHARE`` of its limit when it must make ``sqrt``'s plan itself or the limit is short,
    and ``LARGE_POLICY_SHARE`` when given warm plans (as ``auto`` gives them) and time."""
    asked: list[float] = []
    decompose = blocks.decompose

    def recording(graph, ctx):
        asked.append(ctx.limit)
        return decompose(graph, ctx)

    monkeypatch.setattr(blocks, "decompose", recording)
    budget = parse_budget(0.6, baseline_peak_bytes(gpt18))
    warm = [solve_sqrt(gpt18, budget)]
    monkeypatch.setattr(tuning, "LARGE_POLICY_MIN_SECONDS", 3.0)  # a long limit, for this test's purpose
    for given, limit in ((None, 3.0), (warm, 3.0), (warm, 2.5)):
        plan = solve_ilp(gpt18, budget, SolveContext.limited(limit), warm=given)
        assert simulate(gpt18, plan).peak_bytes <= budget
    assert asked == pytest.approx([3 * POLICY_SHARE, 3 * LARGE_POLICY_SHARE, 2.5 * POLICY_SHARE])
    assert POLICY_SHARE < LARGE_POLICY_SHARE


def test_keep_more_keeps_outputs_where_they_fit_and_recompute_less(gpt18) -> None:
    """``keep_more``, the last step on graphs above ``FLAT_MAX_NODES``: from √N's whole-region
    plan it must find keeps that fit (each move is simulated), and with no moves it changes nothing."""
    graph = gpt18
    budget = parse_budget(0.6, baseline_peak_bytes(graph))
    start = solve_sqrt(graph, budget)
    refined = keep_more(graph, start, budget, SolveContext.limited(3))
    report = simulate(graph, refined)
    assert report.peak_bytes <= budget and refined.peak_bytes == report.peak_bytes
    assert report.cost_seconds < simulate(graph, start).cost_seconds
    added = sum(len(r.keep) for r in refined.regions) - sum(len(r.keep) for r in start.regions)
    assert [(r.start, r.end) for r in refined.regions] == [(r.start, r.end) for r in start.regions]
    assert added > 0 and refined.note.endswith(f"then {added} more output(s) kept by refine.add_keeps")
    assert keep_more(graph, start, budget, SolveContext.limited(0)) is start


def test_block_by_block_plan_runs_with_equal_gradients_and_measured_peak(gpt) -> None:
    model, args, graph = gpt
    budget = parse_budget(0.5, baseline_peak_bytes(graph))
    plan = solve_hierarchical(graph, budget, SolveContext.limited(4), warm=())
    assert len(plan.regions) >= 2
    emitted = ckptplan.emit(graph, ckptplan.make_plan(graph, plan.regions))
    measured = ckptplan.measure_step(emitted, args).peak_bytes
    assert abs(measured - plan.peak_bytes) <= 0.03 * measured
    assert_same_gradients(model, emitted, args)


def test_graphs_of_blocks_get_the_proof_phase_from_the_block_by_block_plan(gpt, monkeypatch) -> None:
    """When the limit leaves the proof phase ``MIN_PROOF_SECONDS`` (lowered here), ``ilp`` runs it
    on the whole graph from the block-by-block plan: a proven gap, and a plan no dearer than the
    warm starts', also when the graph counts as large (``FLAT_MAX_NODES`` lowered). Whether the
    limit leaves that time (``proof_follows``) depends on the graph: large ones keep a larger
    share for the proof phase, and graphs above ``QUICK_PROOF_MAX_NODES`` need
    ``SLOW_PROOF_MIN_SECONDS``."""

    _, _, graph = gpt
    budget = parse_budget(0.7, baseline_peak_bytes(graph))
    monkeypatch.setattr(tuning, "MIN_PROOF_SECONDS", 1.0)
    dp_cost = ckptplan.solve(graph, budget, solver="dp").prediction.cost_seconds
    for flat_max in (tuning.FLAT_MAX_NODES, len(graph.nodes) - 1):
        monkeypatch.setattr(tuning, "FLAT_MAX_NODES", flat_max)
        plan = ilp.solve_ilp(graph, budget, SolveContext.limited(4))
        assert "block by block" in plan.note and "proof phase on the whole graph" in plan.note
        assert plan.gap is not None and 0.0 <= plan.gap <= 1.0
        assert plan.status == "feasible" or plan.gap == 0.0
        assert simulate(graph, plan).peak_bytes == plan.peak_bytes <= budget
        assert plan.cost_seconds <= solve_sqrt(graph, budget).cost_seconds
        if flat_max > len(graph.nodes):  # dp is a warm start on small graphs only
            assert plan.cost_seconds <= dp_cost
    # Large graphs keep LARGE_PROOF_SHARE of the limit for the proof phase, smaller ones PROOF_SHARE.
    short = ilp.solve_ilp(graph, budget, SolveContext.limited(3))  # 0.5 × 3 s >= 1 s
    assert "proof phase on the whole graph" in short.note
    assert not ilp.proof_follows(graph, 1.9)  # 0.5 × 1.9 s < 1 s
    monkeypatch.setattr(tuning, "FLAT_MAX_NODES", len(graph.nodes))
    assert not ilp.proof_follows(graph, 3)  # 0.3 × 3 s < 1 s
    # Above QUICK_PROOF_MAX_NODES the proof phase needs SLOW_PROOF_MIN_SECONDS.
    monkeypatch.setattr(tuning, "QUICK_PROOF_MAX_NODES", len(graph.nodes) - 1)
    monkeypatch.setattr(tuning, "SLOW_PROOF_MIN_SECONDS", 6.0)
    assert ilp.proof_follows(graph, 20) and not ilp.proof_follows(graph, 19)  # 0.3 × 20 s = 6 s
