"""Attention for a CUDA target: ``profile(..., target="cuda")`` of a model faked on CPU or meta
records the fused kernel CUDA runs, not the CPU's math kernel (``profiler/cuda_attention.py``).

The anchors are the H200 rows of ``benchmarks/results/cuda_verify.json`` (``cuda_verify.py``):
the GPT example profiled *on the GPU* predicted 220.1 MiB (fp32) and 135.4 MiB (bf16 autocast) without checkpointing, and
the H200 measured 220.1 MiB allocated and MemTracker within 0.01% of each. The same model
profiled here, for CUDA, must predict the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptplan
from ckptplan.profiler.cuda_attention import cuda_backend
from tests.conftest import assert_same_gradients, load_example

MIB = 2**20


def sdpa_nodes(graph: ckptplan.ComputeGraph) -> list:
    nodes = [n for n in graph.nodes if "scaled_dot_product_attention" in n.op]
    assert nodes, "attention is a node"
    return nodes


def hidden_saved_bytes(graph: ckptplan.ComputeGraph, node) -> int:
    """Bytes a node keeps for backward that it made and does not return."""
    return sum(
        graph.storages[s].nbytes for s in node.saved
        if graph.storages[s].producer == node.index and graph.storages[s].kind == "hidden"
    )


@pytest.mark.parametrize(
    ("autocast", "gpu_mib", "tolerance"), [(None, 220.1, 0.0003), (torch.bfloat16, 135.4, 0.02)], ids=["fp32", "bf16"]
)
def test_the_gpt_example_for_cuda_predicts_what_the_h200_measured(
    autocast: torch.dtype | None, gpu_mib: float, tolerance: float
) -> None:
    """The H200's step dropped the model's outputs once the loss was made (``cuda_verify.py``),
    so the profile does too. Under autocast, ops other than attention still follow CPU
    autocast's casting lists, not CUDA's (``profile``'s docstring): 137.4 MiB against 135.4."""
    model, args = load_example("gpt").build()
    graph = ckptplan.profile(model, args, target="cuda", autocast=autocast, outputs_live=False)
    assert ckptplan.simulate(graph, ()).peak_bytes / MIB == pytest.approx(gpu_mib, rel=tolerance)
    cpu = ckptplan.profile(model, args, autocast=autocast)
    # the CPU's math kernel keeps three B·H·L·S tensors per layer; CUDA's fused one a B·H·L log-sum-exp
    batch, seq = args[0].shape
    heads = model.blocks[0].attn.n_head
    for cuda_node, cpu_node in zip(sdpa_nodes(graph), sdpa_nodes(cpu), strict=True):
        assert hidden_saved_bytes(graph, cuda_node) <= batch * heads * seq * 4 + 64
        assert hidden_saved_bytes(cpu, cpu_node) >= 3 * batch * heads * seq * seq * 2


class MaskedAttention(nn.Module):
    """One attention layer with a boolean padding mask: CUDA's efficient kernel takes it as an
    additive float mask and keeps it for backward."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1 if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, s, w))


def test_a_boolean_mask_is_kept_as_the_efficient_kernels_float_bias() -> None:
    torch.manual_seed(0)
    model = MaskedAttention()
    batch = 16
    x, mask = torch.randn(batch, 40, 64), torch.rand(batch, 1, 40, 40) > 0.2
    graph = ckptplan.profile(model, (x, mask), target="cuda")
    (node,) = sdpa_nodes(graph)
    # the mask as float32 (aligned strides: no padding), a log-sum-exp of 40 rows padded to 64, two RNG scalars
    assert hidden_saved_bytes(graph, node) == batch * 40 * 40 * 4 + batch * 4 * 64 * 4 + 2 * 8
    plan = ckptplan.make_plan(graph, [ckptplan.Region(node.index, node.index + 1)])  # recompute attention
    assert ckptplan.simulate(graph, plan).recompute_flops > 0
    assert_same_gradients(model, ckptplan.emit(graph, plan), (x, mask))


def test_a_broadcast_mask_takes_the_math_kernel_with_cudas_dropout() -> None:
    """A mask broadcast over keys (stride 0, as ``transformers``' BERT and ViT pass theirs) rules
    out the fused kernels: CUDA runs the math kernel, whose dropout keeps a 1-byte mask where
    CPU's keeps its noise in float32."""
    torch.manual_seed(0)
    model = MaskedAttention()
    batch, seq, heads = 16, 40, model.heads
    x = torch.randn(batch, seq, 64)
    mask = (torch.rand(batch, 1, seq, 1) > 0.2).expand(batch, 1, seq, seq)
    cuda = ckptplan.profile(model, (x, mask), target="cuda")
    cpu = ckptplan.profile(model, (x, mask))
    (cuda_node,), (cpu_node,) = sdpa_nodes(cuda), sdpa_nodes(cpu)
    assert hidden_saved_bytes(cpu, cpu_node) - hidden_saved_bytes(cuda, cuda_node) == 3 * batch * heads * seq * seq


def call(q_shape=(2, 4, 64, 32), k_heads=4, dtype=torch.float32, **extra) -> dict:
    b, _, s, d = q_shape
    query = torch.empty(q_shape, dtype=dtype, device="meta")
    key = torch.empty((b, k_heads, s, d), dtype=dtype, device="meta")
    return {"query": query, "key": key, "value": key, **extra}


def test_backend_choice() -> None:
    assert cuda_backend(call()) == "efficient"  # flash takes 16-bit inputs only
    assert cuda_backend(call(dtype=torch.bfloat16)) == "flash"
    assert cuda_backend(call(dtype=torch.bfloat16, attn_mask=torch.empty(64, 64, device="meta"))) == "efficient"
    assert cuda_backend(call(q_shape=(2, 4, 64, 6))) == "math"  # head dim not a multiple of 4
    assert cuda_backend(call(q_shape=(2, 4, 64, 512), dtype=torch.float16)) == "efficient"  # flash stops at 256
    assert cuda_backend(call(k_heads=2, enable_gqa=True, dtype=torch.bfloat16)) == "flash"  # grouped heads
    assert cuda_backend(call(k_heads=2, enable_gqa=True)) == "math"  # grouped heads past flash: not modelled
    assert cuda_backend(call(k_heads=3, enable_gqa=True, dtype=torch.bfloat16)) == "math"  # 4 heads over 3
    assert cuda_backend(call(k_heads=2, enable_gqa=True), autocast=torch.bfloat16) == "flash"  # autocast casts
    unequal = call(k_heads=2, enable_gqa=True, dtype=torch.bfloat16)
    unequal["value"] = torch.empty(2, 1, 64, 32, dtype=torch.bfloat16, device="meta")
    assert cuda_backend(unequal) == "math"  # key and value heads differ
    assert cuda_backend(call(dtype=torch.float64)) == "math"
    broadcast = torch.empty(1, 1, 64, 1, dtype=torch.bool, device="meta").expand(2, 1, 64, 64)
    assert cuda_backend(call(attn_mask=broadcast)) == "math"


class GroupedAttention(nn.Module):
    """Grouped-query attention as ``transformers``' Llama calls it without a mask: 8 query heads
    over 2 key and value heads, ``is_causal``, ``enable_gqa``, with attention dropout (which
    the CPU's flash kernel does not take, and CUDA's does)."""

    def __init__(self, width: int = 64, heads: int = 8, groups: int = 4) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, heads // groups
        self.head_dim = width // heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * self.kv_heads * self.head_dim)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True,
                                           enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, s, w))


def test_grouped_query_attention_in_bfloat16_takes_flash_with_the_key_heads_unrepeated() -> None:
    """Under bf16 autocast, CUDA runs grouped-query attention without a mask on flash, dropout
    included, which keeps a B·H·L float32 log-sum-exp (no B·H·L·S tensor: the CPU's math kernel
    would keep three) and reads the key and value heads as they are: what the node keeps of its
    inputs is the 2 key and value heads, not 8."""
    model = GroupedAttention()
    batch, seq = 4, 48
    x = torch.randn(batch, seq, 64)
    graph = ckptplan.profile(model, (x,), target="cuda", autocast=torch.bfloat16)
    (node,) = sdpa_nodes(graph)
    assert hidden_saved_bytes(graph, node) <= batch * model.heads * seq * 4 + 64
    read = {graph.storages[s].nbytes for s in node.saved if graph.storages[s].producer != node.index}
    q_bytes = batch * model.heads * seq * model.head_dim * 2  # bf16
    assert read == {q_bytes, q_bytes // 2}  # the query, and the key and value (views of one tensor) unrepeated
