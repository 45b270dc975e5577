"""The dataflow computations that look like graph algorithms, timed by hand and through networkx on
a 5,000-node synthetic DAG (``docs/design.md``, "Where networkx is used and where not").

    python benchmarks/networkx_fit.py

The DAG (``tests.synthetic.dag_graph``): node i reads node i-1, in three cases of ten also one of
the eight before it, and every 50th node in the second half the mirror node of the first half (a
U-Net's skips). Each row: the code as ckptplan runs it, then the same result through networkx
(asserted equal), best of five runs, in milliseconds; "DiGraph" is building ``to_networkx()``,
which every networkx row needs once per graph on top of its own time.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import networkx as nx
import results_file  # benchmarks/results_file.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptplan import Region
from ckptplan.remat import closure
from ckptplan.simulation import build_region_tree
from ckptplan.solvers.chain import stage_starts
from tests.synthetic import dag_graph

NODES = 5_000


def synthetic(n: int, seed: int = 0):
    rng = random.Random(seed)
    reads: list[list[int]] = [[]]
    for i in range(1, n):
        r = [i - 1]
        if i > 2 and rng.random() < 0.3:
            r.append(rng.randrange(max(0, i - 9), i - 1))
        if i > n // 2 and i % 50 == 0:
            r.append(n - 1 - i)
        reads.append(r)
    return dag_graph(reads, [rng.choice([64, 128, 256, 1024]) for _ in range(n)])


def best_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def nx_clean_cuts(graph, g: nx.DiGraph) -> list[int]:
    """``stage_starts(graph, skip_share=0)`` as edge cuts: k is clean when no edge runs from a
    node before the previous cut to one at or after k (the sink n stands for graph outputs)."""
    n = len(graph.nodes)
    g = g.copy()
    g.add_edges_from((j, n) for j in graph.outputs)
    cuts: list[int] = []
    for k in range(1, n):
        previous = cuts[-1] if cuts else 0
        if next(iter(nx.edge_boundary(g, range(previous), range(k, n + 1))), None) is None:
            cuts.append(k)
    return [0, *cuts]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    lines: list[str] = []

    def out(line: str) -> None:  # a row to the screen and to the results file
        print(line, flush=True)
        lines.append(line)

    graph = synthetic(NODES)
    n = len(graph.nodes)
    out(f"networkx {nx.__version__}, Python {platform.python_version()}, {platform.machine()}, {n} nodes")
    out("")
    out("| computation | ckptplan ms | networkx ms |")
    out("|---|---|---|")
    out(f"| DiGraph (`to_networkx`) | — | {best_ms(graph.to_networkx):.1f} |")
    g = graph.to_networkx()

    # Stage cuts: the structural case (skip_share 0), the byte-weighted sweep against edge cuts.
    assert stage_starts(graph, max_stages=n, skip_share=0) == nx_clean_cuts(graph, g)
    hand = best_ms(lambda: stage_starts(graph, max_stages=n, skip_share=0))
    out(f"| clean stage cuts, skip_share 0 | {hand:.1f} | {best_ms(lambda: nx_clean_cuts(graph, g), 1):.1f} |")

    # Region inputs: the storages a region reads from before it (32 regions tiling the graph).
    width = n // 32
    regions = [Region(k, min(n, k + width)) for k in range(0, n, width)]

    def nx_inputs() -> list[tuple[int, ...]]:
        return [tuple(sorted({s for u, _ in g.in_edges(range(r.start, r.end)) if u < r.start
                              for s in graph.nodes[u].outputs})) for r in regions]

    assert [t.input_storages for t in build_region_tree(graph, regions)] == nx_inputs()
    out(f"| region input storages, 32 regions | {best_ms(lambda: build_region_tree(graph, regions)):.1f} "
          f"| {best_ms(nx_inputs):.1f} |")

    # Recompute closures: what a rematerialised node's recompute runs. Chosen: every node none of
    # whose inputs is, so that chains are at most two deep, as in every plan (``remat.deep_chains``).
    picked: set[int] = set()
    for node in graph.nodes:
        if not picked.intersection(node.inputs):
            picked.add(node.index)
    chosen = frozenset(picked)
    reverse = g.reverse(copy=False)

    def nx_closure(x: int) -> tuple[int, ...]:
        view = nx.subgraph_view(reverse, filter_node=lambda v: v == x or v in chosen)
        return tuple(nx.dfs_postorder_nodes(view, x, depth_limit=n))  # n: not len(view), a count

    def hand_all() -> list[tuple[int, ...]]:
        return [closure(graph, x, chosen) for x in range(n)]

    assert hand_all() == [nx_closure(x) for x in range(n)]
    out(f"| recompute closures, every node | {best_ms(hand_all):.1f} "
          f"| {best_ms(lambda: [nx_closure(x) for x in range(n)]):.1f} |")
    results_file.write(__file__, "networkx against the hand-written sweeps", lines,
                       about="Best of five runs, equal results asserted.")


if __name__ == "__main__":
    main()
