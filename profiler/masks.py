"""Attention masks that the exported graph builds and the model's own step does not.

``transformers`` decides at run time whether ``scaled_dot_product_attention`` needs a mask:
with no padding it calls the kernel with ``attn_mask=None, is_causal=True`` (the case CUDA's
flash kernel takes), but while ``torch.export`` traces it, it materialises the causal mask
(``arange``, ``cumsum``, ``le``, ``__and__`` … ``expand``) and passes it to the kernel with no
``is_causal``. A graph that keeps that mask runs another kernel than the model (on CUDA the
efficient or math kernel instead of flash), keeps the mask for backward and spends a few ops
rebuilding it; a plan for that graph prices a step the model never runs.

``restore_masks`` gives such calls back their mask-free form. A mask qualifies when it is a
constant of the traced step: built by function calls alone from no input, parameter or
buffer. It is evaluated on CPU at the traced sizes and compared with what the kernel's own
flags mean (``is_causal`` is PyTorch's top-left ``tril``): a mask equal to the causal one
becomes ``is_causal=True``, a mask that keeps every score becomes no mask, and any other mask,
or one that cannot be evaluated, stays as traced. The rewrite changes which kernel runs, not
what it computes.

Without a mask, ``transformers`` also passes grouped-query attention its keys and values
unrepeated, with ``enable_gqa=True`` (``use_gqa_in_sdpa``), where the traced, masked call repeats
them first (``repeat_kv``: ``unsqueeze``, ``expand``, ``reshape``). ``group_repeated_heads`` gives
the calls whose mask was dropped that form back, so the step computes attention and its
backward as the model does, to the last bit under bfloat16 autocast.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

_aten = torch.ops.aten
_SDPA = (_aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)
_CHECKS = (_aten._assert_tensor_metadata.default,)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# Masks above this many elements are left as traced rather than evaluated (a B·L·S boolean
# mask at batch 64 and sequence 8,192 is 4 GiB).
_MAX_MASK_ELEMENTS = 1 << 31
RESTORED = "ckptplan_mask_restored"  # node.meta key of the attention calls ``restore_masks`` rewrote
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)
_GQA_MAX_HEAD_DIM = 256  # transformers' use_gqa_in_sdpa passes enable_gqa only up to this head dim


def restore_masks(gm: GraphModule) -> int:
    """Rewrite every attention call of ``gm`` whose mask is a constant causal or all-keeping
    mask into the call without it, drop the nodes that only built it, and return how many
    calls were rewritten."""
    rewritten = 0
    for node, call in _attention_calls(gm):
        mask = call.get("attn_mask")
        if not isinstance(mask, Node) or call.get("is_causal", False):
            continue
        form = _mask_form(mask, _tensor_meta(call["query"]), _tensor_meta(call["key"]))
        if form is None:
            continue
        _set_call(node, call | {"attn_mask": None, "is_causal": form == "causal"})
        node.meta[RESTORED] = True
        _erase_unused(gm, mask)
        rewritten += 1
    return _recompiled(gm, rewritten)


def group_repeated_heads(gm: GraphModule, *, only: Callable[[dict[str, Any]], bool] | None = None) -> int:
    """Rewrite every attention call of ``gm`` whose mask ``restore_masks`` dropped, and whose keys
    and values are grouped heads repeated for it (``_unrepeated``), into the call ``transformers``
    makes without a mask: keys and values unrepeated, ``enable_gqa=True``, when their head dims
    are equal and at most 256 (``use_gqa_in_sdpa``). ``only``: rewrite just the calls it accepts,
    given as the grouped call's arguments by name (tensors as their traced values). Drop the nodes
    that only repeated them, and return how many calls were rewritten."""
    rewritten = 0
    for node, call in _attention_calls(gm):
        if not node.meta.get(RESTORED) or call.get("enable_gqa", False):
            continue
        keys, values = _tensor_meta(call["key"]), _tensor_meta(call["value"])
        grouped_key, grouped_value = _unrepeated(call["key"]), _unrepeated(call["value"])
        if keys is None or values is None or grouped_key is None or grouped_value is None:
            continue
        heads = _tensor_meta(grouped_key).size(1), _tensor_meta(grouped_value).size(1)
        if heads[0] != heads[1] or keys.size(-1) != values.size(-1) or keys.size(-1) > _GQA_MAX_HEAD_DIM:
            continue
        grouped = call | {"key": grouped_key, "value": grouped_value, "enable_gqa": True}
        if only is not None and not only({name: _tensor_meta(arg) if isinstance(arg, Node) else arg
                                          for name, arg in grouped.items()}):
            continue
        repeated = call["key"], call["value"]
        _set_call(node, grouped)
        for tensor in repeated:
            _erase_unused(gm, tensor)
        rewritten += 1
    return _recompiled(gm, rewritten)


def _attention_calls(gm: GraphModule) -> list[tuple[Node, dict[str, Any]]]:
    """Each ``scaled_dot_product_attention`` node of ``gm`` with its arguments by name."""
    return [(node, dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs))
            for node in gm.graph.nodes if node.op == "call_function" and node.target in _SDPA]


def _set_call(node: Node, call: dict[str, Any]) -> None:
    """Make ``node`` the attention call ``call``: query, key and value by position, the other
    arguments that are not None by name."""
    node.args = tuple(call[name] for name in ("query", "key", "value"))
    node.kwargs = {name: value for name, value in call.items()
                   if name not in ("query", "key", "value") and value is not None}


def _recompiled(gm: GraphModule, rewritten: int) -> int:
    """``rewritten``, after checking and recompiling ``gm`` when it changed."""
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _unrepeated(node: Any) -> Node | None:
    """The tensor of grouped heads that ``node`` repeats, when ``node`` is ``transformers``'
    ``repeat_kv`` of it (``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``, n > 1)
    and nothing else reads the repeat; else None."""
    if not isinstance(node, Node) or node.target not in _RESHAPES or len(node.users) != 1:
        return None
    expand = node.args[0]
    if not isinstance(expand, Node) or expand.target is not _aten.expand.default or len(expand.users) != 1:
        return None
    unsqueeze = expand.args[0]
    if (not isinstance(unsqueeze, Node) or unsqueeze.target is not _aten.unsqueeze.default
            or unsqueeze.args[1] != 2 or len(unsqueeze.users) != 1):
        return None
    grouped, repeated = _tensor_meta(unsqueeze.args[0]), _tensor_meta(node)
    if grouped is None or repeated is None or grouped.dim() != 4 or repeated.dim() != 4:
        return None
    batch, heads, length, dim = grouped.shape
    copies = repeated.size(1) // heads if heads else 0
    if copies < 2 or tuple(repeated.shape) != (batch, heads * copies, length, dim):
        return None
    return unsqueeze.args[0]


def _tensor_meta(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _mask_form(mask: Node, query: torch.Tensor | None, key: torch.Tensor | None) -> str | None:
    """``"causal"`` or ``"none"`` when the constant ``mask`` means exactly that for these
    query and key lengths, else None."""
    if query is None or key is None:
        return None
    value = _evaluate(mask)
    if value is None or value.dim() < 2 or value.numel() > _MAX_MASK_ELEMENTS:
        return None
    length, keys = query.size(-2), key.size(-2)
    if tuple(value.shape[-2:]) not in {(length, keys), (1, keys), (length, 1), (1, 1)}:
        return None
    if value.dtype == torch.bool:
        keep = value
    elif value.is_floating_point():
        # An additive mask is a boolean one only when it holds 0 (keep) and -inf (drop) alone.
        if not bool(((value == 0) | (value == float("-inf"))).all()):
            return None
        keep = value == 0
    else:
        return None
    keep = keep.expand(*keep.shape[:-2], length, keys)
    if bool(keep.all()):
        return "none"
    causal = torch.ones(length, keys, dtype=torch.bool).tril()
    return "causal" if torch.equal(keep, causal.expand_as(keep)) else None


def _evaluate(mask: Node) -> torch.Tensor | None:
    """The value of ``mask`` computed on CPU, or None when it depends on anything but
    function calls on constants, or fails to compute."""
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    needed: set[Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op not in ("call_function", "call_method") or _random(node):
            return None
        needed.add(node)
        stack.extend(node.all_input_nodes)
    values: dict[Node, Any] = {}
    try:
        for node in sorted(needed, key=order.__getitem__):
            args, kwargs = pytree.tree_map_only(Node, values.__getitem__, (node.args, node.kwargs))
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
            if node.op == "call_method":
                values[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.target is operator.getitem:
                values[node] = args[0][args[1]]
            else:
                values[node] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 (an op that fails on CPU tensors leaves the mask as traced)
        return None
    value = values[mask]
    return value if isinstance(value, torch.Tensor) and value.device.type == "cpu" else None


def _random(node: Node) -> bool:
    """A node whose value is drawn from a generator, so not a constant of the step."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _erase_unused(gm: GraphModule, root: Node) -> None:
    """Erase ``root`` and the ancestors that only fed it, last first, with the checks export
    attached to them (``_assert_tensor_metadata`` of a ``.to`` that built the mask)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    candidates: set[Node] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node not in candidates and node.op in ("call_function", "call_method"):
            candidates.add(node)
            stack.extend(node.all_input_nodes)
    for node in sorted(candidates, key=order.__getitem__, reverse=True):
        checks = [user for user in node.users if user.target in _CHECKS and not user.users]
        if len(checks) == len(node.users):
            for check in checks:
                gm.graph.erase_node(check)
            gm.graph.erase_node(node)
