"""The one place library errors become exit codes (as fastapi-cli raises ``typer.Exit``).

0 ok, 1 error, 2 usage, 3 budget infeasible, 130 interrupted (Ctrl-C outside an ``ilp`` solve,
which keeps its best plan instead). Only ``CkptPlanError`` and ``KeyboardInterrupt`` are caught:
anything else is a bug and should surface with its traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer

from ckptplan.cli.render import render_error, stderr_console
from ckptplan.errors import BudgetError, CkptPlanError, InfeasibleBudgetError, UnknownSolverError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

P = ParamSpec("P")
R = TypeVar("R")


def exit_code(error: CkptPlanError) -> int:
    if isinstance(error, InfeasibleBudgetError):
        return EXIT_INFEASIBLE
    # A misspelt option value is a usage error, like the ones typer reports itself.
    if isinstance(error, (BudgetError, UnknownSolverError)):
        return EXIT_USAGE
    return EXIT_ERROR


def exits_on_error(command: Callable[P, R]) -> Callable[P, R]:
    """Run ``command``; a ``CkptPlanError`` becomes ``Error: <message>`` on stderr and its exit code."""

    @functools.wraps(command)  # typer reads the signature through __wrapped__
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except CkptPlanError as error:
            render_error(stderr_console(), str(error))
            raise typer.Exit(exit_code(error)) from None
        except KeyboardInterrupt:
            render_error(stderr_console(), "Interrupted; nothing was written.")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return run
