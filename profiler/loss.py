"""Which outputs a training step differentiates: the convention shared by profiling and measuring."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def loss_leaves(output: Any) -> list[torch.Tensor]:
    """Tensors backward starts from.

    An output with a ``loss`` field or key (``transformers`` ModelOutput, dicts) uses that;
    a scalar tensor output is the loss; otherwise every floating output that requires grad is
    summed (``out.sum()``, whose gradient is a broadcast view and costs no memory).
    """
    loss = None
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    elif not isinstance(output, dict) and isinstance(getattr(output, "loss", None), torch.Tensor):
        loss = output.loss
    if loss is not None:
        return [loss]
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return [output]
    return [
        t for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]


def training_loss(output: Any) -> torch.Tensor:
    """The scalar a training step calls ``backward()`` on, per ``loss_leaves``."""
    leaves = loss_leaves(output)
    if not leaves:
        raise ValueError("The model's output has no floating tensor that requires grad; nothing to train.")
    if len(leaves) == 1 and leaves[0].numel() == 1:
        return leaves[0].reshape(())
    total = leaves[0].sum()
    for leaf in leaves[1:]:
        total = total + leaf.sum()
    return total
