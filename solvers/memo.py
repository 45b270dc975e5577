"""Per-graph memory of budget-independent work, kept with the graph.

``ilp`` and ``auto`` start from ``dp``'s and ``sqrt``'s plans, and a sweep or a comparison solves
one graph at many budgets: the stage chains and cost curves ``dp`` computes, and the candidate
plans ``sqrt`` simulates, are the same every time. Equal graphs share an entry; it goes when the
graph does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ckptplan.graph import ComputeGraph

T = TypeVar("T")

_MEMO: weakref.WeakKeyDictionary[ComputeGraph, dict[str, Any]] = weakref.WeakKeyDictionary()


def graph_memo(graph: ComputeGraph, name: str, make: Callable[[], T]) -> T:
    """``graph``'s entry ``name``, made by ``make()`` the first time it is asked for."""
    entries = _MEMO.setdefault(graph, {})
    if name not in entries:
        entries[name] = make()
    return entries[name]


def forget() -> None:
    """Drop every entry (tests use it to compare against fresh solves)."""
    _MEMO.clear()
