"""ckptplan: memory/compute planner and optimal activation-checkpoint solver for PyTorch.

    graph  = ckptplan.profile(model, args)
    plan   = ckptplan.solve(graph, budget="8GB")
    report = ckptplan.simulate(graph, plan)
    module = ckptplan.emit(graph, plan)

Heavy modules (torch) load on first use of the names that need them.
"""

from __future__ import annotations

import importlib
from typing import Any

from ckptplan.errors import (
    BudgetError,
    CkptPlanError,
    FingerprintMismatchError,
    InfeasibleBudgetError,
    ModelFileError,
    PlanFormatError,
    TraceError,
    UnknownSolverError,
)
from ckptplan.graph import ComputeGraph, Node, ShardSpec, StaticMemory, Storage
from ckptplan.plan import PartitionPlan, Plan, Region, load_any_plan, load_plan
from ckptplan.units import format_bytes, parse_budget

__version__ = "0.1.0"

_LAZY = {
    "profile": "ckptplan.profiler",
    "solve": "ckptplan.solvers",
    "available_solvers": "ckptplan.solvers",
    "simulate": "ckptplan.simulation",  # the core's own, without torch
    "make_plan": "ckptplan.build",
    "emit": "ckptplan.planner",
    "checkpoint": "ckptplan.planner",
    "apply": "ckptplan.planner",
    "measure_step": "ckptplan.planner",
    "verify": "ckptplan.planner",
    "save_plan": "ckptplan.planner",
    "measure_roofline": "ckptplan.planner",
    "compile": "ckptplan.planner",
}

__all__ = [  # noqa: PLE0604 (ruff cannot see that _LAZY's keys are strings)
    "BudgetError",
    "CkptPlanError",
    "ComputeGraph",
    "FingerprintMismatchError",
    "InfeasibleBudgetError",
    "ModelFileError",
    "Node",
    "PartitionPlan",
    "Plan",
    "PlanFormatError",
    "Region",
    "ShardSpec",
    "StaticMemory",
    "Storage",
    "TraceError",
    "UnknownSolverError",
    "format_bytes",
    "load_any_plan",
    "load_plan",
    "parse_budget",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
