"""One exception family for ckptplan; the CLI maps these to exit codes at its edge."""

from __future__ import annotations


class CkptPlanError(Exception):
    """Base of every error ckptplan raises on purpose. The message is one sentence plus a hint."""


class BudgetError(CkptPlanError, ValueError):
    """A budget string or number could not be understood."""


class InfeasibleBudgetError(CkptPlanError):
    """No plan the solver can build fits the budget. ``min_peak_bytes`` is the least peak it
    reached: the simulated peak of ``least_plan`` (a ``Plan``, which a budget of that many bytes
    admits) when the solver made one; without one, a bound below which nothing fits (what every
    plan holds, for a budget refused before any solver ran)."""

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int, least_plan: object = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.least_plan = least_plan


class TraceError(CkptPlanError):
    """The model could not be traced into a graph."""


class PlanFormatError(CkptPlanError, ValueError):
    """A plan file or plan object is malformed, foreign, or inconsistent with its graph."""


class FingerprintMismatchError(CkptPlanError):
    """A saved plan was made for a different model or input shapes."""


class ModelFileError(CkptPlanError):
    """A model file given to the CLI could not be loaded."""


class UnknownSolverError(CkptPlanError, KeyError):
    """No solver is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0])
