"""planner: orchestration around the solvers.

``simulate`` (the referee: memory and recompute of any plan), ``make_plan`` (a plan from
regions), ``emit`` (the FX rewrite that runs a plan), ``checkpoint`` / ``apply`` (one-call use),
``compile`` (``torch.compile`` partitioned by ckptplan), ``measure_step`` (a real step's peak), ``measure_roofline`` (this machine's
cost model), ``verify`` (a plan against real steps),
and plan I/O.
"""

from __future__ import annotations

from ckptplan.build import make_plan
from ckptplan.plan import Plan, load_plan
from ckptplan.planner.api import apply, checkpoint
from ckptplan.planner.calibrate import measure_roofline
from ckptplan.planner.compiled import CompiledPlan, compile
from ckptplan.planner.emit import CheckpointedModule, emit
from ckptplan.planner.io import save_plan
from ckptplan.planner.measure import Measurement, measure_step
from ckptplan.planner.verify import Verification, verify
from ckptplan.simulation import Event, Report, simulate

__all__ = [
    "CheckpointedModule",
    "CompiledPlan",
    "Event",
    "Measurement",
    "Plan",
    "Report",
    "Verification",
    "apply",
    "checkpoint",
    "compile",
    "emit",
    "load_plan",
    "make_plan",
    "measure_roofline",
    "measure_step",
    "save_plan",
    "simulate",
    "verify",
]
