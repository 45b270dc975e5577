"""ckptplan side by side with what users run today: no checkpointing, a checkpoint around every
block (HF ``gradient_checkpointing_enable``), every N-th block, a torchtitan-style selective op
policy, ``torch.compile``'s min-cut partitioner under ``activation_memory_budget``, and ckptplan's
solvers at budgets set to those peers' measured peaks.

    python benchmarks/compare.py [--models gpt,unet,resnet,gpt2,bert] [--quick] [--time-limit 6] [--spell-out] [--no-flops] [--no-write]

Every point is one real CPU training step measured with PyTorch's ``MemTracker``
(``ckptplan.measure_step``), FLOPs counted with ``FlopCounterMode`` over forward+backward, the
median step time as a ratio to the no-checkpoint run in the same process, and gradients compared
with the no-checkpoint run (same seed before every step). The result is written to
``benchmarks/results/compare.md`` (headed by the command and machine; the tables between
``<!-- compare:begin -->`` and ``<!-- compare:end -->``) and the plots to
``benchmarks/plots/compare_<model>.png``; ``--no-write`` prints the section instead.
It needs the ``bench`` extra (``pip install -e ".[bench]"``): ``torch.compile``'s ``ilp``
knapsack solver needs ``scipy``, and without it those rows say so.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import itertools
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import ckptplan
from ckptplan.profiler.loss import training_loss

log = logging.getLogger("compare")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "benchmarks" / "results" / "compare.md"  # results_file.path("compare")
TITLE = "ckptplan against what users run today"
PLOTS = ROOT / "benchmarks" / "plots"
BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"
MIB = 2**20

# llama (and bert's bigger siblings) run with --models; bert is in the default because AOTAutograd can
# trace it, so it gives the torch.compile head-to-head on a transformers model (GPT-2 and Llama fail).
DEFAULT_MODELS = ("gpt", "unet", "resnet", "gpt2", "bert")
CKPTPLAN_SOLVERS = ("sqrt", "dp", "ilp", "auto")
# A further ckptplan series: auto on a profile priced in FLOPs alone and spelled out (the CLI's
# `--costs flops --spell-out`), which minimises what FlopCounterMode counts: the plans that test
# "recomputes no more than any peer" in FLOPs, where the other series minimise step time here.
FLOPS_SOLVER = "auto-flops"
# torch/_functorch/config.py (torch 2.13): activation_memory_budget is 1.0 by default (no extra
# recompute); activation_memory_budget_solver picks the 0-1 knapsack: "dp" (default), "greedy",
# "ilp" (scipy), plus the memory-saving "dp_knapsack_sliding_hirschberg" variant of dp and the
# experimental "dynamic_memory_budget_dp", which we leave out.
COMPILE_BUDGETS = (1.0, 0.8, 0.5, 0.2)
COMPILE_SOLVERS = ("dp", "greedy", "ilp")
COMPILE_ALL_SOLVERS_AT = (0.5,)  # the other budgets use the default "dp" only, to keep the run short
EVERY_NTH = 2
SAME_BUDGET = 0.01  # peer peaks within 1% of each other give one ckptplan budget
LOW_BUDGET_FACTOR = 0.8  # an extra budget: the least peak any peer reached, times this
WITHIN_BUDGET = 1.03  # a measured peak up to 3% over budget counts as within (docs/design.md, "Memory and time")
# Step-time ratios closer than this count as a tie: each run reports its own copy-vs-original ratio
# per model (ModelResult.self_ratio; docs/tuning.md, "Benchmark settings").
TIME_NOISE = 0.05

# What the torchtitan-style policy saves: the outputs of matmul-like and attention ops (torchtitan's
# selective-op save list, `_save_list` / `_op_sac_save_list` in its Llama parallelize.py, names
# aten.mm and the SDPA kernels; we add addmm/bmm, which nn.Linear and batched attention reach on CPU,
# the CPU SDPA kernel, and aten.convolution, the matmul of the conv nets). The rest is recomputed.
_ATEN = torch.ops.aten
SAVE_OPS = frozenset(
    op
    for op in (
        _ATEN.mm.default,
        _ATEN.addmm.default,
        _ATEN.bmm.default,
        _ATEN.baddbmm.default,
        _ATEN.convolution.default,
        _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
        _ATEN._scaled_dot_product_flash_attention.default,
        _ATEN._scaled_dot_product_efficient_attention.default,
        _ATEN._scaled_dot_product_cudnn_attention.default,
    )
)
RANDOM_OP_NAMES = ("rand", "bernoulli", "native_dropout", "philox")


# ---------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class Workload:
    """A model and the inputs of one training step."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """A model to compare: how to build it, what its blocks are, and how to describe it."""

    name: str
    title: str
    build: Callable[[], Workload]
    blocks: Callable[[nn.Module], list[nn.Module]]
    hf: bool = False  # a transformers model: "every block" uses its gradient_checkpointing_enable


def _load_example(name: str) -> ModuleType:
    """``examples/<name>.py``, loaded by path (as measure_examples.py does)."""
    spec = importlib.util.spec_from_file_location(f"compare_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example(name: str, **build_kwargs: int) -> Workload:
    """``examples/<name>.py``'s ``build(**build_kwargs)``."""
    built = _load_example(name).build(**build_kwargs)
    return Workload(built[0], tuple(built[1]), dict(built[2]) if len(built) > 2 else {})


def _gpt_tiny() -> Workload:
    """examples/gpt.py's GPT with 2 layers, batch 8 × 64 tokens: the ``--quick`` smoke run's model
    (activations enough that checkpointing one block saves more than checkpoint's stash of the
    RNG state costs)."""
    torch.manual_seed(0)
    model = _load_example("gpt").GPT(n_layer=2, block_size=64)
    return Workload(model, (torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64))), {})


def _gpt2(layers: int = 4) -> Workload:
    """A GPT-2 from ``transformers``, built from a config (no download); the model computes its own
    LM loss from ``labels``. ``use_cache=False``: export fails on the cache (NOTES.md)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=128, n_head=4, n_positions=128, vocab_size=256, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    ids = torch.randint(0, 256, (4, 128))
    return Workload(transformers.GPT2LMHeadModel(config), (ids,), {"labels": ids})


def _llama(layers: int = 4) -> Workload:
    """A Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) from ``transformers``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=352, max_position_embeddings=128, use_cache=False,
    )
    ids = torch.randint(0, 256, (4, 128))
    return Workload(transformers.LlamaForCausalLM(config), (ids,), {"labels": ids})


def _bert(layers: int = 4) -> Workload:
    """A BERT sequence classifier from ``transformers``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=128,
    )
    ids = torch.randint(0, 256, (4, 128))
    return Workload(transformers.BertForSequenceClassification(config), (ids,), {"labels": torch.randint(0, 2, (4,))})


def _unet_blocks(model: nn.Module) -> list[nn.Module]:
    """The U-Net's double convolutions in execution order: encoder, bottleneck, decoder."""
    return [*model.down, model.bottleneck, *model.dec]


# Batches are smaller than the examples' defaults so the default run fits its 15-minute target on
# two shared CPU cores; the model shapes are the examples' own.
CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("gpt", "examples/gpt.py (6 layers, width 128), batch 2 × 256 tokens",
             lambda: _example("gpt", batch=2), lambda m: list(m.blocks)),
        Case("unet", "examples/unet.py (widths 16/32/64), batch 2 × 128²",
             lambda: _example("unet", batch=2), _unet_blocks),
        Case("resnet", "examples/resnet.py (6 basic blocks), batch 8 × 64²",
             lambda: _example("resnet", batch=8), lambda m: list(m.layers)),
        Case("gpt2", "transformers GPT-2 (4 layers, width 128), batch 4 × 128 tokens",
             _gpt2, lambda m: list(m.transformer.h), hf=True),
        Case("llama", "transformers Llama (4 layers, width 128, GQA 4/2), batch 4 × 128 tokens",
             _llama, lambda m: list(m.model.layers), hf=True),
        Case("bert", "transformers BERT classifier (4 layers, width 128), batch 4 × 128 tokens",
             _bert, lambda m: list(m.bert.encoder.layer), hf=True),
        Case("gpt-tiny", "examples/gpt.py (2 layers, width 128), batch 8 × 64 tokens (--quick)",
             _gpt_tiny, lambda m: list(m.blocks)),
    )
}
QUICK_MODEL = "gpt-tiny"


# ---------------------------------------------------------------------------------------------
# Measuring one method


@dataclass(frozen=True)
class Metrics:
    """What one real training step of a method measured."""

    peak_bytes: int
    flops: int
    time_ratio: float  # median over interleaved pairs of step time / the no-checkpoint step beside it
    grads: str  # "yes", or "no (...)" with the largest absolute difference


@dataclass(frozen=True)
class Point:
    """One row of a model's table. ``metrics`` is None when the method failed or was infeasible;
    ``status`` then says why. ``group`` picks the plot series."""

    method: str
    setting: str
    group: str
    metrics: Metrics | None = None
    status: str = "ok"
    budget_bytes: int | None = None
    predicted_bytes: int | None = None
    predicted_time_ratio: float | None = None  # ckptplan's: 1 + the plan's predicted overhead
    predicted_flops_pct: float | None = None  # FLOPs-priced ckptplan's: predicted recompute FLOPs, % of the step's
    solver: str | None = None
    knob: float | None = None  # torch.compile's activation_memory_budget
    regions: int | None = None  # top-level regions of a ckptplan plan; 0 and no remat: the empty plan
    remat: int = 0  # nodes a ckptplan plan rematerialises (``ckptplan.remat``)
    note: str = ""


@dataclass
class ModelResult:
    """All points of one model, plus what the summary needs."""

    case: Case
    points: list[Point]
    reference: Metrics
    self_ratio: float  # a copy of the no-checkpoint model timed like every point: the timing noise
    nodes: int
    seconds: float
    summary: list[str] = field(default_factory=list)


def _step(module: nn.Module, work: Workload) -> None:
    """One seeded training step (gradients reset first, as ``zero_grad`` does)."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)
    training_loss(module(*work.args, **work.kwargs)).backward()


def _grads(owner: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: (None if p.grad is None else p.grad.detach().clone()) for name, p in owner.named_parameters()}


def _compare_grads(reference: dict[str, torch.Tensor | None], owner: nn.Module) -> str:
    """"yes" when every gradient matches the reference (``torch.testing.assert_close`` defaults)."""
    worst, bad = 0.0, 0
    for name, p in owner.named_parameters():
        expected = reference.get(name)
        if expected is None and p.grad is None:
            continue
        if expected is None or p.grad is None:
            return f"no ({name}: gradient missing on one side)"
        try:
            torch.testing.assert_close(p.grad, expected)
        except AssertionError:
            bad += 1
            worst = max(worst, float((p.grad - expected).abs().max()))
    return "yes" if bad == 0 else f"no (max abs diff {worst:.2g} in {bad} tensors)"


def _timed_step(module: nn.Module, work: Workload) -> float:
    started = time.perf_counter()
    _step(module, work)
    return time.perf_counter() - started


def time_ratio(module: nn.Module, work: Workload, repeats: int, against: nn.Module | None = None) -> float:
    """The median, over ``repeats`` pairs, of a step of ``module`` over a step of ``against``
    (default: the no-checkpoint step, ``work.model``) timed right after it: each pair shares the
    load other processes put on the shared CPU. On BERT's copy timed against itself, twelve
    estimates from 5 pairs each had a standard deviation of 0.027 this way and 0.093 as the ratio
    of the two medians."""
    against = work.model if against is None else against
    if module is against:
        return 1.0
    ratios = []
    for _ in range(repeats):
        ours = _timed_step(module, work)
        ratios.append(ours / _timed_step(against, work))
    return statistics.median(ratios)


def measure(
    module: nn.Module, owner: nn.Module, work: Workload, reference: dict[str, torch.Tensor | None], repeats: int
) -> Metrics:
    """Peak (MemTracker, seeded step, whose gradients are then compared with ``reference``), FLOPs
    of a forward+backward step (that step doubles as the warm-up), and the step-time ratio over
    ``repeats`` interleaved steps. ``owner`` holds the parameters under the reference's names."""
    torch.manual_seed(0)
    peak = ckptplan.measure_step(module, work.args, work.kwargs, outputs_live=False).peak_bytes
    grads = _compare_grads(reference, owner)
    counter = FlopCounterMode(display=False)
    with counter:
        _step(module, work)
    ratio = time_ratio(module, work, repeats)
    for p in module.parameters():
        p.grad = None
    return Metrics(peak_bytes=peak, flops=counter.get_total_flops(), time_ratio=ratio, grads=grads)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:140]}{'…' if len(text) > 140 else ''}"


# ---------------------------------------------------------------------------------------------
# Peers


def _checkpoint_blocks(model: nn.Module, blocks: Sequence[nn.Module], context_fn: Callable | None = None) -> None:
    """Run each of ``blocks`` through non-reentrant ``torch.utils.checkpoint`` by giving it an
    instance-level ``forward`` (parameter names and hooks stay as they were)."""
    for block in blocks:
        original = type(block).forward.__get__(block)

        def forward(*args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            extra = {} if context_fn is None else {"context_fn": context_fn}
            return checkpoint(_original, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan-style selective policy: keep matmul/attention outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def every_block(case: Case, model: nn.Module) -> nn.Module:
    """A copy with a checkpoint around every block (HF models: their own ``gradient_checkpointing_enable``)."""
    copied = copy.deepcopy(model)
    if case.hf:
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        _checkpoint_blocks(copied, case.blocks(copied))
    return copied


def every_nth_block(case: Case, model: nn.Module, n: int) -> nn.Module:
    """A copy with a checkpoint around blocks n, 2n, ... (1-based, as torchtitan's ``ac_freq`` counts)."""
    copied = copy.deepcopy(model)
    blocks = case.blocks(copied)
    _checkpoint_blocks(copied, [b for i, b in enumerate(blocks) if (i + 1) % n == 0])
    return copied


def selective_blocks(case: Case, model: nn.Module) -> nn.Module:
    """A copy with every block checkpointed under the matmul-saving selective policy."""
    copied = copy.deepcopy(model)
    _checkpoint_blocks(copied, case.blocks(copied), functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
    return copied


class _Compiled(nn.Module):
    """``model`` run through AOTAutograd with the min-cut partitioner and no-op compilers, so the
    partitioned forward and backward graphs run eagerly on CPU.

    Like ``torch._functorch.aot_autograd.aot_module`` but with deduplicated parameters:
    ``aot_module`` passes tied weights under both names and ``functional_call`` then refuses them
    (GPT's tied embedding), which ``torch.compile`` itself does not."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from torch._functorch.aot_autograd import aot_function, make_boxed_func
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.model = model
        self.graphs: dict[str, str] = {}
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())

        def call(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            return torch.func.functional_call(model, {**p, **b}, args, kwargs)

        def compiler(kind: str) -> Callable:
            def nop(gm: torch.fx.GraphModule, _inputs: Any) -> Callable:
                self.graphs[kind] = gm.code
                return make_boxed_func(gm.forward)

            return nop

        compiled = aot_function(
            call, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
            partition_fn=min_cut_rematerialization_partition, num_params_buffers=len(params) + len(buffers),
        )
        self._run = lambda *args, **kwargs: compiled(params, buffers, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    def recomputes_random_ops(self) -> bool:
        """Whether the backward graph draws random numbers (a recomputed dropout: a fresh mask)."""
        return any(name in self.graphs.get("backward", "") for name in RANDOM_OP_NAMES)


def compiled(model: nn.Module, work: Workload, budget: float, solver: str) -> _Compiled:
    """A copy of ``model`` traced and partitioned under ``activation_memory_budget=budget`` with the
    knapsack ``solver``; the first (tracing) step runs here, outside any measurement."""
    import torch._functorch.config as functorch_config

    wrapper = _Compiled(copy.deepcopy(model))
    with functorch_config.patch(activation_memory_budget=budget, activation_memory_budget_solver=solver):
        _step(wrapper, work)
    return wrapper


# ---------------------------------------------------------------------------------------------
# One model


@dataclass
class Settings:
    """Command-line choices that shape a run."""

    repeats: int = 5
    time_limit: float = 4.0  # seconds per ilp and auto solve (docs/tuning.md, "Benchmark settings")
    compile_budgets: tuple[float, ...] = COMPILE_BUDGETS
    compile_solvers: tuple[str, ...] = COMPILE_SOLVERS
    compile_all_solvers_at: tuple[float, ...] = COMPILE_ALL_SOLVERS_AT
    solvers: tuple[str, ...] = CKPTPLAN_SOLVERS
    extra_budgets: bool = True  # also 0.8 × the least peer peak and the least sqrt/dp reach
    peer_budgets: int | None = None  # keep only this many of the lowest peer-peak budgets
    spell_out: bool = False  # profile for ckptplan with composite kernels spelled out (the CLI's --spell-out)
    flops_series: bool = True  # also FLOPS_SOLVER at every budget


def _peer_points(case: Case, work: Workload, ref_grads: dict, settings: Settings) -> list[Point]:
    """Measure every peer; a peer that raises becomes a "failed" point."""
    builders: list[tuple[str, str, str, Callable[[], tuple[nn.Module, nn.Module]]]] = []

    def plain(build: Callable[[], nn.Module]) -> Callable[[], tuple[nn.Module, nn.Module]]:
        def module_and_owner() -> tuple[nn.Module, nn.Module]:
            module = build()
            return module, module

        return module_and_owner

    every = "HF gradient_checkpointing_enable" if case.hf else "checkpoint(block) for each block"
    builders.append(("every block", every, "every block", plain(lambda: every_block(case, work.model))))
    builders.append((f"every {EVERY_NTH}nd block", f"blocks {EVERY_NTH}, {2 * EVERY_NTH}, …", "every nth block",
                     plain(lambda: every_nth_block(case, work.model, EVERY_NTH))))
    builders.append(("selective ops (torchtitan-style)", "every block; save mm/addmm/bmm/conv/SDPA outputs",
                     "selective ops", plain(lambda: selective_blocks(case, work.model))))
    points = [_measure_peer(label, setting, group, build, work, ref_grads, settings) for label, setting, group, build
              in builders]
    points += _compile_points(work, ref_grads, settings)
    return points


def _measure_peer(
    method: str, setting: str, group: str, build: Callable[[], tuple[nn.Module, nn.Module]], work: Workload,
    ref_grads: dict, settings: Settings,
) -> Point:
    log.info("  %s (%s)", method, setting)
    try:
        module, owner = build()
        metrics = measure(module, owner, work, ref_grads, settings.repeats)
    except Exception as exc:  # noqa: BLE001 (a peer that cannot run this model is a result, not a crash)
        log.warning("  %s failed: %s", method, _one_line(exc))
        return Point(method, setting, group, status=f"failed: {_one_line(exc)}")
    return Point(method, setting, group, metrics)


def _compile_points(work: Workload, ref_grads: dict, settings: Settings) -> list[Point]:
    """``torch.compile``'s knob at each budget and knapsack solver. Identical partitions (the same
    forward and backward graphs) are measured once. The knapsack is not consulted at budget 1.0,
    so that budget runs once."""
    points: list[Point] = []
    seen: dict[tuple[str, str], tuple[Metrics, str]] = {}
    configs = [
        (b, s) for b in settings.compile_budgets for s in settings.compile_solvers
        if b < 1.0 and (b in settings.compile_all_solvers_at or s == settings.compile_solvers[0])
    ]
    if 1.0 in settings.compile_budgets:
        configs.insert(0, (1.0, settings.compile_solvers[0]))
    for budget, solver in configs:
        setting = f"activation_memory_budget={budget:g}" + ("" if budget >= 1.0 else f", solver {solver}")
        log.info("  torch.compile (%s)", setting)
        try:
            wrapper = compiled(work.model, work, budget, solver)
            key = (wrapper.graphs.get("forward", ""), wrapper.graphs.get("backward", ""))
            note = ""
            if key in seen:
                metrics, first = seen[key]
                note = f"same partition as {first}; measured once"
            else:
                metrics = measure(wrapper, wrapper.model, work, ref_grads, settings.repeats)
                if metrics.grads != "yes" and wrapper.recomputes_random_ops():
                    metrics = replace(metrics, grads=metrics.grads + "; backward re-draws dropout masks")
                seen[key] = (metrics, setting)
        except Exception as exc:  # noqa: BLE001 (likewise: recorded as "failed")
            log.warning("  torch.compile failed: %s", _one_line(exc))
            points.append(Point("torch.compile min-cut", setting, "torch.compile", status=f"failed: {_one_line(exc)}",
                                knob=budget, solver=solver))
            continue
        points.append(Point("torch.compile min-cut", setting, "torch.compile", metrics, knob=budget, solver=solver,
                            note=note))
    return points


def _cluster_budgets(peaks: Sequence[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """Peer peaks grouped so that each group spans at most ``SAME_BUDGET``; each group's budget is
    its least peak (so a ckptplan plan fits under every peer of the group). A budget at or above the
    no-checkpoint peak gets the empty plan, which is ckptplan's answer there too."""
    clusters: list[tuple[int, list[str]]] = []
    for peak, label in sorted(peaks):
        if clusters and peak <= clusters[-1][0] * (1 + SAME_BUDGET):
            clusters[-1][1].append(label)
        else:
            clusters.append((peak, [label]))
    return clusters


def _least_reachable(graph: ckptplan.ComputeGraph, solvers: Sequence[str]) -> int | None:
    """The least peak ``sqrt``/``dp`` report when asked for an impossible budget (cheap: no ilp)."""
    least = []
    floor = graph.static.resident_bytes  # below what is resident for the whole step: surely infeasible
    for solver in ("sqrt", "dp"):
        if solver not in solvers:
            continue
        try:
            ckptplan.solve(graph, max(1, int(floor)), solver=solver)
        except ckptplan.InfeasibleBudgetError as exc:
            least.append(exc.min_peak_bytes)
    return min(least) if least else None


def _low_budget(graph: ckptplan.ComputeGraph, least_peer: int, settings: Settings) -> tuple[int, str]:
    """A budget below every peer: ``LOW_BUDGET_FACTOR`` × the least peer peak, raised to the least
    peak ``sqrt``/``dp`` reach when that is higher (so the point shows what is feasible)."""
    low = int(least_peer * LOW_BUDGET_FACTOR)
    floor = _least_reachable(graph, settings.solvers)
    if floor is None or floor <= low:
        return low, f"{LOW_BUDGET_FACTOR:g} × least peer peak"
    return floor, (f"least sqrt/dp reach; {LOW_BUDGET_FACTOR:g} × least peer peak = {low / MIB:.1f} MiB "
                   "is below it")


def _ckptplan_points(
    graph: ckptplan.ComputeGraph, budgets: list[tuple[int, str]], work: Workload, ref_grads: dict, settings: Settings,
    series: Sequence[tuple[str, str]] | None = None,
) -> list[Point]:
    """Solve at each budget with each of ``series`` ((name, registered solver) pairs; default:
    ``settings.solvers`` under their own names), emit and measure; identical plans are measured once.
    Plans of a graph priced in FLOPs (``graph.priced_in``) predict FLOPs, not step time."""
    flops_priced = graph.priced_in == "flops"
    step_flops = sum(n.fwd_flops + n.bwd_flops for n in graph.nodes)
    points: list[Point] = []
    seen: dict[str, tuple[Metrics, str]] = {}
    series = series if series is not None else [(name, name) for name in settings.solvers]
    for budget, why in budgets:
        for solver, registered in series:
            setting = f"{solver}, budget {budget / MIB:.1f} MiB ({why})"
            log.info("  ckptplan %s", setting)
            limit = settings.time_limit if registered in ("ilp", "auto") else None
            try:
                plan = ckptplan.solve(graph, int(budget), solver=registered, time_limit=limit)
            except ckptplan.InfeasibleBudgetError as exc:
                points.append(Point("ckptplan", setting, f"ckptplan {solver}", status=(
                    f"infeasible, least {exc.min_peak_bytes / MIB:.1f} MiB (solver's claim)"), budget_bytes=budget,
                    solver=solver))
                continue
            except Exception as exc:  # noqa: BLE001 (a ckptplan bug: recorded in the table, reported, run goes on)
                log.error("  ckptplan %s failed: %s", setting, _one_line(exc))
                points.append(Point("ckptplan", setting, f"ckptplan {solver}", status=f"error: {_one_line(exc)}",
                                    budget_bytes=budget, solver=solver))
                continue
            key = repr((plan.regions, plan.remat))
            note = plan.solver.note.split(":")[0] if registered == "auto" else ""
            if key in seen:
                metrics, first = seen[key]
                note = "; ".join(x for x in (note, f"same plan as {first}") if x)
            else:
                try:
                    metrics = measure(ckptplan.emit(graph, plan), work.model, work, ref_grads, settings.repeats)
                except Exception as exc:  # noqa: BLE001 (as above)
                    log.error("  ckptplan %s: emitted module failed: %s", setting, _one_line(exc))
                    points.append(Point("ckptplan", setting, f"ckptplan {solver}", status=f"error: {_one_line(exc)}",
                                        budget_bytes=budget, predicted_bytes=plan.prediction.peak_bytes,
                                        solver=solver))
                    continue
                seen[key] = (metrics, f"{solver} at {budget / MIB:.1f} MiB")
            if plan.remat:
                note = "; ".join(x for x in (f"rematerialises {_plural(len(plan.remat), 'op')}", note) if x)
            elif not plan.regions:
                note = "; ".join(x for x in ("empty plan: no checkpointing", note) if x)
            points.append(Point("ckptplan", setting, f"ckptplan {solver}", metrics, budget_bytes=budget,
                                predicted_bytes=plan.prediction.peak_bytes,
                                predicted_time_ratio=None if flops_priced else 1 + plan.prediction.overhead,
                                predicted_flops_pct=(100 * plan.prediction.recompute_flops / step_flops
                                                     if flops_priced and step_flops else None), solver=solver,
                                regions=len(plan.regions), remat=len(plan.remat), note=note))
    return points


@functools.cache
def host_roofline() -> ckptplan.profiler.Roofline:
    """This machine's cost model (the CLI's ``--costs here``), measured once per run: the plans
    run here, so they are priced here."""
    return ckptplan.measure_roofline()


def run_model(case: Case, settings: Settings) -> ModelResult:
    """Every method on one model, in one process, against the no-checkpoint run."""
    started = time.perf_counter()
    log.info("%s: %s", case.name, case.title)
    work = case.build()
    work.model.train()
    _step(work.model, work)  # warm up allocator and kernels before anything is timed
    ref_grads = _grads(work.model)
    reference = measure(work.model, work.model, work, ref_grads, settings.repeats)
    points = [Point("no checkpoint", "reference", "no checkpoint", reference)]
    points += _peer_points(case, work, ref_grads, settings)

    log.info("  ckptplan: profiling")
    graph = ckptplan.profile(work.model, work.args, work.kwargs, roofline=host_roofline(), measure_times=True,
                             spell_out=settings.spell_out, outputs_live=False)
    peer_peaks = [(p.metrics.peak_bytes, f"{p.method}: {p.setting}") for p in points[1:] if p.metrics is not None]
    clusters = _cluster_budgets(peer_peaks)
    budgets = [(peak, "= " + _short_labels(labels)) for peak, labels in clusters][: settings.peer_budgets]
    if settings.extra_budgets and peer_peaks:
        budgets.append(_low_budget(graph, min(peak for peak, _ in peer_peaks), settings))
    points += _ckptplan_points(graph, budgets, work, ref_grads, settings)
    if settings.flops_series:
        log.info("  ckptplan: profiling priced in FLOPs, spelled out")
        flops_graph = ckptplan.profile(work.model, work.args, work.kwargs, roofline=ckptplan.profiler.FLOPS,
                                       spell_out=True, outputs_live=False)
        points += _ckptplan_points(flops_graph, budgets, work, ref_grads, settings, [(FLOPS_SOLVER, "auto")])

    self_ratio = time_ratio(copy.deepcopy(work.model), work, settings.repeats)
    result = ModelResult(case, points, reference, self_ratio, len(graph.nodes), time.perf_counter() - started)
    result.summary = summarize(result)
    log.info("%s done in %.0f s", case.name, result.seconds)
    return result


def _short_labels(labels: Sequence[str]) -> str:
    """Peer names of a budget cluster, compact: "torch.compile 0.5 dp/greedy, every block"."""
    out = []
    for label in labels:
        method, _, setting = label.partition(": ")
        if method.startswith("torch.compile"):
            out.append(f"compile {_compile_label(Point(method, setting, 'torch.compile'))}")
        else:
            out.append(method.replace(" (torchtitan-style)", ""))
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------
# Report


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference else math.nan


def row_values(point: Point, result: ModelResult) -> dict[str, Any]:
    """The numbers of one table row (None where the point has no measurement)."""
    ref = result.reference
    m = point.metrics
    if m is None:
        return {"peak_mib": None, "peak_ratio": None, "extra_flops_pct": None, "time_ratio": None, "grads": None}
    return {
        "peak_mib": m.peak_bytes / MIB,
        "peak_ratio": _ratio(m.peak_bytes, ref.peak_bytes),
        "extra_flops_pct": 100 * (_ratio(m.flops, ref.flops) - 1),
        "time_ratio": m.time_ratio,
        "grads": m.grads,
    }


def render_table(result: ModelResult) -> str:
    lines = [
        "| method | setting | measured peak MiB | peak / no-ckpt | extra FLOPs % | step time ratio | gradients equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for point in result.points:
        v = row_values(point, result)
        setting = point.setting
        if point.predicted_bytes is not None:
            setting += f"; predicted {point.predicted_bytes / MIB:.1f} MiB"
        if point.predicted_time_ratio is not None:
            setting += f", {point.predicted_time_ratio:.2f}× step time"
        if point.predicted_flops_pct is not None:
            setting += f", {point.predicted_flops_pct:+.1f}% FLOPs"
        if point.note:
            setting += f"; {point.note}"
        if v["peak_mib"] is None:
            lines.append(f"| {point.method} | {setting} | {point.status} | – | – | – | – |")
            continue
        lines.append(
            f"| {point.method} | {setting} | {v['peak_mib']:.1f} | {v['peak_ratio']:.3f} | "
            f"{v['extra_flops_pct']:+.1f} | {v['time_ratio']:.2f} | {v['grads']} |"
        )
    return "\n".join(lines)


def _measured(points: Sequence[Point], group: str) -> list[Point]:
    """Measured points of ``group`` or of the groups under it ("ckptplan": every ckptplan series)."""
    return [p for p in points if p.metrics is not None and (p.group == group or p.group.startswith(group + " "))]


def _best_at_or_below(points: Sequence[Point], peak: int, key: Callable[[Metrics], float]) -> Point | None:
    fits = [p for p in points if p.metrics is not None and p.metrics.peak_bytes <= peak * (1 + SAME_BUDGET)]
    return min(fits, key=lambda p: (key(p.metrics), p.metrics.peak_bytes)) if fits else None


def verdict(peer: Point, ours: Sequence[Point]) -> tuple[str, Point | None]:
    """How ckptplan's fastest plan among ``ours`` at or below ``peer``'s measured peak (+1%) compares
    on step time: "faster", "tie" (within ``TIME_NOISE``), "slower", or "unmatched" (none that low)."""
    mine = _best_at_or_below(ours, peer.metrics.peak_bytes, lambda m: m.time_ratio)
    if mine is None:
        return "unmatched", None
    delta = mine.metrics.time_ratio - peer.metrics.time_ratio
    return ("faster" if delta < -TIME_NOISE else "tie" if delta <= TIME_NOISE else "slower"), mine


def _tally(peers: Sequence[Point], ours: Sequence[Point]) -> dict[str, int]:
    counts = {"faster": 0, "tie": 0, "slower": 0, "unmatched": 0}
    for peer in peers:
        counts[verdict(peer, ours)[0]] += 1
    return counts


def _tally_text(counts: dict[str, int]) -> str:
    text = f"faster for {counts['faster']}, tied for {counts['tie']}, slower for {counts['slower']}"
    return text + (f", none that low for {counts['unmatched']}" if counts["unmatched"] else "")


def _default_solver(points: Sequence[Point]) -> list[Point]:
    """ckptplan's measured points from ``auto`` (what a user gets by default), or all solvers' if
    ``auto`` did not run."""
    auto = _measured(points, "ckptplan auto")
    return auto or _measured(points, "ckptplan")


def _distinct(points: Sequence[Point]) -> list[Point]:
    """Points that were measured, not copied from an identical partition or plan."""
    return [p for p in points if p.metrics is not None and not p.note.startswith("same partition")]


def _describe(point: Point, result: ModelResult) -> str:
    v = row_values(point, result)
    if point.group.startswith("ckptplan"):
        name = f"ckptplan {point.solver}" + (" (empty plan)" if point.regions == 0 and not point.remat else "")
    else:
        name = f"{point.method} ({point.setting})"
    return f"{name} {v['peak_mib']:.1f} MiB, {v['extra_flops_pct']:+.1f}% FLOPs, {v['time_ratio']:.2f}× step time"


def _flops_no_more(peers: Sequence[Point], ours: Sequence[Point]) -> int:
    """How many of ``peers`` have a plan among ``ours`` at or below their measured peak (+1%) that
    counted no more FLOPs."""
    return sum(
        1 for peer in peers
        if (m := _best_at_or_below(ours, peer.metrics.peak_bytes, lambda x: x.flops)) is not None
        and m.metrics.flops <= peer.metrics.flops
    )


def _auto_vs_dp(result: ModelResult) -> tuple[int, int]:
    """At budgets where auto's plan differs from dp's: how many, and at how many dp's measured
    faster by more than ``TIME_NOISE`` (auto ranks plans by ckptplan's cost estimate)."""
    by_budget: dict[int, dict[str, Point]] = {}
    for p in _measured(result.points, "ckptplan"):
        by_budget.setdefault(p.budget_bytes, {})[p.solver] = p
    differ, dp_faster = 0, 0
    for solvers in by_budget.values():
        auto, dp = solvers.get("auto"), solvers.get("dp")
        if auto is None or dp is None or auto.metrics == dp.metrics:
            continue
        differ += 1
        dp_faster += dp.metrics.time_ratio < auto.metrics.time_ratio - TIME_NOISE
    return differ, dp_faster


def rises(pairs: Sequence[tuple[float, int]]) -> list[tuple[tuple[float, int], tuple[float, int]]]:
    """(budget, measured peak) pairs, budgets in falling order, where the lower budget measured a
    higher peak than the next higher one: where the peak does not fall monotonically with the budget."""
    ordered = sorted(pairs, reverse=True)
    return [(a, b) for a, b in itertools.pairwise(ordered) if b[1] > a[1]]


def ckptplan_rises(result: ModelResult, solver: str) -> list[tuple[tuple[float, int], tuple[float, int]]] | None:
    """``rises`` over ``solver``'s measured points by budget (None: fewer than two)."""
    pairs = [(p.budget_bytes, p.metrics.peak_bytes) for p in _measured(result.points, f"ckptplan {solver}")]
    return rises(pairs) if len(pairs) > 1 else None


def compile_rises(result: ModelResult) -> list[tuple[tuple[float, int], tuple[float, int]]] | None:
    """``rises`` over torch.compile's knob, with the knapsack solver every budget runs (None: fewer
    than two measured)."""
    points = [p for p in _measured(result.points, "torch.compile") if p.knob is not None]
    first = min((p.solver for p in points if p.knob < 1.0), default=None, key=COMPILE_SOLVERS.index)
    pairs = [(p.knob, p.metrics.peak_bytes) for p in points if p.knob >= 1.0 or p.solver == first]
    return rises(pairs) if len(pairs) > 1 else None


def _monotone_sentence(result: ModelResult) -> str | None:
    """Whether each ckptplan solver's measured peak, and torch.compile's, falls with the budget."""
    clean, broken = [], []
    for solver in (*CKPTPLAN_SOLVERS, FLOPS_SOLVER):
        found = ckptplan_rises(result, solver)
        if found is None:
            continue
        if not found:
            clean.append(solver)
            continue
        (b1, p1), (b2, p2) = found[0]
        broken.append(f"{solver} (budget {b1 / MIB:.1f} MiB measured {p1 / MIB:.1f} MiB, "
                      f"{b2 / MIB:.1f} MiB measured {p2 / MIB:.1f} MiB)")
    parts = []
    if clean:
        parts.append(f"falls with the budget for ckptplan {', '.join(clean)}")
    if broken:
        parts.append(f"rises as the budget falls for ckptplan {'; '.join(broken)}")
    knob = compile_rises(result)
    if knob is not None:
        if knob:
            (k1, p1), (k2, p2) = knob[0]
            parts.append(f"rises as torch.compile's knob falls ({k1:g}: {p1 / MIB:.1f} MiB, {k2:g}: {p2 / MIB:.1f} MiB)")
        else:
            parts.append("falls with torch.compile's knob")
    return ("Measured peak " + "; ".join(parts) + ".") if parts else None


def summarize(result: ModelResult) -> list[str]:
    """A few sentences computed from the measurements: lowest peaks, head-to-head at equal peak
    (ckptplan's default solver, and the best of all), torch.compile, losses, gradient differences."""
    ref = result.reference
    ours = _measured(result.points, "ckptplan")
    default = _default_solver(result.points)
    label = "auto" if _measured(result.points, "ckptplan auto") else "(any solver)"
    peers = [p for p in _distinct(result.points[1:]) if not p.group.startswith("ckptplan")]
    if not ours:
        return ["ckptplan produced no measured point."]
    out: list[str] = []

    def pct(nbytes: int) -> float:
        return 100 * nbytes / ref.peak_bytes

    best_ours = min(ours, key=lambda p: p.metrics.peak_bytes)
    if peers:
        best_peer = min(peers, key=lambda p: p.metrics.peak_bytes)
        out.append(
            f"Lowest measured peak: ckptplan {best_ours.solver} {best_ours.metrics.peak_bytes / MIB:.1f} MiB "
            f"({pct(best_ours.metrics.peak_bytes):.0f}% of no-checkpoint) vs {best_peer.method} "
            f"({best_peer.setting}) {best_peer.metrics.peak_bytes / MIB:.1f} MiB "
            f"({pct(best_peer.metrics.peak_bytes):.0f}%)."
        )
        sentence = (
            f"At or below each of the {len(peers)} distinct peer runs' measured peaks (+1%), ckptplan {label}'s "
            f"fastest plan was {_tally_text(_tally(peers, default))} (ties: step-time ratios within ±{TIME_NOISE:g})"
        )
        if default is not ours:
            sentence += f"; taking the best of all its solvers, {_tally_text(_tally(peers, ours))}"
        sentence += f"; {label} recomputed no more matmul FLOPs than {_flops_no_more(peers, default)} of them"
        priced = _measured(result.points, f"ckptplan {FLOPS_SOLVER}")
        if priced:
            sentence += f", {FLOPS_SOLVER} than {_flops_no_more(peers, priced)}"
        out.append(sentence + ".")
    compile_points = _distinct(_measured(result.points, "torch.compile"))
    if compile_points:
        target = min(compile_points, key=lambda p: p.metrics.peak_bytes)
        _, mine = verdict(target, default)
        sentence = f"torch.compile's lowest peak: {_describe(target, result)}; " + (
            f"ckptplan at or below it: {_describe(mine, result)}" if mine else f"ckptplan {label} has no plan that low")
        differ = [p for p in compile_points if p.metrics.grads != "yes"]
        if differ:
            sentence += (f"; torch.compile's gradients differ from the no-checkpoint run in {len(differ)} of "
                         f"{len(compile_points)} settings")
            if any("dropout" in p.metrics.grads for p in differ):
                sentence += " (its backward recomputes dropout with a fresh mask)"
        out.append(sentence + ".")
    losses = [(peer, mine) for peer in peers for v, mine in [verdict(peer, default)] if v in ("slower", "unmatched")]
    if losses:
        named = [
            f"{_describe(peer, result)} vs " + (_describe(mine, result) if mine else "no ckptplan plan that low")
            for peer, mine in losses[:3]
        ]
        more = f" and {len(losses) - 3} more" if len(losses) > 3 else ""
        out.append(f"Where ckptplan {label} loses: " + "; ".join(named) + more + ".")
    monotone = _monotone_sentence(result)
    if monotone:
        out.append(monotone)
    differ, dp_faster = _auto_vs_dp(result)
    if dp_faster:
        out.append(
            f"auto's choice (ranked by ckptplan's cost estimate) measured slower than dp's plan at the same budget "
            f"at {dp_faster} of the {differ} budgets where they differ."
        )
    predicted = [p for p in ours if p.predicted_time_ratio is not None and (p.regions or p.remat)
                 and "same plan as" not in p.note]
    if predicted:
        errors = sorted(p.metrics.time_ratio - p.predicted_time_ratio for p in predicted)
        out.append(
            f"Step time, measured minus predicted ratio, over ckptplan's {len(errors)} distinct plans that recompute: "
            f"median {statistics.median(errors):+.2f}, from {errors[0]:+.2f} to {errors[-1]:+.2f}."
        )
    priced = [p for p in ours if p.predicted_flops_pct is not None and (p.regions or p.remat)
              and "same plan as" not in p.note]
    if priced:
        errors = sorted(row_values(p, result)["extra_flops_pct"] - p.predicted_flops_pct for p in priced)
        out.append(
            f"Extra FLOPs, measured minus predicted, over {FLOPS_SOLVER}'s {len(errors)} distinct plans that "
            f"recompute: from {errors[0]:+.1f} to {errors[-1]:+.1f} percentage points."
        )
    bad = sorted({p.group for p in result.points if p.metrics is not None and p.metrics.grads != "yes"
                  and not p.group.startswith("torch.compile")})
    if bad:
        out.append(f"Gradients differ from the no-checkpoint run for: {', '.join(bad)} (see table).")
    return out


def _compile_failure(result: ModelResult) -> str | None:
    """Why torch.compile could not run (some of) a model's settings, as a short phrase."""
    failed = [p for p in result.points if p.group == "torch.compile" and p.status.startswith("failed")]
    if not failed:
        return None
    reason = failed[0].status.removeprefix("failed: ").split(":")[0]
    ran = [p for p in result.points if p.group == "torch.compile" and p.metrics is not None]
    scope = "" if not ran else " below budget 1.0"
    return f"{result.case.name}{scope} ({reason})"


def overall_summary(results: Sequence[ModelResult]) -> str:
    """One line the README can quote: ckptplan (auto) against torch.compile's activation_memory_budget."""
    tally = {"faster": 0, "tie": 0, "slower": 0, "unmatched": 0}
    best, exact = dict(tally), dict(tally)
    lowest, models, compile_grads = [], [], 0
    ours_grads_ok = True
    for result in results:
        ours = _measured(result.points, "ckptplan")
        ours_grads_ok &= all(p.metrics.grads == "yes" for p in ours)
        compile_points = _distinct(_measured(result.points, "torch.compile"))
        if not compile_points:
            continue
        models.append(result.case.name)
        compile_grads += sum(1 for p in compile_points if p.metrics.grads != "yes")
        for key, value in _tally(compile_points, _default_solver(result.points)).items():
            tally[key] += value
        for key, value in _tally(compile_points, ours).items():
            best[key] += value
        same_grads = [p for p in compile_points if p.metrics.grads == "yes"]
        for key, value in _tally(same_grads, _default_solver(result.points)).items():
            exact[key] += value
        if ours:
            ref = result.reference.peak_bytes
            lowest.append((min(p.metrics.peak_bytes for p in ours) / ref,
                           min(p.metrics.peak_bytes for p in compile_points) / ref))
    total = sum(tally.values())
    if not total:
        return "torch.compile's activation_memory_budget could not run any of the models, so there is no head-to-head."
    text = (
        f"Against torch.compile's activation_memory_budget ({_plural(total, 'distinct setting')} on "
        f"{', '.join(models)}), ckptplan's default solver had a plan at or below each measured peak (+1%) that was "
        f"{_tally_text(tally)} (ties: step-time ratios within ±{TIME_NOISE:g}; best of all ckptplan solvers: "
        f"{_tally_text(best)})"
    )
    if lowest:
        text += (
            f"; ckptplan's lowest measured peak was {100 * statistics.median(a for a, _ in lowest):.0f}% of the "
            f"no-checkpoint peak vs {100 * statistics.median(b for _, b in lowest):.0f}% for torch.compile "
            f"(median over those models)"
        )
    peers = [(r, [p for p in _distinct(r.points[1:]) if not p.group.startswith("ckptplan")]) for r in results]
    flops = {
        name: sum(_flops_no_more(ps, _measured(r.points, f"ckptplan {name}")) for r, ps in peers)
        for name in ("auto", FLOPS_SOLVER)
    }
    if any(_measured(r.points, f"ckptplan {FLOPS_SOLVER}") for r in results):
        text += (
            f"; at or below each of the {sum(len(ps) for _, ps in peers)} distinct peer runs' measured peaks (+1%) on "
            f"all models, auto had a plan recomputing no more matmul FLOPs for {flops['auto']}, "
            f"{FLOPS_SOLVER} (priced in FLOPs) for {flops[FLOPS_SOLVER]}"
        )
    auto = [r for r in (ckptplan_rises(result, "auto") for result in results) if r is not None]
    knob = [r for r in (compile_rises(result) for result in results) if r is not None]
    if auto:
        text += f"; auto's measured peak fell with its budget on {sum(not r for r in auto)} of {len(auto)} models"
        if knob:
            text += f", torch.compile's with its knob on {sum(not r for r in knob)} of {len(knob)}"
    text += "; ckptplan's gradients always matched" if ours_grads_ok else "; some ckptplan gradients differed"
    if compile_grads:
        text += (
            f", torch.compile's differed in {_plural(compile_grads, 'setting')} (dropout re-drawn in backward, "
            "which saves it the masks' memory); against the "
            f"{_plural(sum(exact.values()), 'setting')} whose gradients matched, the default solver was "
            f"{_tally_text(exact)}"
        )
    failures = [f for f in (_compile_failure(r) for r in results) if f]
    if failures:
        text += f"; torch.compile failed on {', '.join(failures)}"
    return text + "."


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _also_solvers(settings: Settings) -> str:
    others = settings.compile_solvers[1:]
    if not others or not settings.compile_all_solvers_at:
        return ""
    return f"; also {', '.join(others)} at {', '.join(f'{b:g}' for b in settings.compile_all_solvers_at)}"


def machine_line(threads: int) -> str:
    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.platform()}, "
        f"{os.cpu_count()} CPUs ({threads} torch thread{'s' if threads > 1 else ''})"
    )


def _method_paragraphs(settings: Settings, seconds: float, threads: int) -> list[str]:
    """What was run and how it was measured, one string per paragraph."""
    budgets = ", ".join(f"{b:g}" for b in settings.compile_budgets)
    what = (
        "`python benchmarks/compare.py` — every method on each model in one process: no checkpointing; a "
        "non-reentrant checkpoint around every block (HF models: their own `gradient_checkpointing_enable`); around "
        f"every {EVERY_NTH}nd block; every block under a torchtitan-style selective policy (save matmul, conv and "
        "attention outputs, recompute the rest); `torch.compile`'s min-cut partitioner under "
        f"`activation_memory_budget` {budgets} (knapsack solver {settings.compile_solvers[0]}"
        f"{_also_solvers(settings)}), run through AOTAutograd with no-op compilers so the partitioned graphs "
        "execute eagerly; and ckptplan's solvers at budgets equal to the peers' measured peaks (peaks within 1% "
        f"merged, the least of them used) plus one lower budget: {LOW_BUDGET_FACTOR:g}× the least peer peak, or the "
        "least peak `sqrt`/`dp` report if that is higher. \"infeasible, least X\" quotes the solver's "
        "`InfeasibleBudgetError`, unchecked. Identical ckptplan plans and identical torch.compile partitions are "
        "measured once. ckptplan prices plans as the CLI's `--costs here` does (`measure_times=True`, "
        "`roofline=ckptplan.measure_roofline()`): each op by its measured time on this CPU, plus the measured fixed "
        "cost of each checkpoint region, of each op inside one and of each kept op (run under a selective policy), "
        "since that is where the plans run. `auto` also considers rematerialising cheap ops outside regions "
        "(`ckptplan.remat`: layer norms, GELUs, recomputed in the backward of the op that saved their output, as the "
        "min-cut partitioner's flat backward graph does), its default; rows say how many it rematerialises"
        + ("; and it profiles as `--spell-out` does (`spell_out=True`)." if settings.spell_out else ".")
        + (f" `{FLOPS_SOLVER}` is `auto` on a second profile, priced in FLOPs alone and spelled out (the CLI's "
           "`--costs flops --spell-out`: `roofline=ckptplan.profiler.FLOPS, spell_out=True`), so it minimises what "
           "`FlopCounterMode` counts instead of time here." if settings.flops_series else "")
        + " Each ckptplan row gives the plan's predicted peak and predicted step-time "
        f"ratio (1 + `Plan.prediction.overhead`), or for `{FLOPS_SOLVER}` its predicted recompute FLOPs as a share "
        "of the step's, to read against the measured ones."
    )
    machine = (
        f"Machine: {machine_line(threads)}. Full run: {seconds / 60:.1f} min. `ilp`/`auto` time limit "
        f"{settings.time_limit:g} s each; {_plural(settings.repeats, 'timed step')} per point after one warm-up. "
        "Batches are smaller than the examples' defaults so the run fits 15 minutes; each model's heading gives "
        "its shapes."
    )
    measured = (
        "Measured peak: `MemTracker` over one seeded training step (parameters, gradients, inputs and "
        "activations; `ckptplan.measure_step`). Extra FLOPs: `FlopCounterMode` over forward+backward against no "
        "checkpointing; it counts matmul-like ops only, so recomputed pointwise ops show as 0 — compare step time "
        "too. Step time ratio: the median, over interleaved pairs, of a step's time over the no-checkpoint step "
        "timed right after it (one torch thread; the machine's other core runs other work). As a noise gauge, a copy of the "
        'no-checkpoint model is timed the same way ("own copy" under each heading); differences within '
        f"±{TIME_NOISE:g} count as ties. That gauge sees only noise within a run: between two runs of this script, "
        "the ratio of the same point moved by up to about 0.2 (the other core's load changes how much "
        "memory-bound ops slow down). Gradients equal: `torch.testing.assert_close` against the "
        "no-checkpoint run, seeded identically before every step. Summaries compare `auto`, ckptplan's default "
        f"solver, and also the best of all its series (the four solvers and `{FLOPS_SOLVER}`) picked after measuring."
    )
    failures = (
        'torch.compile "failed" rows are errors raised by AOTAutograd while tracing or running the partitioned '
        "graphs; the wrapper here differs from `torch._functorch.aot_autograd.aot_module` only in passing tied "
        "weights once (`aot_module` rejects the GPT example's tied embedding). Full `torch.compile` (Dynamo) would "
        "graph-break around data-dependent ops instead, but run under `MemTracker`'s dispatch mode its measured "
        "peak equalled eager's at every budget (checked by hand on the GPT example and GPT-2), so it cannot be "
        "measured this way and is not shown."
    )
    return [what, machine, measured, failures]


def render_section(
    results: Sequence[ModelResult], settings: Settings, seconds: float, plots: dict[str, str], threads: int
) -> str:
    """The Markdown between the markers."""
    lines = [BEGIN, ""]
    for paragraph in _method_paragraphs(settings, seconds, threads):
        lines += [paragraph, ""]
    lines += [f"**Overall:** {overall_summary(results)}", ""]
    for result in results:
        header = (
            f"{result.nodes} graph nodes (ckptplan's profile); own copy {result.self_ratio:.2f}× step time; "
            f"{result.seconds:.0f} s for this model."
        )
        lines += [f"## {result.case.name}: {result.case.title}", "", header, "", render_table(result), ""]
        if result.case.name in plots:
            lines += [f"![{result.case.name}: measured peak vs step time and FLOPs]({plots[result.case.name]})", ""]
        lines += [" ".join(result.summary), ""]
    lines.append(END)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plot and file


PEER_STYLE = {  # group: (colour, marker)
    "no checkpoint": ("black", "o"),
    "every block": ("tab:red", "s"),
    "every nth block": ("tab:orange", "s"),
    "selective ops": ("tab:brown", "D"),
    "torch.compile": ("tab:gray", "^"),
}
SOLVER_STYLE = {  # ckptplan solver: (colour, marker, size); sizes differ so that identical plans stay visible
    "ckptplan sqrt": ("tab:olive", "o", 70),
    "ckptplan dp": ("tab:green", "o", 48),
    "ckptplan ilp": ("tab:blue", "o", 28),
    "ckptplan auto": ("tab:purple", "x", 40),
    f"ckptplan {FLOPS_SOLVER}": ("tab:cyan", "+", 60),
}


def _frontier(xy: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (lower is better on both), by increasing x."""
    out: list[tuple[float, float]] = []
    for x, y in sorted(xy):
        if not out or y < out[-1][1]:
            out.append((x, y))
    return out


def _compile_label(point: Point) -> str:
    budget = point.setting.split("=")[1].split(",")[0]
    solver = point.setting.split("solver ")[1] if "solver " in point.setting else ""
    return f"{budget} {solver}".strip()


def plot(result: ModelResult, path: Path) -> None:
    """Measured peak vs step-time ratio and vs extra FLOPs: every measured point, one series per
    peer and per ckptplan solver, with the Pareto frontiers of ckptplan's points and of the peers'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    measured = [p for p in result.points if p.metrics is not None]
    groups = sorted({p.group for p in measured}, key=lambda g: (g.startswith("ckptplan"), g))
    for axis, key, label in ((axes[0], "time_ratio", "step time / no-checkpoint"),
                             (axes[1], "extra_flops_pct", "extra FLOPs % (matmul-like ops only)")):
        for group in groups:
            pts = [row_values(p, result) for p in measured if p.group == group]
            xs, ys = [v["peak_mib"] for v in pts], [v[key] for v in pts]
            if group.startswith("ckptplan"):
                colour, marker, size = SOLVER_STYLE.get(group, ("tab:cyan", "o", 40))
                axis.scatter(xs, ys, c=colour, marker=marker, s=size, label=group, alpha=0.85, zorder=3)
            else:
                colour, marker = PEER_STYLE.get(group, ("tab:pink", "x"))
                axis.scatter(xs, ys, c=colour, marker=marker, s=56, label=group, alpha=0.9,
                             edgecolors="black", linewidths=0.6, zorder=2)
        for prefix, colour, name in (("ckptplan", "tab:blue", "ckptplan frontier"), ("", "tab:red", "peer frontier")):
            chosen = [p for p in measured if p.group.startswith("ckptplan") == bool(prefix)]
            line = _frontier([(row_values(p, result)["peak_mib"], row_values(p, result)[key]) for p in chosen])
            if len(line) > 1:
                axis.step([x for x, _ in line], [y for _, y in line], where="post", color=colour, alpha=0.35,
                          linestyle="--", label=name, zorder=1)
        for point in measured:
            if point.group == "torch.compile" and not point.note:
                v = row_values(point, result)
                axis.annotate(_compile_label(point), (v["peak_mib"], v[key]), fontsize=6, color="dimgray",
                              xytext=(3, 3), textcoords="offset points")
        axis.set_xlabel("measured peak (MiB)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{result.case.name}: every method, one real CPU training step each (lower-left is better)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_section(section: str, path: Path = RESULTS) -> None:
    """Replace the marked section of ``path`` (append it if absent), atomically."""
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        new = head + section + tail
    else:
        new = text.rstrip("\n") + "\n\n" + section + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(new)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# Command line


@dataclass
class Report:
    """What ``main`` returns: the per-model results and the Markdown section."""

    results: list[ModelResult]
    section: str
    seconds: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--quick", action="store_true",
                        help=f"one small model ({QUICK_MODEL}), few points, one timed step (smoke test)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for ckptplan's ilp and auto solvers (default 4; 1 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per point (default 5; 1 with --quick)")
    parser.add_argument("--no-write", action="store_true", help="print the section; write no file or plot")
    parser.add_argument("--spell-out", action="store_true",
                        help="profile for ckptplan as --spell-out does: CPU dropout as a one-byte mask and its "
                             "product, math-kernel attention as its ops (off by default: see results/spell_out.md)")
    parser.add_argument("--no-flops", action="store_true",
                        help=f"skip the {FLOPS_SOLVER} series (auto on a profile priced in FLOPs, spelled out)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on this shared 2-core machine two OpenMP threads "
                             "made a GPT step 20x slower and the timings erratic)")
    return parser.parse_args(argv)


def settings_for(options: argparse.Namespace) -> tuple[list[str], Settings]:
    if options.quick:
        settings = Settings(repeats=1, time_limit=1.0, compile_budgets=(0.5,), compile_solvers=("dp",),
                            solvers=("sqrt", "dp", "ilp"), extra_budgets=False, peer_budgets=1)
        models = [QUICK_MODEL]
    else:
        settings = Settings()
        models = [m.strip() for m in options.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in CASES]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if options.time_limit is not None:
        settings.time_limit = options.time_limit
    if options.repeats is not None:
        settings.repeats = max(1, options.repeats)
    settings.spell_out = options.spell_out
    settings.flops_series = not options.no_flops
    return models, settings


def main(argv: Sequence[str] | None = None) -> Report:
    options = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    models, settings = settings_for(options)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, options.threads))
    started = time.perf_counter()
    try:
        results = [run_model(CASES[name], settings) for name in models]
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - started
    plots: dict[str, str] = {}
    if not options.no_write:
        for result in results:
            path = PLOTS / f"compare_{result.case.name}.png"
            plot(result, path)
            plots[result.case.name] = Path(os.path.relpath(path, RESULTS.parent)).as_posix()
    section = render_section(results, settings, seconds, plots, max(1, options.threads))
    if options.no_write:
        sys.stdout.write(section + "\n")
    else:
        import results_file  # benchmarks/results_file.py, beside this script (tests load this file alone)

        results_file.write(__file__, TITLE, [])  # this run's command and machine; then the section after them
        write_section(section)
        log.info("wrote %s and %d plots", RESULTS, len(plots))
    log.info("total %.0f s", seconds)
    return Report(results, section, seconds)


if __name__ == "__main__":
    main()
