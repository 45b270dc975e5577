"""The memory/compute trade-off of one graph (an eager step's, or a compiled step's joint graph):
solve at several budgets, optionally plot it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ckptplan.errors import CkptPlanError, InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.joint import JointGraph
from ckptplan.partition import simulate_partition
from ckptplan.solvers import solve
from ckptplan.solvers.partition import no_recompute
from ckptplan.units import parse_budget


@dataclass(frozen=True)
class SweepPoint:
    """One budget's outcome; ``peak_bytes`` and the costs are None when no plan fits."""

    requested: str
    budget_bytes: int
    solver: str
    peak_bytes: int | None
    recompute_flops: int | None
    overhead: float | None
    least_peak_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def sweep(
    graph: ComputeGraph, budgets: Sequence[str | int | float], solver: str = "auto", time_limit: float | None = None,
    remat: bool | None = None,
) -> list[SweepPoint]:
    """Solve ``graph`` at each budget in order (``remat``: as ``solve`` takes it); infeasible budgets
    give a point with no plan."""
    points = []
    for budget in budgets:
        requested = budget if isinstance(budget, str) else repr(budget)
        try:
            plan = solve(graph, budget, solver=solver, time_limit=time_limit, remat=remat)
        except InfeasibleBudgetError as error:
            points.append(SweepPoint(requested, error.budget_bytes, solver, None, None, None, error.min_peak_bytes))
            continue
        points.append(
            SweepPoint(
                requested,
                plan.budget.bytes,
                plan.solver.name,
                plan.prediction.peak_bytes,
                plan.prediction.recompute_flops,
                plan.prediction.overhead,
            )
        )
    return points


def sweep_partitions(
    graph: JointGraph, budgets: Sequence[str | int | float], solver: str = "auto", time_limit: float | None = None,
) -> list[SweepPoint]:
    """A compiled step's trade-off: ``solve_partition_step`` on its joint graph at each budget
    (a fraction is of the peak recomputing nothing). ``overhead`` is the recomputed seconds over
    the step's (every forward and backward value's cost); infeasible budgets give a point with no
    partition."""
    from ckptplan.solvers.orchestrate import solve_partition_step  # imports the partition solvers

    baseline = simulate_partition(graph, no_recompute(graph)).peak_bytes
    step_seconds = sum(v.cost for v in graph.values if v.phase in ("forward", "backward")) or 1.0
    points = []
    for budget in budgets:
        requested = budget if isinstance(budget, str) else repr(budget)
        budget_bytes = parse_budget(budget, baseline)
        found = solve_partition_step(graph, budget_bytes, solver=solver, time_limit=time_limit)
        report = found.report
        if not found.feasible:
            points.append(SweepPoint(requested, budget_bytes, solver, None, None, None, report.peak_bytes))
            continue
        points.append(SweepPoint(requested, budget_bytes, solver, report.peak_bytes, report.recompute_flops,
                                 report.recompute_seconds / step_seconds))
    return points


def check_plotting() -> None:
    """Raise ``CkptPlanError`` saying how to install matplotlib if it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CkptPlanError("Plotting needs matplotlib; install it with: pip install 'ckptplan[plot]'.") from None


def plot_pareto(points: Sequence[SweepPoint], path: str | Path, title: str) -> Path:
    """Draw predicted peak against recompute overhead as a PNG (needs ``ckptplan[plot]``)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    solved = [p for p in points if p.peak_bytes is not None]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([100 * p.overhead for p in solved], [p.peak_bytes / 2**20 for p in solved], marker="o")
    for p in solved:
        axes.annotate(p.requested, (100 * p.overhead, p.peak_bytes / 2**20), textcoords="offset points", xytext=(4, 4))
    axes.set_xlabel("recompute overhead (% of a step, as the profile prices ops)")
    axes.set_ylabel("predicted peak (MiB)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
