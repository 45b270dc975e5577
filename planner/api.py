"""One-call entry points: checkpoint a model under a budget, or apply a saved plan to it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ckptplan.errors import FingerprintMismatchError
from ckptplan.graph import ShardSpec
from ckptplan.plan import Plan
from ckptplan.planner.emit import CheckpointedModule, emit
from ckptplan.profiler import profile
from ckptplan.profiler.trace import Target, TraceMode
from ckptplan.solvers import solve


def checkpoint(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None = None,
    *,
    budget: str | float,
    solver: str = "auto",
    trace: TraceMode = "export",
    optimizer: str | None = None,
    time_limit: float | None = None,
    shard: ShardSpec | None = None,
    autocast: torch.dtype | None = None,
    target: Target | None = None,
    spell_out: bool = False,
    remat: bool | None = None,
    outputs_live: bool = True,
) -> CheckpointedModule:
    """Profile ``model``, solve for ``budget`` and return the rewritten module (``plan`` attached
    as ``module.ckptplan_plan``). ``shard``: plan one rank of a sharded step (``ckptplan.sharding``).
    ``remat``: also consider rematerialising cheap ops (``ckptplan.solve``; None: for ``auto`` only).
    ``autocast``, ``target``, ``spell_out``, ``outputs_live``: as ``profile`` takes them; with ``autocast``, run the
    module's forward and loss under ``torch.autocast`` with that dtype and its backward outside it."""
    graph = profile(
        model, args, kwargs, trace=trace, optimizer=optimizer, shard=shard, autocast=autocast, target=target,
        spell_out=spell_out, outputs_live=outputs_live,
    )
    plan = solve(graph, budget, solver=solver, time_limit=time_limit, remat=remat)
    module = emit(graph, plan)
    module.__dict__["ckptplan_plan"] = plan
    return module


def apply(
    model: nn.Module,
    args: Any,
    plan: Plan,
    kwargs: dict[str, Any] | None = None,
    *,
    trace: TraceMode | None = None,
    optimizer: str | None = None,
) -> CheckpointedModule:
    """Re-trace ``model`` and emit ``plan``; refuses a plan made for another model or shapes.

    The model is profiled as the plan's step was: under its autocast dtype (run the module's
    forward and loss under ``torch.autocast`` with it, as that step did) and for its target's
    kernels (a plan made on ``meta`` for ``"cuda"`` applies to the model on a GPU, or on CPU),
    with its composite kernels spelled out if they were.
    A plan made for a sharded step (``plan.model.sharding``) is emitted for the same shard
    units, so that ``fully_shard`` on the model's blocks composes with the result. In a
    distributed job, solve once and give every rank the same plan file: each rank then runs
    the same regions, which a per-rank solve under a time limit does not guarantee."""
    sharding = plan.model.sharding
    shard = None
    if sharding is not None:
        shard = ShardSpec(sharding.degree, stage=sharding.stage, master_dtype=sharding.master_dtype,
                          units=sharding.units)
    autocast = getattr(torch, plan.model.autocast) if plan.model.autocast is not None else None
    graph = profile(
        model, args, kwargs, trace=trace or "export", optimizer=optimizer, shard=shard, autocast=autocast,
        target=plan.model.target or "cpu",  # plans from before targets were fingerprinted as CPU ones
        spell_out=plan.model.spell_out,
    )
    if graph.fingerprint != plan.model.fingerprint:
        raise FingerprintMismatchError(
            f"Plan was made for {plan.model.name} with fingerprint {plan.model.fingerprint}, but this model "
            f"and inputs give {graph.fingerprint}; solve again for this model and input shapes."
        )
    module = emit(graph, plan)
    module.__dict__["ckptplan_plan"] = plan
    return module
