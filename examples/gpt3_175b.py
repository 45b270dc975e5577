"""GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048),
one sequence per rank, as a `transformers` GPT-2 built from its config on the ``meta`` device:
nothing is allocated, so it plans on a laptop.

The parameters are bfloat16, as FSDP2 computes with ``MixedPrecisionPolicy(param_dtype=bf16)``;
``TRAINING`` says the sharded masters, gradients and AdamW state are float32, and that the step
runs CUDA's kernels (dropout keeps 1-byte masks). Attention is the eager kind (explicit softmax
and dropout), the layer Korthikanti et al. (2022) count activations for.

    ckptplan solve examples/gpt3_175b.py --budget 80GB --shard-degree 64
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

TRAINING = {"optimizer": "adamw", "master_dtype": "float32", "target": "cuda"}


def build(layers: int = 96, hidden: int = 12288, heads: int = 96, seq: int = 2048, batch: int = 1):
    config = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq, vocab_size=50257,
        use_cache=False, attn_implementation="eager",
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (), {"input_ids": ids, "labels": ids}
