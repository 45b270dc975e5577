"""ckptplan against what users run today, on one GPU at training sizes.

    python benchmarks/gpu_compare.py [--models llama,gpt2,unet,resnet] [--time-limit 10] [--repeats 5]
    python benchmarks/gpu_compare.py --tiny     # the same run at toy sizes, on CPU when there is no GPU

Four families: a Llama-shaped and a GPT-2-shaped ``transformers`` model built from configs (no
downloads), a U-Net (SiLU convolutions) and a ResNet with batch norm. For each, one process
measures: no checkpointing; a checkpoint around every block (``gradient_checkpointing_enable``
for the ``transformers`` models); every 2nd block; a torchtitan-style selective policy around
every block (matmul outputs kept); and ckptplan's ``auto`` at each of those peers' measured peaks,
at 0.5 of the no-checkpoint peak and at the least peak it states. Peak: ``measure_step`` (on
CUDA ``torch.cuda.max_memory_allocated`` over the step, with the module's state and inputs);
time: the median over ``--repeats`` pairs of a step over the no-checkpoint step run right after
it. The loop drops the outputs once the loss is made, and the profiles say so
(``outputs_live=False``). On CUDA the rows go to ``benchmarks/results/gpu_compare.json`` (keys:
device, torch, model, method, budget_bytes, measured_peak_bytes, predicted_peak_bytes,
step_time_ratio, predicted_step_time_ratio; null where a peer has none) and a table beside it.
Without CUDA and without ``--tiny`` it says so and exits 1; a ``--tiny`` run on CPU writes nothing.

    python benchmarks/gpu_compare.py --compile --models llama   # compiled steps (inductor)

``--compile`` measures compiled steps instead: ``torch.compile`` (inductor, its min-cut
partitioner) at ``activation_memory_budget`` 1.0, 0.5 and 0.2, and ``ckptplan.compile`` (inductor)
at each of those settings' measured peaks and at 0.5 of its model's no-recompute peak, its
predicted peak the model of the partitioned graphs; step times over the eager model's. Its rows
go to ``gpu_compare_compile.json`` and ``.md``. Each row is one or more inductor compiles (a
minute or so each at these sizes): run one family per call.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zoo  # benchmarks/zoo.py, beside this script
from torch import nn

import ckptplan
from ckptplan.build import make_plan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.profiler.loss import training_loss

ROOT = zoo.ROOT
RESULTS = ROOT / "benchmarks" / "results" / "gpu_compare.json"


@dataclass
class Family:
    """One model family: its builder (``tiny`` for toy sizes), its blocks, whether it is a
    ``transformers`` model, and the autocast dtype its step runs under (None: none)."""

    name: str
    build: Callable[[bool, torch.device], tuple[nn.Module, tuple, dict]]
    blocks: Callable[[nn.Module], list[nn.Module]]
    hf: bool = False
    autocast: torch.dtype | None = None


def _llama(tiny: bool, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    """8 layers, width 2048, 16 heads, MLP 5632, sequence 2048, batch 4 (the Llama-shaped model of the H200 measurements, docs/results.md)."""
    import transformers

    torch.manual_seed(0)
    size = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 176,
            "vocab_size": 256, "max_position_embeddings": 64} if tiny else {
        "hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "intermediate_size": 5632,
        "vocab_size": 32000, "max_position_embeddings": 2048}
    config = transformers.LlamaConfig(**size, use_cache=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    batch, seq = (2, 64) if tiny else (4, 2048)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, (ids,), {"labels": ids}


def _gpt2(tiny: bool, device: torch.device) -> tuple[nn.Module, tuple, dict]:
    """GPT-2 medium's shape: 12 layers of width 1024 (24 in the original), sequence 1024, batch 4, dropout."""
    import transformers

    torch.manual_seed(0)
    size = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 256} if tiny else {
        "n_layer": 12, "n_embd": 1024, "n_head": 16, "n_positions": 1024, "vocab_size": 50257}
    config = transformers.GPT2Config(**size, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device(device):
        model = transformers.GPT2LMHeadModel(config)
    batch, seq = (2, 64) if tiny else (4, 1024)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, (ids,), {"labels": ids}


def _example(name: str, tiny_sizes: dict, sizes: dict) -> Callable[[bool, torch.device], tuple]:
    def build(tiny: bool, device: torch.device) -> tuple[nn.Module, tuple, dict]:
        model, args = zoo.load(ROOT / "examples" / f"{name}.py", f"ckptplan_gpu_{name}").build(
            **(tiny_sizes if tiny else sizes))
        return model.to(device), tuple(a.to(device) for a in args), {}

    return build


FAMILIES = {
    "llama": Family("llama", _llama, lambda m: list(m.model.layers), hf=True, autocast=torch.bfloat16),
    "gpt2": Family("gpt2", _gpt2, lambda m: list(m.transformer.h), hf=True),
    "unet": Family("unet", _example("unet", {"batch": 2, "size": 32}, {"batch": 16, "size": 256}),
                   lambda m: [*m.down, m.bottleneck, *m.dec]),
    "resnet": Family("resnet", _example("resnet", {"batch": 4, "size": 32}, {"batch": 64, "size": 64}),
                     lambda m: list(m.layers)),
}


def _compare_module() -> Any:
    """``benchmarks/compare.py``: its peers (every block, every n-th, the selective policy)."""
    return zoo.load(ROOT / "benchmarks" / "compare.py", "ckptplan_gpu_compare_peers")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(module: nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None) -> None:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)
    with ckptplan.planner.measure.forward_autocast(module, args, kwargs, autocast):
        loss = training_loss(module(*args, **kwargs))
    loss.backward()


def _seconds(module: nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None, device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    _step(module, args, kwargs, autocast)
    _sync(device)
    return time.perf_counter() - started


def _time_ratio(module: nn.Module, reference: nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None,
                device: torch.device, repeats: int) -> float:
    """Median over ``repeats`` pairs of ``module``'s step over ``reference``'s run right after it."""
    if module is reference:
        return 1.0
    _step(module, args, kwargs, autocast)  # warm-up
    return statistics.median(
        _seconds(module, args, kwargs, autocast, device) / _seconds(reference, args, kwargs, autocast, device)
        for _ in range(repeats))


def _peak(module: nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None) -> int:
    return ckptplan.measure_step(module, args, kwargs, autocast=autocast, outputs_live=False).peak_bytes


def run_family(family: Family, options: argparse.Namespace, device: torch.device, compare: Any) -> list[dict]:
    """Every row of one family: the peers, then ckptplan at each budget."""
    model, args, kwargs = family.build(options.tiny, device)
    case = compare.Case(family.name, family.name, lambda: None, family.blocks, hf=family.hf)
    base = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "model": family.name}
    rows = []

    def row(method: str, module: nn.Module, plan: ckptplan.Plan | None = None) -> None:
        peak = _peak(module, args, kwargs, family.autocast)
        ratio = _time_ratio(module, model, args, kwargs, family.autocast, device, options.repeats)
        rows.append({**base, "method": method, "budget_bytes": plan.budget.bytes if plan else None,
                     "measured_peak_bytes": peak,
                     "predicted_peak_bytes": plan.prediction.peak_bytes if plan else None,
                     "step_time_ratio": ratio,
                     "predicted_step_time_ratio": 1 + plan.prediction.overhead if plan else None})
        print(f"{family.name} | {method} | {ckptplan.format_bytes(peak)} | {ratio:.2f}x"
              + (f" | predicted {ckptplan.format_bytes(plan.prediction.peak_bytes)}, {1 + plan.prediction.overhead:.2f}x"
                 if plan else ""), flush=True)

    row("no checkpointing", model)
    peers = {
        "every block" + (" (gradient_checkpointing_enable)" if family.hf else ""): compare.every_block(case, model),
        "every 2nd block": compare.every_nth_block(case, model, 2),
        "selective policy (matmuls kept)": compare.selective_blocks(case, model),
    }
    for method, module in peers.items():
        row(method, module)
        del module
    graph = ckptplan.profile(model, args, kwargs, autocast=family.autocast, outputs_live=False)
    # The emitted module with no regions must be the model's own step: its peak and time.
    unchanged = make_plan(graph, ())
    row("ckptplan with no regions", ckptplan.emit(graph, unchanged), unchanged)
    budgets: list[tuple[str, float | int]] = [(f"auto at {r['method']}'s peak", r["measured_peak_bytes"])
                                              for r in rows[1:] if r["budget_bytes"] is None]
    budgets.append(("auto at 0.5", 0.5))
    try:
        ckptplan.solve(graph, graph.static.floor_bytes, time_limit=options.time_limit)
        budgets.append(("auto at its least", graph.static.floor_bytes))
    except InfeasibleBudgetError as error:
        budgets.append(("auto at its least", error.min_peak_bytes))
    for method, budget in budgets:
        try:
            plan = ckptplan.solve(graph, budget, time_limit=options.time_limit)
        except InfeasibleBudgetError as error:
            print(f"{family.name} | {method} | infeasible: {error}", flush=True)
            continue
        row(method, ckptplan.emit(graph, plan), plan)
    return rows


KNOBS = (1.0, 0.5, 0.2)


def run_compiled_family(family: Family, options: argparse.Namespace, device: torch.device, compare: Any) -> list[dict]:
    """The compiled rows of one family: ``torch.compile`` at each knob setting, then
    ``ckptplan.compile`` at each setting's measured peak and at 0.5."""
    from torch._functorch import config as functorch_config

    from ckptplan.planner.compiled import choose_loss_functions

    model, args, kwargs = family.build(options.tiny, device)
    choose_loss_functions(model)  # a transformers model picks its loss before Dynamo traces it whole
    base = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "model": family.name}
    rows = []

    def row(method: str, module: nn.Module, plan: Any = None) -> None:
        peak = _peak(module, args, kwargs, family.autocast)
        ratio = _time_ratio(module, model, args, kwargs, family.autocast, device, options.repeats)
        rows.append({**base, "method": method, "budget_bytes": plan.budget_bytes if plan else None,
                     "measured_peak_bytes": peak, "predicted_peak_bytes": plan.peak_bytes if plan else None,
                     "step_time_ratio": ratio, "predicted_step_time_ratio": None,
                     "measured_at_compile_bytes": plan.measured_peak_bytes if plan else None,
                     "partitions": len(module.ckptplan_attempts) if plan else None})
        print(f"{family.name} | {method} | {ckptplan.format_bytes(peak)} | {ratio:.2f}x"
              + (f" | model {ckptplan.format_bytes(plan.peak_bytes)}, {rows[-1]['partitions']} partition(s)"
                 if plan else ""), flush=True)

    for knob in KNOBS:
        torch._dynamo.reset()
        with functorch_config.patch(activation_memory_budget=knob):
            module = torch.compile(model, fullgraph=True)
            _step(module, args, kwargs, family.autocast)  # compiles under the setting
        row(f"torch.compile, activation_memory_budget {knob}", module)
        del module
    budgets: list[tuple[str, float | int]] = [  # one knob row per setting, in KNOBS' order
        (f"ckptplan.compile at activation_memory_budget {knob}'s peak", r["measured_peak_bytes"])
        for knob, r in zip(KNOBS, rows, strict=True)
    ]
    budgets.append(("ckptplan.compile at 0.5", 0.5))
    for method, budget in budgets:
        torch._dynamo.reset()
        try:
            module = ckptplan.compile(model, args, kwargs, budget=budget, time_limit=options.time_limit,
                                      outputs_live=False, autocast=family.autocast)
        except InfeasibleBudgetError as error:
            print(f"{family.name} | {method} | infeasible: {error}", flush=True)
            continue
        row(method, module, module.ckptplan_plan)
        del module
    torch._dynamo.reset()
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| model | method | budget | measured peak | predicted | step time | predicted |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        def gib(value: int | None) -> str:
            return "-" if value is None else ckptplan.format_bytes(value)

        predicted_ratio = r["predicted_step_time_ratio"]
        lines.append(f"| {r['model']} | {r['method']} | {gib(r['budget_bytes'])} | {gib(r['measured_peak_bytes'])} | "
                     f"{gib(r['predicted_peak_bytes'])} | {r['step_time_ratio']:.2f} | "
                     f"{'-' if predicted_ratio is None else f'{predicted_ratio:.2f}'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    parser.add_argument("--repeats", type=int, default=5, help="step-time pairs per method")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (runs on CPU without a GPU; writes nothing)")
    parser.add_argument("--compile", action="store_true",
                        help="compiled steps: torch.compile's memory budget against ckptplan.compile (inductor)")
    options = parser.parse_args()
    unknown = [m for m in options.models.split(",") if m not in FAMILIES]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    if not torch.cuda.is_available() and not options.tiny:
        print("gpu_compare.py needs a CUDA GPU (none is available here); --tiny runs the toy sizes on CPU.",
              file=sys.stderr)
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compare = _compare_module()
    rows = []
    failed = []
    for name in options.models.split(","):
        try:
            run = run_compiled_family if options.compile else run_family
            rows += run(FAMILIES[name], options, device, compare)
        except Exception as exc:  # noqa: BLE001 (one family's failure must not lose the others' device time)
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"{name} | failed | {failed[-1]}", file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not rows:
        return 1
    table = _table(rows)
    print("\n" + table)
    if device.type == "cuda" and not options.tiny:
        results = RESULTS.with_name("gpu_compare_compile.json") if options.compile else RESULTS
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(rows, indent=2) + "\n")
        command = " ".join(["python benchmarks/gpu_compare.py", *sys.argv[1:]])
        results.with_suffix(".md").write_text(
            f"# ckptplan against what users run today, on {rows[0]['device']}\n\n`{command}`, torch {torch.__version__}; "
            "peaks as `torch.cuda.max_memory_allocated` counts them, step times as ratios to the no-checkpoint step.\n\n"
            + table + "\n" + "".join(f"\nFailed: {line}\n" for line in failed))
        print(f"written to {results.relative_to(ROOT)} and {results.with_suffix('.md').relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
