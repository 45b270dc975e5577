"""Byte quantities: parsing budgets and printing sizes.

Decimal units follow SI (``"80GB"`` = 80·10⁹ bytes) and binary units IEC (``"80GiB"`` = 80·2³⁰),
as ``nvidia-smi`` and PyTorch's memory APIs report GiB and vendors sell GB.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from ckptplan.errors import BudgetError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_budget(budget: str | float, baseline_peak_bytes: int) -> int:
    """Turn a budget into bytes.

    ``"80GB"``, ``"80GiB"``, ``"512MiB"``: sizes. A plain number is bytes, except a number in
    (0, 1] written with a decimal point or exponent (``0.6``, ``"0.6"``, ``"6e-1"``) or a
    percentage (``"60%"``), which is that fraction of ``baseline_peak_bytes``, the peak of the
    step without checkpointing. Decimal text is read exactly, and fractions round down, so the
    budget is never looser than asked.
    """
    if isinstance(budget, bool) or not isinstance(budget, (str, int, float)):
        raise BudgetError(f"Budget {budget!r} is not a size; write bytes, '80GB', '80GiB' or a fraction like 0.6.")
    if isinstance(budget, int):
        return _positive(budget, budget)
    if isinstance(budget, float):
        if not math.isfinite(budget):
            raise BudgetError(f"Budget {budget!r} is not a finite number.")
        return _plain_number(Decimal(repr(budget)), baseline_peak_bytes, budget, fractional=True)
    text = budget.strip()
    percent = _PERCENT_RE.match(text)
    if percent:
        return _fraction(Decimal(percent.group(1)) / 100, baseline_peak_bytes, budget)
    match = _SIZE_RE.match(text)
    if not match:
        raise BudgetError(
            f"Budget {budget!r} is not a size; write bytes, '80GB', '80GiB', '60%' or a fraction like 0.6."
        )
    number, unit = Decimal(match.group(1)), match.group(2).upper()
    if unit not in _UNITS:
        raise BudgetError(
            f"Budget {budget!r} has unknown unit {match.group(2)!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB."
        )
    if unit == "":
        fractional = "." in match.group(1) or "e" in match.group(1).lower()
        return _plain_number(number, baseline_peak_bytes, budget, fractional=fractional)
    return _positive(math.floor(number * _UNITS[unit]), budget)


def _plain_number(number: Decimal, baseline_peak_bytes: int, original: object, *, fractional: bool) -> int:
    """A unitless number: a fraction of the baseline if written as one and at most 1, else bytes."""
    if fractional and number <= 1:
        return _fraction(number, baseline_peak_bytes, original)
    if number != number.to_integral_value():
        raise BudgetError(
            f"Budget {original!r} is neither whole bytes nor a fraction in (0, 1]; write e.g. 0.6, '60%' or '8GB'."
        )
    return _positive(int(number), original)


def check_budget(budget: str | float) -> None:
    """Raise ``BudgetError`` if ``budget`` cannot be read, without needing the baseline peak
    (so a command can reject a typo before profiling)."""
    parse_budget(budget, baseline_peak_bytes=2**62)  # any fraction of a large baseline is positive


def _positive(n_bytes: int, original: object) -> int:
    if n_bytes <= 0:
        raise BudgetError(f"Budget {original!r} must be positive.")
    return int(n_bytes)


def _fraction(fraction: Decimal, baseline_peak_bytes: int, original: object) -> int:
    if not 0 < fraction <= 1:
        raise BudgetError(
            f"Budget {original!r} reads as a fraction of the no-checkpoint peak but is not in (0, 1]; "
            "write a size such as '8GB' for an absolute budget."
        )
    return _positive(math.floor(fraction * baseline_peak_bytes), original)


def format_bytes(n_bytes: float) -> str:
    """``123456789`` -> ``'117.7 MiB'`` (binary units, as PyTorch's memory summaries use)."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024.0 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def format_flops(flops: float) -> str:
    """``3.2e12`` -> ``'3.20 TFLOP'``."""
    value = float(flops)
    for unit in ("FLOP", "KFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"):
        if abs(value) < 1000.0 or unit == "PFLOP":
            return f"{value:.0f} {unit}" if unit == "FLOP" else f"{value:.2f} {unit}"
        value /= 1000.0
    raise AssertionError("unreachable")


def describe_bytes(n_bytes: int) -> str:
    """``'1.2 MiB (1,258,291 bytes)'``: readable, and exact where rounding would hide a difference."""
    return f"{format_bytes(n_bytes)} ({int(n_bytes):,} bytes)"
