"""Small models built the way real architectures are, each standing for a construct a plan must
keep exact: in-place activations (EfficientNet's squeeze-excitation), views of in-place results,
constant index tables and masks built in forward (Swin's shifted windows), stochastic depth,
densely connected blocks (DenseNet), a weight whose gradient is made in another layout
(ConvNeXt's downsampling), and ``transformers`` T5, Whisper and Qwen2 built from configs.

Every ``build_*`` returns ``(model, args, kwargs)`` in training mode, seeded, small enough for the
test suite on CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

Built = tuple[nn.Module, tuple, dict]


class SqueezeExcite(nn.Module):
    """torchvision's ``SqueezeExcitation`` with ``SiLU(inplace=True)``, as EfficientNet uses it."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.act = nn.SiLU(inplace=True)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


def stochastic_depth(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """torchvision's row-mode ``stochastic_depth``: a Bernoulli draw per sample, scaled in place."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
    noise.bernoulli_(survival)
    noise.div_(survival)
    return x * noise


class MBConv(nn.Module):
    """EfficientNet's inverted residual: expand, depthwise, squeeze-excitation, project, with
    in-place SiLU after each batch norm and stochastic depth on the residual."""

    def __init__(self, channels: int, expand: int = 4, drop: float = 0.2) -> None:
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU(True))
        self.depthwise = nn.Sequential(
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.SiLU(True)
        )
        self.se = SqueezeExcite(hidden, max(1, channels // 4))
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(self.se(self.depthwise(self.expand(x))))
        return x + stochastic_depth(h, self.drop, self.training)


class EfficientNetLike(nn.Module):
    def __init__(self, channels: int = 8, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.SiLU(True))
        self.blocks = nn.Sequential(*(MBConv(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class ShiftedWindowAttention(nn.Module):
    """Swin's shifted-window attention on a (B, H, W, C) map: roll, partition into windows, a
    relative position bias gathered through an index table (a plain tensor attribute, which
    ``torch.export`` lifts as a constant), and the shifted windows' mask built in forward from a
    Python-made label table (``torch.tensor``, another lifted constant) with slice assignments."""

    def __init__(self, dim: int = 16, heads: int = 2, window: int = 4, shift: int = 2) -> None:
        super().__init__()
        self.heads, self.window, self.shift = heads, window, shift
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.index_table = (relative[..., 0] * (2 * window - 1) + relative[..., 1]).flatten()  # (w*w*w*w,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        w, s = self.window, self.shift
        x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        windows = x.view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        qkv = self.qkv(windows).reshape(windows.shape[0], w * w, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (nW*B, heads, w*w, hd)
        attn = (q * (C // self.heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.bias_table[self.index_table].view(w * w, w * w, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        labels = x.new_zeros((H, W))
        regions = torch.tensor([0.0, 1.0, 2.0])
        for k_h, rows in enumerate(((0, -w), (-w, -s), (-s, None))):
            for k_w, cols in enumerate(((0, -w), (-w, -s), (-s, None))):
                labels[rows[0]:rows[1], cols[0]:cols[1]] = regions[k_h] * 3 + regions[k_w]
        labels = labels.view(H // w, w, W // w, w).permute(0, 2, 1, 3).reshape(-1, w * w)
        mask = (labels.unsqueeze(1) - labels.unsqueeze(2)).ne(0).float() * -100.0  # (nW, w*w, w*w)
        attn = attn.view(B, -1, self.heads, w * w, w * w) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, w * w, w * w).softmax(-1)
        out = (attn @ v).transpose(1, 2).reshape(-1, w * w, C)
        out = self.proj(out).view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
        return torch.roll(out, shifts=(s, s), dims=(1, 2))


class SwinLike(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(3, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.attns = nn.ModuleList(ShiftedWindowAttention(dim, shift=0 if k % 2 == 0 else 2) for k in range(depth))
        self.mlps = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                  for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, W, 3)
        h = self.embed(x)
        for norm, attn, mlp in zip(self.norms, self.attns, self.mlps):
            h = h + stochastic_depth(attn(norm(h)), 0.1, self.training)
            h = h + mlp(h)
        return self.head(h.mean((1, 2)))


class DenseLayer(nn.Module):
    """DenseNet's layer: concatenate every earlier feature map, BN, in-place ReLU, convolutions."""

    def __init__(self, channels: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(channels), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(channels, 2 * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(2 * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        h = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(h)))


class DenseNetLike(nn.Module):
    def __init__(self, channels: int = 8, growth: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.layers = nn.ModuleList(DenseLayer(channels + k * growth, growth) for k in range(layers))
        self.norm = nn.BatchNorm2d(channels + layers * growth)
        self.head = nn.Linear(channels + layers * growth, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))
        h = F.relu(self.norm(torch.cat(features, 1)), inplace=True)
        return self.head(h.mean((2, 3)))


class LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's channels-first layer norm: permute to channels-last and back, which leaves a
    channels-last tensor behind (the next convolution's weight gradient then comes in another
    layout than the weight's, and autograd copies it into the weight's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, drop: float = 0.1) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.5))
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.pw2(F.gelu(self.pw1(self.norm(h)))).permute(0, 3, 1, 2)
        return x + stochastic_depth(self.layer_scale * h, self.drop, self.training)


class ConvNeXtLike(nn.Module):
    def __init__(self, dims: tuple[int, int] = (8, 16)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 2, stride=2), LayerNorm2d(dims[0], eps=1e-6))
        self.stage1 = ConvNeXtBlock(dims[0])
        self.downsample = nn.Sequential(LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, stride=2))
        self.stage2 = ConvNeXtBlock(dims[1])
        self.head = nn.Linear(dims[1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stage2(self.downsample(self.stage1(self.stem(x))))
        return self.head(h.mean((2, 3)))


def _seeded(build: Callable[[], Built]) -> Callable[[], Built]:
    def seeded() -> Built:
        torch.manual_seed(0)
        model, args, kwargs = build()
        model.train()
        return model, args, kwargs

    seeded.__name__ = build.__name__
    return seeded


@_seeded
def build_efficientnet() -> Built:
    return EfficientNetLike(), (torch.randn(4, 3, 16, 16),), {}


@_seeded
def build_swin() -> Built:
    return SwinLike(), (torch.randn(4, 16, 16, 3),), {}


@_seeded
def build_densenet() -> Built:
    return DenseNetLike(), (torch.randn(8, 3, 32, 32),), {}


@_seeded
def build_convnext() -> Built:
    return ConvNeXtLike(), (torch.randn(8, 3, 64, 64),), {}


@_seeded
def build_t5() -> Built:
    import transformers

    config = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    )
    ids, labels = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 16))
    return transformers.T5ForConditionalGeneration(config), (), {"input_ids": ids, "labels": labels}


@_seeded
def build_whisper() -> Built:
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=32,
        max_target_positions=32, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )
    features, labels = torch.randn(4, 16, 64), torch.randint(0, 128, (4, 16))
    return transformers.WhisperForConditionalGeneration(config), (), {"input_features": features, "labels": labels}


@_seeded
def build_qwen2() -> Built:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    ids = torch.randint(0, 128, (4, 64))
    return transformers.Qwen2ForCausalLM(config), (), {"input_ids": ids, "labels": ids}


ARCHITECTURES: dict[str, Callable[[], Built]] = {
    "efficientnet": build_efficientnet,
    "swin": build_swin,
    "densenet": build_densenet,
    "convnext": build_convnext,
    "t5": build_t5,
    "whisper": build_whisper,
    "qwen2": build_qwen2,
}
