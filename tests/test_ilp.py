"""The ``ilp`` solver: its CP-SAT model agrees with the simulator plan by plan, it is optimal
against exhaustive search over one-level plans with keep-sets, and its plans run."""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

import ckptplan
from ckptplan import remat
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.simulation import baseline_peak_bytes, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.cpsat import fix_plan, solve_interruptibly
from ckptplan.solvers.dp import solve_dp
from ckptplan.solvers.ilp import solve_ilp
from ckptplan.solvers.ilp_flat import least_peak
from ckptplan.solvers.ilp_lazy import (
    DEFERRED_PHASES,
    _seed_rows,
    fewer_of_a_class,
    proof_search,
    proof_workers,
    search_lazily,
    symmetric_classes,
)
from ckptplan.solvers.ilp_model import COST_SCALE, add_events, build_model
from ckptplan.solvers.sqrt import least_peak_regions, solve_sqrt
from tests import models
from tests.architectures import ARCHITECTURES
from tests.conftest import assert_same_gradients, load_example
from tests.ilp_oracles import model_cost, model_peak
from tests.plan_spaces import one_level_plans, random_plan
from tests.synthetic import chain_graph, skip_graph


# ----------------------------------------------------------------------------- the model
@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([16, 32, 48, 64, 100, 128, 256]), min_size=1, max_size=8),
    saves_output=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_model_peak_equals_the_simulated_peak_on_chains(sizes: list[int], saves_output: bool, seed: int) -> None:
    graph = chain_graph(sizes, saves_output=saves_output)
    plan = random_plan(graph, random.Random(seed))
    assert model_peak(graph, plan) == simulate(graph, plan).peak_bytes


def test_model_peak_equals_the_simulated_peak_with_skips_dropout_and_keeps() -> None:
    graph = skip_graph()
    rng = random.Random(1)
    for _ in range(200):
        plan = random_plan(graph, rng)
        assert model_peak(graph, plan) == simulate(graph, plan).peak_bytes, plan


def test_bounding_clauses_cut_off_no_plan() -> None:
    """The proof phase's redundant clauses (``held_s or recomputed_p``) hold for every plan: with
    them the model's least peak and least cost for a fixed plan are still the simulator's."""
    graph = replace(skip_graph(), region_cost=2.0**-20, region_op_cost=2.0**-23, policy_op_cost=2.0**-22)
    rng = random.Random(4)
    for _ in range(60):
        plan = random_plan(graph, rng)
        report = simulate(graph, plan)
        assert model_peak(graph, plan, bounding=True) == report.peak_bytes, plan
        cost = model_cost(graph, plan, budget_bytes=report.peak_bytes, bounding=True)
        assert cost == pytest.approx(report.cost_seconds, rel=1e-9), plan


def test_model_cost_equals_the_simulated_cost_with_checkpoint_machinery() -> None:
    """The objective counts what ``simulate`` does: recomputed nodes, each region's fixed cost,
    its cost per node, and the selective policy's cost per kept node (in forward and again in
    the recompute). Costs are powers of two, so the model's integers
    are exact."""
    graph = replace(skip_graph(), region_cost=2.0**-20, region_op_cost=2.0**-23, policy_op_cost=2.0**-22)
    rng = random.Random(2)
    for _ in range(100):
        plan = random_plan(graph, rng)
        report = simulate(graph, plan)
        expected = report.recompute_seconds + sum(
            2.0**-20 + 2.0**-23 * (r.end - r.start) + 2 * 2.0**-22 * len(r.keep)
            for r in plan
        )
        assert report.cost_seconds == expected
        assert model_cost(graph, plan, budget_bytes=report.peak_bytes) == pytest.approx(expected, rel=1e-9), plan


@pytest.mark.parametrize("name", ["gpt", "unet"])
def test_model_cost_equals_the_simulated_cost_on_profiled_examples(name: str) -> None:
    """On real graphs (views, dropout masks, multi-output ops, skips) the model's least cost for a
    fixed plan, within its simulated peak, is the simulated cost. The budget matters: without it
    the model could hold a storage it need not hold, and so hide a term that overcharges a plan
    for dropping it."""
    example = load_example(name)
    if name == "gpt":
        torch.manual_seed(0)
        ids = torch.randint(0, 256, (2, 32))
        model, args = example.GPT(n_layer=2, block_size=32), (ids, torch.randint(0, 256, (2, 32)))
    else:
        model, args = example.build()
    graph = ckptplan.profile(model, args)
    rng = random.Random(3)
    for _ in range(5):
        plan = random_plan(graph, rng)
        rounding = (2 * len(graph.nodes) + len(plan)) / COST_SCALE  # each term rounds to an integer
        report = simulate(graph, plan)
        for bounding in (False, True):  # the proof phase's redundant clauses cut off no plan
            cost = model_cost(graph, plan, budget_bytes=report.peak_bytes, bounding=bounding)
            assert cost == pytest.approx(report.cost_seconds, abs=rounding), plan


def _random_remat(graph: ComputeGraph, regions: tuple, rng: random.Random, *, chains: bool = False) -> tuple[str, ...]:
    """A random set of rematerialisation candidates outside ``regions`` that a plan may choose
    (no view conflicts, no chain three deep), with chains only when ``chains``."""
    candidates = list(remat.outside(graph, remat.candidates(graph), regions))
    rng.shuffle(candidates)
    chosen: list[int] = []
    for x in candidates:
        trial = [*chosen, x]
        if (rng.random() < 0.6 and not remat.conflicts(graph, trial) and not remat.deep_chains(graph, trial)
                and (chains or not remat.chains(graph, trial))):
            chosen.append(x)
    return tuple(graph.nodes[x].name for x in sorted(chosen))


def test_model_peak_and_cost_equal_the_simulated_ones_with_rematerialisation() -> None:
    """With ``remat_{x}`` fixed beside random one-level plans on a profiled GPT (layer norms,
    GELUs, attention), the model's least peak is the simulator's, and so is its least cost
    within that peak, each recompute charged its op and the hooks' fixed cost."""
    torch.manual_seed(0)
    model = load_example("gpt").GPT(n_layer=2, block_size=128)
    ids = torch.randint(0, 256, (4, 128))
    graph = replace(ckptplan.profile(model, (ids, torch.randint(0, 256, (4, 128)))), remat_cost=2.0**-16)
    rng = random.Random(5)
    lower = 0
    for trial in range(8):
        regions = random_plan(graph, rng)
        regions = tuple(sorted(rng.sample(regions, min(trial % 3, len(regions))), key=lambda r: r.start))
        names = _random_remat(graph, regions, rng)
        report = simulate(graph, regions, remat=names)
        lower += report.peak_bytes < simulate(graph, regions).peak_bytes
        assert model_peak(graph, regions, remat=names) == report.peak_bytes, (regions, names)
        rounding = (2 * len(graph.nodes) + len(regions) + len(report.recomputed)) / COST_SCALE
        cost = model_cost(graph, regions, budget_bytes=report.peak_bytes, bounding=True, remat=names)
        assert cost == pytest.approx(report.cost_seconds, abs=rounding), (regions, names)
    assert lower >= 4  # the rematerialisations matter to most of these plans' peaks


def test_model_prices_chains_exactly_and_bounds_their_peak_from_above() -> None:
    """With chains (a rematerialised op reading another's output, ``remat.chains``) beside random
    one-level plans on convolution, group norm and SiLU layers: the model's cost is the
    simulator's (each saver recomputes the chain's input too), and its peak is at least the
    simulated one, by no more than the chains' inputs (the model holds them through the saver's
    backward; the simulator only while the unpack runs)."""
    from tests.test_remat import _ConvNormSilu

    torch.manual_seed(0)
    model, args = _ConvNormSilu(), (torch.randn(2, 8, 32, 32),)
    graph = replace(ckptplan.profile(model, args), remat_cost=2.0**-16)
    rng = random.Random(7)
    chained = 0
    for trial in range(8):
        regions = random_plan(graph, rng)
        regions = tuple(sorted(rng.sample(regions, min(trial % 2, len(regions))), key=lambda r: r.start))
        names = _random_remat(graph, regions, rng, chains=True)
        pairs = remat.chains(graph, remat.indices(graph, names))
        chained += bool(pairs)
        report = simulate(graph, regions, remat=names)
        peak = model_peak(graph, regions, remat=names)
        slack = sum((graph.new_bytes(y) + graph.nodes[y].fwd_workspace_bytes) * len(remat.savers(graph, x))
                    for x, y in pairs)
        assert report.peak_bytes <= peak <= report.peak_bytes + slack, (regions, names)
        rounding = (2 * len(graph.nodes) + len(regions) + len(report.recomputed)) / COST_SCALE
        cost = model_cost(graph, regions, budget_bytes=peak, remat=names)
        assert cost == pytest.approx(report.cost_seconds, abs=rounding), (regions, names)
    assert chained >= 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unet", "resnet"])
def test_model_peak_equals_the_simulated_peak_on_profiled_examples(name: str) -> None:
    model, args = load_example(name).build()
    graph = ckptplan.profile(model, args)
    rng = random.Random(0)
    for _ in range(6):
        plan = random_plan(graph, rng)
        assert model_peak(graph, plan) == simulate(graph, plan).peak_bytes, plan


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_model_peak_equals_the_simulated_peak_under_autocast(target: str) -> None:
    """Autocast's cache holds each weight's bfloat16 cast to the end of forward (or of the
    recompute that remade it), inside regions too; CUDA's dropout has made its output when it
    saves its mask. The model once missed the first, which made it claim plans below their
    simulated peak (the solver then cut them off, one re-solve each)."""
    torch.manual_seed(0)
    model = models.DropoutEverywhere(width=64, depth=4)
    graph = ckptplan.profile(model, (torch.randn(64, 64),), autocast=torch.bfloat16, target=target)
    rng = random.Random(0)
    for _ in range(40):
        plan = random_plan(graph, rng)
        assert model_peak(graph, plan) == simulate(graph, plan).peak_bytes, plan


def test_a_stopped_least_peak_search_still_names_sqrt_s_least() -> None:
    """The least peak an infeasible-budget error names: a search stopped at once still reports
    the least of ``sqrt``'s plans (where it starts), not the no-checkpoint peak."""
    torch.manual_seed(0)
    model = load_example("gpt").GPT(n_layer=2, block_size=64)
    graph = ckptplan.profile(model, (torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))))
    _, sqrt_least = least_peak_regions(graph)
    peak = least_peak(graph, SolveContext.limited(1.0), deterministic_seconds=0.001, workers=1, seed=0,
                      window=None).peak_bytes
    assert peak <= sqrt_least < baseline_peak_bytes(graph)


def test_the_least_peak_an_error_states_is_the_same_when_its_share_of_the_clock_ran_out() -> None:
    """The least-peak search runs on CP-SAT's deterministic clock to the whole solve's deadline,
    not to its share's (``SolveContext.promised``): on a loaded machine, where the share's wall
    clock is spent before the search, the least an error states is still the one a solve at that
    budget finds again."""
    model, args, kwargs = ARCHITECTURES["densenet"]()  # where one-level plans reach below dp's nested ones
    graph = ckptplan.profile(model, args, kwargs)
    budget = graph.static.resident_bytes + 1
    with pytest.raises(InfeasibleBudgetError) as calm:
        solve_ilp(graph, budget, SolveContext.limited(5))
    spent = replace(SolveContext.limited(60).within(5), deadline=time.perf_counter())  # the share is over
    with pytest.raises(InfeasibleBudgetError) as loaded:
        solve_ilp(graph, budget, spent)
    least = calm.value.min_peak_bytes
    assert loaded.value.min_peak_bytes == least < least_peak_regions(graph)[1]
    assert solve_ilp(graph, least, SolveContext.limited(5)).peak_bytes <= least


def test_variables_are_named_and_the_window_bounds_regions() -> None:
    graph = chain_graph([100] * 10)
    _, v = build_model(graph, None, window=3)
    names = {var.Name() for var in [*v.rec, *v.start, *v.keep.values()]}
    assert {"rec_0", "start_9", "keep_4"} <= names
    assert v.window == 3
    plan = solve_ilp(graph, baseline_peak_bytes(graph) - 1, window=3)
    assert all(region.end - region.start <= 3 for region in plan.regions)


# ----------------------------------------------------------------------------- optimality
def _check_against(graph: ComputeGraph, plans) -> None:
    reports = [simulate(graph, plan) for plan in plans]
    peaks = sorted({r.peak_bytes for r in reports})
    for budget in peaks:
        best = min(r.cost_seconds for r in reports if r.peak_bytes <= budget)
        plan = solve_ilp(graph, budget, warm=[])
        assert plan.status == "optimal", budget
        assert simulate(graph, plan).peak_bytes == plan.peak_bytes <= budget
        assert plan.cost_seconds <= best, budget
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_ilp(graph, peaks[0] - 1, warm=[])
    assert info.value.min_peak_bytes <= peaks[0]


@pytest.mark.parametrize("seed", range(5))
def test_ilp_is_optimal_against_every_one_level_plan_with_keep_sets(seed: int) -> None:
    """Seeds 3 and 4 give regions and selective policies a cost of their own, as
    ``ckptplan.measure_roofline`` does on CPU: the optimum then trades them against recompute."""
    rng = random.Random(300 + seed)
    sizes = [rng.choice([16, 48, 100, 256]) for _ in range(6)]
    graph = chain_graph(sizes, saves_output=seed == 1)
    if seed >= 3:
        node_cost = max(n.fwd_cost for n in graph.nodes)
        graph = replace(graph, region_cost=(seed - 2) * node_cost, region_op_cost=node_cost / 8,
                        policy_op_cost=node_cost / 4)
    _check_against(graph, one_level_plans(graph, None))


def test_ilp_is_optimal_on_the_skip_graph() -> None:
    # Every region set (4,181), plus random keep-sets: all 300k combinations take minutes.
    graph = skip_graph()
    rng = random.Random(2)
    plans = [*one_level_plans(graph, max_keeps=0), *(random_plan(graph, rng) for _ in range(2000))]
    _check_against(graph, plans)


@pytest.mark.parametrize("seed", range(4))
def test_ilp_is_no_dearer_than_one_level_dp_and_sqrt_on_chains(seed: int) -> None:
    """At budgets spread from the least peak any of the three reaches to the unplanned peak, ilp
    proves its plan optimal, and it costs no more than dp's plan wherever that is one level (then
    in ilp's space) nor than sqrt's wherever sqrt has one; dp (optimal over nested plans without
    keep-sets, at one byte per memory unit) costs no more than ilp's plan wherever that keeps
    nothing (then in dp's space), so where both hold the two are equal. Each comparison is made
    at least once."""
    rng = random.Random(500 + seed)
    graph = chain_graph([rng.choice([32, 64, 100, 128, 256]) for _ in range(rng.randint(6, 12))])
    least = {}
    for name, solver in (("dp", solve_dp), ("sqrt", solve_sqrt)):
        with pytest.raises(InfeasibleBudgetError) as info:
            solver(graph, graph.static.floor_bytes - 1)
        least[name] = info.value.min_peak_bytes
    lowest = min(least.values())
    compared = {"dp": 0, "exact dp": 0, "sqrt": 0}
    for k in range(6):
        budget = lowest + (baseline_peak_bytes(graph) - lowest) * k // 6
        ilp = solve_ilp(graph, budget, warm=[])
        assert ilp.status == "optimal" and ilp.peak_bytes <= budget
        if budget >= least["dp"]:
            dp = solve_dp(graph, budget, mem_unit=1)
            if all(not r.children for r in dp.regions):
                assert ilp.cost_seconds <= dp.cost_seconds
                compared["dp"] += 1
            if not any(r.keep for r in ilp.regions):
                assert dp.status == "optimal"
                assert dp.cost_seconds <= ilp.cost_seconds
                compared["exact dp"] += 1
        if budget >= least["sqrt"]:
            assert ilp.cost_seconds <= solve_sqrt(graph, budget).cost_seconds
            compared["sqrt"] += 1
    assert all(compared.values()), compared


def test_warm_start_is_never_beaten_by_a_stopped_search() -> None:
    graph = chain_graph([100, 300, 100, 300, 100, 300, 100, 300])
    budget = int(0.8 * baseline_peak_bytes(graph))
    sqrt_plan = solve_sqrt(graph, budget)
    plan = solve_ilp(graph, budget, SolveContext.limited(0.0), warm=[sqrt_plan])
    assert plan.solver == "ilp"
    assert plan.cost_seconds <= sqrt_plan.cost_seconds
    assert plan.peak_bytes <= budget


def test_a_limit_too_short_to_build_the_model_returns_the_refined_warm_plan() -> None:
    """When the limit cannot pay for building the CP-SAT model (``BUILD_SECONDS_PER_PAIR``), the
    search is skipped: the refined warm plan comes back, the same on every run, and says why."""
    graph = chain_graph([100, 300] * 100)
    budget = int(0.6 * baseline_peak_bytes(graph))
    assert 2 * tuning.BUILD_SECONDS_PER_PAIR * 200 * 128 > 1.0  # the model would take longer than the limit
    plans = [solve_ilp(graph, budget, SolveContext.limited(1.0)) for _ in range(2)]
    assert "no CP-SAT search" in plans[0].note
    assert plans[0].regions == plans[1].regions
    assert simulate(graph, plans[0]).peak_bytes <= budget
    assert plans[0].cost_seconds <= solve_sqrt(graph, budget).cost_seconds


def test_a_limit_too_short_to_build_the_model_without_a_one_level_warm_plan_returns_the_warm_plan(
    monkeypatch,
) -> None:
    """With no one-level warm plan to refine (a nested one, as ``dp`` makes) and no time to build
    the model, the search is skipped too: the cheapest warm plan comes back and says why, the
    model never built."""
    from ckptplan.solvers import ilp_flat
    from ckptplan.solvers.solution import solution

    graph = chain_graph([100, 300] * 100)
    nested = tuple(Region(lo, lo + 50, children=(Region(lo, lo + 25), Region(lo + 25, lo + 50)))
                   for lo in range(0, 200, 50))
    warm = solution(graph, nested, "dp")
    budget = warm.peak_bytes
    assert budget < baseline_peak_bytes(graph)

    def unaffordable(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(ilp_flat, "build_model", unaffordable)
    monkeypatch.setattr(ilp_flat, "search_lazily", unaffordable)
    plan = ilp_flat.solve_flat(graph, budget, SolveContext.limited(1.0), warm=[warm])
    assert plan.regions == nested and plan.solver == "ilp" and plan.status == "timeout"
    assert "no one-level warm plan; returning the dp plan" in plan.note


def _slow_to_prove(n: int = 30) -> cp_model.CpModel:
    """n queens with a weighted objective: CP-SAT finds a placement in well under a second and
    cannot prove the least one in minutes."""
    model = cp_model.CpModel()
    xs = [model.NewIntVar(0, n - 1, f"x{i}") for i in range(n)]
    model.AddAllDifferent(xs)
    model.AddAllDifferent([xs[i] + i for i in range(n)])
    model.AddAllDifferent([xs[i] - i for i in range(n)])
    model.Minimize(sum((i % 7) * xs[i] for i in range(n)))
    return model


class _SignalOnFirstSolution(cp_model.CpSolverSolutionCallback):
    """Sends this process a SIGINT, as Ctrl-C does, once the search has found a solution."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_at: float | None = None

    def on_solution_callback(self) -> None:
        if self.sent_at is None:
            self.sent_at = time.perf_counter()
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_ends_a_cp_sat_search_at_once_and_skips_later_ones() -> None:
    """Python's handler takes the SIGINT (whichever thread the kernel gives it to) and the
    search stops; CP-SAT's own handler, which is thread-local to the solving thread, is off.
    The handler is set as an interactive Python sets it: a process started in the background
    by a non-interactive shell (a CI job, ``cmd &``) inherits SIGINT ignored."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 60.0
    solver.parameters.num_workers = 1
    callback = _SignalOnFirstSolution()
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    handler = signal.getsignal(signal.SIGINT)
    ctx = SolveContext.limited(60.0)
    try:
        code = solve_interruptibly(solver, _slow_to_prove(), ctx, callback)
        # Stopped, not ended by its 60 s limit: a feasible placement, no proof, the flag set.
        assert callback.sent_at is not None and code == cp_model.FEASIBLE and ctx.cancelled
        assert signal.getsignal(signal.SIGINT) is handler
        assert solve_interruptibly(cp_model.CpSolver(), _slow_to_prove(), ctx) == cp_model.UNKNOWN  # skipped
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the search")
    finally:
        signal.signal(signal.SIGINT, inherited)


def _interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt  # stands in for Ctrl-C landing in Python code between two searches


def test_ctrl_c_before_the_search_returns_the_cheapest_plan_made_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C outside any CP-SAT search (while plans are refined, or blocks are decomposed)
    still ends ``solve_ilp`` with a plan: the cheapest one made so far, else ``sqrt``'s; and
    raises on when even ``sqrt`` has none."""
    from ckptplan.solvers import ilp, ilp_flat

    graph = skip_graph()
    budget = (baseline_peak_bytes(graph) * 9) // 10
    warm = ilp_flat.warm_plans(graph, budget, SolveContext.limited(5.0))
    cheapest = min(warm, key=lambda p: p.cost_seconds)
    assert cheapest.regions != solve_sqrt(graph, budget).regions  # so that the two cases below differ
    monkeypatch.setattr(ilp_flat, "starting_plan", _interrupt)  # after the warm plans are made
    ctx = SolveContext.limited(5)
    plan = solve_ilp(graph, budget, ctx)
    assert plan.regions == cheapest.regions and plan.status == "timeout"
    assert "made before its search could return one" in plan.note and ctx.cancelled
    monkeypatch.undo()  # refinement runs again: the cases below must end without it

    def absorbed(graph: ComputeGraph, budget_bytes: int, ctx: SolveContext, **kwargs: object) -> None:
        ctx.cancel.set()  # as a CP-SAT search of the block-by-block phase does when Ctrl-C lands in it

    monkeypatch.setattr(ilp, "solve_hierarchical", absorbed)  # the phases after it are skipped
    ctx = SolveContext.limited(5)
    plan = solve_ilp(graph, budget, ctx)
    assert plan.regions == solve_sqrt(graph, budget).regions and plan.note.startswith("the sqrt plan made before")
    assert ctx.cancelled
    monkeypatch.setattr(ilp, "solve_hierarchical", _interrupt)  # before any plan is made
    plan = solve_ilp(graph, budget, SolveContext.limited(5))
    assert plan.regions == solve_sqrt(graph, budget).regions and plan.status == "timeout"
    assert simulate(graph, plan).peak_bytes <= budget
    with pytest.raises(KeyboardInterrupt):
        solve_ilp(graph, least_peak_regions(graph)[1] - 1, SolveContext.limited(5))


def test_a_search_outside_the_main_thread_runs_in_place() -> None:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 1.0
    solver.parameters.num_workers = 1
    codes: list[int] = []
    worker = threading.Thread(
        target=lambda: codes.append(solve_interruptibly(solver, _slow_to_prove(8), SolveContext.limited(1.0))))
    worker.start()
    worker.join()
    assert codes == [cp_model.OPTIMAL]


def test_ilp_plans_are_deterministic() -> None:
    graph = skip_graph()
    budget = (baseline_peak_bytes(graph) * 9) // 10

    def plan_json() -> str:
        plan = ckptplan.solve(skip_graph(), budget, solver="ilp")
        return plan.model_copy(update={"solver": plan.solver.model_copy(update={"seconds": 0.0})}).to_json()

    assert plan_json() == plan_json()


# ----------------------------------------------------------------------------- proof phase
def _relaxed_peak(graph: ComputeGraph, plan, *, add_back: bool) -> int:
    """The least peak for a fixed plan in the model built without the rows of
    ``DEFERRED_PHASES``, with all of them added back (``add_back``) or none."""
    model, v = build_model(graph, None, deferred_phases=DEFERRED_PHASES)
    assert {phase for phase, _ in v.deferred} == DEFERRED_PHASES
    if add_back:
        add_events(v, list(v.deferred))
        assert not v.deferred
    fix_plan(model, graph, v, tuple(plan))
    model.Minimize(v.peak)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.Solve(model) == cp_model.OPTIMAL
    return int(solver.Value(v.peak))


def test_deferred_rows_added_back_restore_the_model() -> None:
    """Without its backward and recompute rows the model is a relaxation (a plan's peak there is
    at most the simulator's, and lower for some); with them added back it is the model again."""
    graph = skip_graph()
    rng = random.Random(7)
    relaxed_below = 0
    for _ in range(40):
        plan = random_plan(graph, rng)
        peak = simulate(graph, plan).peak_bytes
        assert _relaxed_peak(graph, plan, add_back=True) == peak, plan
        relaxed = _relaxed_peak(graph, plan, add_back=False)
        assert relaxed <= peak, plan
        relaxed_below += relaxed < peak
    assert relaxed_below > 0


def test_deferred_rows_are_exact_whichever_join_in_any_order() -> None:
    """A deferred row makes the variables only it reads (``alive``, ``copy``, ``rc``,
    ``cachelive``, ``trigger_bytes``) when it joins: with any few rows added, in any order, a fixed
    plan's least peak in the relaxation is the simulator's most live bytes over the forward
    events and the events added. Windows shorter than the graph make ``trigger_bytes`` in parts."""
    rng = random.Random(11)
    cases = [(skip_graph(), 4), (chain_graph([64, 16, 100, 32, 48, 128, 16, 64, 32, 100], saves_output=True), 3)]
    for graph, window in cases:
        checked = 0
        while checked < 25:
            plan = random_plan(graph, rng)
            if any(region.end - region.start > window for region in plan):
                continue
            checked += 1
            report = simulate(graph, plan)
            model, v = build_model(graph, None, window=window, deferred_phases=DEFERRED_PHASES)
            keys = rng.sample(sorted(v.deferred), k=rng.randint(1, 6))
            add_events(v, keys)
            fix_plan(model, graph, v, tuple(plan))
            model.Minimize(v.peak)
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = 1
            assert solver.Solve(model) == cp_model.OPTIMAL
            expected = max(e.live_bytes for e in report.timeline if e.phase == "forward" or (e.phase, e.node) in keys)
            assert solver.Value(v.peak) == expected, (plan, keys)


@pytest.mark.parametrize(
    ("workers", "up_front", "per_round"),
    [(1, tuning.SEEDED_ROWS, None), (proof_workers(), tuning.PROOF_SEEDED_ROWS, tuning.PROOF_ROWS_PER_ROUND)],
    ids=["search", "proof"],
)
def test_the_lazy_search_finds_and_proves_the_exhaustive_optimum(workers: int, up_front: int, per_round: int | None) -> None:
    """From the dearest plan that fits, ``search_lazily`` (a relaxation gaining rows as plans
    break them) ends proven optimal, no dearer than any plan of the exhaustive set, with one
    worker and every broken row joining (the reproducible search) or the portfolio and the
    fullest ``per_round`` (the proof phase); on some budget it needs rows it left out (seen with
    none stated up front from the start plan's fullest events, on every other budget); and below
    every plan's peak it proves the budget infeasible."""
    graph = skip_graph()
    rng = random.Random(2)
    plans = [*one_level_plans(graph, max_keeps=0), *(random_plan(graph, rng) for _ in range(500))]
    reports = [(plan, simulate(graph, plan)) for plan in plans]
    peaks = sorted({r.peak_bytes for _, r in reports if r.peak_bytes < baseline_peak_bytes(graph)})
    rows = []
    for number, budget in enumerate(peaks[:: max(1, len(peaks) // 6)]):
        fitting = [(plan, r) for plan, r in reports if r.peak_bytes <= budget]
        dearest = max(fitting, key=lambda pr: pr[1].cost_seconds)[0]
        seeded = up_front if number % 2 else 0
        found = search_lazily(graph, budget, tuple(dearest), SolveContext.limited(60), seconds=60, workers=workers, deterministic_seconds=60,
                              announce=False, seeded_rows=seeded, rows_per_round=per_round)
        assert found.status == "OPTIMAL", budget
        report = simulate(graph, found.regions)
        assert report.peak_bytes <= budget
        assert report.cost_seconds == pytest.approx(found.cost / COST_SCALE, rel=1e-12)
        assert report.cost_seconds <= min(r.cost_seconds for _, r in fitting) * (1 + 1e-9), budget
        assert found.seeded == min(seeded, found.deferred)
        if per_round is not None:  # each round a plan breaking deferred rows stops adds the fullest
            assert found.rows - found.seeded <= found.rounds * per_round
        rows.append(found.rows - found.seeded)
    assert max(rows) > 0
    least, proven, _ = least_peak(graph, SolveContext.limited(30), deterministic_seconds=30, workers=1, seed=0,
                                  window=None)
    assert proven
    below = search_lazily(graph, least - 1, None, SolveContext.limited(60), seconds=60, workers=workers, deterministic_seconds=60,
                          announce=False)
    assert below.status == "INFEASIBLE" and below.regions is None


def test_the_proof_phase_searches_only_the_plans_recomputing_fewer_of_a_class() -> None:
    """From a plan whose whole cost is recomputing k nodes of one class of interchangeable ones,
    the proof phase searches only the plans recomputing fewer (the others cost at least as much)
    and still ends proven optimal and no dearer than the exhaustive optimum (one-level plans
    with up to one kept node per region): from the dearest such plan it finds a cheaper one in
    that range; from the cheapest, the exhaustive optimum itself, it proves the range holds
    nothing cheaper."""
    graph = chain_graph([128] * 6, param_bytes=8, saves_output=True)
    assert symmetric_classes(graph) == [(1, 3, 5), (2, 4)]  # the relus; the linears after the first
    reports = [(plan, simulate(graph, plan)) for plan in one_level_plans(graph, max_keeps=1)]
    budget = 832
    fitting = [(plan, r) for plan, r in reports if r.peak_bytes <= budget]
    least_seconds = min(r.cost_seconds for _, r in fitting)
    whole = [(plan, r) for plan, r in fitting if fewer_of_a_class(graph, plan) is not None]
    dearest = max(whole, key=lambda pr: pr[1].cost_seconds)[0]
    cheapest, cheapest_report = min(whole, key=lambda pr: pr[1].cost_seconds)
    assert cheapest_report.cost_seconds == least_seconds
    assert fewer_of_a_class(graph, (ckptplan.Region(1, 3),)) is None  # recomputes a relu and a linear
    ends = []
    for start in (dearest, cheapest):
        found = proof_search(graph, budget, tuple(start), SolveContext.limited(30), seconds=30, announce=False)
        assert found.status == "OPTIMAL" and "fewer than" in found.split
        report = simulate(graph, found.regions)
        assert report.peak_bytes <= budget
        assert report.cost_seconds <= least_seconds * (1 + 1e-9)
        ends.append(found.regions == tuple(start))
    assert ends == [False, True]


def test_a_start_longer_than_the_window_states_more_rows_up_front_and_still_ends_optimal() -> None:
    """A start with a region longer than the model's window is no hint, so every round of the
    proof phase begins from no plan: it states ``tuning.UNHINTED_SEEDED_ROWS`` rows up front (one where
    the start is a hint) and still ends proven optimal among the window's plans, no dearer than
    any of them that fits."""
    graph, window = skip_graph(), 3

    def longest(plan) -> int:
        return max((region.end - region.start for region in plan), default=0)

    reports = [(plan, simulate(graph, plan)) for plan in one_level_plans(graph, max_keeps=0)]
    short = [r for plan, r in reports if longest(plan) <= window]
    budget = sorted({r.peak_bytes for r in short})[2]  # a few of the window's plans fit
    start, start_report = max(((plan, r) for plan, r in reports if longest(plan) > window and r.peak_bytes <= budget),
                              key=lambda pr: pr[1].cost_seconds)
    found = proof_search(graph, budget, tuple(start), SolveContext.limited(30), seconds=30, window=window,
                         announce=False)
    assert found.seeded == min(tuning.UNHINTED_SEEDED_ROWS, found.deferred) > tuning.PROOF_SEEDED_ROWS
    assert found.status == "OPTIMAL"
    assert simulate(graph, found.regions).cost_seconds <= min(
        [start_report.cost_seconds, *(r.cost_seconds for r in short if r.peak_bytes <= budget)]) * (1 + 1e-9)
    hinted = max(((plan, r) for plan, r in reports if plan and longest(plan) <= window and r.peak_bytes <= budget),
                 key=lambda pr: pr[1].cost_seconds)[0]
    again = proof_search(graph, budget, tuple(hinted), SolveContext.limited(30), seconds=30, window=window,
                         announce=False)
    assert again.seeded == min(tuning.PROOF_SEEDED_ROWS, again.deferred) and again.status == "OPTIMAL"


def test_a_start_longer_than_the_window_and_cheaper_than_its_plans_is_kept_and_proven() -> None:
    """From no hint the search is not bounded by the start's cost (CP-SAT may pass through the
    window's dearer plans), yet only cheaper plans count: from a start past the window that
    costs less than the window's optimum (found by the same search from no plan), the search
    returns the start, proven optimal among the window's plans."""
    graph, window = skip_graph(), 3
    reports = [(plan, simulate(graph, plan)) for plan in one_level_plans(graph, max_keeps=0)]
    tried = 0
    for budget in sorted({r.peak_bytes for _, r in reports})[1:6]:
        best = proof_search(graph, budget, None, SolveContext.limited(30), seconds=30, window=window, announce=False)
        if best.status != "OPTIMAL" or best.regions is None:
            continue
        optimum = simulate(graph, best.regions).cost_seconds
        cheaper = [(plan, r) for plan, r in reports if r.peak_bytes <= budget and r.cost_seconds < optimum * (1 - 1e-6)]
        if not cheaper:
            continue
        start = tuple(min(cheaper, key=lambda pr: pr[1].cost_seconds)[0])
        assert max(region.end - region.start for region in start) > window
        found = proof_search(graph, budget, start, SolveContext.limited(30), seconds=30, window=window, announce=False)
        assert found.regions == start and found.status == "OPTIMAL"
        tried += 1
    assert tried, "no budget has a start past the window cheaper than its optimum"


# ----------------------------------------------------------------------------- real models
def test_keep_set_plan_on_unet_runs_with_equal_gradients_and_measured_peak() -> None:
    model, args = load_example("unet").build(batch=2)
    graph = ckptplan.profile(model, args)
    plan = ckptplan.solve(graph, 0.7, solver="ilp", time_limit=3)
    assert any(region.keep for region in plan.regions) and plan.solver.name == "ilp"
    emitted = ckptplan.emit(graph, plan)
    measured = ckptplan.measure_step(emitted, args).peak_bytes
    assert abs(measured - plan.prediction.peak_bytes) <= 0.03 * measured
    assert measured <= plan.budget.bytes * 1.03
    assert_same_gradients(model, emitted, args)


@pytest.mark.parametrize("outputs", [(1,), (1, 5), (3,)])
def test_model_peak_equals_the_simulated_peak_when_the_caller_keeps_the_outputs(outputs: tuple[int, ...]) -> None:
    """``graph.outputs_live``: the model's outputs (here also the skip source ``enc_relu``, a
    pre-loss activation, or the dropout's output) live to the end of the step in the model as in
    the simulator, which peaks higher for it on some plans."""
    base = replace(skip_graph(), outputs=(*outputs, 8))
    live = replace(base, outputs_live=True)
    rng = random.Random(7)
    higher = 0
    for _ in range(80):
        plan = random_plan(live, rng)
        report = simulate(live, plan)
        assert model_peak(live, plan) == report.peak_bytes, plan
        higher += report.peak_bytes > simulate(base, plan).peak_bytes
    assert higher


def test_rows_stated_up_front_from_an_unhinted_start_are_spread_over_the_step() -> None:
    """From a start the model cannot take as a hint, CP-SAT's first plans are not the start, and
    the start's fullest events cluster around its own peak: the rows stated up front are its
    fullest events at least ``tuning.UNHINTED_ROW_GAP`` nodes apart, and where too few are that far
    apart, the fullest of the rest make up the count."""
    graph = chain_graph([64] * 40)
    budget, report = int(0.5 * baseline_peak_bytes(graph)), simulate(graph, ())
    gap = tuning.UNHINTED_ROW_GAP

    def stated(count: int, gap: int) -> list[int]:
        _, v = build_model(graph, budget, window=8, deferred_phases=DEFERRED_PHASES)
        deferred = set(v.deferred)
        seeded = _seed_rows(v, report, count, gap)
        rows = sorted(node for _, node in deferred - set(v.deferred))
        assert seeded == len(rows) == min(count, len(deferred))
        return rows

    fullest = stated(4, 0)  # the four fullest events: next to each other at the start of the backward
    assert any(b - a < gap for a, b in itertools.pairwise(fullest))
    spread = stated(4, gap)
    assert all(b - a >= gap for a, b in itertools.pairwise(spread)) and max(spread) == max(fullest)
    assert len(stated(len(graph.nodes), gap)) == len(stated(len(graph.nodes), 0))  # the count is made up
