"""The least peak a solve states when nothing fits: always the simulated peak of a plan a solver
made, so that asking for that many bytes gets a plan."""

from __future__ import annotations

from collections.abc import Sequence

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.solvers.solution import Solution
from ckptplan.units import describe_bytes


def least_plan(errors: Sequence[InfeasibleBudgetError]) -> Solution | None:
    """The plan of least peak among the solvers' least-peak plans (cheapest on ties), if any."""
    plans = [e.least_plan for e in errors if isinstance(e.least_plan, Solution)]
    return min(plans, key=lambda p: (p.peak_bytes, p.cost_seconds), default=None)


def least_of(errors: Sequence[InfeasibleBudgetError], budget_bytes: int, what: str) -> Solution:
    """From the solvers' answers to an infeasible ``budget_bytes``: the cheapest of their
    least-peak plans that fits after all (a solver's own search may miss its least-peak plan), else
    ``InfeasibleBudgetError`` naming the least peak among those plans, the plan attached.

    A solver that states a least peak without a plan (a user's) is believed only when no solver
    made one. ``what`` starts the message ("No solver fits")."""
    plans = [e.least_plan for e in errors if isinstance(e.least_plan, Solution)]
    fitting = [p for p in plans if p.peak_bytes <= budget_bytes]
    if fitting:
        return min(fitting, key=lambda p: (p.cost_seconds, p.peak_bytes))
    least = least_plan(errors)
    if least is not None:
        peak = least.peak_bytes
    elif errors:
        least, peak = None, min(e.min_peak_bytes for e in errors)
    else:
        raise InfeasibleBudgetError(f"{what} the budget of {describe_bytes(budget_bytes)}; no solver ran.",
                                    budget_bytes=budget_bytes, min_peak_bytes=0)
    raise InfeasibleBudgetError(
        f"{what} the budget of {describe_bytes(budget_bytes)}; the least peak any reaches is {describe_bytes(peak)}. "
        "Raise the budget.",
        budget_bytes=budget_bytes, min_peak_bytes=peak, least_plan=least,
    )
