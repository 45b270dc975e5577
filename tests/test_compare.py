"""Smoke test of ``benchmarks/compare.py --quick --no-write``: the section's structure and the
sanity of its numbers (one small GPT, a few points, one timed step each)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py"
HEADER = "| method | setting | measured peak MiB | peak / no-ckpt | extra FLOPs % | step time ratio | gradients equal |"


def _load() -> ModuleType:
    name = "ckptplan_benchmark_compare"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compare() -> ModuleType:
    return _load()


@pytest.fixture(scope="module")
def quick(compare: ModuleType) -> tuple[Any, str, list[str]]:
    """One ``--quick --no-write`` run: the report, what it printed, and any attempt to write a file
    (``write_section`` and ``plot`` are replaced by recorders for the run)."""
    writes: list[str] = []
    saved = compare.write_section, compare.plot
    compare.write_section = lambda *args, **kwargs: writes.append("RESULTS.md")
    compare.plot = lambda *args, **kwargs: writes.append("plot")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            report = compare.main(["--quick", "--no-write"])
    finally:
        compare.write_section, compare.plot = saved
    return report, out.getvalue(), writes


def _table_rows(section: str) -> list[list[str]]:
    lines = section.splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _section_structure(compare: ModuleType, quick: tuple[Any, str, list[str]]) -> None:
    report, printed, writes = quick
    assert printed.strip() == report.section.strip()
    assert printed.lstrip().startswith(compare.BEGIN)
    assert printed.rstrip().endswith(compare.END)
    assert "torch " in printed and "Python " in printed and "CPUs" in printed
    assert "**Overall:**" in printed
    assert printed.count(HEADER) == 1
    rows = _table_rows(printed)
    (result,) = report.results
    assert len(rows) == len(result.points)
    assert all(len(row) == 7 for row in rows)
    assert result.summary and all(sentence.endswith(".") for sentence in result.summary)
    assert writes == []  # --no-write writes neither the results file nor plots


def _reference_row(quick: tuple[Any, str, list[str]]) -> None:
    report, printed, _ = quick
    first = _table_rows(printed)[0]
    assert first[0] == "no checkpoint"
    assert first[3:] == ["1.000", "+0.0", "1.00", "yes"]
    assert report.results[0].points[0].metrics.time_ratio == 1.0


def _every_method_is_present_and_sane(compare: ModuleType, quick: tuple[Any, str, list[str]]) -> None:
    report, _, _ = quick
    (result,) = report.results
    groups = {p.group for p in result.points}
    assert {"no checkpoint", "every block", "every nth block", "selective ops", "torch.compile"} <= groups
    assert {"ckptplan sqrt", "ckptplan dp", "ckptplan ilp", f"ckptplan {compare.FLOPS_SOLVER}"} <= groups
    for point in result.points:  # the FLOPs-priced series predicts FLOPs, the others step time
        if point.group.startswith("ckptplan") and point.metrics is not None:
            flops_priced = point.solver == compare.FLOPS_SOLVER
            assert (point.predicted_flops_pct is not None) == flops_priced
            assert (point.predicted_time_ratio is None) == flops_priced
    reference = result.reference
    for point in result.points:
        if point.metrics is None:
            assert point.status.startswith(("failed: ", "infeasible, least ")), point  # never "error: "
            continue
        assert 0 < point.metrics.peak_bytes
        assert math.isfinite(point.metrics.time_ratio) and point.metrics.time_ratio > 0
        assert point.metrics.flops >= reference.flops * 0.999 or point.group == "torch.compile"
    for group in ("every block", "every nth block", "selective ops"):
        (point,) = [p for p in result.points if p.group == group]
        assert point.metrics is not None, point.status
        assert point.metrics.grads == "yes"
        assert point.metrics.peak_bytes < reference.peak_bytes


def _ckptplan_points_fit_their_budgets(compare: ModuleType, quick: tuple[Any, str, list[str]]) -> None:
    report, _, _ = quick
    (result,) = report.results
    solved = [p for p in result.points if p.group.startswith("ckptplan") and p.metrics is not None]
    assert solved, "no ckptplan point was solved"
    for point in solved:
        assert point.budget_bytes is not None
        assert point.metrics.peak_bytes <= point.budget_bytes * compare.WITHIN_BUDGET, point
        assert point.metrics.grads == "yes", point


def test_quick_run(compare: ModuleType, quick: tuple[Any, str, list[str]], tmp_path: Path) -> None:
    """Every check of the one ``--quick`` run, in one test: pytest-xdist would otherwise spread
    them over its workers, and each worker would make the run again."""
    _section_structure(compare, quick)
    _reference_row(quick)
    _every_method_is_present_and_sane(compare, quick)
    _ckptplan_points_fit_their_budgets(compare, quick)
    pytest.importorskip("matplotlib")  # last: the checks above need no plotting
    _plot_writes_a_png(compare, quick, tmp_path)


def test_write_section_replaces_only_the_marked_part(compare: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nkeep me\n")
    first = f"{compare.BEGIN}\none\n{compare.END}"
    compare.write_section(first, path)
    assert path.read_text() == f"# Results\n\nkeep me\n\n{first}\n"
    path.write_text(path.read_text() + "\n## later\n")
    compare.write_section(f"{compare.BEGIN}\ntwo\n{compare.END}", path)
    assert path.read_text() == f"# Results\n\nkeep me\n\n{compare.BEGIN}\ntwo\n{compare.END}\n\n## later\n"
    assert [p.name for p in tmp_path.iterdir()] == ["RESULTS.md"]


def _plot_writes_a_png(compare: ModuleType, quick: tuple[Any, str, list[str]], tmp_path: Path) -> None:
    report, _, _ = quick
    path = tmp_path / "plots" / "compare_quick.png"
    compare.plot(report.results[0], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rises_finds_where_a_lower_budget_measured_a_higher_peak(compare: ModuleType) -> None:
    """The monotonicity sentences: BERT's knob measured 28.6, 24.4 and 28.7 MiB at 0.8, 0.5 and
    0.2 (benchmarks/results/compare.md), a rise; ckptplan's budgets here fall with their peaks."""
    from types import SimpleNamespace

    def point(group: str, peak_mib: float, **fields: Any) -> Any:
        metrics = compare.Metrics(peak_bytes=int(peak_mib * 2**20), flops=0, time_ratio=1.0, grads="yes")
        return compare.Point("m", "s", group, metrics, **fields)

    mib = 2**20
    result = SimpleNamespace(points=[
        point("torch.compile", 34.8, knob=1.0, solver="dp"),
        point("torch.compile", 28.6, knob=0.8, solver="dp"),
        point("torch.compile", 24.4, knob=0.5, solver="dp"),
        point("torch.compile", 23.1, knob=0.5, solver="ilp"),  # other knapsack solvers are left out
        point("torch.compile", 28.7, knob=0.2, solver="dp"),
        point("ckptplan auto", 28.4, budget_bytes=int(28.6 * mib), solver="auto"),
        point("ckptplan auto", 14.9, budget_bytes=int(14.9 * mib), solver="auto"),
        point("ckptplan dp", 23.1, budget_bytes=int(23.1 * mib), solver="dp"),
        point("ckptplan dp", 23.9, budget_bytes=int(22.0 * mib), solver="dp"),
        # a series whose name starts like auto's: a rise of its own, none of auto's
        point(f"ckptplan {compare.FLOPS_SOLVER}", 20.0, budget_bytes=int(20.0 * mib), solver=compare.FLOPS_SOLVER),
        point(f"ckptplan {compare.FLOPS_SOLVER}", 21.0, budget_bytes=int(19.0 * mib), solver=compare.FLOPS_SOLVER),
    ])
    assert compare.compile_rises(result) == [((0.5, int(24.4 * mib)), (0.2, int(28.7 * mib)))]
    assert compare.ckptplan_rises(result, "auto") == []
    assert len(compare.ckptplan_rises(result, "dp")) == 1
    assert compare.ckptplan_rises(result, "ilp") is None
    sentence = compare._monotone_sentence(result)
    assert "falls with the budget for ckptplan auto" in sentence
    assert "rises as the budget falls for ckptplan dp" in sentence
    assert "rises as torch.compile's knob falls (0.5: 24.4 MiB, 0.2: 28.7 MiB)" in sentence
    assert len(compare.ckptplan_rises(result, compare.FLOPS_SOLVER)) == 1
    assert f"; {compare.FLOPS_SOLVER} (budget 20.0 MiB measured 20.0 MiB, 19.0 MiB measured 21.0 MiB)" in sentence


def test_flops_are_counted_against_each_peer_from_plans_at_or_below_its_peak(compare: ModuleType) -> None:
    def point(group: str, peak_mib: float, flops: int) -> Any:
        metrics = compare.Metrics(peak_bytes=int(peak_mib * 2**20), flops=flops, time_ratio=1.0, grads="yes")
        return compare.Point("m", "s", group, metrics)

    peers = [point("selective ops", 40.0, 100), point("torch.compile", 30.0, 110), point("every block", 20.0, 130)]
    ours = [point("ckptplan auto-flops", 40.3, 100), point("ckptplan auto-flops", 30.5, 104),
            point("ckptplan auto-flops", 25.0, 120)]
    # 40.3 is within 1% of 40.0; the plan at 30.5 is over 30.0 + 1%, so the one at 25.0 answers
    # compile; nothing is at or below 20.0
    assert compare._flops_no_more(peers, ours) == 1
    assert compare._flops_no_more(peers[:1], ours) == 1
    everything = [*peers, *ours, point("ckptplan auto", 10.0, 999)]
    assert compare._measured(everything, "ckptplan auto") == everything[-1:]
    assert compare._measured(everything, "ckptplan") == everything[3:]
