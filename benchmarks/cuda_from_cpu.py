"""Planning for a GPU without one: ``cuda_verify.py``'s models profiled here for ``target="cuda"``,
against what the same models predicted profiled on the H200 (RESULTS.md's H200 table, whose
predictions the H200 measured).

    python benchmarks/cuda_from_cpu.py [CASE ...]

For each case: the no-checkpoint peak ``simulate`` predicts from a CPU profile for CUDA's kernels,
and the H200 table's prediction at budget 1 (its plans there are empty: the no-checkpoint peak).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import re
from pathlib import Path

import cuda_verify  # this folder's GPU script: the same cases
import torch

import ckptplan
from ckptplan.units import format_bytes

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def h200_predictions() -> dict[str, str]:
    """case -> predicted peak of the H200 table's budget-1 row."""
    text = RESULTS.read_text()
    table = text[text.index("## Predicted vs measured peak on an H200"):]
    return {m[1]: m[2] for m in re.finditer(r"^\| ([\w-]+) \| 1 \| \w+ \| ([\d.]+ [KMG]iB) \|", table, re.MULTILINE)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*")
    options = parser.parse_args()
    gpu = h200_predictions()
    table = cuda_verify.cases()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, profiled on CPU for target cuda\n")
    print("| case | autocast | predicted here | predicted on the H200 |")
    print("|---|---|---|---|")
    for name in options.cases or list(table):
        build, autocast = table[name]
        torch.manual_seed(0)
        work = build()
        dtype = getattr(torch, autocast) if autocast else None
        graph = ckptplan.profile(work.model, tuple(work.args), dict(work.kwargs), target="cuda", autocast=dtype)
        peak = ckptplan.simulate(graph, ()).peak_bytes
        print(f"| {name} | {autocast or '-'} | {format_bytes(peak)} | {gpu.get(name, '?')} |", flush=True)


if __name__ == "__main__":
    main()
