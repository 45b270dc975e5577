"""Predicted against measured peak on a zoo of real architectures, for every solver and budget.

    python benchmarks/accuracy.py [--models gpt2,llama,...] [--solvers sqrt,dp,ilp,auto]
                                  [--budgets 0.9,0.7,0.5] [--time-limit 5] [--no-bf16]

Each model is profiled once per precision (float32, and bfloat16 autocast where the zoo says so),
solved with each solver at each budget (a fraction of its no-checkpoint peak), emitted, and run
for one real CPU training step measured with PyTorch's ``MemTracker`` (``ckptplan.measure_step``,
under the plan's autocast: forward and loss inside ``torch.autocast``, backward outside it). That
step is seeded and its gradients are compared (``torch.testing.assert_close``) with a seeded step
of an untouched copy of the model. Each model's first row is the emitted module without regions,
the no-checkpoint prediction's own subject. A budget a solver cannot reach is listed as
infeasible with the least peak it reached.

The targets: every |error| within 3% and, per model and solver, a measured peak that does not
rise as the budget falls; the summary lines after the table report both. A second table
compares the traced graph without regions with the model's own code, whose peak the plans do
not promise (``transformers`` attention takes another path under ``torch.export``).

Writes ``benchmarks/results/accuracy.md``, and its rows to ``accuracy.json``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import itertools
import logging
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import results_file  # benchmarks/results_file.py, beside this script
import torch
from torch import nn

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes
from ckptplan.units import format_bytes

log = logging.getLogger("accuracy")

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.03  # the target: worst |predicted - measured| / measured
SOLVERS = ("sqrt", "dp", "ilp", "auto")
BUDGETS = (0.9, 0.7, 0.5)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _load(relative: str) -> ModuleType:
    """A file of this repository loaded by path, once (benchmarks run from any directory)."""
    path = ROOT / relative
    name = f"accuracy_{path.parent.name}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


# compare.py's workloads: the same transformers configs, with fewer layers here.
_compare = _load("benchmarks/compare.py")
Workload = _compare.Workload


@dataclass(frozen=True)
class Case:
    """One model of the zoo: how to build it, what the table calls it, and in which precisions it runs."""

    name: str
    title: str
    build: Callable[[], Workload]
    precisions: tuple[str, ...] = ("fp32",)


_example = _compare._example


def _gpt() -> Workload:
    torch.manual_seed(0)
    model = _load("examples/gpt.py").GPT(n_layer=4, block_size=128)
    return Workload(model, (torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128))))


_gpt2 = functools.partial(_compare._gpt2, layers=2)
_llama = functools.partial(_compare._llama, layers=2)
_bert = functools.partial(_compare._bert, layers=2)


def _vit() -> Workload:
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, num_labels=10,
    )
    images, labels = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    return Workload(transformers.ViTForImageClassification(config), (images,), {"labels": labels})


def _zoo_model(name: str, *args: Any, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return getattr(_load("tests/models.py"), name)(*args, **kwargs)


def _dropout_everywhere() -> Workload:
    model = _zoo_model("DropoutEverywhere", width=256, depth=4)
    return Workload(model, (torch.randn(1024, 256),))


def _inplace_and_views() -> Workload:
    torch.manual_seed(0)
    blocks = _load("tests/models.py").InplaceAndViews
    model = nn.Sequential(*(blocks(width=256) for _ in range(4)))
    return Workload(model, (torch.randn(1024, 256),))


def _kwargs_and_dataclass() -> Workload:
    model = _zoo_model("KwargsAndDataclass", vocab=64, width=512)
    ids = torch.randint(0, 64, (16, 128))
    return Workload(model, (ids,), {"targets": torch.randint(0, 64, (16, 128)), "temperature": 0.5})


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("gpt2", "transformers GPT-2, 2 layers, width 128, batch 4 × 128 tokens", _gpt2, ("fp32", "bf16")),
        Case("llama", "transformers Llama, 2 layers, width 128, GQA 4/2, batch 4 × 128 tokens", _llama,
             ("fp32", "bf16")),
        Case("bert", "transformers BERT classifier, 2 layers, width 128, batch 4 × 128 tokens", _bert),
        Case("vit", "transformers ViT classifier, 2 layers, width 128, batch 8 × 64² (patch 8)", _vit),
        Case("gpt", "examples/gpt.py's GPT, 4 layers, width 128, batch 2 × 128 tokens", _gpt, ("fp32", "bf16")),
        Case("resnet", "examples/resnet.py (BatchNorm), batch 4 × 64²", lambda: _example("resnet", batch=4)),
        Case("unet", "examples/unet.py (skips), batch 1 × 128²", lambda: _example("unet", batch=1)),
        Case("dropout", "tests/models.py DropoutEverywhere, width 256, depth 4, batch 1024",
             _dropout_everywhere, ("fp32", "bf16")),
        Case("inplace", "4 × tests/models.py InplaceAndViews (frozen layer, in-place relu, views), width 256, batch 1024",
             _inplace_and_views),
        Case("tied", "tests/models.py KwargsAndDataclass (tied weights, kwargs, dataclass output), "
                     "vocab 64, width 512, batch 16 × 128", _kwargs_and_dataclass),
    )
}


@dataclass(frozen=True)
class Row:
    """One line of the table. ``measured_bytes`` is None when the budget was infeasible; ``note``
    then says what the solver reached."""

    model: str
    precision: str
    budget: str
    solver: str
    budget_bytes: int | None
    predicted_bytes: int | None
    measured_bytes: int | None = None
    grads: str = ""
    note: str = ""
    solve_seconds: float = 0.0

    @property
    def error(self) -> float | None:
        if self.measured_bytes is None or self.predicted_bytes is None:
            return None
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    @property
    def within_budget(self) -> str:
        if self.measured_bytes is None or self.budget_bytes is None:
            return "—"
        return "yes" if self.measured_bytes <= self.budget_bytes else "NO"


def _gradients(owner: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in owner.named_parameters()}


def _compare(reference: dict[str, torch.Tensor | None], owner: nn.Module) -> str:
    """"yes" when every gradient equals the reference's (``torch.testing.assert_close`` defaults)
    and the same parameters have none."""
    bad, worst = 0, 0.0
    for name, p in owner.named_parameters():
        expected = reference[name]
        if expected is None or p.grad is None:
            if (expected is None) != (p.grad is None):
                return f"NO ({name}: gradient on one side only)"
            continue
        try:
            torch.testing.assert_close(p.grad, expected)
        except AssertionError:
            bad += 1
            worst = max(worst, float((p.grad - expected).abs().max()))
    return "yes" if bad == 0 else f"NO (max abs diff {worst:.2g} in {bad} tensors)"


def _seeded_peak(module: nn.Module, work: Workload, autocast: torch.dtype | None) -> int:
    """MemTracker's peak over one seeded step; the step's gradients stay on the parameters."""
    torch.manual_seed(0)
    return ckptplan.measure_step(module, work.args, work.kwargs, autocast=autocast, outputs_live=False).peak_bytes


@dataclass(frozen=True)
class Fidelity:
    """The traced graph against the model's own code, without checkpointing: the emitted module
    with no regions runs the traced graph, ``eager_bytes`` is the model's own step."""

    model: str
    precision: str
    predicted_bytes: int
    emitted_bytes: int
    eager_bytes: int
    grads: str


def run_case(case: Case, precision: str, solvers: tuple[str, ...], budgets: tuple[float, ...],
             time_limit: float) -> tuple[list[Row], Fidelity]:
    """Every solver at every budget for one model in one precision, after the plan without regions.

    Every step is seeded and its gradients are compared with those of the same step of an
    untouched copy of the model (``reference``)."""
    work = case.build()
    autocast = PRECISIONS[precision]
    graph = ckptplan.profile(work.model, work.args, work.kwargs, autocast=autocast, outputs_live=False)
    reference = copy.deepcopy(work.model)
    eager = _seeded_peak(reference, work, autocast)
    expected = _gradients(reference)
    unplanned = _seeded_peak(ckptplan.emit(graph, ckptplan.make_plan(graph, [])), work, autocast)
    fidelity = Fidelity(case.name, precision, baseline_peak_bytes(graph), unplanned, eager, _compare(expected, work.model))
    rows = [Row(case.name, precision, "1.0", "none", None, baseline_peak_bytes(graph), unplanned, fidelity.grads)]
    for budget in budgets:
        for solver in solvers:
            work.model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            try:
                plan = ckptplan.solve(graph, budget, solver=solver,
                                      time_limit=time_limit if solver in ("ilp", "auto") else None)
            except InfeasibleBudgetError as exc:
                rows.append(Row(case.name, precision, f"{budget}", solver, exc.budget_bytes, None,
                                note=f"infeasible (least {format_bytes(exc.min_peak_bytes)})",
                                solve_seconds=time.perf_counter() - started))
                continue
            seconds = time.perf_counter() - started
            measured = _seeded_peak(ckptplan.emit(graph, plan), work, autocast)
            rows.append(Row(case.name, precision, f"{budget}", solver, plan.budget.bytes, plan.prediction.peak_bytes,
                            measured, _compare(expected, work.model), solve_seconds=seconds))
    return rows, fidelity


def monotonicity_violations(rows: list[Row]) -> list[str]:
    """Per model, precision and solver: budgets (in falling order, starting from the plan without
    regions at 1.0) at which the measured peak rose."""
    found = []
    series: dict[tuple[str, str, str], list[Row]] = {}
    unplanned = {(r.model, r.precision): r for r in rows if r.solver == "none"}
    for row in rows:
        if row.solver != "none" and row.measured_bytes is not None:
            series.setdefault((row.model, row.precision, row.solver), [unplanned[row.model, row.precision]]).append(row)
    for (model, precision, solver), points in series.items():
        points.sort(key=lambda r: -float(r.budget))
        for higher, lower in itertools.pairwise(points):
            if lower.measured_bytes > higher.measured_bytes:
                found.append(
                    f"{model} {precision} {solver}: {format_bytes(higher.measured_bytes)} at {higher.budget} "
                    f"→ {format_bytes(lower.measured_bytes)} at {lower.budget}"
                )
    return found


def render(rows: list[Row]) -> str:
    lines = [
        ("| model | precision | budget | solver | predicted peak | measured peak | error | within budget | "
         "gradients equal | solve s |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = "none" if r.solver == "none" else f"{r.budget} = {format_bytes(r.budget_bytes)}"
        solver = "no regions" if r.solver == "none" else r.solver
        if r.measured_bytes is None:
            lines.append(f"| {r.model} | {r.precision} | {budget} | {solver} | — | — | — | {r.note} | — | "
                         f"{r.solve_seconds:.1f} |")
            continue
        seconds = "" if r.solver == "none" else f"{r.solve_seconds:.1f}"
        lines.append(
            f"| {r.model} | {r.precision} | {budget} | {solver} | {format_bytes(r.predicted_bytes)} | "
            f"{format_bytes(r.measured_bytes)} | {100 * r.error:+.2f}% | {r.within_budget} | {r.grads} | {seconds} |"
        )
    return "\n".join(lines)


def render_fidelity(found: list[Fidelity]) -> str:
    lines = [
        ("| model | precision | predicted, no checkpointing | emitted, no regions (measured) | "
         "model's own step (measured) | traced / own | gradients equal |"),
        "|---|---|---|---|---|---|---|",
    ]
    for f in found:
        lines.append(
            f"| {f.model} | {f.precision} | {format_bytes(f.predicted_bytes)} | {format_bytes(f.emitted_bytes)} | "
            f"{format_bytes(f.eager_bytes)} | {100 * (f.emitted_bytes / f.eager_bytes - 1):+.2f}% | {f.grads} |"
        )
    return "\n".join(lines)


def _grouped(rows: list[Row]) -> str:
    """``; model precision at budget (solver, solver)`` for each model, precision and budget."""
    groups: dict[tuple[str, str], dict[str, list[str]]] = {}
    for r in rows:
        groups.setdefault((r.model, r.precision), {}).setdefault(r.budget, []).append(r.solver)
    return "".join(
        f"; {m} {p} " + ", ".join(f"at {b} ({', '.join(s)})" for b, s in budgets.items())
        for (m, p), budgets in groups.items()
    )


def summary(rows: list[Row]) -> str:
    measured = [r for r in rows if r.error is not None]
    worst = max(measured, key=lambda r: abs(r.error))
    over = [r for r in measured if abs(r.error) > TOLERANCE]
    grads_bad = [r for r in measured if r.grads not in ("yes", "—")]
    outside = [r for r in measured if r.within_budget == "NO"]
    infeasible = [r for r in rows if r.measured_bytes is None]
    violations = monotonicity_violations(rows)
    where = f"{worst.model} {worst.precision}, {worst.solver} at {worst.budget}"
    lines = [
        (f"- Worst |error|: {100 * abs(worst.error):.2f}% ({where}); {len(over)} of {len(measured)} measured "
         f"steps beyond {100 * TOLERANCE:.0f}%."),
        f"- Gradients differ from the model's own in {len(grads_bad)} of {len(measured)} steps" + _grouped(grads_bad) + ".",
        (f"- Measured peak above budget in {len(outside)} steps"
         + "".join(f"; {r.model} {r.precision} {r.solver} at {r.budget} ({100 * r.error:+.2f}%)" for r in outside)
         + "."),
        f"- Infeasible, not run: {len(infeasible)} of {len(rows)} rows" + _grouped(infeasible) + ".",
        ("- Measured peak non-increasing as the budget falls (from no regions at 1.0), per model, precision and "
         "solver: " + ("yes, everywhere." if not violations else f"NO in {len(violations)}: " + "; ".join(violations) + ".")),
    ]
    return "\n".join(lines)


def main() -> list[dict[str, Any]]:
    """Run and print the tables; return their rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--solvers", default=",".join(SOLVERS))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--time-limit", type=float, default=5.0, help="seconds for ilp and auto")
    parser.add_argument("--no-bf16", action="store_true", help="float32 rows only")
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log.setLevel(logging.INFO)
    solvers = tuple(options.solvers.split(","))
    budgets = tuple(float(b) for b in options.budgets.split(","))
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()} CPU, "
          f"{torch.get_num_threads()} threads; solvers {', '.join(solvers)} (ilp and auto: {options.time_limit:g} s)\n")
    for name in options.models.split(","):
        print(f"- {name}: {CASES[name].title}")
    print()
    rows: list[Row] = []
    fidelity: list[Fidelity] = []
    started = time.perf_counter()
    for name in options.models.split(","):
        case = CASES[name]
        for precision in case.precisions:
            if precision != "fp32" and options.no_bf16:
                continue
            case_started = time.perf_counter()
            case_rows, case_fidelity = run_case(case, precision, solvers, budgets, options.time_limit)
            rows += case_rows
            fidelity.append(case_fidelity)
            log.info("%s %s: %.1f s", name, precision, time.perf_counter() - case_started)
    print(render(rows))
    print()
    print(summary(rows))
    print("\nThe traced graph against the model's own code (no checkpointing either way):\n")
    print(render_fidelity(fidelity))
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")
    return [{"table": "plans", **asdict(r)} for r in rows] + [{"table": "traced", **asdict(f)} for f in fidelity]


TITLE = "Predicted against measured peak on a model zoo, every solver and budget"
ABOUT = (
    "Each model profiled, solved by each solver (`ilp` and `auto` with the time limit) at each budget (a fraction of "
    "its no-checkpoint peak), emitted, and run for one seeded CPU training step measured with `ckptplan.measure_step`; "
    "gradients compared (`torch.testing.assert_close`) with a seeded step of an untouched copy of the model. Rows in "
    "bf16 are profiled with `autocast=torch.bfloat16`, forward and loss under `torch.autocast`, backward outside it. "
    "Each model's first row is the emitted module without regions (what the no-checkpoint prediction describes). "
    "Budgets a solver cannot reach are listed with the least peak it reached and not run. The second table sets the "
    "traced graph without regions against the model's own code, whose peak the plans do not promise."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT) as record:
        record.rows = main()
