"""The profiler against Korthikanti et al. (2022), §4.1 eq. 1: one GPT layer saves
s·b·h·(34 + 5·a·s/h) bytes for backward (16-bit activations, 1-byte dropout masks).

A small shape of ``examples/korthikanti_gpt.py`` on the meta device, profiled for CUDA's kernels
(its ``TRAINING`` target) and, to show what that changes, for CPU's, measured by the functions
``benchmarks/korthikanti.py`` prints its table with."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "korthikanti.py"


def _load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ckptplan_benchmark_korthikanti", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


korthikanti = _load_benchmark()
SMALL = korthikanti.Shape(layers=2, hidden=256, heads=8, seq=128, batch=2, vocab=512)


@pytest.fixture(scope="module")
def measured():
    return korthikanti.measure(SMALL)


def test_the_example_is_planned_for_cuda(measured) -> None:
    assert korthikanti.example_target() == "cuda" and measured.target == "cuda"


def test_paper_formula_in_integers_is_eq_1() -> None:
    gpt3 = korthikanti.Shape(layers=96, hidden=12288, heads=96, seq=2048, batch=1)
    s, b, h, a = gpt3.seq, gpt3.batch, gpt3.hidden, gpt3.heads
    assert korthikanti.paper_layer_bytes(gpt3) == round(s * b * h * (34 + 5 * a * s / h)) == 2_868_903_936
    assert korthikanti.paper_layer_bytes(SMALL) == 128 * 2 * 256 * 54


def test_layers_are_equal_and_account_for_the_step(measured) -> None:
    assert len(set(measured.layer_bytes)) == 1
    # module-path attribution agrees with adding one layer to the model
    assert measured.difference_bytes == measured.per_layer_bytes
    assert sum(measured.layer_bytes) + measured.outside_bytes == measured.activation_bytes


def test_each_paper_term_is_saved_as_counted(measured) -> None:
    layer_norm_stats = 2 * 4 * SMALL.seq * SMALL.batch  # fp32 mean and rstd, which the paper omits
    rows = {row.label: row for row in measured.terms}
    assert len(rows) == len(korthikanti.PAPER_TERMS), "the layer saves a tensor the paper does not count"
    for row in rows.values():
        if row.op == "layer_norm":
            assert row.profiled_bytes == row.paper_bytes + layer_norm_stats, row.label
        else:  # dropout included: CUDA's native_dropout keeps a bool mask, 1 B/element
            assert row.profiled_bytes == row.paper_bytes, row.label


def test_with_one_sequence_q_k_v_are_saved_once_in_the_qkv_output() -> None:
    one = korthikanti.Shape(layers=1, hidden=256, heads=8, seq=128, batch=1, vocab=512)
    matmuls = [row for row in korthikanti.measure(one, cross_check=False).terms if row.op == "matmul"]
    qkv_output = 6 * one.sbh  # the first matmul's bmm saves views of it, not copies
    assert matmuls[0].profiled_bytes == qkv_output
    assert sum(r.profiled_bytes for r in matmuls) == sum(r.paper_bytes for r in matmuls)


def test_layer_bytes_within_5_percent_of_the_paper(measured) -> None:
    assert measured.dropout_excess_bytes == 0
    assert abs(measured.error(measured.per_layer_bytes)) <= 0.05


def test_for_cpu_kernels_every_dropout_keeps_bf16_noise() -> None:
    """The unfused CPU path keeps 2 B/element: as²b + 2sbh more per layer than CUDA's masks, and
    nothing else changes."""
    cpu = korthikanti.measure(SMALL, target="cpu", cross_check=False)
    assert cpu.target == "cpu"
    assert cpu.dropout_excess_bytes == SMALL.as2b + 2 * SMALL.sbh
    assert abs(cpu.error(cpu.per_layer_bytes - cpu.dropout_excess_bytes)) <= 0.01
    assert cpu.error(cpu.per_layer_bytes) > 0.05


def test_benchmark_table_names_its_command_and_numbers(measured) -> None:
    text = korthikanti.render(measured, "python benchmarks/korthikanti.py --layers 2")
    assert text.startswith("`python benchmarks/korthikanti.py --layers 2`")
    assert f"| per layer (bytes) | {measured.per_layer_bytes:,} | {korthikanti.paper_layer_bytes(SMALL):,} |" in text
