"""``auto``'s last phase, CP-SAT's portfolio from the reproducible phases' cheapest plan
(``solvers.polish``): when it runs, that it only ever returns a cheaper plan the simulator
confirms within the budget, from one-level and nested starts and from the graph with cheap ops
rematerialised. (Its ``optimal`` claims are checked against every plan of small graphs in
``tests/test_exhaustive.py``.)"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

import ckptplan
from ckptplan.region import Region
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import ilp_flat, polish, remat_plans, tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.dp import solve_dp
from ckptplan.solvers.ilp_lazy import LazyResult
from ckptplan.solvers.registry import default_seconds
from ckptplan.solvers.solution import solution
from ckptplan.solvers.sqrt import solve_sqrt
from tests.conftest import load_example
from tests.synthetic import chain_graph


@pytest.fixture(scope="module")
def gpt() -> ckptplan.ComputeGraph:
    model, args = load_example("gpt").build(batch=2, seq=64)
    return ckptplan.profile(model, args)


def test_auto_polishes_graphs_the_whole_model_suits_with_time_for_it() -> None:
    small, large = chain_graph([64] * 6), chain_graph([64] * (tuning.POLISH_MAX_NODES + 1))
    assert polish.polishes(small, "auto", 10.0)
    assert not polish.polishes(small, "ilp", 10.0)  # ilp keeps its own proof phase
    assert not polish.polishes(small, "auto", math.inf)  # no deadline to stop it
    assert not polish.polishes(small, "auto", 2 * tuning.POLISH_MIN_SECONDS * 0.9)
    assert not polish.polishes(large, "auto", 60.0)  # left to the block-by-block plan


def test_the_default_limit_is_seconds_up_to_600_nodes() -> None:
    assert default_seconds("auto", tuning.LARGE_NODES) == 10.0
    assert default_seconds("auto", tuning.LARGE_NODES + 1) == 30.0
    assert default_seconds("ilp", 50) == 60.0 and default_seconds("dp", 50) == math.inf


@pytest.mark.parametrize("start", ["sqrt", "dp"])
def test_the_portfolio_returns_a_cheaper_plan_that_fits_or_its_start(gpt, start: str) -> None:
    """From ``sqrt``'s one-level plan (a hint) and from ``dp``'s (nested here, so from nothing):
    the plan returned fits, is what the simulator says of it, never costs more, and keeps what
    the solve before it skipped."""
    budget = int(0.8 * baseline_peak_bytes(gpt))
    begin = (solve_sqrt if start == "sqrt" else solve_dp)(gpt, budget).but(skipped=("dp skipped: a reason",))
    found = polish.polish(gpt, budget, begin, SolveContext.limited(4))
    report = simulate(gpt, found.regions, remat=found.remat)
    assert report.peak_bytes == found.peak_bytes <= budget
    assert report.cost_seconds == pytest.approx(found.cost_seconds, rel=1e-12)
    assert found.cost_seconds <= begin.cost_seconds and found.skipped == begin.skipped
    if found is not begin:
        assert found.solver == "ilp" and all(not region.children for region in found.regions)
        assert "portfolio" in found.note


def test_auto_ends_no_dearer_than_its_reproducible_phases(gpt, monkeypatch) -> None:
    """The same solve with the portfolio phase left out (everything else as it was) never
    returns a cheaper plan, and the plan ``auto`` returns is the simulator's within budget,
    rematerialisation included."""
    budget = int(0.8 * baseline_peak_bytes(gpt))
    plan = ckptplan.solve(gpt, budget, time_limit=6)
    assert simulate(gpt, plan).peak_bytes == plan.prediction.peak_bytes <= budget
    monkeypatch.setattr(remat_plans, "polish", lambda graph, budget_bytes, best, ctx, **_: best)
    without = ckptplan.solve(gpt, budget, time_limit=6)
    assert plan.prediction.cost_seconds <= without.prediction.cost_seconds


def test_a_plan_of_the_rematerialised_graph_comes_back_rematerialising_what_it_needs(gpt) -> None:
    """Polished on the graph where every candidate is rematerialised, the plan returned is one of
    the model's graph that rematerialises only candidates, fits and costs no more."""
    from ckptplan import remat

    order = remat.by_price(gpt)
    rematerialised = remat.Remat(gpt, order, ())

    def onto(found, budget):
        kept = remat_plans.shed_remat(gpt, found.regions, remat_plans._beside(gpt, order, found.regions), budget)
        return found.resimulated(gpt, found.regions, [gpt.nodes[x].name for x in kept])

    # the first budget where sqrt's plan of the rematerialised graph fits the model's graph
    for fraction in (0.8, 0.7, 0.9, 0.6):
        budget = int(fraction * baseline_peak_bytes(gpt))
        try:
            begin = onto(solve_sqrt(rematerialised.graph, budget), budget)
        except ckptplan.InfeasibleBudgetError:
            continue
        if begin.peak_bytes <= budget:
            break
    assert begin.peak_bytes <= budget and begin.remat
    found = polish.polish(gpt, budget, begin, SolveContext.limited(4), solved_on=rematerialised.graph,
                          onto=lambda plan: onto(plan, budget))
    assert found.peak_bytes == simulate(gpt, found.regions, remat=found.remat).peak_bytes <= budget
    assert set(found.remat) <= {gpt.nodes[x].name for x in order}
    assert found.cost_seconds <= begin.cost_seconds


def test_ctrl_c_before_the_portfolio_keeps_the_plan_made(gpt) -> None:
    budget = int(0.8 * baseline_peak_bytes(gpt))
    begin = solve_sqrt(gpt, budget)
    ctx = SolveContext.limited(4)
    ctx.cancel.set()
    assert polish.polish(gpt, budget, begin, ctx) is begin


def test_a_start_too_long_to_hint_is_cut_into_regions_the_first_stage_can_hint(monkeypatch) -> None:
    """A start whose region spans more nodes than the first stage's window is cut in two at the
    cut whose plan fits and costs least, each half keeping what it held of the keep-set; the
    first stage starts from that plan, and a search that finds nothing cheaper returns it. Where
    no cut fits, the start stays as it was (the stage runs from no hint)."""
    graph = chain_graph([64 * (1 + i % 3) for i in range(80)])
    window = polish.windows(graph)[0]
    kept = (graph.nodes[12].name, graph.nodes[60].name)
    start = (Region(10, 70, kept),)  # 60 nodes: two regions of at most ``window`` each
    assert not polish._within(start, window)
    halves = {cut: (Region(10, cut, kept[:1]), Region(cut, 70, kept[1:])) for cut in sorted(graph.boundaries)
              if 70 - window <= cut <= 10 + window}
    reports = {cut: simulate(graph, plan) for cut, plan in halves.items()}
    budget = max(report.peak_bytes for report in reports.values())
    least = min(reports, key=lambda cut: (reports[cut].cost_seconds, reports[cut].peak_bytes))
    ctx = SolveContext.limited(4)
    assert polish.split_start(graph, budget, start, (), window, ctx) == halves[least]
    tight = min(report.peak_bytes for report in reports.values()) - 1
    assert polish.split_start(graph, tight, start, (), window, ctx) is None
    assert polish.split_start(graph, budget, start, (), window, SolveContext.limited(0.0)) is None  # out of time

    seen = []

    def nothing_cheaper(graph, budget_bytes, regions, ctx, **_):
        seen.append(regions)  # proven: no plan of the model is cheaper than its start
        return LazyResult(status="OPTIMAL", regions=regions, cost=0.0, bound=0.0, rounds=1, rows=0, deferred=0,
                          seeded=0, variables=0, constraints=0, seconds=0.0), regions

    monkeypatch.setattr(ilp_flat, "proof_phase", nothing_cheaper)
    # On a chain a cut recomputes the same ops; a start priced higher stands for one whose cut saves
    # recomputation (as the compare script's GPT-2's does: docs/tuning.md, "polish").
    begin = solution(graph, start, "dp")
    begin = begin.but(report=dataclasses.replace(begin.report, recompute_seconds=2 * begin.report.recompute_seconds))
    assert reports[least].cost_seconds < begin.cost_seconds
    found = polish.polish(graph, budget, begin, SolveContext.limited(4))
    assert seen[0] == halves[least] and found.regions == halves[least]
    assert found.status == "optimal" and found.peak_bytes <= budget
    seen.clear()
    assert polish.polish(graph, tight, begin, SolveContext.limited(4)).regions == start
    assert seen[0] == start


def test_a_start_longer_than_two_windows_is_cut_window_by_window() -> None:
    """A region longer than twice the window loses a first part no longer than the window at
    each cut, until every part fits; each plan on the way fits the budget."""
    graph = chain_graph([64] * 160)
    window = polish.windows(graph)[0]
    start = (Region(4, 150),)
    budget = simulate(graph, start).peak_bytes
    cut = polish.split_start(graph, budget, start, (), window, SolveContext.limited(10))
    assert cut is not None and polish._within(cut, window) and (cut[0].start, cut[-1].end) == (4, 150)
    assert all(a.end == b.start for a, b in itertools.pairwise(cut)) and len(cut) >= 150 // window
    assert simulate(graph, cut).peak_bytes <= budget
