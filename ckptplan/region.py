"""Regions: the working type every solver, the simulator and the emitter share, and its rules.

A ``Region`` is plain frozen data, below the graph's users and the plan-file schema
(``ckptplan.plan`` validates the regions of a file with the same rules). The rules are written
once: ``_shape_problem`` for one region and its direct children, ``validate_regions`` for a
sequence of them against a graph's nodes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from ckptplan.errors import PlanFormatError


@dataclass(frozen=True)
class Region:
    """Nodes with execution index in ``[start, end)`` run inside one non-reentrant checkpoint.

    In backward the region is recomputed from its inputs, except nodes named in ``keep``, whose
    outputs are stored in forward (selective checkpointing). ``children`` are nested regions
    inside it; regions at one level are disjoint and ordered. Construction raises ``ValueError``
    for a region that breaks these rules on its own.
    """

    start: int
    end: int
    keep: tuple[str, ...] = ()
    children: tuple[Region, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", tuple(self.keep))
        object.__setattr__(self, "children", tuple(self.children))
        problem = _shape_problem(self)
        if problem is not None:
            raise ValueError(problem)

    def walk(self) -> list[Region]:
        """This region and all its descendants, outermost first."""
        found = [self]
        for child in self.children:
            found.extend(child.walk())
        return found


def _span(region: Region) -> str:
    return f"[{region.start}, {region.end})"


def _shape_problem(region: Region) -> str | None:
    """What is wrong with ``region`` and its direct children on their own, or None."""
    if not (isinstance(region.start, int) and isinstance(region.end, int)) or not 0 <= region.start < region.end:
        return f"Region {_span(region)} is empty or starts before node 0"
    if len(set(region.keep)) != len(region.keep):
        return f"Region {_span(region)} names a kept node twice"
    previous_end = region.start
    for child in region.children:
        if child.start < previous_end or child.end > region.end:
            return f"Region {_span(child)} is not inside its parent {_span(region)} or overlaps a sibling"
        previous_end = child.end
    return None


def region_problem(
    regions: Iterable[Region], *, node_count: int | None = None, names: Collection[str] | None = None
) -> str | None:
    """The first rule ``regions`` (top level, ordered) break, or None: each region and its
    children well formed (``_shape_problem``, checked again for regions built around
    construction), siblings ordered and disjoint, none past the ``node_count`` nodes, and keep-sets
    naming only ``names`` (each left unchecked when None)."""
    previous_end = 0
    tops = list(regions)
    for region in tops:
        if region.start < previous_end:
            return f"Region {_span(region)} overlaps the region before it"
        previous_end = region.end
    stack = tops[::-1]  # popped in pre-order
    while stack:
        region = stack.pop()
        problem = _shape_problem(region)
        if problem is not None:
            return problem
        if node_count is not None and region.end > node_count:
            return f"Region {_span(region)} runs past the last node (the graph has {node_count})"
        if names is not None:
            unknown = [name for name in region.keep if name not in names]
            if unknown:
                return f"Region {_span(region)} keeps unknown node {unknown[0]!r}"
        stack.extend(reversed(region.children))
    return None


def validate_regions(
    regions: Sequence[Region], *, node_count: int | None = None, names: Collection[str] | None = None
) -> None:
    """``PlanFormatError`` naming the first rule ``regions`` break (``region_problem``)."""
    problem = region_problem(regions, node_count=node_count, names=names)
    if problem is not None:
        raise PlanFormatError(f"{problem}.")
