"""README.md quotes measured results: each number it quotes is read back here from the results
file the benchmark wrote, so that the README cannot drift from what was measured."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())  # one line: sentences wrap anywhere


def _table(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header row starts with ``header``, as cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _section(text: str, heading: str) -> str:
    """The Markdown section of ``text`` under the ``## `` heading that starts with ``heading``."""
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def _number(cell: str) -> float:
    return float(re.search(r"[-+]?\d+(?:\.\d+)?", cell).group())


def test_the_gpt_table_quotes_rows_of_compare_md() -> None:
    """Each row of the README's GPT table (measured peak, extra FLOPs, step time) is a row of the
    GPT section of ``compare.md``, a ckptplan row where the README says ckptplan."""
    readme = (ROOT / "README.md").read_text()
    quoted = _table(readme, "| method | measured peak |")
    assert len(quoted) >= 6
    measured = _table(_section((RESULTS / "compare.md").read_text(), "gpt:"), "| method | setting |")
    rows: dict[tuple[str, str, str], list[str]] = {}
    for row in measured:
        rows.setdefault((row[2], row[4], row[5]), []).append(f"{row[0]} {row[1]}")
    for method, peak, flops, step, _ in quoted:
        key = (f"{_number(peak):.1f}", f"{_number(flops):+.1f}", f"{_number(step):.2f}")
        assert key in rows, f"README row {method!r} ({peak}, {flops}, {step}) is no row of compare.md"
        if method.startswith("ckptplan `auto`"):
            assert any(name.startswith("ckptplan auto,") for name in rows[key]), method
        else:
            assert not any(name.startswith("ckptplan") for name in rows[key]), method


def test_the_summary_against_the_memory_budget_knob_is_compare_md_s() -> None:
    readme, overall = _readme(), (RESULTS / "compare.md").read_text()
    faster, settings, tied, slower = re.search(
        r"faster than `torch.compile`'s memory budget in (\d+) of (\d+) settings, tied in (\d+) and slower in (\d+)",
        readme).groups()
    measured = re.search(r"\((\d+) distinct settings.*?faster for (\d+), tied for (\d+), slower for (\d+)", overall)
    assert (settings, faster, tied, slower) == measured.groups()
    ours, theirs = re.search(r"median (\d+)% of the no-checkpoint peak against (\d+)%", readme).groups()
    assert (ours, theirs) == re.search(r"peak was (\d+)% of the no-checkpoint peak vs (\d+)%", overall).groups()


def test_the_compiled_least_peaks_and_timings_are_compile_compare_md_s() -> None:
    """The compile table's least peaks (one decimal, "redrawn" where the knob's least re-draws
    dropout masks), and the head-to-head timing counts and range in fp32 and bf16."""
    rows = _table((RESULTS / "compile_compare.md").read_text(), "| model | method |")
    readme = (ROOT / "README.md").read_text()
    quoted = {row[0]: row[1:] for row in _table(readme, "| model | gpt |")}
    header = next(line for line in readme.splitlines() if line.startswith("| model | gpt |"))
    models = [cell.strip() for cell in header.strip().strip("|").split("|")][1:]
    for column, model in enumerate(models):
        knob = min((row for row in rows if row[0] == model and row[1].startswith("activation_memory_budget")),
                   key=lambda row: float(row[2]))
        least = next(row for row in rows if row[0] == model and row[1] == "ckptplan at its least")
        redrawn = " (redrawn)" if knob[8].startswith("no") else ""
        assert quoted["knob's least"][column] == f"{float(knob[2]):.1f}{redrawn}", model
        assert quoted["ckptplan's least"][column] == f"{float(least[2]):.1f}", model

    ratios = {}
    for dtype, name in (("fp32", "compile_compare.md"), ("bf16", "compile_compare_bfloat16.md")):
        table = _table((RESULTS / name).read_text(), "| model | method |")
        ratios[dtype] = [float(row[7]) for row in table if row[1].startswith("ckptplan at knob")]
    fp32_within, fp32_rows, bf16_within, bf16_rows, low, high = re.search(
        r"within 3% of the knob's or faster in (\d+) of (\d+) rows in fp32 and (\d+) of (\d+) in bf16 "
        r"\(CPU; ([\d.]+)–([\d.]+) of the knob's time\)", _readme()).groups()
    for dtype, within, count in (("fp32", fp32_within, fp32_rows), ("bf16", bf16_within, bf16_rows)):
        assert (int(within), int(count)) == (sum(r <= 1.03 for r in ratios[dtype]), len(ratios[dtype])), dtype
    every = ratios["fp32"] + ratios["bf16"]
    assert (low, high) == (f"{min(every):.2f}", f"{max(every):.2f}")


def test_the_allocator_agreement_is_allocator_md_s() -> None:
    """"within 0.01% ... on N of its M models, and at most X% over it on the others"."""
    errors: dict[str, float] = {}  # each model's error furthest from zero, signed
    for row in _table((RESULTS / "allocator.md").read_text(), "| model | step |"):
        error = float(re.search(r"\(([-+][\d.]+)%\)", row[3]).group(1))
        errors[row[0]] = max(errors.get(row[0], 0.0), error, key=abs)
    close, models, worst = re.search(
        r"within 0\.01% with and without a plan on (\w+) of its (\w+) models.*?at most ([\d.]+)% over it", _readme()
    ).groups()
    assert WORDS[models] == len(errors)
    assert WORDS[close] == sum(abs(error) <= 0.01 for error in errors.values())
    assert float(worst) == max(errors.values(), key=abs) > 0  # over the allocator's count
