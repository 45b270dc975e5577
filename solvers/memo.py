"""Per-graph memory of budget-independent work, kept with the graph (``ComputeGraph.memo``).

``ilp`` and ``auto`` start from ``dp``'s and ``sqrt``'s plans, and a sweep or a comparison solves
one graph at many budgets: the stage chains and cost curves ``dp`` computes, and the candidate
plans ``sqrt`` simulates, are the same every time. The entries go when the graph does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ckptplan.graph import ComputeGraph

T = TypeVar("T")


def graph_memo(graph: ComputeGraph, name: str, make: Callable[[], T]) -> T:
    """``graph``'s entry ``name``, made by ``make()`` the first time it is asked for."""
    entries = graph.memo
    if name not in entries:
        entries[name] = make()
    return entries[name]
