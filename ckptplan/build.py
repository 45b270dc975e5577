"""Assemble a ``Plan`` from regions: validate them, simulate, and record the prediction.

Torch-free, so solvers can call it; ``ckptplan.make_plan`` is this function.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptplan.graph import ComputeGraph
from ckptplan.plan import (
    BudgetInfo,
    InputInfo,
    ModelInfo,
    NodeDecision,
    Plan,
    Prediction,
    Region,
    SolverInfo,
)
from ckptplan.simulation import Report, build_region_tree, simulate


def baseline_peak_bytes(graph: ComputeGraph) -> int:
    """Peak of one step without checkpointing."""
    return graph.baseline_peak_bytes


def make_plan(
    graph: ComputeGraph,
    regions: Sequence[Region],
    *,
    budget: BudgetInfo | None = None,
    solver: SolverInfo | None = None,
    report: Report | None = None,
) -> Plan:
    """A ``Plan`` for ``graph`` running ``regions``, with the simulator's prediction.

    Without ``budget`` the plan's budget is its own predicted peak; without ``solver`` it is
    recorded as a hand-made (``manual``) plan.
    """
    regions = tuple(regions)
    build_region_tree(graph, regions)
    report = report if report is not None else simulate(graph, regions)
    baseline = baseline_peak_bytes(graph)
    step_cost = graph.step_cost
    prediction = Prediction(
        peak_bytes=report.peak_bytes,
        baseline_peak_bytes=baseline,
        activation_bytes=graph.activation_bytes,
        recompute_flops=report.recompute_flops,
        recompute_seconds=report.recompute_seconds,
        overhead=report.recompute_seconds / step_cost if step_cost > 0 else 0.0,
    )
    return Plan(
        model=ModelInfo(
            name=graph.name,
            fingerprint=graph.fingerprint,
            inputs=tuple(InputInfo(shape=t.shape, dtype=t.dtype) for t in graph.inputs),
            node_count=len(graph.nodes),
        ),
        budget=budget or BudgetInfo(requested=str(report.peak_bytes), bytes=report.peak_bytes),
        solver=solver or SolverInfo(name="manual", status="feasible", seconds=0.0),
        prediction=prediction,
        regions=regions,
        nodes=_decisions(graph, regions),
    )


def _decisions(graph: ComputeGraph, regions: tuple[Region, ...]) -> tuple[NodeDecision, ...]:
    decision = ["store"] * len(graph.nodes)
    for top in regions:
        for region in top.walk():
            for i in range(region.start, region.end):
                decision[i] = "recompute"
    for top in regions:
        for region in top.walk():
            for name in region.keep:
                decision[graph.index_of[name]] = "keep"
    return tuple(
        NodeDecision(
            name=node.name,
            op=node.op,
            module=node.module,
            decision=decision[node.index],  # type: ignore[arg-type]
            output_bytes=node.output_bytes,
            saved_bytes=graph.saved_bytes(node.index),
            fwd_flops=node.fwd_flops,
        )
        for node in graph.nodes
    )


def solver_plan(
    graph: ComputeGraph,
    regions: Sequence[Region],
    budget_bytes: int,
    solver: SolverInfo,
    report: Report | None = None,
) -> Plan:
    """``make_plan`` as a solver returns it: the budget recorded in bytes (``solve`` later
    records how the user wrote it)."""
    return make_plan(
        graph, regions, budget=BudgetInfo(requested=str(budget_bytes), bytes=budget_bytes), solver=solver, report=report
    )
