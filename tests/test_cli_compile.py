"""Compiled steps' plans: ``ckptplan solve --compile`` writes a joint-graph partition, ``show``
reads it, ``verify`` compiles the model with it and measures, ``ckptplan.compile(plan=...)``
follows it; each refusal is one sentence and the documented exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import ckptplan
from ckptplan.cli.exits import EXIT_ERROR, EXIT_USAGE
from ckptplan.cli.main import app
from ckptplan.errors import CkptPlanError, PlanFormatError
from ckptplan.plan import PartitionPlan, load_any_plan

# Activations dominate (batch 512 × 64 → 256 → 64), so recomputing pays at 0.8.
MLP = """
import torch
from torch import nn

TRAINING = {"outputs": "dropped"}

def build():
    torch.manual_seed(0)
    model = nn.Sequential(*[
        nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64))
        for _ in range(2)
    ])
    return model, torch.randn(512, 64)
"""

runner = CliRunner()


def invoke(*args: object) -> Result:
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compile") / "mlp.py"
    path.write_text(MLP)
    return path


@pytest.fixture(scope="module")
def partition_file(model_file: Path) -> Path:
    torch._dynamo.reset()
    out = model_file.with_name("partition.json")
    result = invoke("solve", model_file, "--budget", "0.8", "--compile", "--time-limit", "2", "--out", out)
    assert result.exit_code == 0, result.output
    torch._dynamo.reset()
    return out


def test_solve_compile_writes_a_joint_graph_partition(partition_file: Path) -> None:
    plan = load_any_plan(partition_file)
    assert isinstance(plan, PartitionPlan)
    raw = json.loads(partition_file.read_text())
    assert (raw["schema_version"], raw["kind"]) == ("ckptplan.partition/v1", "joint-graph partition")
    assert plan.recomputed and plan.prediction.peak_bytes <= plan.budget.bytes
    assert plan.model.outputs_live is False  # the file's TRAINING says the loop drops them
    assert PartitionPlan.model_validate_json(plan.to_json()) == plan


def test_show_reads_a_partition(partition_file: Path) -> None:
    result = invoke("show", partition_file)
    assert result.exit_code == 0
    assert "compiled step" in result.output and "recomputed" in result.output
    assert invoke("show", partition_file, "--json").stdout == partition_file.read_text()
    refused = invoke("show", partition_file, "--plot", partition_file.with_name("t.png"))
    assert refused.exit_code == EXIT_ERROR and "no timeline" in refused.output
    assert "inductor" not in result.output  # compiled with inductor's defaults (or by aot_eager)
    # A plan whose inductor step ran with other settings says which; a setting ckptplan does not
    # set is refused when the file is read.
    raw = json.loads(partition_file.read_text())
    raw["inductor_options"] = {"reorder_for_peak_memory": False, "layout_optimization": False}
    other = partition_file.with_name("modelled.json")
    other.write_text(json.dumps(raw))
    result = invoke("show", other)
    assert result.exit_code == 0
    assert "inductor    compiled with layout_optimization=False," in result.output
    assert "reorder_for_peak_memory=False" in result.output
    raw["inductor_options"] = {"max_autotune": True}
    other.write_text(json.dumps(raw))
    refused = invoke("show", other)
    assert refused.exit_code == EXIT_ERROR and "inductor_options" in refused.output


def test_verify_compiles_the_model_with_the_partition_and_measures_it(model_file: Path, partition_file: Path) -> None:
    result = invoke("verify", model_file, "--plan", partition_file, "--steps", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    plan = load_any_plan(partition_file)
    assert report["within_budget"] and report["gradients_equal"]
    assert report["measured_peak_bytes"] == plan.prediction.peak_bytes


def test_an_autocast_partition_is_verified_under_autocast(model_file: Path) -> None:
    """``--autocast`` plans the mixed-precision step; verify runs it under autocast and compares
    its gradients with those of the compiled step recomputing nothing."""
    out = model_file.with_name("autocast.json")
    result = invoke("solve", model_file, "--budget", "0.8", "--compile", "--autocast", "bf16", "--time-limit", "2",
                    "--out", out)
    assert result.exit_code == 0, result.output
    plan = load_any_plan(out)
    assert plan.model.autocast == "bfloat16" and plan.recomputed
    torch._dynamo.reset()
    result = invoke("verify", model_file, "--plan", out, "--steps", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["within_budget"] and report["gradients_equal"]
    assert report["measured_peak_bytes"] == plan.prediction.peak_bytes


def test_compile_follows_a_plan_file_and_refuses_another_step(partition_file: Path) -> None:
    plan = load_any_plan(partition_file)
    namespace: dict[str, object] = {}
    exec(MLP, namespace)  # noqa: S102 (the test's own model file)
    model, x = namespace["build"]()
    module = ckptplan.compile(model, (x,), backend="aot_eager", plan=partition_file)
    assert module.ckptplan_plan.saved == plan.saved
    assert module.ckptplan_plan.peak_bytes == plan.prediction.peak_bytes
    torch._dynamo.reset()
    with pytest.raises(CkptPlanError, match="another compiled step"):
        ckptplan.compile(model, (x[:64],), backend="aot_eager", plan=partition_file)
    with pytest.raises(PlanFormatError, match="compiled step's plan"):
        ckptplan.load_plan(partition_file)


def test_compile_refusals_come_before_any_work(model_file: Path) -> None:
    for options, code, words in (
        (("--solver", "ilp"), EXIT_USAGE, "Unknown solver 'ilp' for --compile"),
        (("--costs", "here"), EXIT_ERROR, "--costs here is not available"),
        (("--optimizer", "adamw"), EXIT_ERROR, "--optimizer does not apply"),
    ):
        result = invoke("solve", model_file, "--budget", "0.8", "--compile", *options)
        assert result.exit_code == code and words in result.output, result.output


def test_sweep_compile_partitions_the_joint_graph_at_each_budget(model_file: Path) -> None:
    result = invoke("sweep", model_file, "--compile", "--budgets", "0.9,0.7,0.05", "--time-limit", "3", "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)
    assert [p["requested"] for p in points] == ["0.9", "0.7", "0.05"]
    for point in points[:2]:
        assert point["peak_bytes"] <= point["budget_bytes"] and point["overhead"] >= 0
    assert points[0]["recompute_flops"] <= points[1]["recompute_flops"]
    assert points[2]["peak_bytes"] is None and points[2]["least_peak_bytes"] > points[2]["budget_bytes"]


def test_schema_compile_is_the_partition_files_schema() -> None:
    schema = json.loads(invoke("schema", "--compile").stdout)
    assert schema["$id"] == "ckptplan.partition/v1"
    assert {"saved", "recomputed", "prediction", "model"} <= set(schema["properties"])
