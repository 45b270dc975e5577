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
    ShardingInfo,
    SolverInfo,
)
from ckptplan.remat import indices
from ckptplan.simulation import Report, baseline_peak_bytes, build_region_tree, simulate
from ckptplan.timeline import timeline_of


def make_plan(
    graph: ComputeGraph,
    regions: Sequence[Region],
    *,
    budget: BudgetInfo | None = None,
    solver: SolverInfo | None = None,
    report: Report | None = None,
    remat: Sequence[str] = (),
) -> Plan:
    """A ``Plan`` for ``graph`` running ``regions`` and rematerialising the nodes named in
    ``remat`` (``ckptplan.remat``), with the simulator's prediction.

    Without ``budget`` the plan's budget is its own predicted peak; without ``solver`` it is
    recorded as a hand-made (``manual``) plan.
    """
    regions = tuple(regions)
    remat = tuple(graph.nodes[i].name for i in indices(graph, remat)) if remat else ()
    tops = build_region_tree(graph, regions)
    report = report if report is not None else simulate(graph, regions, remat=remat)
    baseline = baseline_peak_bytes(graph)
    step_cost = graph.step_cost
    prediction = Prediction(
        peak_bytes=report.peak_bytes,
        baseline_peak_bytes=baseline,
        activation_bytes=graph.activation_bytes,
        recompute_flops=report.recompute_flops,
        recompute_seconds=report.recompute_seconds,
        checkpoint_seconds=report.checkpoint_seconds,
        overhead=report.cost_seconds / step_cost if step_cost > 0 else 0.0,
        priced_in=graph.priced_in,
        priced_on=graph.priced_on or None,
        timeline=timeline_of(report.timeline),
    )
    return Plan(
        model=ModelInfo(
            name=graph.name,
            fingerprint=graph.fingerprint,
            inputs=tuple(InputInfo(shape=t.shape, dtype=t.dtype) for t in graph.inputs),
            node_count=len(graph.nodes),
            sharding=_sharding(graph),
            autocast=graph.autocast,
            target=graph.target,
            spell_out=graph.spelled_out,
            outputs_live=graph.outputs_live,
        ),
        budget=budget or BudgetInfo(requested=str(report.peak_bytes), bytes=report.peak_bytes),
        solver=solver or SolverInfo(name="manual", status="feasible", seconds=0.0),
        prediction=prediction,
        regions=regions,
        nodes=_decisions(graph, regions, _region_input_bytes(graph, [top.input_storages for top in tops]), remat),
        remat=remat,
    )


def _sharding(graph: ComputeGraph) -> ShardingInfo | None:
    layout = graph.sharding
    if layout is None:
        return None
    spec = layout.spec
    return ShardingInfo(degree=spec.degree, stage=spec.stage, master_dtype=spec.master_dtype,
                        units=tuple(u.path for u in layout.units))


def _region_input_bytes(graph: ComputeGraph, input_storages: Sequence[Sequence[int]]) -> list[int]:
    """Per node: bytes of the storages it allocated that top-level regions store as their
    inputs (``input_storages`` per region, as ``build_region_tree`` finds them). A storage two
    regions read counts once: it is held once."""
    per_node_bytes = [0] * len(graph.nodes)
    for s in sorted({s for storages in input_storages for s in storages}):
        storage = graph.storages[s]
        if storage.producer >= 0:
            per_node_bytes[storage.producer] += storage.nbytes
    return per_node_bytes


def _decisions(
    graph: ComputeGraph, regions: tuple[Region, ...], region_input_bytes: Sequence[int], remat: Sequence[str] = ()
) -> tuple[NodeDecision, ...]:
    decision = ["store"] * len(graph.nodes)
    for name in remat:
        decision[graph.index_of[name]] = "remat"
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
            region_input_bytes=region_input_bytes[node.index],
        )
        for node in graph.nodes
    )
