"""Attention masks the exported graph builds and the model's step does not (``profiler/masks.py``):
a constant causal mask becomes ``is_causal``, a constant all-keeping mask becomes none, and any
other mask stays; the emitted module then runs the model's own step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptplan
from ckptplan.build import make_plan
from ckptplan.profiler.loss import training_loss
from ckptplan.profiler.masks import restore_masks

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(nn.Module):
    """One attention call whose mask ``kind`` names how it is built."""

    def __init__(self, kind: str, length: int = 8) -> None:
        super().__init__()
        self.kind, self.length = kind, length
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.size(0), self.length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        n = self.length
        rows = torch.arange(n, device=x.device)
        if self.kind == "causal":
            mask = (rows[None, :] <= rows[:, None])[None, None].expand(x.size(0), 1, n, n)
        elif self.kind == "additive":
            mask = torch.full((n, n), float("-inf"), device=x.device).triu(1)
        elif self.kind == "keep_all":
            mask = torch.ones(x.size(0), 1, 1, n, dtype=torch.bool, device=x.device)
        elif self.kind == "anticausal":
            mask = rows[None, :] >= rows[:, None]
        elif self.kind == "padding":
            mask = padding[:, None, None, :]
        elif self.kind == "random":
            mask = torch.rand(n, n, device=x.device) < 0.5
            mask[:, 0] = True
        else:
            raise ValueError(self.kind)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(x.size(0), n, 16)


def _sdpa_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SDPA]


def _exported(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(model, args).module()


@pytest.mark.parametrize(("kind", "causal"), [("causal", True), ("additive", True), ("keep_all", False)])
def test_a_constant_mask_the_kernel_flags_say_is_dropped(kind: str, causal: bool) -> None:
    torch.manual_seed(0)
    model, x = Attention(kind), torch.randn(2, 8, 16)
    gm = _exported(model, x)
    before = len(gm.graph.nodes)
    assert restore_masks(gm) == 1
    (call,) = _sdpa_calls(gm)
    assert call.kwargs.get("attn_mask") is None and len(call.args) == 3
    assert call.kwargs.get("is_causal", False) is causal
    assert len(gm.graph.nodes) < before  # the nodes that only built the mask are gone
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("kind", ["anticausal", "padding", "random"])
def test_other_masks_stay_as_traced(kind: str) -> None:
    model, x = Attention(kind), torch.randn(2, 8, 16)
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[1, 6:] = False
    gm = torch.export.export(model, (x, padding)).module()
    graph_text = str(gm.graph)
    assert restore_masks(gm) == 0
    assert str(gm.graph) == graph_text
    (call,) = _sdpa_calls(gm)
    assert isinstance(call.args[3] if len(call.args) > 3 else call.kwargs["attn_mask"], torch.fx.Node)


def _attention_calls(graph: ckptplan.ComputeGraph) -> list:
    return [n for n in graph.nodes if "scaled_dot_product_attention" in n.op]


def _llama(key_value_heads: int = 4) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=key_value_heads, max_position_embeddings=128, use_cache=False,
    )
    ids = torch.randint(0, 256, (2, 128))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def test_a_transformers_llama_plan_runs_the_models_own_attention_step() -> None:
    """``transformers`` calls SDPA with ``is_causal=True`` and no mask when nothing is padded; the
    profiled graph does too, and its emitted module with no regions is the model's step: the same
    peak as the allocator counts it and the same gradients."""
    model, kwargs = _llama()
    reference = copy.deepcopy(model)
    graph = ckptplan.profile(model, (), kwargs)
    assert len(_attention_calls(graph)) == 2
    assert not [n for n in graph.nodes if "cumsum" in n.op or "__and__" in n.op]
    plan = make_plan(graph, ())
    emitted = ckptplan.emit(graph, plan)
    model_peak = ckptplan.measure_step(reference, (), kwargs).peak_bytes
    assert ckptplan.measure_step(emitted, (), kwargs).peak_bytes == model_peak
    assert abs(plan.prediction.peak_bytes - model_peak) <= 0.001 * model_peak
    for module in (emitted, reference):
        for p in module.parameters():
            p.grad = None
        training_loss(module(**kwargs)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_grouped_query_attention_runs_unrepeated_as_the_model_calls_it() -> None:
    """With fewer key and value heads than query heads, ``transformers`` calls SDPA without a mask
    with the heads unrepeated and ``enable_gqa=True``; the profiled graph does too, so under
    bfloat16 autocast, where the repeated form rounds otherwise, the emitted module's step is the
    model's to the bit: the same gradients and the same peak. Profiled for CUDA's kernels on CPU,
    the calls are grouped where CUDA's flash kernel takes them (16-bit), and the repeat stays in
    float32 (``cuda_attention`` models no other grouped call)."""
    model, kwargs = _llama(key_value_heads=2)
    reference = copy.deepcopy(model)
    graph = ckptplan.profile(model, (), kwargs, autocast=torch.bfloat16)
    assert len(_attention_calls(graph)) == 2
    assert not [n for n in graph.nodes if n.op == "aten.expand.default" and "self_attn" in n.module]
    emitted = ckptplan.emit(graph, make_plan(graph, ()))
    model_peak = ckptplan.measure_step(reference, (), kwargs, autocast=torch.bfloat16).peak_bytes
    assert ckptplan.measure_step(emitted, (), kwargs, autocast=torch.bfloat16).peak_bytes == model_peak
    for module in (emitted, reference):
        for p in module.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = training_loss(module(**kwargs))
        loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    for_cuda = ckptplan.profile(model, (), kwargs, autocast=torch.bfloat16, target="cuda")
    assert len(_attention_calls(for_cuda)) == 2
    assert not [n for n in for_cuda.nodes if n.op == "aten.expand.default" and "self_attn" in n.module]
    fp32_for_cuda = ckptplan.profile(model, (), kwargs, target="cuda")
    assert [n for n in fp32_for_cuda.nodes if n.op == "aten.expand.default" and "self_attn" in n.module]
