"""solvers: ``ComputeGraph`` + budget -> ``Plan``.

``solve`` (``solvers.orchestrate``) is the one entry point: it owns the time limit, Ctrl-C and
the simulator's check, and runs a solver kernel, found by name (``solvers.registry``): ``sqrt``,
``dp``, ``ilp``, ``auto``, or one a user ``register``s. None imports torch.
"""

from __future__ import annotations

from ckptplan.solvers.orchestrate import solve
from ckptplan.solvers.registry import available_solvers, register

__all__ = ["available_solvers", "register", "solve"]
