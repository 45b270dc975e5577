"""Budget parsing and size printing (``ckptplan.units``)."""

from __future__ import annotations

import re

import pytest

from ckptplan.errors import BudgetError, CkptPlanError
from ckptplan.units import describe_bytes, format_bytes, format_flops, parse_budget

BASELINE = 1_000_000  # bytes of a pretend no-checkpoint peak


@pytest.mark.parametrize(
    ("budget", "expected_bytes"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        (" 80 GiB ", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512MB", 512 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * 2**29),
        ("4KiB", 4096),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("100B", 100),
        ("123", 123),
        (123, 123),
        (80 * 10**9, 80 * 10**9),
        (1, 1),
    ],
)
def test_sizes_parse_to_bytes(budget: object, expected_bytes: int) -> None:
    assert parse_budget(budget, BASELINE) == expected_bytes


def test_sizes_ignore_the_baseline() -> None:
    assert parse_budget("512MiB", 1) == parse_budget("512MiB", 10**15) == 512 * 2**20


@pytest.mark.parametrize(
    ("budget", "baseline", "expected_bytes"),
    [
        (0.6, 1000, 600),
        (0.5, 999, 499),  # 499.5 floors: never looser than asked
        (1.0, 12345, 12345),
        ("1.0", 12345, 12345),
        ("0.25", 1000, 250),
        ("60%", 1000, 600),
        ("100%", 777, 777),
        ("50 %", 999, 499),
        ("12.5%", 800, 100),
        (0.6, 12_345_679, 7_407_407),
    ],
)
def test_fractions_of_the_baseline_round_down(budget: object, baseline: int, expected_bytes: int) -> None:
    assert parse_budget(budget, baseline) == expected_bytes


def test_fraction_and_percent_agree() -> None:
    for baseline in (1000, 4097, 10**9 + 7, 3 * 2**30):
        assert parse_budget("60%", baseline) == parse_budget(0.6, baseline) == parse_budget("0.6", baseline)


@pytest.mark.parametrize("budget", ["29%", "0.29", "57%"])
def test_decimal_fraction_text_is_exact(budget: str) -> None:
    # 29% (or 0.29) of 100 bytes is exactly 29 bytes; 57% of 100 is 57. Rounding down is documented
    # to make the budget "never looser than asked", which does not call for losing a whole byte.
    expected = {"29%": 29, "0.29": 29, "57%": 57}[budget]
    assert parse_budget(budget, 100) == expected


def _one_sentence(message: str) -> bool:
    """One line, ends with a full stop, no second sentence started inside it."""
    return "\n" not in message and message.endswith(".") and not re.search(r"[.;!?]\s+[A-Z]", message)


@pytest.mark.parametrize(
    "budget",
    [
        "",
        "   ",
        "lots",
        "-5GB",
        "0",
        "0GB",
        "0.0",
        0,
        -1,
        1.5,
        0.0,
        -0.5,
        float("nan"),
        float("inf"),
        True,
        False,
        "80XB",
        "1.5",
        "2.5e0",
        "150%",
        "0%",
        "GB",
        "1.2.3GB",
        None,
        [1],
        "0.0000000001B",
    ],
)
def test_bad_budgets_raise_budget_error_with_one_sentence(budget: object) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(budget, BASELINE)  # type: ignore[arg-type]
    assert isinstance(info.value, CkptPlanError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert _one_sentence(message), message
    assert message.startswith("Budget ")


def test_unknown_unit_names_the_unit_and_the_known_ones() -> None:
    with pytest.raises(BudgetError, match="unknown unit 'XB'") as info:
        parse_budget("80XB", BASELINE)
    assert "GiB" in str(info.value) and "GB" in str(info.value)


def test_fraction_error_says_to_write_a_size() -> None:
    with pytest.raises(BudgetError, match=r"fraction .* \(0, 1\]") as info:
        parse_budget(1.5, BASELINE)
    assert "'8GB'" in str(info.value)


def test_tiny_fraction_of_tiny_baseline_is_rejected_not_zero() -> None:
    # floor(0.1 * 5) == 0 bytes: no step fits in zero bytes, so it is an error, not a 0 budget.
    with pytest.raises(BudgetError, match="positive"):
        parse_budget(0.1, 5)


@pytest.mark.parametrize(
    ("n_bytes", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (123456789, "117.7 MiB"),
        (80 * 2**30, "80.0 GiB"),
        (80 * 10**9, "74.5 GiB"),
        (5 * 2**40, "5.0 TiB"),
        (2**50, "1024.0 TiB"),
        (-2048, "-2.0 KiB"),
        (512.4, "512 B"),
    ],
)
def test_format_bytes(n_bytes: float, text: str) -> None:
    assert format_bytes(n_bytes) == text


@pytest.mark.parametrize(
    ("flops", "text"),
    [
        (0, "0 FLOP"),
        (999, "999 FLOP"),
        (1000, "1.00 KFLOP"),
        (2.5e6, "2.50 MFLOP"),
        (3.2e12, "3.20 TFLOP"),
        (7e15, "7.00 PFLOP"),
        (1e18, "1000.00 PFLOP"),
    ],
)
def test_format_flops(flops: float, text: str) -> None:
    assert format_flops(flops) == text


def test_describe_bytes_is_readable_and_exact() -> None:
    assert describe_bytes(1_258_291) == "1.2 MiB (1,258,291 bytes)"
    assert describe_bytes(1_258_292) != describe_bytes(1_258_291)
    assert describe_bytes(0) == "0 B (0 bytes)"


@pytest.mark.parametrize(("budget", "expected"), [("8e9", 8 * 10**9), (8e9, 8 * 10**9), ("1e3", 1000), ("6e-1", 600)])
def test_scientific_notation_is_bytes_above_one_and_a_fraction_below(budget: object, expected: int) -> None:
    assert parse_budget(budget, 1000) == expected
