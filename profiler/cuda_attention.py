"""Scaled-dot-product attention as CUDA runs it, recorded on fake tensors of another device.

A profile for ``target="cuda"`` of a model faked on CPU or ``meta`` would otherwise record the
kernel of the fake tensors' device. In training with dropout that is PyTorch's math kernel,
whose backward keeps three B·H·L·S tensors (softmax output, dropout noise, dropped
probabilities); CUDA's fused kernels keep their output and a B·H·L log-sum-exp. On the GPT
example that difference is most of its activations.

Which kernel CUDA runs is decided in ATen's ``select_sdp_backend``
(``transformers/cuda/sdp_utils.cpp``): flash attention, then memory-efficient attention, then
the math kernel, each behind constraints. This module assumes PyTorch's default backends on an
sm80-or-newer GPU (A100, H100, H200) and checks the constraints that depend on the call:

* flash: float16/bfloat16, no ``attn_mask``, q/k/v of one head dim ≤ 256, no causal mask over
  unequal query and key lengths; grouped-query calls too (``enable_gqa``, the query's heads a
  multiple of the key's: ``can_use_flash_attention`` takes them, and the kernel reads the
  key and value heads as they are, saving them unrepeated);
* memory-efficient: float32/float16/bfloat16, q and k of one head dim, q and v head dims
  divisible by 8 (16-bit) or 4 (float32); grouped-query calls that flash does not take are
  not modelled (whether this kernel takes them depends on the PyTorch release);
* otherwise the math kernel, run here as CUDA runs it: the composite of ordinary ops
  (``composite``'s sequence) with CUDA's fused dropout, which keeps a 1-byte mask.

Both fused kernels need 4-D inputs whose last dimension has stride 1, and an ``attn_mask``
whose last dimension has stride 1 (``transformers``' BERT and ViT broadcast theirs over keys
with stride 0, and an H200 ran their attention on the math kernel). On Hopper with a recent
cuDNN, PyTorch prefers cuDNN attention for 16-bit inputs; it keeps the same tensors as flash
(output and a B·H·L float32 log-sum-exp), so flash stands for both.

What ``scaled_dot_product_attention`` does around the kernels on CUDA (ATen's
``attention.cu`` and ``attention.cpp``) is done here too, since it allocates: autocast casts
the inputs to its 16-bit dtype; flash pads head dims to a multiple of 8; the efficient kernel
takes a boolean mask as an additive one in the query's dtype, padded in its last dimension
to a multiple of 8 when not aligned, and keeps it for backward. The fused ops run on the fake
tensors through their meta implementations, with autograd saving what CUDA's would.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ckptplan.profiler.composite import attention_bias

_aten = torch.ops.aten
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_MASK_ALIGNMENT = 8  # attention.cpp, preprocess_mask: mem_eff_alignment

Backend = Literal["flash", "efficient", "math"]


def sdpa_call(func: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The arguments of a ``scaled_dot_product_attention`` call by name, else None."""
    if func is not F.scaled_dot_product_attention and func is not _aten.scaled_dot_product_attention.default:
        return None
    return dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs


def cuda_backend(call: dict[str, Any], autocast: torch.dtype | None = None) -> Backend:
    """The kernel CUDA's dispatch picks for ``call`` on an sm80+ GPU with default settings
    ("math" also for the calls this module does not model). ``autocast``: the dtype CUDA's
    autocast casts float32 inputs to (None: as enabled where this runs)."""
    query, key, value = call["query"], call["key"], call["value"]
    dtype = autocast if autocast is not None and query.dtype == torch.float32 else _compute_dtype(query)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"
    grouped = call.get("enable_gqa", False) and key.size(-3) != query.size(-3)
    if grouped and (query.size(-3) % key.size(-3) != 0 or value.size(-3) != key.size(-3)):
        return "math"  # CUDA refuses these; the device's kernel records them
    mask = call.get("attn_mask")
    if mask is not None and mask.stride(-1) != 1:
        return "math"  # fused kernels need the mask's last dimension dense too (a broadcast one is not)
    if any(t.stride(-1) != 1 and t.size(-1) != 1 for t in (query, key, value)):
        return "math"
    q_dim, k_dim, v_dim = query.size(-1), key.size(-1), value.size(-1)
    causal_rectangle = call.get("is_causal", False) and query.size(-2) != key.size(-2)
    if (
        dtype in _LOW_PRECISION
        and call.get("attn_mask") is None
        and q_dim == k_dim == v_dim <= _FLASH_MAX_HEAD_DIM
        and not causal_rectangle
    ):
        return "flash"
    if grouped:
        return "math"  # grouped heads beyond flash: not modelled; the device's kernel records them
    alignment = 8 if dtype in _LOW_PRECISION else 4
    if dtype in (torch.float32, *_LOW_PRECISION) and q_dim == k_dim and q_dim % alignment == 0 and v_dim % alignment == 0:
        return "efficient"
    return "math"


def attention_as_cuda(call: dict[str, Any]) -> torch.Tensor | None:
    """``scaled_dot_product_attention(**call)`` through the kernel CUDA would run, on the call's
    (fake) tensors; None for the calls this module does not model (the caller runs them as
    they are)."""
    backend = cuda_backend(call)
    if backend == "math" and (call.get("enable_gqa", False) or (call.get("scale") or 0.0) < 0):
        return None
    dtype = _compute_dtype(call["query"])
    query, key, value = (call[name].to(dtype) for name in ("query", "key", "value"))
    mask, dropout_p, is_causal = call.get("attn_mask"), call.get("dropout_p", 0.0), call.get("is_causal", False)
    scale = call.get("scale")
    if scale is None:  # the scale of the unpadded head dim (sdp::calculate_scale)
        scale = 1.0 / math.sqrt(query.size(-1))
    if backend == "math":
        return _math_as_cuda(query, key, value, mask, dropout_p, is_causal, scale)
    if backend == "flash":
        head_dim = query.size(-1)
        padded = [_pad_last_dim(t, 8) for t in (query, key, value)]
        out = _aten._scaled_dot_product_flash_attention.default(*padded, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :head_dim] if out.size(-1) != head_dim else out
    bias = _efficient_bias(mask, query, key)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return _aten._scaled_dot_product_efficient_attention.default(
        query, key, value, bias, grad, dropout_p, is_causal, scale=scale
    )[0]


def _math_as_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float,
) -> torch.Tensor:
    """The math kernel's ops (``_scaled_dot_product_attention_math``, as ``composite`` spells it
    out) on inputs already cast, its dropout the fused CUDA kernel's."""
    root = math.sqrt(scale)  # query and key are each scaled by √scale, for stability
    # Autocast casts the kernel's inputs once; the ops inside it are not cast again.
    device = query.device.type
    with torch.autocast(device, enabled=False) if device in ("cpu", "cuda") else contextlib.nullcontext():
        scores = torch.matmul(query * root, key.transpose(-2, -1) * root)
        if is_causal or mask is not None:
            scores = scores + attention_bias(query, key, mask, is_causal)
        weights = _aten._safe_softmax.default(scores, -1)
        if dropout_p > 0:
            weights = _aten.native_dropout.default(weights, dropout_p, True)[0]
        return torch.matmul(weights, value)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: CUDA's autocast casts its inputs to the 16-bit dtype."""
    device = query.device.type
    if query.dtype == torch.float32 and device != "meta" and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def _pad_last_dim(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.size(-1) % multiple
    return F.pad(t, (0, extra)) if extra else t


def _efficient_bias(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The additive bias the efficient kernel receives: a boolean mask as 0 / -inf in the query's
    dtype (``convert_boolean_attn_mask``), padded to an aligned last dimension when it is not
    (``preprocess_mask``), broadcast to B·H·L·S (a view)."""
    if mask is None:
        return None
    mask = attention_bias(query, key, mask, False).to(query.dtype)
    aligned = mask.stride(-1) == 1 and all(stride % _MASK_ALIGNMENT == 0 for stride in mask.stride()[:-1])
    if not aligned:  # pad_bias pads by alignment - size % alignment: a whole 8 when the size is aligned
        last = mask.size(-1)
        mask = F.pad(mask, (0, _MASK_ALIGNMENT - last % _MASK_ALIGNMENT))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(-2))
