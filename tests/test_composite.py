"""Composite kernels spelled out as graph nodes (``profile(..., spell_out=True)``,
``profiler/composite.py``): attention's math kernel and CPU dropout run as their parts, bitwise as
the model runs them, and plans can keep or recompute each part with the peak the simulator
predicts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptplan
from ckptplan.cli.main import app
from ckptplan.profiler.composite import apply_dropout_mask, dropout_mask, runs_math_kernel
from tests.conftest import bits


class Attention(nn.Module):
    """Two attention layers with dropout, masked as ``mask`` says: "causal", "bool" or "float"."""

    def __init__(self, mask: str, width: int = 32, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.mask, self.heads, self.dropout = mask, heads, dropout
        self.qkv = nn.ModuleList([nn.Linear(width, 3 * width) for _ in range(2)])
        self.proj = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in qkv(x).split(C, dim=2))
            mask = {"causal": None, "bool": allowed, "float": torch.where(allowed, 0.0, -1e4)}[self.mask]
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout, is_causal=self.mask == "causal"
            )  # (B, nh, T, hs)
            x = x + self.drop(proj(y.transpose(1, 2).reshape(B, T, C)))
        return x


def _inputs(seq: int = 16, width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    allowed = torch.rand(4, 1, seq, seq) > 0.3
    allowed[..., 0] = True  # every query attends somewhere
    return torch.randn(4, seq, width), allowed


def _parts(graph: ckptplan.ComputeGraph, prefix: str) -> list[str]:
    return [n.name for n in graph.nodes if n.name.startswith(prefix)]


@pytest.mark.parametrize("mask", ["causal", "bool", "float"])
def test_attention_and_dropout_run_as_their_parts_with_the_models_gradients(mask: str) -> None:
    torch.manual_seed(0)
    model = Attention(mask)
    args = _inputs()
    assert not _parts(ckptplan.profile(model, args), "attn_")  # whole unless asked
    graph = ckptplan.profile(model, args, spell_out=True)
    assert graph.spelled_out
    assert _parts(graph, "attn_softmax") == ["attn_softmax", "attn_softmax_1"]
    assert len(_parts(graph, "attn_bias")) == 2
    assert not any(n.op == "aten.scaled_dot_product_attention.default" for n in graph.nodes)
    # 2 attention dropouts and 2 residual dropouts, each as mask and product; nothing else random
    assert sorted(n.name.endswith("_mask") for n in graph.nodes if n.random) == [True] * 4
    products = [n for n in graph.nodes if n.name.endswith("_mul")]
    assert len(products) == 4
    # The product keeps the bool mask for backward (one byte an element), not fp32 noise (four).
    for product in products:
        mask = graph.index_of[product.name.removesuffix("_mul") + "_mask"]
        assert graph.saved_bytes(product.index) == graph.new_bytes(mask) == product.output_bytes // 4
    # The parts run the kernel's ops with the kernel's random draws: the same bits.
    result = ckptplan.verify(model, args, ckptplan.make_plan(graph, []), steps=1)
    assert result.gradients_equal and result.max_grad_error == 0.0
    assert abs(result.prediction_error) <= 0.03


def test_plans_keep_the_softmax_or_recompute_the_dropout_product_within_their_predicted_peak() -> None:
    torch.manual_seed(0)
    model = Attention("causal", width=64)
    args = _inputs(seq=64, width=64)  # (B, nh, T, T) attention matrices dominate the step
    graph = ckptplan.profile(model, args, spell_out=True)
    at = graph.index_of
    no_plan = ckptplan.make_plan(graph, []).prediction.peak_bytes
    # The first layer's attention (the second's backward is the step's peak, which a region
    # there would raise): recompute only the product of softmax and noise, whose inputs stay
    # saved; or keep the softmax output and recompute everything else, the noise included.
    for region in (
        ckptplan.Region(at["attn_dropout_mul"], at["attn_out"] + 1),
        ckptplan.Region(at["attn_query"], at["attn_out"] + 1, keep=("attn_softmax",)),
    ):
        plan = ckptplan.make_plan(graph, [region])
        assert plan.prediction.peak_bytes < no_plan
        # the plan says so, and applying it profiles the model the same way (verify applies it)
        assert ckptplan.Plan.from_json(plan.to_json()).model.spell_out
        result = ckptplan.verify(model, args, plan, steps=1)
        assert result.gradients_equal and result.max_grad_error == 0.0
        assert abs(result.prediction_error) <= 0.03


def test_keeping_an_attention_matmul_caches_its_output_alone() -> None:
    """The contiguous copies the kernel's matmuls make of their strided operands (and save) are
    nodes of their own, so a region can keep the scores and the output, as a selective policy
    saving ``bmm`` outputs does, and recompute the copies: caching them too would hold more."""
    torch.manual_seed(0)
    model = Attention("causal", width=64)
    args = _inputs(seq=64, width=64)
    graph = ckptplan.profile(model, args, spell_out=True)
    at = graph.index_of
    for name in ("attn_scores", "attn_out", "attn_scores_1", "attn_out_1"):
        assert [s.kind for s in graph.storages if s.producer == at[name]] == ["activation"], name
    outputs = ("attn_scores", "attn_out")
    with_copies = ("attn_query_c", "attn_key_c", "attn_scores", "attn_value_c", "attn_out")
    peaks = []
    for keep in (outputs, with_copies):
        plan = ckptplan.make_plan(graph, [ckptplan.Region(at["attn_query"], at["attn_out"] + 1, keep=keep)])
        result = ckptplan.verify(model, args, plan, steps=1)
        assert result.gradients_equal and result.max_grad_error == 0.0
        assert abs(result.prediction_error) <= 0.03
        peaks.append(plan.prediction.peak_bytes)
    assert peaks[0] < peaks[1]


def test_what_stays_whole() -> None:
    torch.manual_seed(0)
    args = _inputs()
    # No dropout: the CPU flash kernel runs, saving its output and log-sum-exp; attention stays one node.
    graph = ckptplan.profile(Attention("causal", dropout=0.0), args, spell_out=True)
    assert not _parts(graph, "attn_") and not _parts(graph, "dropout_mask")
    # Planned for CUDA kernels (fused dropout, fused attention): dropout and attention stay whole.
    graph = ckptplan.profile(Attention("causal"), args, target="cuda", spell_out=True)
    assert not _parts(graph, "attn_") and not any(n.name.endswith("_mask") for n in graph.nodes)
    # Under autocast attention stays whole (its inputs are cast once for the whole kernel).
    graph = ckptplan.profile(Attention("causal"), args, autocast=torch.bfloat16, spell_out=True)
    assert not _parts(graph, "attn_") and _parts(graph, "dropout")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_spelled_out_dropout_is_cpu_dropout_bit_for_bit(dtype: torch.dtype) -> None:
    """``dropout_mask`` draws ``bernoulli_``'s stream straight into a bool tensor, and
    ``apply_dropout_mask`` multiplies by it and by the kept value: the output and the input's
    gradient have the bits of ``aten.dropout`` on CPU (zeros' signs included)."""

    for p, shape in ((0.1, (4, 128, 128)), (1 / 3, (3, 5, 17, 33)), (0.77, (1_000_003,))):
        x = torch.randn(shape, dtype=dtype).requires_grad_()
        grad = torch.randn(shape, dtype=dtype)
        torch.manual_seed(5)
        expected = torch.ops.aten.dropout.default(x, p, True)
        (expected_grad,) = torch.autograd.grad(expected, x, grad)
        torch.manual_seed(5)
        mask = dropout_mask(x, p)
        assert mask.dtype == torch.bool
        got = apply_dropout_mask(x, mask, p)
        (got_grad,) = torch.autograd.grad(got, x, grad)
        assert torch.equal(bits(got), bits(expected)) and torch.equal(bits(got_grad), bits(expected_grad))


def test_the_math_kernel_probe_asks_pytorch() -> None:
    q = torch.empty(2, 4, 16, 8)
    assert runs_math_kernel({"query": q, "key": q, "value": q, "dropout_p": 0.1}, "cpu")
    assert not runs_math_kernel({"query": q, "key": q, "value": q, "dropout_p": 0.0}, "cpu")


MODEL_FILE = """
import torch  # imported before CliRunner runs (see test_cli.py)
from tests.test_composite import Attention, _inputs

def build():
    torch.manual_seed(0)
    return Attention("causal"), _inputs()
"""


def test_cli_spell_out_flag(tmp_path) -> None:
    from typer.testing import CliRunner

    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL_FILE)
    runner = CliRunner()
    whole = runner.invoke(app, ["profile", str(model_file), "--json"])
    parts = runner.invoke(app, ["profile", str(model_file), "--json", "--spell-out"])
    assert whole.exit_code == 0 and parts.exit_code == 0, whole.output + parts.output
    ops = [{row["op"] for row in json.loads(result.stdout)["by_op"]} for result in (whole, parts)]
    assert "aten._safe_softmax.default" in ops[1] - ops[0]
    assert "aten.scaled_dot_product_attention.default" in ops[0] - ops[1]
