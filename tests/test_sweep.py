"""``sweep`` and ``ckptplan sweep``: the trade-off between peak memory and recomputation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch  # imported before CliRunner runs (see test_cli.py)
from typer.testing import CliRunner

import ckptplan
from ckptplan.cli.main import app
from ckptplan.planner.sweep import sweep
from tests import models

MODEL = """
import torch  # imported before CliRunner runs (see test_cli.py)
from torch import nn

def build():
    torch.manual_seed(0)
    layers = [layer for _ in range(8) for layer in (nn.Linear(64, 64), nn.Tanh())]
    return nn.Sequential(*layers), (torch.randn(512, 64),)
"""


def test_sweep_points_follow_the_budgets_and_peaks_fall() -> None:
    graph = ckptplan.profile(models.mlp(depth=8), (torch.randn(512, 64),))
    points = sweep(graph, ["1.0", "0.8", "0.6", "0.001"], solver="dp")
    assert [p.requested for p in points] == ["1.0", "0.8", "0.6", "0.001"]
    solved = [p for p in points if p.peak_bytes is not None]
    assert len(solved) == 3 and solved[0].overhead == 0.0
    assert all(p.peak_bytes <= p.budget_bytes for p in solved)
    assert [p.peak_bytes for p in solved] == sorted((p.peak_bytes for p in solved), reverse=True)
    assert [p.overhead for p in solved] == sorted(p.overhead for p in solved)
    infeasible = points[-1]
    assert infeasible.peak_bytes is None and infeasible.least_peak_bytes > infeasible.budget_bytes


def test_cli_sweep_table_json_and_plot(tmp_path: Path) -> None:
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL)
    runner = CliRunner()
    table = runner.invoke(app, ["sweep", str(model_file), "--budgets", "0.9,0.5,0.01"])
    assert table.exit_code == 0, table.output
    assert "infeasible" in table.stderr and "overhead" in table.stderr
    as_json = runner.invoke(app, ["sweep", str(model_file), "--budgets", "0.9,0.5", "--json"])
    rows = json.loads(as_json.stdout)
    assert [row["requested"] for row in rows] == ["0.9", "0.5"]
    for bad in ("lots", "", "0.9,,nope"):
        result = runner.invoke(app, ["sweep", str(model_file), "--budgets", bad])
        assert result.exit_code == 2 and "Traceback" not in result.output
    pytest.importorskip("matplotlib")
    png = tmp_path / "pareto.png"
    plotted = runner.invoke(app, ["sweep", str(model_file), "--budgets", "0.9,0.6", "--plot", str(png)])
    assert plotted.exit_code == 0, plotted.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
