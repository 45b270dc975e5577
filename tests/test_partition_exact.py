"""The exact partition model (``solvers.partition_exact``) against every saved set, and as
``ckptplan.compile`` runs it.

On small joint graphs made at random (views sharing storage, random draws with two outputs,
kernel workspaces, outputs kept or dropped) every subset of the forward values is simulated:
the exact model's answer must be the least recomputation of any subset within the budget,
proved, or "infeasible" exactly when no subset fits."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from torch import nn

import ckptplan
from ckptplan.errors import CkptPlanError, UnknownSolverError
from ckptplan.joint import JointGraph, JointValue
from ckptplan.partition import PartitionReport, simulate_partition
from ckptplan.profiler.loss import training_loss
from ckptplan.solvers import partition, tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.orchestrate import solve_partition_step
from ckptplan.solvers.partition import Partition, no_recompute, solve_partition
from ckptplan.solvers.partition_exact import (
    least_partition,
    solve_partition_exact,
)
from tests import models


def _random_joint(seed: int) -> JointGraph:
    """A forward of 3 to 10 ops over two primals, then a backward that reads some forward values
    (an op's output or its inputs) on its way from the tangent to the gradient."""
    rng = random.Random(seed)
    values: list[JointValue] = []
    sizes: list[int] = []

    def new_storage(size: int) -> int:
        sizes.append(size)
        return len(sizes) - 1

    def add(name: str, phase: str, inputs=(), storages=None, **fields) -> int:
        if storages is None:
            storages = (new_storage(rng.choice([4, 8, 12, 16, 24, 32])),)
        values.append(JointValue(len(values), name, name.rstrip("0123456789."), phase, inputs=tuple(sorted(set(inputs))),
                                 storages=tuple(storages), **fields))
        return len(values) - 1

    primals = [add("x", "primal"), add("w", "primal")]
    forward: list[int] = []
    replays: list[tuple[int, int]] = []
    replayed: list[int] = []  # read by the backward only
    for k in range(rng.randint(3, 10)):
        twins = {twin for twin, _ in replays}
        if sum(v.phase == "forward" and not v.multi_output and v.index not in twins for v in values) >= 13:
            break  # the oracle enumerates every subset of these
        inputs = rng.sample(primals + forward, min(len(primals + forward), rng.choice([1, 2])))
        if forward and not set(inputs) & set(forward):
            inputs.append(forward[-1])
        kind = rng.random()
        if kind < 0.12 and forward:  # a view of a forward value: its storage
            source = max(i for i in inputs if i in forward)
            forward.append(add(f"view{k}", "forward", [source], storages=values[source].storages))
        elif kind < 0.3 and forward:  # a draw whose mask the backward may replay from the saved state
            # As ``read_joint`` has it: a tuple holds its parts' storages, each part its own.
            size = rng.choice([4, 8])
            parts = (new_storage(1), new_storage(rng.choice([8, 16])), new_storage(size))
            draw = add(f"draw{k}", "forward", inputs, storages=parts, recomputable=False, multi_output=True, cost=1.0)
            state, out, mask = (add(f"{name}{k}", "forward", [draw], storages=(part,))
                                for name, part in zip(("state", "out", "mask"), parts, strict=True))
            again = (new_storage(size), new_storage(rng.choice([0, 8])))
            replay = add(f"replay{k}", "forward", [state], storages=again, multi_output=True, replay=True,
                         cost=rng.choice([0.5, 1.0]), workspace_bytes=rng.choice([0, 8]))
            replayed.append(add(f"replayed{k}", "forward", [replay], storages=again[:1], replay=True))
            replays.append((replayed[-1], mask))
            if rng.random() < 0.5:  # the output made again from the mask, and from the replayed one
                size = values[out].storages[0]
                kept = add(f"kept{k}", "forward", [inputs[0], mask], cost=0.2)
                remade = add(f"remade{k}", "forward", [kept], storages=(new_storage(sizes[size]),), replay=True,
                             cost=0.3)
                kept_twin = add(f"kept_twin{k}", "forward", [inputs[0], replayed[-1]], cost=0.2)
                replayed.append(add(f"remade_twin{k}", "forward", [kept_twin], storages=(new_storage(sizes[size]),),
                                    replay=True, cost=0.3))
                replays += [(remade, out), (kept_twin, kept), (replayed[-1], remade)]
            forward.append(out)
        elif kind < 0.22:  # a random draw: a tuple of two parts, neither drawn again
            draw = add(f"draw{k}", "forward", inputs, storages=(), recomputable=False, multi_output=True, cost=1.0)
            for part, size in enumerate((rng.choice([8, 16]), rng.choice([2, 4]))):
                forward.append(add(f"part{k}.{part}", "forward", [draw], storages=(new_storage(size),),
                                   recomputable=False))
        else:
            forward.append(add(f"op{k}", "forward", inputs, cost=rng.choice([0.0, 0.5, 1.0, 2.0, 3.0]) * rng.random(),
                               workspace_bytes=rng.choice([0, 0, 0, 4, 8])))
    grad = tangent = add("tangent", "tangent")
    for k, j in enumerate(replayed):
        grad = add(f"unmask{k}", "backward", [grad, j])
    for k, j in enumerate(reversed(forward)):
        if rng.random() < 0.55:
            reads = [j] if rng.random() < 0.5 else list(values[j].inputs)
            reads = [r for r in reads if values[r].phase == "forward" and not values[r].multi_output]
            grad = add(f"grad{k}", "backward", [grad, *reads])
    first = [] if values[forward[0]].multi_output else [forward[0]]
    weight_grad = add("grad_w", "backward", [grad, *first])
    graph = JointGraph(f"random{seed}", tuple(values), tuple(sizes), forward_outputs=(forward[-1],),
                       backward_outputs=(weight_grad,), outputs_live=rng.random() < 0.5, replays=tuple(replays))
    caller = rng.random()  # the caller's loss: the output itself, with its seed; or a new scalar and its seed
    if caller < 1 / 3:
        return replace(graph, caller_held=(forward[-1], tangent))
    if caller < 2 / 3:
        return replace(graph, caller_bytes=rng.choice([2, 4, 8]))
    return graph


def _every_partition(graph: JointGraph) -> list[PartitionReport]:
    # Saving a twin is saving its original (``JointGraph.reading_drawn``): enumerate originals.
    forward = [v.index for v in graph.values
               if v.phase == "forward" and not v.multi_output and v.index not in graph.drawn_for]
    found: dict[tuple[int, ...], PartitionReport] = {}
    for bits in range(1 << len(forward)):
        try:
            report = simulate_partition(graph, [j for k, j in enumerate(forward) if bits >> k & 1])
        except CkptPlanError:  # it would recompute a random draw
            continue
        found[report.saved] = report
    return list(found.values())


@pytest.mark.parametrize("seed", range(60))
def test_the_exact_model_is_exact_on_every_budget(seed: int) -> None:
    graph = _random_joint(seed)
    every = _every_partition(graph)
    peaks = sorted({r.peak_bytes for r in every})
    for budget in (peaks[0] - 1, *peaks):
        least = min((r.recompute_seconds for r in every if r.peak_bytes <= budget), default=None)
        found = solve_partition_exact(graph, budget, SolveContext.limited(30))
        if least is None:
            assert found.status == "infeasible" and found.report is None
            continue
        assert found.status == "optimal"
        assert found.report == simulate_partition(graph, found.report.saved)
        assert found.report.peak_bytes <= budget
        # The objective is in integer units of a millionth of the costliest value's seconds.
        assert found.report.recompute_seconds == pytest.approx(least, abs=1e-5)


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_the_least_peak_bisection_ends_near_the_least_there_is(seed: int) -> None:
    graph = _random_joint(seed)
    every = _every_partition(graph)
    lowest = min(r.peak_bytes for r in every)
    fullest = max(every, key=lambda r: r.peak_bytes)
    least, infeasible = least_partition(graph, SolveContext.limited(30), fullest, graph.static_bytes,
                                        deterministic_seconds=3.0)
    assert least == simulate_partition(graph, least.saved)
    assert infeasible < lowest <= least.peak_bytes
    resolution = tuning.EXACT_LEAST_RESOLUTION
    assert least.peak_bytes - infeasible <= resolution * least.peak_bytes or least.peak_bytes == lowest


@pytest.mark.parametrize("seed", range(0, 60, 4))
def test_a_start_never_makes_the_greedy_search_dearer(seed: int, monkeypatch) -> None:
    """Handed other starts (PyTorch's partitions, in ``compile``), the greedy search still
    searches from saving everything when that recomputes less than every start that fits and
    peaks within ``NEAR_FITTING`` of the budget (here raised so that every such start counts): a
    start never makes its answer dearer than the search without it, at any budget where that
    search fits."""
    monkeypatch.setattr(tuning, "NEAR_FITTING", 10.0)
    graph = _random_joint(seed)
    every = sorted(_every_partition(graph), key=lambda r: (r.recompute_seconds, r.peak_bytes))
    for budget in sorted({r.peak_bytes for r in every}):
        alone = solve_partition(graph, budget)
        if not alone.feasible:
            continue
        for start in every:  # each partition that fits: the dearest first
            if start.peak_bytes > budget or start.recompute_seconds <= alone.report.recompute_seconds:
                continue
            found = solve_partition(graph, budget, [start.saved])
            assert found.feasible and found.report == simulate_partition(graph, found.report.saved)
            assert found.report.recompute_seconds <= alone.report.recompute_seconds, (budget, start.saved)


@pytest.mark.parametrize("seed", range(0, 12, 4))
def test_a_start_handed_over_twice_is_searched_from_once(seed: int, monkeypatch) -> None:
    """Starts that coincide (PyTorch's partitions at several settings often do), or equal saving
    everything, are searched from once: the search simulates as often, and ends as it does,
    with each handed over once."""
    graph = _random_joint(seed)
    every = sorted(_every_partition(graph), key=lambda r: (r.recompute_seconds, r.peak_bytes))
    budget = every[len(every) // 2].peak_bytes
    counted = []

    def simulated(g, saved, *args, **kwargs):
        counted.append(1)
        return simulate_partition(g, saved, *args, **kwargs)

    monkeypatch.setattr(tuning, "NEAR_FITTING", 10.0)  # every start over the budget is searched from too
    monkeypatch.setattr(partition, "simulate_partition", simulated)
    starts = [r.saved for r in every[::3]]
    once = solve_partition(graph, budget, starts)
    simulations = len(counted)
    counted.clear()
    twice = solve_partition(graph, budget, [*starts, *starts, no_recompute(graph)])
    assert twice == once and len(counted) == simulations


def _mlp(dropout: float = 0.0) -> nn.Module:
    return models.norm_mlp(dropout, blocks=3, width=32, hidden=128)


@pytest.fixture(scope="module")
def joint() -> JointGraph:
    torch._dynamo.reset()
    compiled = ckptplan.compile(_mlp(0.1), (torch.randn(256, 32),), budget=1.0, backend="aot_eager", solver="greedy",
                                outputs_live=False)
    torch._dynamo.reset()
    return compiled.ckptplan_plan.graph


@pytest.mark.parametrize("fraction", [0.8, 0.6])
def test_the_exact_model_recomputes_no_more_than_the_greedy_search(joint: JointGraph, fraction: float) -> None:
    budget = int(fraction * simulate_partition(joint, no_recompute(joint)).peak_bytes)
    greedy = solve_partition(joint, budget)
    found = solve_partition_step(joint, budget, solver="exact", time_limit=20)
    assert greedy.feasible and found.feasible
    assert found.report == simulate_partition(joint, found.report.saved)
    assert found.report.peak_bytes <= budget
    assert found.report.recompute_seconds <= greedy.report.recompute_seconds
    assert found.status in ("optimal", "feasible")


def test_greedy_alone_seeks_no_proof(joint: JointGraph) -> None:
    budget = int(0.7 * simulate_partition(joint, no_recompute(joint)).peak_bytes)
    found = solve_partition_step(joint, budget, solver="greedy")
    assert (found.origin, found.status) == ("greedy", "heuristic")
    assert found.report == solve_partition(joint, budget).report


def test_a_proved_infeasible_budget_states_a_least_peak_the_solver_then_fits(joint: JointGraph) -> None:
    found = solve_partition_step(joint, joint.static_bytes + 1, solver="auto", time_limit=10)
    assert not found.feasible and found.status == "infeasible"
    assert found.report == simulate_partition(joint, found.report.saved)
    assert found.report.peak_bytes <= solve_partition(joint, joint.static_bytes + 1).report.peak_bytes
    # Fitting the stated least needs no proof (a proof takes some 8 s here).
    again = solve_partition_step(joint, found.report.peak_bytes, solver="auto", time_limit=3)
    assert again.feasible and again.report.peak_bytes <= found.report.peak_bytes


def test_the_least_peak_search_is_the_same_on_every_run(joint: JointGraph) -> None:
    start = simulate_partition(joint, no_recompute(joint))
    runs = [least_partition(joint, SolveContext.limited(60), start, joint.static_bytes, deterministic_seconds=0.3)
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0][0].peak_bytes < start.peak_bytes


def test_a_budget_the_greedy_search_misses_gets_the_least_peak_first_and_a_stated_least_fits(
    joint: JointGraph, monkeypatch
) -> None:
    """When the greedy search fits nothing, the deterministic least-peak search runs before any
    search at the budget: at a budget below reach it states a least peak, and at that peak the
    same search finds the same partition, so the stated least fits."""
    from ckptplan.solvers import orchestrate, partition_exact

    missed = simulate_partition(joint, no_recompute(joint))
    monkeypatch.setattr(orchestrate, "solve_partition", lambda *args: Partition(report=missed, feasible=False))
    calls = []
    real = partition_exact.solve_partition_exact

    def exact(graph, budget_bytes, ctx, incumbent=None, *, fit_only=False, deterministic_seconds=None):
        calls.append(deterministic_seconds is not None)
        return real(graph, budget_bytes, ctx, incumbent, fit_only=fit_only, deterministic_seconds=deterministic_seconds)

    monkeypatch.setattr(partition_exact, "solve_partition_exact", exact)
    below = solve_partition_step(joint, joint.static_bytes + 1, solver="auto", time_limit=10)
    assert not below.feasible and below.origin == "exact" and below.report.peak_bytes < missed.peak_bytes
    assert calls[0] and not calls[-1]  # the deterministic probes, then the search at the budget
    calls.clear()
    at = solve_partition_step(joint, below.report.peak_bytes, solver="auto", time_limit=10)
    assert calls[0]
    assert at.feasible and at.report.peak_bytes <= below.report.peak_bytes
    assert at.report == simulate_partition(joint, at.report.saved)


def test_compile_with_the_exact_solver_trains_as_eager_and_measures_as_predicted() -> None:
    model, x = _mlp(0.2), torch.randn(256, 32)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = ckptplan.compile(model, (x,), budget=0.7, backend="aot_eager", solver="exact", time_limit=10,
                                outputs_live=False)
    plan = compiled.ckptplan_plan
    assert plan.recomputed and plan.peak_bytes <= plan.budget_bytes
    assert plan.status in ("optimal", "feasible")
    ckptplan.measure_step(compiled, (x,), outputs_live=False)
    assert ckptplan.measure_step(compiled, (x,), outputs_live=False).peak_bytes == plan.peak_bytes
    for module in (compiled, reference):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        training_loss(module(x)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)
    torch._dynamo.reset()


def test_an_unknown_solver_is_refused_before_compiling() -> None:
    with pytest.raises(UnknownSolverError, match="greedy"):
        ckptplan.compile(_mlp(), (torch.randn(4, 32),), budget=0.5, backend="aot_eager", solver="ilp")
