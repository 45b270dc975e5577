"""Plan spaces the solvers are checked against: every one-level plan of a small graph (the
exhaustive reference) and random one-level plans with keep-sets."""

from __future__ import annotations

import itertools
import random

from ckptplan import Region
from ckptplan.graph import ComputeGraph
from ckptplan.solvers.ilp_model import keepable


def one_level_plans(graph: ComputeGraph, max_keeps: int | None = None):
    """Every set of disjoint regions over the graph, each with every keep-set of at most
    ``max_keeps`` nodes (all of them when None): the exhaustive reference space."""
    n = len(graph.nodes)

    def regions_from(lo: int):
        if lo >= n:
            yield ()
            return
        yield from regions_from(lo + 1)
        for end in range(lo + 1, n + 1):
            if lo in graph.boundaries and end in graph.boundaries:
                for rest in regions_from(end):
                    yield ((lo, end), *rest)

    for spans in regions_from(0):
        choices = []
        for lo, end in spans:
            names = [graph.nodes[j].name for j in range(lo, end) if keepable(graph, j)]
            limit = len(names) if max_keeps is None else min(max_keeps, len(names))
            keeps = [combo for size in range(limit + 1) for combo in itertools.combinations(names, size)]
            choices.append([Region(lo, end, keep=keep) for keep in keeps])
        yield from itertools.product(*choices)


def random_plan(graph: ComputeGraph, rng: random.Random) -> tuple[Region, ...]:
    n, regions, t = len(graph.nodes), [], 0
    while t < n:
        ends = [e for e in sorted(graph.boundaries) if e > t][:4]
        if t in graph.boundaries and ends and rng.random() < 0.4:
            end = rng.choice(ends)
            keep = tuple(graph.nodes[j].name for j in range(t, end) if keepable(graph, j) and rng.random() < 0.3)
            regions.append(Region(t, end, keep=keep))
            t = end
        else:
            t += 1
    return tuple(regions)



def nested_region_sets(graph: ComputeGraph) -> list[tuple[Region, ...]]:
    """Every forest of regions without keep-sets, edges at ``graph.boundaries``, each region's
    children a forest strictly inside it (none spanning it whole): ``dp``'s plan space."""
    points = sorted(graph.boundaries)
    memo: dict[tuple[int, int], list[tuple[Region, ...]]] = {}

    def inside(lo: int, hi: int) -> list[tuple[Region, ...]]:
        """The forests over points ``lo..hi`` (indices into ``points``) with no region spanning
        the whole of ``[points[lo], points[hi])``."""
        if (lo, hi) not in memo:
            found: list[tuple[Region, ...]] = []

            def extend(i: int, acc: tuple[Region, ...]) -> None:
                if i >= hi:
                    found.append(acc)
                    return
                extend(i + 1, acc)  # no region starts at points[i]
                for j in range(i + 1, hi + 1):
                    if (i, j) != (lo, hi):
                        for children in inside(i, j):
                            extend(j, (*acc, Region(points[i], points[j], children=children)))

            extend(lo, ())
            memo[lo, hi] = found
        return memo[lo, hi]

    last = len(points) - 1
    whole = [(Region(points[0], points[last], children=c),) for c in inside(0, last)] if last > 0 else []
    return [*inside(0, last), *whole]
