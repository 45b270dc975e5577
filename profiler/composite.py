"""Composite kernels spelled out as graph nodes: attention's math kernel and CPU dropout.

A graph node can only be kept or recomputed whole. Where the kernel behind a node is itself a
composite of ordinary ops, spelling those ops out as nodes lets a plan keep some of its tensors
and recompute the cheap rest, as torch.compile's min-cut partitioner does (it traces below the
dispatcher and sees these ops). The emitted module then runs exactly the ops the kernel would
have, in the same order with the same random draws, so outputs and gradients are bitwise those
of the model. Only kernels of the profile's target device are spelled out.

Attention
---------

``scaled_dot_product_attention`` dispatches at run time to a fused kernel (flash, memory-efficient,
cuDNN, CPU flash) or, where none applies, to ``_scaled_dot_product_attention_math``: a composite
of ordinary ops whose backward saves the softmax output, the dropout noise and the dropout output
(three B·H·L·S tensors) and copies of the scaled query and key, where a fused kernel saves its
output and log-sum-exp. On CPU every training call with dropout takes the math kernel (torch 2.13).

The sequence (``_scaled_dot_product_attention_math`` in ATen's ``attention.cpp``, as ``make_fx``
shows it in torch 2.13)::

    q · √scale, (kᵀ) · √scale  ->  matmul  ->  + mask bias  ->  _safe_softmax  ->  dropout  ->  matmul v

``matmul`` copies a strided operand into a contiguous batch for ``bmm``, which saves that copy.
Here the copies are nodes of their own (``contiguous``: the same copy, the same values), so a
plan can keep a matmul's product, as a selective policy saving ``bmm`` outputs does, and
recompute the copies instead of caching them with it.

Dropout
-------
On CPU, ``at::native::dropout`` (training, 0 < p < 1) computes
``input * empty_like(input).bernoulli_(1 - p).div_(1 - p)`` and its backward keeps that noise in
the input's dtype: 4 bytes per element in fp32, where CUDA's fused ``native_dropout`` (and
torch.compile's partitioner on either device) keeps a one-byte mask. Spelled out, dropout is a
``<name>_mask`` node, which draws the same Bernoulli samples into a boolean mask, and a
``<name>_mul`` node, ``apply_dropout_mask``, which multiplies by the mask and by the noise's one
nonzero value (the same bits as ``input * noise``); its backward keeps only the mask. So the
step keeps a quarter of the bytes per fp32 dropout, and a region can start at the product:
backward recomputes the product from the saved mask, where recomputing dropout whole re-draws
the noise (on CPU the dearest part). CUDA's fused ``native_dropout`` is one kernel and stays
one node.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
# What the new nodes take over from the attention call: where it sits in the model.
_INHERITED_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


def attention_bias(query: torch.Tensor, key: torch.Tensor, attn_mask: Any, is_causal: bool) -> torch.Tensor:
    """The additive mask the math kernel adds to the scores: 0 where attention is allowed,
    -inf where not (a causal ``tril`` or a boolean ``attn_mask``), in the query's dtype; a float
    ``attn_mask`` as it is. Built on the query's device, so the graph runs wherever the model does.
    Called with ``is_causal`` or a mask (the kernel refuses both at once)."""
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    if attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device)
    minus_inf = torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device)
    return torch.where(attn_mask, zero, minus_inf)


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def runs_math_kernel(call: dict[str, Any], device: str) -> bool:
    """Whether ``scaled_dot_product_attention(**call)`` runs the math kernel on ``device``, in
    training (inputs that require grad). Asked of PyTorch itself, on fake tensors with the call's
    shapes, dtypes and strides: a dispatch probe, nothing allocated."""
    mode = FakeTensorMode()
    fakes: dict[str, Any] = {}
    with mode:
        for name, value in call.items():
            if isinstance(value, torch.Tensor):
                fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
                fakes[name] = fake.requires_grad_(value.is_floating_point() and name != "attn_mask")
            else:
                fakes[name] = value
        probe = _OpNames()
        with probe:
            F.scaled_dot_product_attention(**fakes)
    return _aten._safe_softmax.default in probe.ops


def _call_of(node: torch.fx.Node) -> dict[str, Any] | None:
    """The call's arguments by name, with tensors as their traced values (``meta["val"]``, which
    torch.export records); None when one is unknown."""
    bound = dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs)
    call: dict[str, Any] = {}
    for name, arg in bound.items():
        if isinstance(arg, torch.fx.Node):
            value = arg.meta.get("val")
            if not isinstance(value, torch.Tensor):
                return None
            call[name] = value
        else:
            call[name] = arg
    return call


def _decomposable(call: dict[str, Any]) -> bool:
    """Calls this module spells out: plain heads (no grouped-query broadcast, which the kernel
    handles with ``repeat_interleave``), a non-negative scale, dropout a constant."""
    scale = call.get("scale")
    return (
        not call.get("enable_gqa", False)
        and (scale is None or scale >= 0)
        and isinstance(call.get("dropout_p", 0.0), float | int)
        and isinstance(call.get("is_causal", False), bool)
    )


def spell_out_composites(gm: torch.fx.GraphModule, target: str, *, autocast: bool = False) -> None:
    """Spell out, in place, ``gm``'s composite kernels on device kind ``target``: attention that
    runs the math kernel there, then (on CPU) every dropout, the attention's own included.

    Under ``autocast`` attention stays whole: autocast casts its inputs once and runs the whole
    kernel in the low dtype, which its parts, each cast by its own rule, would not reproduce.
    Dropout's parts are on no autocast list, as dropout is not. Whether attention runs the math
    kernel is asked of PyTorch on fake tensors of ``target``'s device, which needs that device's
    backend: without CUDA, attention for a CUDA target stays whole."""
    replaced = 0
    if not autocast and (target == "cpu" or torch.cuda.is_available()):
        replaced += _spell_out_math_attention(gm, target)
    if target == "cpu":
        replaced += _spell_out_cpu_dropout(gm)
    if replaced:
        gm.graph.lint()
        gm.recompile()


def dropout_noise(input: torch.Tensor, p: float) -> torch.Tensor:
    """The scaled Bernoulli noise CPU dropout multiplies by (``at::native::_dropout_impl``).

    Under torch.compile it is dropout applied to ones, whose values are the same: compilers
    that replace random ops by their own generators (inductor) then draw for it what they draw
    for the model's dropout of a tensor of that shape, and ``input * noise`` is their product."""
    if torch.compiler.is_compiling():
        return torch.ops.aten.dropout.default(torch.ones_like(input), p, True)
    return torch.empty_like(input).bernoulli_(1 - p).div_(1 - p)


def dropout_mask(input: torch.Tensor, p: float) -> torch.Tensor:
    """Where CPU dropout keeps ``input``: the Bernoulli draws of ``dropout_noise`` as a bool
    tensor, one byte each. ``bernoulli_`` draws the same stream whatever the tensor's dtype
    (checked bitwise by ``tests/test_composite.py``), so the draws go straight into the mask."""
    if torch.compiler.is_compiling():
        return torch.ops.aten.dropout.default(torch.ones_like(input), p, True).ne(0)
    return torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p)


def _scale(p: float, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's noise value where it keeps an element, ``1 / (1 - p)`` as its ``div_`` rounds it."""
    return torch.ones((), dtype=dtype).div_(1 - p)


class _ApplyDropoutMask(torch.autograd.Function):
    """``input * noise`` from the bool mask: ``input * mask`` (``input`` or a zero of its sign)
    times the kept elements' noise value, one rounding as in ``input * noise``. Backward keeps
    only the mask and computes mul's own gradient, ``grad * noise``, the same way."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
        ctx.p = p
        ctx.save_for_backward(mask)
        return (input * mask).mul_(_scale(p, input.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return (grad * mask).mul_(_scale(ctx.p, grad.dtype)), None, None


def apply_dropout_mask(input: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """CPU dropout's product, ``input * dropout_noise(input, p)``, bitwise, from ``dropout_mask``'s
    draws; autograd keeps the bool mask instead of the noise."""
    return _ApplyDropoutMask.apply(input, mask, p)


def _spell_out_cpu_dropout(gm: torch.fx.GraphModule) -> int:
    """Replace each out-of-place training dropout of ``gm`` by ``<name>_mask`` and
    ``<name>_mul`` nodes; returns how many were replaced. In-place dropout stays whole."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _aten.dropout.default:
            continue
        bound = dict(zip(("input", "p", "train"), node.args, strict=False)) | dict(node.kwargs)
        p, train = bound.get("p"), bound.get("train")
        if not (isinstance(p, float) and 0.0 < p < 1.0 and train is True):
            continue  # no kernel (identity or zeros), or a value known only at run time
        inherited = _inherited_meta(node)
        with gm.graph.inserting_before(node):
            x = bound["input"]
            mask = gm.graph.create_node("call_function", dropout_mask, (x, p), name=f"{node.name}_mask")
            out = gm.graph.create_node("call_function", apply_dropout_mask, (x, mask, p), name=f"{node.name}_mul")
        mask.meta.update(inherited)
        out.meta.update(inherited)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        log.info("spelled out %d CPU dropout call(s) as mask and product", replaced)
    return replaced


def _inherited_meta(node: torch.fx.Node) -> dict[str, Any]:
    return {name: node.meta[name] for name in _INHERITED_META if name in node.meta}


def _spell_out_math_attention(gm: torch.fx.GraphModule, device: str) -> int:
    """Replace, in place, each attention call of ``gm`` that runs the math kernel on ``device``
    with the nodes that kernel runs; returns how many were replaced. The new nodes carry the
    call's module path, so per-module views still place them."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        call = _call_of(node)
        if call is None or not _decomposable(call) or not runs_math_kernel(call, device):
            continue
        _spell_out(gm.graph, node, call)
        replaced += 1
    if replaced:
        log.info("spelled out %d math-kernel attention call(s) as their ops", replaced)
    return replaced


def _spell_out(graph: torch.fx.Graph, node: torch.fx.Node, call: dict[str, Any]) -> None:
    bound = dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs)
    query, key, value = bound["query"], bound["key"], bound["value"]
    attn_mask, is_causal = bound.get("attn_mask"), bound.get("is_causal", False)
    dropout_p = float(bound.get("dropout_p", 0.0))
    scale = call.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(call["query"].shape[-1])
    # The kernel scales query and key by √scale each, for stability in low precision.
    root = math.sqrt(scale)
    inherited = _inherited_meta(node)

    def add(name: str, target: Any, *args: Any) -> torch.fx.Node:
        new = graph.create_node("call_function", target, args, name=f"attn_{name}")
        new.meta.update(inherited)
        return new

    with graph.inserting_before(node):
        scaled_query = add("query", _aten.mul.Scalar, query, root)
        key_t = add("key_t", _aten.transpose.int, key, -2, -1)
        scaled_key = add("key", _aten.mul.Scalar, key_t, root)
        scores = add("scores", _aten.matmul.default, add("query_c", _aten.contiguous.default, scaled_query),
                     add("key_c", _aten.contiguous.default, scaled_key))
        if is_causal or attn_mask is not None:
            bias = add("bias", attention_bias, query, key, attn_mask, is_causal)
            scores = add("masked", _aten.add.Tensor, scores, bias)
        weights = add("softmax", _aten._safe_softmax.default, scores, -1)
        if dropout_p > 0.0:
            weights = add("dropout", _aten.dropout.default, weights, dropout_p, True)
        out = add("out", _aten.matmul.default, weights, add("value_c", _aten.contiguous.default, value))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
