"""``solvers.refine``: its moves keep a plan's regions, never break the budget nor raise the
cost, keep what costs most per byte, and the ilp's search starts no worse than they end."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptplan import Region
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp import solve_ilp
from ckptplan.solvers.refine import Moves, add_keeps, shed_keeps, simplify
from ckptplan.solvers.sqrt import solve_sqrt
from tests.plan_spaces import random_plan
from tests.synthetic import chain_graph, skip_graph


def _spans(regions: tuple[Region, ...]) -> list[tuple[int, int]]:
    return [(r.start, r.end) for r in regions]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([16, 48, 100, 256]), min_size=2, max_size=9),
    flops=st.lists(st.integers(1, 5000), min_size=9, max_size=9),
    skip=st.booleans(),
    slack=st.sampled_from([0, 40, 400]),
    seed=st.integers(0, 10_000),
)
def test_moves_keep_the_regions_fit_the_budget_and_cost_no_more(
    sizes: list[int], flops: list[int], skip: bool, slack: int, seed: int
) -> None:
    graph = skip_graph() if skip else chain_graph(sizes, fwd_flops=flops[: len(sizes)])
    regions = random_plan(graph, random.Random(seed))
    before = simulate(graph, regions)
    budget = before.peak_bytes + slack

    added = add_keeps(graph, regions, budget)
    assert _spans(added) == _spans(regions)
    assert all(set(r.keep) <= set(a.keep) for r, a in zip(regions, added, strict=True))
    after = simulate(graph, added)
    assert after.peak_bytes <= budget and after.cost_seconds <= before.cost_seconds

    shed = shed_keeps(graph, regions, budget)
    bare = tuple(Region(r.start, r.end) for r in regions)
    assert (shed is None) == (simulate(graph, bare).peak_bytes > budget)
    if shed is not None:
        assert _spans(shed) == _spans(regions) and simulate(graph, shed).peak_bytes <= budget

    simple = simplify(graph, regions, budget)
    assert simulate(graph, simple).peak_bytes <= budget
    assert simulate(graph, simple).cost_seconds <= before.cost_seconds


def test_add_keeps_keeps_the_costliest_output_per_byte_first() -> None:
    # linear_2 costs 50x its neighbours per byte; the budget holds one kept output of 100 bytes.
    graph = chain_graph([100] * 6, fwd_flops=[200, 100, 10_000, 100, 200, 100])
    region = (Region(0, 6),)
    budget = simulate(graph, (Region(0, 6, keep=("linear_2",)),)).peak_bytes
    kept = add_keeps(graph, region, budget)[0].keep
    assert "linear_2" in kept
    assert simulate(graph, (Region(0, 6, keep=kept),)).peak_bytes <= budget


def test_shed_keeps_recomputes_the_cheapest_outputs_per_byte_first() -> None:
    graph = chain_graph([100] * 6, fwd_flops=[200, 100, 10_000, 100, 200, 100])
    budget = simulate(graph, (Region(0, 6, keep=("linear_2",)),)).peak_bytes
    shed = shed_keeps(graph, (Region(0, 6),), budget)
    assert shed is not None and "linear_2" in shed[0].keep


def test_moves_stop_the_passes_when_spent() -> None:
    """An allowance of moves, shared by the passes, bounds their work by count (not by the clock,
    which would make the plan depend on the machine): none spent leaves the plan as it was."""
    graph = chain_graph([100] * 6, fwd_flops=[200, 100, 10_000, 100, 200, 100])
    region = (Region(0, 6),)
    budget = simulate(graph, (Region(0, 6, keep=("linear_2",)),)).peak_bytes
    assert add_keeps(graph, region, budget, moves=Moves(0)) == region
    assert shed_keeps(graph, region, budget, moves=Moves(0)) is None  # every output kept breaks the budget
    moves = Moves(1)
    assert "linear_2" in add_keeps(graph, region, budget, moves=moves)[0].keep  # the costliest per byte first
    assert moves.left == 0
    assert add_keeps(graph, region, budget, moves=moves) == region  # the allowance is shared


def test_the_ilp_search_starts_from_the_refined_warm_plan() -> None:
    """Stopped at once, the ilp returns a plan no dearer than ``add_keeps`` makes of its warm plan."""
    graph = chain_graph([100, 300, 100, 300, 100, 300, 100, 300], fwd_flops=[4000, 10, 4000, 10, 4000, 10, 4000, 10])
    budget = int(0.8 * baseline_peak_bytes(graph))
    sqrt_plan = solve_sqrt(graph, budget)
    refined = simulate(graph, add_keeps(graph, sqrt_plan.regions, budget))
    assert refined.cost_seconds < sqrt_plan.cost_seconds  # the move matters here
    plan = solve_ilp(graph, budget, SolveContext.limited(0.0), warm=[sqrt_plan])
    assert plan.peak_bytes <= budget
    assert plan.cost_seconds <= refined.cost_seconds
