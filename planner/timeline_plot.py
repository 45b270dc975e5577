"""A plan's memory timeline as a PNG (``ckptplan show PLAN.json --plot timeline.png``)."""

from __future__ import annotations

from pathlib import Path

from ckptplan.errors import CkptPlanError
from ckptplan.plan import Plan
from ckptplan.planner.sweep import check_plotting

MIB = 2**20


def plot_timeline(plan: Plan, path: str | Path) -> Path:
    """Draw the plan's predicted live bytes over one step, forward and backward shaded, with its
    budget and peak, as a PNG at ``path`` (needs ``ckptplan[plot]``).

    Raises ``CkptPlanError`` when the plan carries no timeline (plans written by older versions).
    """
    timeline = plan.prediction.timeline
    if timeline is None or not timeline.bytes:
        raise CkptPlanError("This plan has no memory timeline; solve it again to get one.")
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = len(timeline.bytes)
    figure, axes = plt.subplots(figsize=(8, 4))
    axes.axvspan(0, timeline.backward_start, color="tab:blue", alpha=0.08, label="forward")
    axes.axvspan(timeline.backward_start, buckets, color="tab:orange", alpha=0.08, label="backward")
    # One step per bucket: each holds the most bytes live during its stretch of the step.
    axes.stairs([b / MIB for b in timeline.bytes], range(buckets + 1), color="tab:blue", linewidth=1.5,
                label="live (max per bucket)")
    axes.axhline(plan.budget.bytes / MIB, color="tab:red", linestyle="--", linewidth=1,
                 label=f"budget {plan.budget.bytes / MIB:.1f} MiB")
    axes.axhline(timeline.peak_bytes / MIB, color="tab:gray", linestyle=":", linewidth=1,
                 label=f"peak {timeline.peak_bytes / MIB:.1f} MiB")
    axes.set_xlim(0, buckets)
    axes.set_ylim(0, 1.08 * max(plan.budget.bytes, timeline.peak_bytes) / MIB)
    axes.set_xlabel(f"step progress ({timeline.events} simulator events in {buckets} buckets)")
    axes.set_ylabel("live memory (MiB)")
    axes.set_title(f"{plan.model.name}: predicted memory, {plan.solver.name} plan")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize="small", frameon=False)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
