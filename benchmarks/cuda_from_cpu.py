"""Planning for a GPU without one: ``cuda_verify.py``'s models profiled here for ``target="cuda"``,
against what the same models predicted profiled on a GPU (``benchmarks/results/cuda_verify.json``,
the rows ``cuda_verify.py`` wrote there, whose predictions the GPU measured).

    python benchmarks/cuda_from_cpu.py [CASE ...]

For each case: the no-checkpoint peak ``simulate`` predicts from a CPU profile for CUDA's kernels,
and the GPU run's prediction at budget 1 (its plans there are empty: the no-checkpoint peak).
Prints a Markdown table and writes it to ``benchmarks/results/cuda_from_cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import platform

import cuda_verify  # this folder's GPU script: the same cases
import results_file  # benchmarks/results_file.py, beside this script
import torch

import ckptplan
from ckptplan.units import format_bytes

GPU_ROWS = results_file.path("cuda_verify", ".json")


def gpu_predictions() -> dict[str, str]:
    """case -> predicted peak of the GPU run's budget-1 row, as its table shows it."""
    rows = json.loads(GPU_ROWS.read_text())["rows"]
    return {row["case"]: row["predicted_peak"] for row in rows if row["budget"] == 1 and "predicted_peak" in row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*")
    options = parser.parse_args()
    gpu = gpu_predictions()
    table = cuda_verify.cases()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, profiled on CPU for target cuda\n")
    print("| case | autocast | predicted here | predicted on the H200 |")
    print("|---|---|---|---|")
    for name in options.cases or list(table):
        build, autocast = table[name]
        torch.manual_seed(0)
        work = build()
        dtype = getattr(torch, autocast) if autocast else None
        graph = ckptplan.profile(work.model, tuple(work.args), dict(work.kwargs), target="cuda", autocast=dtype, outputs_live=False)
        peak = ckptplan.simulate(graph, ()).peak_bytes
        print(f"| {name} | {autocast or '-'} | {format_bytes(peak)} | {gpu.get(name, '?')} |", flush=True)


TITLE = "Planning for a GPU on a CPU: attention and dropout as CUDA runs them"
ABOUT = (
    "The models of `cuda_verify.py`, profiled on this CPU with `target=\"cuda\"`, against what the same models "
    "predicted when profiled on the GPU (`benchmarks/results/cuda_verify.json`, whose steps that GPU measured), at "
    "budget 1 (no regions). The profile records dropout and scaled-dot-product attention as CUDA's kernels run "
    "(`profiler/cuda_attention.py`: flash, memory-efficient or math attention, chosen by PyTorch's rules for an "
    "sm80+ GPU); every other op runs as on CPU. Mixed precision differs: CUDA's autocast runs `pow`, `softmax`, "
    "`layer_norm` and more in float32, CPU's does not."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
