"""``verify`` and ``ckptplan verify``: a plan checked against real training steps."""

from __future__ import annotations

import io
import json
import re
import statistics
from pathlib import Path

import pytest
import torch  # imported before CliRunner runs (see test_cli.py)
from rich.console import Console
from typer.testing import CliRunner

import ckptplan
from ckptplan.cli.main import app
from ckptplan.cli.render import render_verification
from ckptplan.errors import CkptPlanError, FingerprintMismatchError
from ckptplan.planner.verify import Verification
from tests import models

MODEL = """
import torch  # imported before CliRunner runs (see test_cli.py)
from tests import models

def build():
    torch.manual_seed(0)
    return models.DropoutEverywhere(width=128, depth=6), (torch.randn(512, 128),)

def other():
    torch.manual_seed(0)
    return models.mlp(depth=3), (torch.randn(8, 64),)
"""


def _solved(tmp_path: Path) -> tuple[Path, Path]:
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL)
    plan_file = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["solve", str(model_file), "--budget", "0.8", "--time-limit", "2", "--out", str(plan_file)])
    assert result.exit_code == 0, result.output
    return model_file, plan_file


def test_verify_measures_within_budget_with_equal_gradients() -> None:
    torch.manual_seed(0)
    model = models.DropoutEverywhere(width=128, depth=6)
    args = (torch.randn(512, 128),)
    plan = ckptplan.solve(ckptplan.profile(model, args), 0.8, time_limit=2)
    result = ckptplan.verify(model, args, plan, steps=1)
    assert result.within_budget and result.gradients_equal and result.max_grad_error == 0.0
    assert abs(result.prediction_error) <= 0.03
    assert result.measured_peak_bytes < result.original_peak_bytes
    assert result.original_step_seconds > 0 and result.emitted_step_seconds > 0


def test_verify_times_steps_in_pairs_and_reports_their_spread() -> None:
    """The step times are the medians of ``steps`` paired steps; the overhead's spread is the
    least and most of the pairs' (its value is the machine's noise, not tested here)."""
    model = models.mlp(depth=3)
    args = (torch.randn(8, 64),)
    graph = ckptplan.profile(model, args)
    plan = ckptplan.make_plan(graph, [ckptplan.Region(0, len(graph.nodes) // 2)])
    result = ckptplan.verify(model, args, plan, steps=3)
    assert len(result.original_step_times) == len(result.emitted_step_times) == 3
    assert result.original_step_seconds == sorted(result.original_step_times)[1]
    assert result.emitted_step_seconds == sorted(result.emitted_step_times)[1]
    low, high = result.step_overhead_range
    assert low <= result.step_overhead + 1e-12 and result.step_overhead <= high + 1e-12
    report = result.to_dict()
    assert report["step_overhead_range"] == [low, high] and len(report["emitted_step_times"]) == 3


def _verification(original: tuple[float, ...], emitted: tuple[float, ...]) -> Verification:
    return Verification(
        device="cpu", budget_bytes=100, predicted_peak_bytes=90, measured_peak_bytes=90, original_peak_bytes=120,
        gradients_equal=True, max_grad_error=0.0,
        original_step_seconds=statistics.median(original), emitted_step_seconds=statistics.median(emitted),
        original_step_times=original, emitted_step_times=emitted,
    )


def test_step_time_is_shown_with_its_spread() -> None:
    console = Console(file=io.StringIO(), width=80)
    render_verification(console, _verification((1.0, 1.0, 1.0), (1.1, 1.2, 0.9)))
    text = console.file.getvalue()
    assert "+10.0% (-10.0% to +20.0% over 3 steps), within noise" in text
    assert "1200.0 ms" not in text and "1100.0 ms vs 1000.0 ms median" in text
    console = Console(file=io.StringIO(), width=80)
    render_verification(console, _verification((1.0,), (1.5,)))
    assert "+50.0% (1 step: no spread)" in console.file.getvalue()
    assert _verification((1.0, 2.0), (1.5, 2.0)).step_overhead_range == (0.0, 0.5)


def test_verify_rejects_bad_arguments() -> None:
    model = models.mlp(depth=2)
    args = (torch.randn(8, 64),)
    plan = ckptplan.make_plan(ckptplan.profile(model, args), [])
    with pytest.raises(CkptPlanError, match="steps"):
        ckptplan.verify(model, args, plan, steps=0)
    with pytest.raises(CkptPlanError, match="device"):
        ckptplan.verify(model, args, plan, device="tpu")
    with pytest.raises(FingerprintMismatchError):
        ckptplan.verify(models.mlp(depth=3), args, plan)


def test_cli_verify_reports_and_exits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    model_file, plan_file = _solved(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(model_file), "--plan", str(plan_file), "--steps", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["within_budget"] and report["gradients_equal"]
    assert report["measured_peak_bytes"] <= report["budget_bytes"]
    assert len(report["original_step_times"]) == len(report["emitted_step_times"]) == 1
    assert report["step_overhead_range"] == [pytest.approx(report["step_overhead"])] * 2
    human = runner.invoke(app, ["verify", str(model_file), "--plan", str(plan_file), "--steps", "2"])
    assert human.exit_code == 0 and "within budget" in human.stderr and "Traceback" not in human.output
    assert re.search(r"step time +[+-]\d+\.\d% \([+-]\d+\.\d% to [+-]\d+\.\d% over 2 steps\)", human.stderr)
    wrong_model = runner.invoke(app, ["verify", f"{model_file}:other", "--plan", str(plan_file)])
    assert wrong_model.exit_code == 1 and "fingerprint" in wrong_model.stderr
    assert "Traceback" not in wrong_model.output
    if not torch.cuda.is_available():
        no_gpu = runner.invoke(app, ["verify", str(model_file), "--plan", str(plan_file), "--device", "cuda"])
        assert no_gpu.exit_code == 1 and "CUDA is not available" in no_gpu.stderr


def test_verify_refuses_a_meta_model_in_one_sentence(tmp_path: Path) -> None:
    """A plan made on ``meta`` applies to the real model; verify, which runs steps, says so."""
    model, args = models.mlp(depth=2), (torch.randn(8, 64),)
    plan = ckptplan.make_plan(ckptplan.profile(model, args), [])
    with pytest.raises(CkptPlanError, match="meta device.*build the model and its inputs on cpu or cuda"):
        ckptplan.verify(models.mlp(depth=2).to("meta"), (torch.randn(8, 64, device="meta"),), plan)
    model_file = tmp_path / "meta_model.py"
    model_file.write_text(MODEL.replace("return models.DropoutEverywhere(width=128, depth=6), (torch.randn(512, 128),)",
                                        "return models.mlp(depth=2).to('meta'), (torch.randn(8, 64, device='meta'),)"))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    result = CliRunner().invoke(app, ["verify", str(model_file), "--plan", str(plan_file)])
    assert result.exit_code == 1 and "meta device" in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) <= 3


def test_verify_measures_a_resnet_plan_at_its_least_peak_within_budget() -> None:
    """The allocator's count of the step, not MemTracker's (whose hooks make autograd add
    gradients at the residual branches out of place): a plan at the least peak ``auto`` states
    measures exactly its prediction, within its budget."""
    from tests.conftest import load_example

    model, args = load_example("resnet").build(batch=8, size=32)
    graph = ckptplan.profile(model, args)
    with pytest.raises(ckptplan.InfeasibleBudgetError) as least:
        ckptplan.solve(graph, 0.2, time_limit=2)
    plan = ckptplan.solve(graph, least.value.min_peak_bytes, time_limit=2)
    result = ckptplan.verify(model, args, plan, steps=1)
    assert result.within_budget and result.gradients_equal
    assert result.measured_peak_bytes == result.predicted_peak_bytes
