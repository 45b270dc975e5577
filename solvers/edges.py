"""Plans cut at FSDP unit edges, which the emitted module needs (a checkpoint cannot span two
units)."""

from __future__ import annotations

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.sharding import split_at_unit_edges
from ckptplan.solvers.solution import Solution
from ckptplan.units import describe_bytes


def at_unit_edges(graph: ComputeGraph, plan: Solution, budget_bytes: int) -> Solution:
    """``plan`` with its regions cut at FSDP unit edges (``sharding.split_at_unit_edges``);
    raises ``InfeasibleBudgetError`` if the cut plan no longer fits."""
    regions = split_at_unit_edges(graph, plan.regions)
    if regions == plan.regions:
        return plan
    cut = plan.resimulated(graph, regions, plan.remat)
    if cut.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(
            f"The {plan.solver} plan no longer fits {describe_bytes(budget_bytes)} once its regions are cut at "
            f"the shard units' edges ({describe_bytes(cut.peak_bytes)}); try --solver ilp, whose large-graph "
            "plans stay inside blocks, or raise the budget.",
            budget_bytes=budget_bytes,
            min_peak_bytes=cut.peak_bytes,
            least_plan=cut,
        )
    return cut.but(note=f"{plan.note}; regions cut at shard unit edges".lstrip("; "))
