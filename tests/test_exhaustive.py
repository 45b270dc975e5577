"""Every solver against exhaustive search on small graphs with skips: each plan space a solver
searches is enumerated in full, every plan in it scored by ``simulate``, and at budgets from
the least peak the space reaches to the unplanned peak:

* a plan that reports ``status == "optimal"`` costs exactly the least that any plan of the
  space it claims to be optimal over costs within the budget (``ilp``: one-level regions with
  every keep-set, ``solvers.ilp_model``, which ``auto``'s portfolio phase, ``solvers.polish``,
  proves its plans optimal over too; ``dp`` on a chain of one-node stages: nested regions
  without keep-sets, ``solvers.dp``);
* every plan fits, its prediction is what ``simulate`` says of it, and the cost it predicts is
  never below the least of an enumerated space that holds it (which would mean a solver and the
  simulator disagree).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import pytest

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Plan, Region
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.auto import solve_auto
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.dp import solve_dp
from ckptplan.solvers.ilp import solve_ilp
from ckptplan.solvers.ilp_model import keepable
from ckptplan.solvers.polish import polish
from ckptplan.solvers.solution import Solution
from ckptplan.solvers.sqrt import solve_sqrt
from tests.plan_spaces import nested_region_sets, one_level_plans
from tests.synthetic import RESIDUAL_LAYOUT, UNET_LAYOUT, chain_graph, layout_graph


def _polished(graph: ComputeGraph, budget: int) -> Solution:
    """``auto``'s last phase (the CP-SAT portfolio) from the cheaper of ``sqrt``'s and ``dp``'s
    plans: from nothing when that is nested, else from its regions."""
    starts, errors = [], []
    for kernel in (solve_sqrt, solve_dp):
        try:
            starts.append(kernel(graph, budget))
        except InfeasibleBudgetError as error:
            errors.append(error)
    if not starts:
        raise min(errors, key=lambda error: error.min_peak_bytes)
    return polish(graph, budget, min(starts, key=lambda p: p.cost_seconds), SolveContext.limited(20))


SOLVERS: dict[str, Callable[[ComputeGraph, int], Plan]] = {
    "sqrt": solve_sqrt,
    "dp": solve_dp,
    "ilp": lambda graph, budget: solve_ilp(graph, budget, SolveContext.limited(60)),
    "auto": lambda graph, budget: solve_auto(graph, budget, SolveContext.limited(60)),
    "polish": _polished,
}


class Space:
    """The (peak, cost) of every plan of one enumerated space, and what the space holds."""

    def __init__(self, graph: ComputeGraph, plans: Iterable[tuple[Region, ...]], *, nested: bool, keeps: bool):
        self.graph, self.nested, self.keeps = graph, nested, keeps
        self.scored = [(r.peak_bytes, r.cost_seconds) for r in (simulate(graph, plan) for plan in plans)]

    def least_cost(self, budget: int) -> float | None:
        return min((cost for peak, cost in self.scored if peak <= budget), default=None)

    def holds(self, regions: tuple[Region, ...]) -> bool:
        """Whether a plan of these regions is one this space enumerated."""
        def fits(region: Region, depth: int) -> bool:
            return (
                {region.start, region.end} <= self.graph.boundaries
                and (self.nested or depth == 0)
                and (not region.keep or (self.keeps and all(keepable(self.graph, self.graph.node(k).index)
                                                            for k in region.keep)))
                and all(fits(child, depth + 1) for child in region.children)
            )

        return all(fits(region, 0) for region in regions)


def _budgets(graph: ComputeGraph, space: Space, count: int = 5) -> list[int]:
    """``count`` budgets spread over the distinct peaks of ``space`` below the unplanned peak,
    its least peak first, and the unplanned peak."""
    peaks = sorted({peak for peak, _ in space.scored if peak < baseline_peak_bytes(graph)})
    picked = sorted({peaks[k * (len(peaks) - 1) // (count - 1)] for k in range(count)} if peaks else set())
    return [*picked, baseline_peak_bytes(graph)]


def _check(
    graph: ComputeGraph, spaces: dict[str, Space], claims: dict[str, str], budgets: list[int],
    solvers: dict[str, Callable[[ComputeGraph, int], Plan]] = SOLVERS,
) -> dict:
    """Solve at every budget with every solver and check its plan against the spaces; ``claims``
    names the space each solver's ``optimal`` is over. Returns how often each claim was checked."""
    checked = dict.fromkeys(claims, 0)
    for budget in budgets:
        for name, solver in solvers.items():
            try:
                plan = solver(graph, budget)
            except InfeasibleBudgetError as error:  # only a budget below the solver's reach may refuse
                assert error.min_peak_bytes > budget and budget < baseline_peak_bytes(graph), (name, budget)
                continue
            report = simulate(graph, plan)
            assert report.peak_bytes == plan.peak_bytes <= budget, (name, budget)
            assert plan.cost_seconds == pytest.approx(report.cost_seconds, rel=1e-12), (name, budget)
            for space in spaces.values():
                if space.holds(plan.regions):
                    least = space.least_cost(budget)
                    assert least is not None and plan.cost_seconds >= least * (1 - 1e-12), (name, budget)
            claimed = claims.get(plan.solver)
            if plan.status == "optimal" and claimed is not None:
                least = spaces[claimed].least_cost(budget)
                assert plan.cost_seconds == pytest.approx(least, rel=1e-12, abs=1e-15), (name, budget)
                checked[plan.solver] += 1
    return checked


def test_residual_blocks_of_twelve_nodes() -> None:
    """Four residual blocks with in-place ReLUs: 13,156 one-level plans with keep-sets."""
    graph = layout_graph(RESIDUAL_LAYOUT, name="residual")
    one_level = Space(graph, one_level_plans(graph), nested=False, keeps=True)
    assert len(one_level.scored) == 13_156
    checked = _check(graph, {"one_level": one_level}, {"ilp": "one_level"}, _budgets(graph, one_level))
    assert checked["ilp"] >= 5, checked  # the optimum is proven and compared below the unplanned peak


def test_the_portfolio_widens_its_window_and_claims_only_what_the_whole_model_proves(monkeypatch, caplog) -> None:
    """``auto``'s portfolio searches plans of short regions first (``tuning.POLISH_WINDOWS``, here 2 and
    4 nodes), then wider ones: at budgets where every plan of regions that short costs more than
    the least, it still ends at the least, and its ``optimal`` is over every one-level plan. A
    start with longer regions than a stage allows is no plan of its model, not a disagreement
    between model and simulator."""
    monkeypatch.setattr(tuning, "POLISH_WINDOWS", (2, 4))
    graph = layout_graph(RESIDUAL_LAYOUT, name="residual")
    plans = list(one_level_plans(graph))
    one_level = Space(graph, plans, nested=False, keeps=True)
    short = Space(graph, [p for p in plans if all(r.end - r.start <= 4 for r in p)], nested=False, keeps=True)
    budgets = [b for b in _budgets(graph, one_level) if _dearer(short.least_cost(b), one_level.least_cost(b))]
    assert budgets  # where the short regions' least is dearer
    checked = _check(graph, {"one_level": one_level}, {"ilp": "one_level"}, budgets, solvers={"polish": _polished})
    assert checked["ilp"] == len(budgets), checked
    assert "rejects every plan" not in caplog.text


def _dearer(cost: float | None, least: float | None) -> bool:
    """Whether a space's least ``cost`` (None: no plan fits) is above ``least``."""
    return least is not None and (cost is None or cost > least)


def _small_unet() -> ComputeGraph:
    """``UNET_LAYOUT`` without its middle: eight nodes, the skip from ``relu1`` to ``cat1``."""
    rows = [UNET_LAYOUT[i] for i in (0, 1, 2, 3, 4)]
    rows += [("up1", "aten.linear.default", (4,), 256, ("in",), 512, True),
             ("cat1", "aten.cat.default", (5, 1), 512, (), 0, False),
             ("loss", "aten.mse_loss.default", (6,), 4, ("in",), 64, False)]
    return layout_graph(tuple(rows), name="small_unet")


def test_small_unet_against_every_one_level_plan_with_keeps() -> None:
    """Eight nodes, 8,319 one-level plans with keep-sets (its 231,168 nested plans take a minute
    to score: dp's plans here are checked only when one-level)."""
    graph = _small_unet()
    one_level = Space(graph, one_level_plans(graph), nested=False, keeps=True)
    assert len(one_level.scored) == 8_319
    checked = _check(graph, {"one_level": one_level}, {"ilp": "one_level"}, _budgets(graph, one_level))
    assert checked["ilp"] >= 5, checked


@pytest.mark.parametrize("seed", range(3))
def test_dp_and_ilp_on_chains_against_their_whole_spaces(seed: int) -> None:
    """On a chain of one-node stages dp's model is the simulator's: its ``optimal`` is over every
    nested plan without keep-sets (bytes small enough that its memory unit is one byte)."""
    rng = random.Random(700 + seed)
    graph = chain_graph([rng.choice([8, 16, 24, 40, 64]) for _ in range(5)], param_bytes=8, input_bytes=16,
                        saves_output=seed == 2)
    one_level = Space(graph, one_level_plans(graph), nested=False, keeps=True)
    nested = Space(graph, nested_region_sets(graph), nested=True, keeps=False)
    budgets = sorted({*_budgets(graph, one_level), *_budgets(graph, nested)})
    checked = _check(graph, {"one_level": one_level, "nested": nested}, {"ilp": "one_level", "dp": "nested"},
                     budgets)
    # ilp returns dp's plan, as feasible, where a nested one is cheaper than every one-level plan
    assert checked["ilp"] >= 1 and checked["dp"] >= 2, checked  # dp: below the unplanned peak too


@pytest.mark.slow
def test_unet_of_twelve_nodes_against_every_region_set() -> None:
    """Its 2,048,016 one-level plans with keep-sets are too many to score; the 28,657 region sets
    without keeps are a part of ilp's space (so its optimum is no dearer than theirs) and hold
    the one-level plans of sqrt and dp."""
    graph = layout_graph(UNET_LAYOUT, name="unet")
    region_sets = Space(graph, one_level_plans(graph, max_keeps=0), nested=False, keeps=False)
    for budget in _budgets(graph, region_sets):
        _check(graph, {"region_sets": region_sets}, {}, [budget])
        plan = SOLVERS["ilp"](graph, budget)
        if plan.status == "optimal":
            assert plan.cost_seconds <= region_sets.least_cost(budget) * (1 + 1e-12), budget
