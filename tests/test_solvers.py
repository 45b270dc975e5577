"""Every registered solver, refereed by the simulator, on synthetic graphs (no torch)."""

from __future__ import annotations

from functools import cache
from itertools import pairwise

import pytest

import ckptplan
from ckptplan.build import make_plan
from ckptplan.errors import BudgetError, CkptPlanError, InfeasibleBudgetError, UnknownSolverError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import BudgetInfo, Plan, Region, SolverInfo
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import available_solvers, registry, solve
from ckptplan.solvers.context import Progress
from ckptplan.solvers.registry import get_solver, register
from ckptplan.solvers.sqrt import crossing_bytes, segment
from ckptplan.units import format_bytes
from tests.synthetic import chain_graph, skip_graph, without_modules

SOLVERS = available_solvers()

GRAPHS = {
    "uniform16": lambda: chain_graph([1000] * 16, param_bytes=16, saves_output=True),
    "varied20": lambda: chain_graph([(37 * i) % 500 + 100 for i in range(20)], param_bytes=40),
    "bulge6": lambda: chain_graph([100, 100, 400, 400, 100, 100]),
    "skip": skip_graph,
    "single": lambda: chain_graph([50]),
}


@cache
def graph_named(name: str) -> ComputeGraph:
    return GRAPHS[name]()


@cache
def least_peak(graph_name: str, solver: str) -> int:
    """The least peak ``solver`` reaches on the graph, as its ``InfeasibleBudgetError`` reports
    for a budget of what every plan holds (``solve`` refuses less at once)."""
    floor = graph_named(graph_name).static.floor_bytes
    try:
        return solve(graph_named(graph_name), floor, solver=solver).prediction.peak_bytes  # nothing is lower
    except InfeasibleBudgetError as error:
        assert error.least_plan is not None
        return error.min_peak_bytes


def budgets_between(graph_name: str, solver: str) -> list[int]:
    least, baseline = least_peak(graph_name, solver), baseline_peak_bytes(graph_named(graph_name))
    return sorted({least + (baseline - least) * k // 4 for k in range(5)})


def _without_timing(plan: Plan) -> str:
    return plan.model_copy(update={"solver": plan.solver.model_copy(update={"seconds": 0.0})}).to_json()


# ----------------------------------------------------------------------------- registry
def test_registry_lists_auto_first_then_by_name() -> None:
    assert SOLVERS[0] == "auto"
    assert "sqrt" in SOLVERS
    assert SOLVERS[1:] == sorted(SOLVERS[1:])
    assert ckptplan.available_solvers() == SOLVERS


def test_unknown_solver_lists_the_choices() -> None:
    with pytest.raises(UnknownSolverError) as info:
        solve(graph_named("bulge6"), "100%", solver="magic")
    message = str(info.value)
    assert isinstance(info.value, KeyError) and isinstance(info.value, CkptPlanError)
    assert "'magic'" in message and not message.startswith('"')
    assert all(name in message for name in SOLVERS)
    with pytest.raises(UnknownSolverError):
        get_solver("")


def test_a_name_cannot_be_registered_twice() -> None:
    before = available_solvers()
    with pytest.raises(ValueError, match="twice"):
        register("sqrt")(lambda graph, budget_bytes, ctx=None: None)
    assert available_solvers() == before and get_solver("sqrt").__name__ == "solve_sqrt"


def _fixed_solver(regions: tuple[Region, ...], least_peak_bytes: int):
    """A stand-in solver that always proposes ``regions``: its plan when it fits, else infeasible
    with ``least_peak_bytes`` (whatever it claims) as its least peak, its plan attached when that
    is the plan's peak."""

    def solve_fixed(graph: ComputeGraph, budget_bytes: int, ctx: object = None) -> Plan:
        plan = make_plan(
            graph,
            regions,
            budget=BudgetInfo(requested=str(budget_bytes), bytes=budget_bytes),
            solver=SolverInfo(name="aaa_fixed", status="feasible", seconds=0.0),
        )
        if plan.prediction.peak_bytes > budget_bytes:
            honest = plan.prediction.peak_bytes == least_peak_bytes  # the claim is its plan's peak
            raise InfeasibleBudgetError("Too small.", budget_bytes=budget_bytes, min_peak_bytes=least_peak_bytes,
                                        least_plan=plan if honest else None)
        return plan

    return solve_fixed


def test_auto_keeps_the_cheapest_plan_and_the_least_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = graph_named("bulge6")
    monkeypatch.setitem(registry._USER, "aaa_fixed", _fixed_solver((Region(0, 6),), least_peak_bytes=7))
    assert available_solvers()[:2] == ["auto", "aaa_fixed"]  # auto first, even before "aaa"
    # All fit at the baseline: the real solvers' empty plans cost nothing, the whole-graph region does.
    plan = solve(graph, "100%", solver="auto")
    assert plan.solver.name in ("dp", "sqrt") and plan.regions == ()
    assert solve(graph, "100%", solver="aaa_fixed").prediction.recompute_seconds > 0
    # Nothing fits: auto states the least peak of a plan a solver made, not the 7 bytes the fixed
    # solver claims without one, and asking for it gets a plan.
    least = min(least_peak("bulge6", name) for name in ("dp", "ilp", "sqrt"))
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, least - 1, solver="auto")
    assert info.value.min_peak_bytes == least == info.value.least_plan.prediction.peak_bytes
    assert info.value.budget_bytes == least - 1 and f"({least:,} bytes)" in str(info.value)
    assert solve(graph, least, solver="auto").prediction.peak_bytes <= least


def test_auto_picks_the_only_solver_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # On bulge6 a region over [0, 3) peaks lower than anything sqrt finds (its least is the baseline).
    graph = graph_named("bulge6")
    regions = (Region(0, 3),)
    peak = simulate(graph, regions).peak_bytes
    assert peak < least_peak("bulge6", "sqrt")
    monkeypatch.setitem(registry._USER, "aaa_fixed", _fixed_solver(regions, least_peak_bytes=peak))
    plan = solve(graph, peak, solver="auto")
    # auto's portfolio phase may prove the plan optimal: then ilp claims it, its origin kept
    assert plan.regions == regions and "aaa_fixed" in (plan.solver.name, plan.solver.origin)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, peak - 1, solver="auto")
    assert info.value.min_peak_bytes == peak


# ----------------------------------------------------------------------------- every solver
@pytest.mark.parametrize("graph_name", list(GRAPHS))
@pytest.mark.parametrize("solver", SOLVERS)
def test_plans_fit_their_budget_under_the_simulator(solver: str, graph_name: str) -> None:
    graph = graph_named(graph_name)
    for budget in budgets_between(graph_name, solver):
        plan = solve(graph, budget, solver=solver)
        report = simulate(graph, plan)
        assert plan.prediction.peak_bytes == report.peak_bytes <= plan.budget.bytes == budget
        assert plan.prediction.recompute_flops == report.recompute_flops
        assert plan.prediction.recompute_seconds == report.recompute_seconds
        assert plan.prediction.baseline_peak_bytes == baseline_peak_bytes(graph)
        assert plan.model.fingerprint == graph.fingerprint and plan.model.node_count == len(graph)
        assert plan.solver.status in ("optimal", "feasible") and plan.solver.seconds >= 0.0
        # "remat": rematerialisation alone (no regions), which auto considers (ckptplan.remat).
        assert plan.solver.name in (*SOLVERS, "remat") and plan.solver.name != "auto"
        assert plan.solver.name != "remat" or (plan.remat and not plan.regions)
        assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("graph_name", list(GRAPHS))
@pytest.mark.parametrize("solver", SOLVERS)
def test_a_tighter_budget_never_costs_less(solver: str, graph_name: str) -> None:
    graph = graph_named(graph_name)
    costs = [solve(graph, b, solver=solver).prediction.cost_seconds for b in budgets_between(graph_name, solver)]
    assert costs == sorted(costs, reverse=True)


@pytest.mark.parametrize("graph_name", list(GRAPHS))
def test_auto_is_no_worse_than_any_solver(graph_name: str) -> None:
    graph = graph_named(graph_name)
    others = [name for name in SOLVERS if name != "auto"]
    assert least_peak(graph_name, "auto") == min(least_peak(graph_name, name) for name in others)
    for budget in budgets_between(graph_name, "auto"):
        auto = solve(graph, budget, solver="auto")
        assert auto.solver.note.startswith(f"auto chose {auto.solver.name}")
        for name in others:
            try:
                plan = solve(graph, budget, solver=name)
            except InfeasibleBudgetError:
                continue
            assert auto.prediction.cost_seconds <= plan.prediction.cost_seconds


@pytest.mark.parametrize("solver", SOLVERS)
def test_solving_is_deterministic(solver: str) -> None:
    graph = graph_named("varied20")
    budget = budgets_between("varied20", solver)[1]
    first, second = (
        solve(graph, budget, solver=solver),
        solve(chain_graph([(37 * i) % 500 + 100 for i in range(20)], param_bytes=40), budget, solver=solver),
    )
    assert first.regions == second.regions
    assert _without_timing(first) == _without_timing(second)


@pytest.mark.parametrize("graph_name", list(GRAPHS))
@pytest.mark.parametrize("solver", SOLVERS)
def test_budget_below_the_least_peak_names_it(solver: str, graph_name: str) -> None:
    graph = graph_named(graph_name)
    least = least_peak(graph_name, solver)
    assert least <= baseline_peak_bytes(graph)
    budget = least - 1
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, budget, solver=solver)
    error = info.value
    assert error.budget_bytes == budget < error.min_peak_bytes == least
    message = str(error)
    assert f"{least:,}" in message or format_bytes(least) in message
    # The least peak is reachable: asking for exactly it succeeds.
    assert solve(graph, least, solver=solver).prediction.peak_bytes <= least


# ``solve`` resolves the budget before any solver sees it, so the fast solvers cover every form;
# the slow ones add only CI time (about 17 s).
@pytest.mark.parametrize("solver", ["sqrt", "dp"])
def test_budget_forms_resolve_to_the_same_bytes(solver: str) -> None:
    graph = graph_named("uniform16")
    expected = int(0.6 * baseline_peak_bytes(graph))
    assert expected >= least_peak("uniform16", solver)  # 60% is reachable on this graph
    plans = {form: solve(graph, form, solver=solver) for form in ("60%", 0.6, "0.6", expected)}
    assert {p.budget.bytes for p in plans.values()} == {expected}
    assert plans["60%"].budget.requested == "60%" and plans[expected].budget.requested == str(expected)
    assert len({p.regions for p in plans.values()}) == 1
    assert all(p.prediction.peak_bytes <= expected for p in plans.values())


@pytest.mark.parametrize("graph_name", list(GRAPHS))
@pytest.mark.parametrize("solver", SOLVERS)
def test_a_budget_above_the_baseline_needs_no_checkpointing(solver: str, graph_name: str) -> None:
    graph = graph_named(graph_name)
    for budget in (baseline_peak_bytes(graph), baseline_peak_bytes(graph) + 1000, "100%", 1.0, "8GB"):
        plan = solve(graph, budget, solver=solver)
        assert plan.regions == ()
        assert plan.prediction.recompute_flops == 0 and plan.prediction.recompute_seconds == 0.0
        assert plan.prediction.peak_bytes == baseline_peak_bytes(graph)
        assert {n.decision for n in plan.nodes} == {"store"}


def test_solve_checks_the_budget_text() -> None:
    with pytest.raises(BudgetError):
        solve(graph_named("bulge6"), "lots")
    with pytest.raises(BudgetError):
        solve(graph_named("bulge6"), 1.5)


def test_solvers_reduce_memory_on_a_long_chain() -> None:
    # Teeth for the tests above: checkpointing a 16-layer chain reaches well under its baseline.
    graph = graph_named("uniform16")
    plan = solve(graph, "60%")
    assert plan.regions and plan.prediction.recompute_flops > 0
    assert plan.prediction.peak_bytes <= 0.6 * baseline_peak_bytes(graph)


def test_empty_graph() -> None:
    graph = chain_graph([])
    assert simulate(graph, []).peak_bytes == graph.static.resident_bytes
    for name in SOLVERS:
        plan = solve(graph, "100%", solver=name)
        assert plan.regions == () and plan.prediction.peak_bytes == graph.static.resident_bytes


# ----------------------------------------------------------------------------- sqrt internals
def test_crossing_bytes_on_a_chain() -> None:
    acts = [100, 200, 300, 400, 500]
    # Cut k (0 < k < n) is crossed by node k-1's output only; nothing crosses the ends.
    assert crossing_bytes(chain_graph(acts)) == [0, 100, 200, 300, 400, 0]


def test_crossing_bytes_counts_the_skip_connection() -> None:
    # enc_relu (400 bytes) is read by down (2) and cat (6): it crosses cuts 2..6. Hidden masks
    # are not activations and are not counted.
    assert crossing_bytes(skip_graph()) == [0, 400, 400, 600, 600, 600, 800, 800, 100, 0]


def test_segment_is_chens_greedy() -> None:
    graph = chain_graph([100] * 6)
    everywhere = set(range(1, 6))
    # linear_0 saves only the graph input (resident), so the first segment must also take relu_1.
    assert segment(graph, 0.0, everywhere) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert segment(graph, 150.0, everywhere) == [(0, 3), (3, 5), (5, 6)]
    assert segment(graph, float("inf"), everywhere) == [(0, 6)]
    assert segment(graph, 0.0, {4}) == [(0, 4), (4, 6)]
    assert segment(graph, 0.0, set()) == [(0, 6)]


def test_sqrt_records_its_provenance() -> None:
    plan = solve(graph_named("uniform16"), "60%", solver="sqrt")
    assert plan.solver.name == "sqrt" and plan.solver.status == "feasible"
    assert f"{len(plan.regions)} checkpoint segment(s) over 16 nodes" in plan.solver.note
    assert all(isinstance(r, Region) and not r.children and not r.keep for r in plan.regions)


def test_auto_says_when_the_graph_is_too_large_for_ilp(monkeypatch) -> None:
    """Without repeated blocks, ``ilp`` skips graphs of more than ``FLAT_MAX_NODES`` nodes and
    ``auto`` says so; its last phase, CP-SAT's portfolio on ``ilp``'s model of short regions
    (``solvers.polish``, graphs of up to 600 nodes), may then only improve on the plan kept."""
    from ckptplan.solvers import remat_plans
    from ckptplan.solvers.tuning import FLAT_MAX_NODES

    graph = without_modules(chain_graph([100] * (FLAT_MAX_NODES + 2)))
    plan = solve(graph, "80%", solver="auto", time_limit=4)
    monkeypatch.setattr(remat_plans, "polish", lambda graph, budget_bytes, best, ctx, **_: best)
    kept = solve(graph, "80%", solver="auto", time_limit=4)
    assert kept.solver.name in ("dp", "sqrt")
    skipped = f"ilp skipped: {FLAT_MAX_NODES + 2} nodes > {FLAT_MAX_NODES} and no repeated blocks"
    assert skipped in kept.solver.note
    assert plan.prediction.cost_seconds <= kept.prediction.cost_seconds
    assert plan.solver.name == kept.solver.name or "portfolio" in plan.solver.note
    assert skipped in plan.solver.note  # whichever phase's plan won


def test_a_solve_reports_its_phases_and_its_best_plan_as_it_goes() -> None:
    """``solve(progress=...)`` hears each phase as it starts, and a best plan that only gets
    cheaper; the plan returned is no dearer than the best reported, which a plan of the solve
    (not one of a block or of the rematerialised graph) reached."""
    graph = graph_named("varied20")
    heard: list[Progress] = []
    plan = solve(graph, 0.6, solver="auto", time_limit=5, progress=heard.append)
    phases = [p.phase for p in heard]
    assert {"sqrt", "dp", "ilp"} <= set(phases)
    costs = [p.best_cost_seconds for p in heard if p.best_cost_seconds is not None]
    assert costs and all(b <= a for a, b in pairwise(costs))
    assert plan.prediction.cost_seconds <= costs[-1] * (1 + 1e-12)
    assert heard[-1].best_peak_bytes is not None and heard[-1].best_peak_bytes <= plan.budget.bytes
    bounds = [p.bound_cost_seconds for p in heard if p.bound_cost_seconds is not None]
    assert all(b >= a for a, b in pairwise(bounds))


def test_a_solve_without_a_listener_is_the_same_solve() -> None:
    graph = graph_named("skip")
    heard: list[object] = []
    quiet = solve(graph, 0.8, solver="ilp", time_limit=2)
    told = solve(graph, 0.8, solver="ilp", time_limit=2, progress=heard.append)
    assert heard and _without_timing(quiet) == _without_timing(told)
