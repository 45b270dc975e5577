"""The profiler against Korthikanti et al. (2022): activation bytes of one GPT layer.

    python benchmarks/korthikanti.py [--layers 96] [--hidden 12288] [--heads 96] [--seq 2048] [--batch 1]
                                     [--target cuda|cpu]

Profiles ``examples/korthikanti_gpt.py`` (GPT-3 175B's shape by default, bf16, on the meta
device, for the target its ``TRAINING`` names: CUDA's kernels) and compares the bytes autograd saves for backward per transformer layer
(``ComputeGraph.activation_bytes`` restricted to one layer's nodes) with the paper's count,
term by term. Prints Markdown and writes it to ``benchmarks/results/korthikanti.md``.

A layer's bytes are those of the non-resident storages its nodes save for backward (nodes whose
module path is ``layers.<i>`` or below), each storage once. The first LayerNorm saves the layer's
input, which the previous layer produced; the paper counts it in the layer that saves it, and so
does this. Embedding, final LayerNorm, head and loss are outside every layer. As a cross-check,
``activation_bytes`` of the same shape with two layers minus that with one must equal one layer.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

import ckptplan

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "korthikanti_gpt.py"
GB = 10**9


@dataclass(frozen=True)
class Shape:
    """``s`` sequence, ``b`` micro-batch, ``h`` hidden size, ``a`` attention heads (the paper's names)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int = 50257

    @property
    def sbh(self) -> int:
        return self.seq * self.batch * self.hidden

    @property
    def as2b(self) -> int:
        return self.heads * self.seq * self.seq * self.batch


def paper_layer_bytes(shape: Shape) -> int:
    """Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    §4.1, eq. 1: one layer stores s·b·h·(34 + 5·a·s/h) bytes (16-bit activations, 1-byte
    dropout masks, no tensor or sequence parallelism)."""
    return 34 * shape.sbh + 5 * shape.as2b


@dataclass(frozen=True)
class PaperTerm:
    """One tensor (or pair) of the paper's §4.1 count: the node that saves it in this model's
    graph (module path below ``layers.<i>``, short op name, which occurrence of that pair),
    and its size as ``sbh_units·sbh + as2b_units·as²b`` bytes."""

    label: str
    module: str
    op: str
    occurrence: int
    sbh_units: int
    as2b_units: int

    def nbytes(self, shape: Shape) -> int:
        return self.sbh_units * shape.sbh + self.as2b_units * shape.as2b

    @property
    def formula(self) -> str:
        parts = [_units(self.sbh_units, "sbh"), _units(self.as2b_units, "as²b")]
        return " + ".join(p for p in parts if p)


def _units(count: int, symbol: str) -> str:
    return "" if count == 0 else symbol if count == 1 else f"{count}{symbol}"


# The paper's §4.1 terms, in the order the layer runs them. They sum to 34sbh + 5as²b.
PAPER_TERMS = (
    PaperTerm("LayerNorm 1: its input", "ln_1", "layer_norm", 0, 2, 0),
    PaperTerm("QKV projection: its input", "attn.qkv", "linear", 0, 2, 0),
    PaperTerm("QKᵀ: Q and K", "attn", "matmul", 0, 4, 0),
    PaperTerm("softmax output", "attn", "softmax", 0, 0, 2),
    PaperTerm("softmax dropout mask", "attn.attn_drop", "dropout", 0, 0, 1),
    PaperTerm("attention over V: dropout output and V", "attn", "matmul", 1, 2, 2),
    PaperTerm("output projection: its input", "attn.proj", "linear", 0, 2, 0),
    PaperTerm("attention dropout mask", "attn.resid_drop", "dropout", 0, 1, 0),
    PaperTerm("LayerNorm 2: its input", "ln_2", "layer_norm", 0, 2, 0),
    PaperTerm("MLP h→4h: its input", "mlp.0", "linear", 0, 2, 0),
    PaperTerm("GELU: its input", "mlp.1", "gelu", 0, 8, 0),
    PaperTerm("MLP 4h→h: its input", "mlp.2", "linear", 0, 8, 0),
    PaperTerm("MLP dropout mask", "mlp.3", "dropout", 0, 1, 0),
)

# Why PyTorch saves other bytes than the paper counts, by the op that saves them:
# (short note for the term table, explanation printed under it).
WHY = {
    "layer_norm": (
        "+ fp32 mean and rstd",
        (
            "`aten.layer_norm` saves, besides its input, the per-row mean and reciprocal standard deviation "
            "in fp32: 2·4·s·b bytes per LayerNorm, which the paper leaves out (4/h of the input's bytes)."
        ),
    ),
    "dropout": (
        "bf16 noise, not a 1-byte mask",
        (
            "with `--target cpu`, `aten.dropout` takes ATen's unfused CPU path (`_dropout_impl`: "
            "`empty_like(input).bernoulli_(1-p).div_(1-p)`, then `input * noise`), so `MulBackward0` saves "
            "the noise in the input's dtype: 2 B/element in bf16. On CUDA (the default target here) the same "
            "op calls `native_dropout`, whose backward saves a bool mask, 1 B/element: the paper's count."
        ),
    ),
    "matmul": (
        "Q, K, V in one storage (b = 1)",
        "with b = 1 the two matmuls move V's 2sbh between them; their sum is the paper's (Q, K and V below).",
    ),
}

# Terms PyTorch stores as the paper says, by a route that is not obvious from the model code.
SAME = (
    "Q, K and V: `q @ k.transpose(-2, -1)` and `probs @ v` (`aten.matmul`) fold (b, a, s, h/a) into "
    "(b·a, s, h/a) batches for `bmm`, which saves what it is given. With b > 1 the fold copies the "
    "head-transposed views, 2sbh per tensor, each saved by its matmul. With b = 1 the fold is a view, so "
    "the first matmul saves the QKV projection's whole 6sbh output (Q, K and V together) and the second "
    "finds V already saved. The softmax output (saved by softmax's backward) and the dropout output "
    "(saved by the second matmul) are two tensors of 2as²b each, as the paper counts; GELU saves its "
    "8sbh input and the 4h→h projection the 8sbh GELU output. Residual adds and the scaling by "
    "1/√(h/a) save nothing; the causal mask is one buffer shared by all layers, not an activation."
)


@dataclass(frozen=True)
class TermRow:
    label: str
    op: str
    saved_by: str
    formula: str
    paper_bytes: int
    profiled_bytes: int
    why: str = ""


@dataclass(frozen=True)
class Measurement:
    """What one profile says about the layers.

    ``target``: whose kernels the profile modelled (``ckptplan.profile``); ``layer_bytes[i]``: bytes saved by layer i's nodes; ``outside_bytes``: bytes saved only by
    nodes outside every layer; ``activation_bytes``: the whole step's; ``difference_bytes``:
    ``activation_bytes`` of this shape with 2 layers minus with 1 (None when not measured);
    ``terms``: layer 0 term by term; ``dropout_excess_bytes``: per layer, what the dropout ops
    save beyond the paper's 1-byte masks."""

    shape: Shape
    target: str
    layer_bytes: tuple[int, ...]
    outside_bytes: int
    activation_bytes: int
    difference_bytes: int | None
    terms: tuple[TermRow, ...]
    dropout_excess_bytes: int
    profile_seconds: float
    nodes: int

    @property
    def paper_bytes(self) -> int:
        return paper_layer_bytes(self.shape)

    @property
    def per_layer_bytes(self) -> int:
        return self.layer_bytes[0]

    def error(self, nbytes: int) -> float:
        return nbytes / self.paper_bytes - 1.0


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("korthikanti_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_target() -> str:
    """The target the example's ``TRAINING`` plans it for."""
    return load_example().TRAINING["target"]


def profile_shape(shape: Shape, target: str) -> ckptplan.ComputeGraph:
    model, args = load_example().build(
        layers=shape.layers, hidden=shape.hidden, heads=shape.heads, seq=shape.seq, batch=shape.batch,
        vocab=shape.vocab,
    )
    return ckptplan.profile(model, args, target=target, outputs_live=False)


def _in_layer(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_storages(graph: ckptplan.ComputeGraph, layer: int) -> list[int]:
    """Non-resident storages saved by layer ``layer``'s nodes, each once, in first-saved order."""
    prefix = f"layers.{layer}"
    found: dict[int, None] = {}
    for node in graph.nodes:
        if _in_layer(node.module, prefix):
            found.update((s, None) for s in node.saved if not graph.storages[s].is_static)
    return list(found)


def layer_terms(graph: ckptplan.ComputeGraph, layer: int, shape: Shape) -> tuple[TermRow, ...]:
    """Layer ``layer``'s saved bytes attributed to the node that first saves each storage, matched
    to the paper's terms; savers the paper does not name get a row of their own."""
    prefix = f"layers.{layer}"
    seen: set[int] = set()
    occurrences: Counter[tuple[str, str]] = Counter()
    profiled: dict[tuple[str, str, int], tuple[int, str]] = {}
    for node in graph.nodes:
        if not _in_layer(node.module, prefix):
            continue
        module = node.module[len(prefix) + 1:]
        op = node.op.removeprefix("aten.").split(".")[0]
        fresh = [s for s in node.saved if not graph.storages[s].is_static and s not in seen]
        seen.update(node.saved)
        if not fresh:
            continue
        key = (module, op, occurrences[(module, op)])
        occurrences[(module, op)] += 1
        profiled[key] = (sum(graph.storages[s].nbytes for s in fresh), node.name)
    rows = []
    for term in PAPER_TERMS:
        nbytes, name = profiled.pop((term.module, term.op, term.occurrence), (0, "—"))
        paper = term.nbytes(shape)
        why = "" if nbytes == paper else "not saved" if nbytes == 0 else WHY.get(term.op, ("differs", ""))[0]
        rows.append(TermRow(term.label, term.op, f"`{name}` ({term.op})", term.formula, paper, nbytes, why))
    for (module, op, _), (nbytes, name) in profiled.items():
        label = f"not in the paper: {module or 'layer'} {op}"
        rows.append(TermRow(label, op, f"`{name}` ({op})", "0", 0, nbytes, "extra"))
    return tuple(rows)


def measure(shape: Shape, *, target: str | None = None, cross_check: bool = True) -> Measurement:
    """Profile ``shape`` for ``target`` (default: the example's) and attribute its saved bytes."""
    target = target or example_target()
    started = time.perf_counter()
    graph = profile_shape(shape, target)
    seconds = time.perf_counter() - started
    per_layer = [layer_storages(graph, i) for i in range(shape.layers)]
    in_layers = {s for storages in per_layer for s in storages}
    if sum(len(s) for s in per_layer) != len(in_layers):
        raise RuntimeError("a storage is saved by nodes of two layers; per-layer bytes would double-count it")
    saved = {s for node in graph.nodes for s in node.saved if not graph.storages[s].is_static}
    outside = sum(graph.storages[s].nbytes for s in saved - in_layers)
    terms = layer_terms(graph, 0, shape)
    if sum(t.paper_bytes for t in terms) != paper_layer_bytes(shape):
        raise RuntimeError("PAPER_TERMS do not sum to the paper's per-layer formula")
    difference = None
    if cross_check:
        one, two = (replace(shape, layers=n) for n in (1, 2))
        difference = profile_shape(two, target).activation_bytes - profile_shape(one, target).activation_bytes
    return Measurement(
        shape=shape,
        target=target,
        layer_bytes=tuple(sum(graph.storages[s].nbytes for s in storages) for storages in per_layer),
        outside_bytes=outside,
        activation_bytes=graph.activation_bytes,
        difference_bytes=difference,
        terms=terms,
        dropout_excess_bytes=sum(t.profiled_bytes - t.paper_bytes for t in terms if t.op == "dropout"),
        profile_seconds=seconds,
        nodes=len(graph.nodes),
    )


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(m: Measurement, command: str) -> str:
    shape, paper = m.shape, m.paper_bytes
    layers_bytes, layers_paper = sum(m.layer_bytes), shape.layers * paper
    low, high = min(m.layer_bytes), max(m.layer_bytes)
    uniform = "yes" if low == high else f"no (min {low:,}, max {high:,})"
    cuda_masks = m.per_layer_bytes - m.dropout_excess_bytes
    lines = [
        (
            f"`{command}` — L={shape.layers}, h={shape.hidden}, a={shape.heads}, s={shape.seq}, b={shape.batch}, "
            f"bf16, meta device, {m.target} kernels; {m.nodes} nodes profiled in {m.profile_seconds:.1f} s "
            f"(torch {torch.__version__}, Python {platform.python_version()})."
        ),
        (
            "Per-layer bytes: `ComputeGraph.activation_bytes` restricted to the storages saved by nodes under "
            f"`layers.<i>`; the {shape.layers} layers are equal: {uniform}."
        ),
        "",
        _row("quantity", "profiled", "Korthikanti et al. eq. 1: s·b·h·(34 + 5as/h)", "error"),
        "|---|---|---|---|",
        _row("per layer (bytes)", f"{m.per_layer_bytes:,}", f"{paper:,}", f"{m.error(m.per_layer_bytes):+.2%}"),
    ]
    if m.difference_bytes is not None:
        lines.append(_row(
            "cross-check: `activation_bytes` with 2 layers − with 1", f"{m.difference_bytes:,}", f"{paper:,}",
            f"{m.error(m.difference_bytes):+.2%}",
        ))
    if m.dropout_excess_bytes:
        lines.append(_row(
            "per layer with the dropout masks at 1 B/element (what CUDA's `native_dropout` saves)",
            f"{cuda_masks:,}", f"{paper:,}", f"{m.error(cuda_masks):+.2%}",
        ))
    lines += [
        _row(
            f"{shape.layers} layers (GB)", f"{layers_bytes / GB:,.2f}", f"{layers_paper / GB:,.2f}",
            f"{layers_bytes / layers_paper - 1:+.2%}",
        ),
        _row("outside the layers: embedding, final LayerNorm, head, loss (GB)", f"{m.outside_bytes / GB:,.2f}",
             "—", ""),
        _row("whole step, `activation_bytes` (GB)", f"{m.activation_bytes / GB:,.2f}", "—", ""),
        "",
        _row("term (paper §4.1)", "saved by (layer 0)", "paper", "paper bytes", "profiled bytes", "profiled − paper",
             "why"),
        "|---|---|---|---|---|---|---|",
    ]
    for t in m.terms:
        lines.append(_row(
            t.label, t.saved_by, t.formula, f"{t.paper_bytes:,}", f"{t.profiled_bytes:,}",
            f"{t.profiled_bytes - t.paper_bytes:+,}", t.why,
        ))
    paper_total, profiled_total = sum(t.paper_bytes for t in m.terms), sum(t.profiled_bytes for t in m.terms)
    lines.append(_row(
        "**total**", "", "34sbh + 5as²b", f"{paper_total:,}", f"{profiled_total:,}",
        f"{profiled_total - paper_total:+,}", "",
    ))
    differing = dict.fromkeys(t.op for t in m.terms if t.profiled_bytes != t.paper_bytes)
    lines += ["", *(f"- {op}: {WHY[op][1]}" for op in differing if op in WHY), f"- as the paper counts: {SAME}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--target", choices=("cuda", "cpu"), default=None,
                        help="whose kernels to profile for (default: the example's TRAINING, cuda)")
    argv = sys.argv[1:] if argv is None else argv
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    shape = Shape(options.layers, options.hidden, options.heads, options.seq, options.batch, options.vocab)
    command = " ".join(["python benchmarks/korthikanti.py", *argv])
    print(render(measure(shape, target=options.target), command))


TITLE = "Activation bytes per layer against Korthikanti et al. (2022)"
ABOUT = (
    "The layer of Korthikanti et al., \"Reducing Activation Recomputation in Large Transformer Models\" (2022), "
    "§4.1, eq. 1, which stores s·b·h·(34 + 5as/h) bytes for backward with 16-bit activations and 1-byte dropout "
    "masks: `examples/korthikanti_gpt.py` (pre-LayerNorm, explicit softmax attention with dropout, 4h GELU MLP, "
    "dropout after both projections, bf16), profiled on the meta device for the target's kernels."
)

if __name__ == "__main__":
    import results_file  # benchmarks/results_file.py, beside this script (tests load this file alone)

    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
