"""Resident memory of a training step: parameters, buffers, inputs, gradients, optimizer state."""

from __future__ import annotations

from ckptplan.errors import CkptPlanError
from ckptplan.graph import StaticMemory, Storage

# Optimizer state per trainable parameter byte, from the torch.optim implementations:
# Adam/AdamW keep exp_avg and exp_avg_sq (same dtype as the parameter) plus a float32 ``step``
# scalar; SGD with momentum keeps one momentum buffer. ``step`` costs 4 bytes per parameter tensor.
_STATE_COPIES = {"adamw": 2, "adam": 2, "sgd": 1}
_STEP_SCALAR_BYTES = {"adamw": 4, "adam": 4, "sgd": 0}


def static_memory(storages: list[Storage], optimizer: str | None) -> StaticMemory:
    if optimizer is not None:
        optimizer = optimizer.lower()
        if optimizer not in _STATE_COPIES:
            raise CkptPlanError(
                f"Unknown optimizer {optimizer!r}; use 'adamw', 'adam', 'sgd' or None."
            )
    params = [s for s in storages if s.kind == "param"]
    trainable = [s for s in params if s.trainable]
    grad_bytes = sum(s.nbytes for s in trainable)
    optimizer_bytes = 0
    if optimizer is not None:
        optimizer_bytes = _STATE_COPIES[optimizer] * grad_bytes + _STEP_SCALAR_BYTES[optimizer] * len(trainable)
    return StaticMemory(
        param_bytes=sum(s.nbytes for s in params),
        buffer_bytes=sum(s.nbytes for s in storages if s.kind == "buffer"),
        input_bytes=sum(s.nbytes for s in storages if s.kind == "input"),
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        optimizer=optimizer,
    )
