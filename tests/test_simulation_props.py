"""Properties of the simulator (``ckptplan.simulation``) on synthetic graphs, and a brute-force
oracle for the sqrt solver on short chains.

Two slow, obvious references live here beside the simulator:

* ``reference_chain_baseline``: the memory timeline of an un-checkpointed chain, written as
  closed-form sums over what each node saves;
* ``reference_schedule``: the order in which ops run (forward, recompute, backward) under any
  region tree, from the rules in the simulator's docstring: a region is recomputed when
  backward first reaches one of its ops that saved something (outermost region first), and
  its recompute stops after the last op directly in it that saves, or as its last child begins.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from itertools import product

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptplan.build import make_plan
from ckptplan.errors import InfeasibleBudgetError, PlanFormatError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Region
from ckptplan.simulation import Report, baseline_peak_bytes, build_region_tree, simulate
from ckptplan.solvers import solve
from ckptplan.solvers.sqrt import solve_sqrt
from tests.synthetic import chain_graph, check_consistent, dag_graph, skip_graph

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- strategies
@st.composite
def chain_specs(draw, min_nodes: int = 1, max_nodes: int = 12) -> dict:
    """Keyword arguments of ``chain_graph``."""
    n = draw(st.integers(min_nodes, max_nodes))
    return {
        "act_bytes": draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n)),
        "param_bytes": draw(st.integers(0, 300)),
        "input_bytes": draw(st.integers(1, 300)),
        "saves_output": draw(st.booleans()),
    }


def chains(min_nodes: int = 1, max_nodes: int = 12) -> st.SearchStrategy[ComputeGraph]:
    return chain_specs(min_nodes, max_nodes).map(lambda spec: chain_graph(**spec))


graphs = st.one_of(chains(), st.just(skip_graph()))


@st.composite
def dags(draw, max_nodes: int = 14) -> ComputeGraph:
    """A ``dag_graph``: each node reads one to three earlier nodes (none for node 0), some of the
    others are returned as well as the last."""
    n = draw(st.integers(1, max_nodes))
    reads = [draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=3)) if i else [] for i in range(n)]
    act_bytes = draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(0, n - 1), max_size=2))
    return dag_graph(reads, act_bytes, outputs=outputs)


@st.composite
def region_sets(draw, graph: ComputeGraph, lo: int, hi: int, depth: int, with_keep: bool) -> tuple[Region, ...]:
    """Disjoint ordered regions inside ``[lo, hi)``; each may hold children down to ``depth`` more
    levels and keep any of the nodes directly in it (except random ones, which cannot be kept)."""
    regions: list[Region] = []
    i = lo
    while i < hi:
        if draw(st.booleans()):
            i += 1  # node i runs outside any region at this level
            continue
        start, end = i, i + draw(st.integers(1, hi - i))
        children: tuple[Region, ...] = ()
        if depth > 0 and draw(st.booleans()):
            children = draw(region_sets(graph, start, end, depth - 1, with_keep))
        direct = [
            j
            for j in range(start, end)
            if not any(c.start <= j < c.end for c in children) and not graph.nodes[j].random
        ]
        keep: list[int] = []
        if with_keep and direct:
            keep = sorted(draw(st.lists(st.sampled_from(direct), unique=True, max_size=len(direct))))
        regions.append(Region(start, end, keep=tuple(graph.nodes[j].name for j in keep), children=children))
        i = end
    return tuple(regions)


@st.composite
def planned(draw, graph_strategy=graphs, max_depth: int = 2, with_keep: bool = True):
    graph = draw(graph_strategy)
    depth = draw(st.integers(0, max_depth))
    return graph, draw(region_sets(graph, 0, len(graph), depth, with_keep))


# ----------------------------------------------------------------------------- references
def _walk(regions: tuple[Region, ...]) -> list[tuple[Region, Region | None]]:
    """(region, parent) pairs, outermost first."""
    found: list[tuple[Region, Region | None]] = []
    stack: list[tuple[Region, Region | None]] = [(r, None) for r in reversed(regions)]
    while stack:
        region, parent = stack.pop()
        found.append((region, parent))
        stack.extend((c, region) for c in reversed(region.children))
    return found


def _gradient_nodes(graph: ComputeGraph) -> set[int]:
    """Nodes whose backward runs: reached from the loss through ``grad_inputs``."""
    reached = set(graph.loss_nodes)
    for i in reversed(range(len(graph))):
        if i in reached and graph.nodes[i].requires_grad:
            reached.update(graph.nodes[i].grad_inputs)
    return {i for i in reached if graph.nodes[i].requires_grad}


def reference_schedule(graph: ComputeGraph, regions: tuple[Region, ...]) -> tuple[list[tuple[str, int]], list[int]]:
    """``(events, recomputed)``: the (phase, node) of every timeline event and the nodes re-executed,
    in order. Regions are identified by position in ``_walk`` (equal regions may repeat)."""
    walked = _walk(regions)
    n = len(graph)
    chain: list[list[int]] = [[] for _ in range(n)]  # region ids containing node i, outermost first
    for rid, (region, _) in enumerate(walked):
        for i in range(region.start, region.end):
            chain[i].append(rid)
    owner = {i: ids[-1] for i, ids in enumerate(chain) if ids}

    def stop(rid: int) -> int:
        region = walked[rid][0]
        last = region.start - 1
        i = region.start
        children = {c.start: c for c in region.children}
        while i < region.end:
            if i in children:
                last, i = i - 1, children[i].end
                continue
            if graph.nodes[i].saved:
                last = i
            i += 1
        return last

    events = [("forward", i) for i in range(n)]
    recomputed: list[int] = []
    done: set[int] = set()
    for i in sorted(_gradient_nodes(graph), reverse=True):
        if graph.nodes[i].saved:
            for rid in chain[i]:
                if rid in done:
                    continue
                done.add(rid)
                region = walked[rid][0]
                kept = {graph.index_of[name] for name in region.keep}
                for j in range(region.start, stop(rid) + 1):
                    events.append(("recompute", j))
                    if not (owner[j] == rid and j in kept):
                        recomputed.append(j)
        events.append(("backward", i))
    return events, recomputed


def reference_chain_baseline(graph: ComputeGraph) -> list[int]:
    """Live bytes at each event of an un-checkpointed ``chain_graph`` step (forward 0..n-1, then
    backward n-1..0). ``a[j]`` is node j's output; it lives in forward while node j+1 reads it or
    while any node saves it, and in backward until the last node saving it has run."""
    n = len(graph)
    resident = graph.static.resident_bytes
    a = [graph.storages[node.outputs[0]].nbytes for node in graph.nodes]
    out = [node.outputs[0] for node in graph.nodes]
    first_saver = [min((k for k in range(n) if out[j] in graph.nodes[k].saved), default=None) for j in range(n)]
    param_bytes = [sum(graph.storages[p].nbytes for p in node.param_grads) for node in graph.nodes]
    live: list[int] = []
    for i in range(n):
        held = sum(a[j] for j in range(i) if first_saver[j] is not None or j == i - 1)
        live.append(resident + held + a[i])
    for i in reversed(range(n)):
        saved = sum(a[j] for j in range(n) if first_saver[j] is not None and first_saver[j] <= i)
        grads = sum(param_bytes[i:]) + (a[i] if i < n - 1 else 0) + (a[i - 1] if i > 0 else 0)
        live.append(resident + saved + grads)
    return live


def one_level_region_sets(n: int) -> list[tuple[Region, ...]]:
    """Every set of disjoint, ordered, non-empty intervals of ``[0, n)`` (233 for n = 6)."""
    if n == 0:
        return [()]
    found: list[tuple[Region, ...]] = []

    def extend(i: int, acc: tuple[Region, ...]) -> None:
        if i == n:
            found.append(acc)
            return
        extend(i + 1, acc)
        for end in range(i + 1, n + 1):
            extend(end, (*acc, Region(i, end)))

    extend(0, ())
    return found


# ----------------------------------------------------------------------------- anchors
@settings(max_examples=60, deadline=None)
@given(graph=dags(), data=st.data())
def test_region_inputs_are_the_edges_into_the_region_from_before_it(graph: ComputeGraph, data) -> None:
    """``build_region_tree``'s sweep against networkx: a region's input storages are the outputs of
    the tails of the dataflow edges that enter it from earlier nodes."""
    import networkx as nx

    n = len(graph)
    start = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(start + 1, n))
    (info,) = build_region_tree(graph, (Region(start, end),))
    g = graph.to_networkx()
    entering = nx.edge_boundary(g, range(start), range(start, end))
    assert info.input_storages == tuple(sorted({s for u, _ in entering for s in graph.nodes[u].outputs}))


def test_synthetic_graphs_are_consistent() -> None:
    for graph in (chain_graph([5]), chain_graph([100, 200, 300], saves_output=True), skip_graph()):
        check_consistent(graph)
    assert [len(one_level_region_sets(n)) for n in range(7)] == [1, 2, 5, 13, 34, 89, 233]


def test_hand_computed_chain_baseline() -> None:
    # linear_0 relu_1 linear_2 relu_3 linear_4 relu_5; weights 3 x 64, input 32: resident 224.
    graph = chain_graph([100, 100, 200, 200, 100, 100])
    report = simulate(graph, [])
    assert graph.static.resident_bytes == 224
    assert [(e.phase, e.node, e.live_bytes) for e in report.timeline] == [
        ("forward", 0, 324),  # + a0
        ("forward", 1, 424),  # + a1; a0 dies after (relu saves its output, not its input)
        ("forward", 2, 524),  # + a2
        ("forward", 3, 724),  # + a3; a2 dies after
        ("forward", 4, 624),  # + a4
        ("forward", 5, 724),  # + a5; a4 dies after
        ("backward", 5, 724),  # a5 saved, + grad a4 (100)
        ("backward", 4, 888),  # a5 freed, + grad a3 (200) + weight grad (64)
        ("backward", 3, 988),  # grad a4 freed, + grad a2 (200)
        ("backward", 2, 752),  # a3 and grad a3 freed, + grad a1 (100) + weight grad
        ("backward", 1, 652),  # grad a2 freed, + grad a0 (100)
        ("backward", 0, 516),  # a1 and grad a1 freed, + weight grad
    ]
    assert report.peak_bytes == baseline_peak_bytes(graph) == 988
    assert report.peak_event.node == 3 and report.peak_event.phase == "backward"


def test_hand_computed_region_recompute() -> None:
    graph = chain_graph([100, 100, 200, 200, 100, 100])
    report = simulate(graph, [Region(2, 4)])
    assert report.recomputed == (2, 3)
    assert report.recompute_flops == 2 * 200 + 200
    assert [(e.phase, e.node, e.live_bytes) for e in report.timeline] == [
        # Forward as without the region: a1 is its input (saved by relu_1 anyway), a2 is saved by
        # nobody, a3 is saved by linear_4 outside the region.
        ("forward", 0, 324),
        ("forward", 1, 424),
        ("forward", 2, 524),
        ("forward", 3, 724),
        ("forward", 4, 624),
        ("forward", 5, 724),
        ("backward", 5, 724),
        ("backward", 4, 888),  # then a3 dies: relu_3 ran in the region and did not save it
        ("recompute", 2, 788),  # 588 + a2' (200)
        ("recompute", 3, 988),  # + a3' (200), the last tensor the region saves: early stop
        ("backward", 3, 988),  # a2' freed, + grad a2 (200)
        ("backward", 2, 752),
        ("backward", 1, 652),
        ("backward", 0, 516),
    ]
    assert report.peak_bytes == 988


def test_hand_computed_early_stop_before_an_unsaved_output() -> None:
    # Region [0, 3) ends at linear_2, which saves only its input a1: the recompute stops before
    # linear_2 computes (early stop), so a2 is never allocated again.
    graph = chain_graph([100, 100, 200, 200, 100, 100])
    report = simulate(graph, [Region(0, 3)])
    assert [(e.phase, e.node, e.live_bytes) for e in report.timeline] == [
        ("forward", 0, 324),
        ("forward", 1, 424),  # a0 dies after
        ("forward", 2, 524),  # a1 dies after: its readers ran in the region
        ("forward", 3, 624),  # a2 dies after
        ("forward", 4, 524),
        ("forward", 5, 624),
        ("backward", 5, 624),
        ("backward", 4, 788),
        ("backward", 3, 888),  # then a3 and grad a3 are freed: 488
        ("recompute", 0, 588),
        ("recompute", 1, 688),  # a0' dies after
        ("recompute", 2, 588),  # nothing allocated: the early stop fires at linear_2's save
        ("backward", 2, 752),
        ("backward", 1, 652),
        ("backward", 0, 516),
    ]
    assert report.recomputed == (0, 1, 2) and report.peak_bytes == 888 < baseline_peak_bytes(graph)


def test_hand_computed_region_starting_after_an_unsaved_value() -> None:
    # Region [1, 4) starts at relu_1, whose input a0 nobody saves: the region holds it as its
    # input until its backward is done. Recomputing it in backward raises the peak past the
    # baseline (988): a1', a2' and a3' come back while gradients are live.
    graph = chain_graph([100, 100, 200, 200, 100, 100])
    report = simulate(graph, [Region(1, 4)])
    assert [(e.phase, e.node, e.live_bytes) for e in report.timeline] == [
        ("forward", 0, 324),
        ("forward", 1, 424),  # a0 held by the region
        ("forward", 2, 624),  # a1 dies after: relu_1 and linear_2 run in the region, saving nothing
        ("forward", 3, 724),
        ("forward", 4, 624),
        ("forward", 5, 724),
        ("backward", 5, 724),
        ("backward", 4, 888),  # then a3 dies (only linear_4 saved it): 588
        ("recompute", 1, 688),
        ("recompute", 2, 888),
        ("recompute", 3, 1088),
        ("backward", 3, 1088),
        ("backward", 2, 852),
        ("backward", 1, 752),  # then a1', and a0 with the region's inputs, are freed
        ("backward", 0, 516),
    ]
    assert report.recomputed == (1, 2, 3) and report.peak_bytes == 1088 > baseline_peak_bytes(graph)


def test_hand_computed_nested_regions() -> None:
    # linear_0 relu_1 linear_2 relu_3 (100 bytes each; weights 2 x 64, input 32: resident 160),
    # one region over all four holding a child over [2, 4).
    graph = chain_graph([100] * 4)
    report = simulate(graph, [Region(0, 4, children=(Region(2, 4),))])
    assert [(e.phase, e.node, e.live_bytes) for e in report.timeline] == [
        ("forward", 0, 260),
        ("forward", 1, 360),  # a0 dies after
        ("forward", 2, 360),  # the child's input a1 is not saved (the parent's hook drops it) ...
        ("forward", 3, 460),  # ... but the caller holds it until the child returns; then all die
        ("recompute", 0, 260),  # outer region: reruns 0..1, stops as the child saves its input a1'
        ("recompute", 1, 360),
        ("recompute", 2, 360),  # child region from a1'
        ("recompute", 3, 460),
        ("backward", 3, 460),  # a2' freed, + grad a2
        ("backward", 2, 524),
        ("backward", 1, 524),
        ("backward", 0, 388),
    ]
    assert report.recomputed == (0, 1, 2, 3) and report.peak_bytes == 524


def test_hand_computed_skip_graph_baseline() -> None:
    # input 400 + five weights of 48: resident 640. enc_relu's output a1 (400) is saved by
    # itself and by down, and read again by cat; drop saves a 50-byte hidden mask.
    graph = skip_graph()
    assert graph.static.resident_bytes == 640
    report = simulate(graph, [])
    assert [(e.phase, e.node, e.live_bytes) for e in report.timeline] == [
        ("forward", 0, 1040),
        ("forward", 1, 1440),  # a0 dies after
        ("forward", 2, 1240),
        ("forward", 3, 1490),  # + a3 and the mask; a2 dies after
        ("forward", 4, 1490),
        ("forward", 5, 1890),
        ("forward", 6, 2690),  # cat (800); up's output dies after (cat saves nothing)
        ("forward", 7, 2390),
        ("forward", 8, 2394),
        ("backward", 8, 2490),
        ("backward", 7, 3238),  # + grad a6 (800) + head's weight grad
        ("backward", 6, 3138),  # cat: grads for up (400) and, through the skip, enc_relu (400)
        ("backward", 5, 2586),
        ("backward", 4, 2234),
        ("backward", 3, 2034),
        ("backward", 2, 2232),  # down accumulates into enc_relu's existing grad: a 400-byte transient
        ("backward", 1, 2032),
        ("backward", 0, 1280),
    ]
    assert report.peak_bytes == baseline_peak_bytes(graph) == 3238


# ----------------------------------------------------------------------------- properties
@FAST
@given(chains())
def test_baseline_matches_the_closed_form_reference(graph: ComputeGraph) -> None:
    report = simulate(graph, [])
    assert [e.live_bytes for e in report.timeline] == reference_chain_baseline(graph)
    assert report.peak_bytes == max(reference_chain_baseline(graph))


@FAST
@given(graphs)
def test_no_regions_is_the_baseline_and_recomputes_nothing(graph: ComputeGraph) -> None:
    report = simulate(graph, [])
    assert report == simulate(graph, ()) == simulate(graph, make_plan(graph, []))
    assert report.peak_bytes == baseline_peak_bytes(graph)
    assert report.recompute_flops == 0 and report.recompute_seconds == 0.0 and report.recomputed == ()
    assert all(e.phase != "recompute" for e in report.timeline)


@FAST
@given(planned())
def test_peak_covers_resident_state_and_is_the_timeline_maximum(case) -> None:
    graph, regions = case
    report = simulate(graph, regions)
    assert report.baseline_resident_bytes == graph.static.resident_bytes
    assert report.peak_bytes >= graph.static.resident_bytes
    assert all(e.live_bytes >= graph.static.resident_bytes for e in report.timeline)
    assert report.peak_bytes == max(e.live_bytes for e in report.timeline)
    assert report.peak_event in report.timeline and report.peak_event.live_bytes == report.peak_bytes


@FAST
@given(st.data())
def test_simulate_is_deterministic(data) -> None:
    spec = data.draw(chain_specs())
    graph, twin = chain_graph(**spec), chain_graph(**spec)  # built independently, equal
    regions = data.draw(region_sets(graph, 0, len(graph), 2, True))
    first = simulate(graph, regions)
    assert simulate(graph, regions) == first
    assert simulate(graph, list(regions)) == first
    assert simulate(graph, make_plan(graph, regions)) == first
    assert simulate(twin, regions) == first


@FAST
@given(planned())
def test_ops_run_in_the_reference_order(case) -> None:
    graph, regions = case
    report = simulate(graph, regions)
    events, recomputed = reference_schedule(graph, regions)
    assert [(e.phase, e.node) for e in report.timeline] == events
    assert list(report.recomputed) == recomputed


@FAST
@given(planned())
def test_phases_come_in_order(case) -> None:
    graph, regions = case
    timeline = simulate(graph, regions).timeline
    n = len(graph)
    assert [(e.phase, e.node) for e in timeline[:n]] == [("forward", i) for i in range(n)]
    assert all(e.phase != "forward" for e in timeline[n:])
    backward = [e.node for e in timeline if e.phase == "backward"]
    assert backward == sorted(backward, reverse=True) and len(set(backward)) == len(backward)
    # A node's recompute always comes before its own backward.
    for position, event in enumerate(timeline):
        if event.phase == "recompute":
            assert any(e.phase == "backward" and e.node == event.node for e in timeline[position + 1 :])


@FAST
@given(planned())
def test_recompute_cost_is_the_forward_cost_of_the_rerun_ops(case) -> None:
    graph, regions = case
    report = simulate(graph, regions)
    assert report.recompute_flops == sum(graph.nodes[i].fwd_flops for i in report.recomputed)
    assert report.recompute_seconds == sum(graph.nodes[i].fwd_cost for i in report.recomputed)
    covered = {i for region, _ in _walk(regions) for i in range(region.start, region.end)}
    assert set(report.recomputed) <= covered
    depth = Counter(i for region, _ in _walk(regions) for i in range(region.start, region.end))
    assert all(count <= depth[i] for i, count in Counter(report.recomputed).items())


@FAST
@given(planned(graph_strategy=chains(), max_depth=0))
def test_one_level_regions_on_chains_rerun_exactly_their_unkept_nodes(case) -> None:
    # Every chain op saves something and gets a gradient, so each region is recomputed once,
    # to its last op, skipping the ops it keeps.
    graph, regions = case
    report = simulate(graph, regions)
    expected = [
        i
        for region in reversed(regions)
        for i in range(region.start, region.end)
        if graph.nodes[i].name not in region.keep
    ]
    assert list(report.recomputed) == expected
    assert report.recompute_flops == sum(graph.nodes[i].fwd_flops for i in expected)
    assert (report.recompute_flops > 0) == bool(expected)  # chain ops all have fwd_flops > 0


@FAST
@given(planned(graph_strategy=chains(), max_depth=0, with_keep=False))
def test_keeping_every_node_of_a_region_recomputes_none_of_them(case) -> None:
    graph, regions = case
    regions = regions or (Region(0, len(graph)),)
    keep_all = (
        dataclasses.replace(regions[0], keep=tuple(n.name for n in graph.nodes[regions[0].start : regions[0].end])),
        *regions[1:],
    )
    without = simulate(graph, regions)
    report = simulate(graph, keep_all)
    first = set(range(regions[0].start, regions[0].end))
    assert first <= set(without.recomputed)
    assert not first & set(report.recomputed)
    assert set(report.recomputed) == set(without.recomputed) - first
    assert report.recompute_flops == without.recompute_flops - sum(graph.nodes[i].fwd_flops for i in first)


@settings(max_examples=60, deadline=None)
@given(planned(graph_strategy=st.just(skip_graph()), max_depth=1))
def test_regions_on_the_skip_graph_obey_the_same_rules(case) -> None:
    graph, regions = case
    report = simulate(graph, regions)
    assert report.peak_bytes == max(e.live_bytes for e in report.timeline) >= graph.static.resident_bytes
    events, recomputed = reference_schedule(graph, regions)
    assert [(e.phase, e.node) for e in report.timeline] == events
    assert list(report.recomputed) == recomputed


def test_skip_connection_is_held_by_a_region_around_it() -> None:
    # enc_relu (node 1, 400 bytes) is read by cat (6); a region over 2..5 takes it as an input
    # and so holds it until the region's backward, while the region saves none of 2..5.
    graph = skip_graph()
    inside = simulate(graph, [Region(2, 6)])
    assert inside.recomputed == (2, 3, 4, 5)
    assert inside.peak_bytes < baseline_peak_bytes(graph)
    # cat saves nothing, so a region holding only cat is never recomputed.
    assert simulate(graph, [Region(6, 7)]).recomputed == ()


# ----------------------------------------------------------------------------- validation
def _bad(**fields) -> Region:
    """A region built around its own checks, as a buggy solver could hand over."""
    region = object.__new__(Region)
    for name, value in {"keep": (), "children": (), **fields}.items():
        object.__setattr__(region, name, value)
    return region


@pytest.mark.parametrize(
    ("regions", "match"),
    [
        ([Region(0, 7)], "runs past"),
        ([Region(3, 4), Region(5, 9)], "runs past"),
        ([Region(0, 3), Region(2, 5)], "overlaps"),
        ([Region(3, 5), Region(0, 2)], "overlaps"),
        ([_bad(start=0, end=6, children=(Region(0, 3), Region(2, 5)))], "overlaps a sibling"),
        ([_bad(start=0, end=3, children=(Region(2, 5),))], "not inside its parent"),
        ([Region(0, 4, keep=("linear_2",), children=(Region(2, 4),))], "not directly in it"),
        ([Region(0, 4, keep=("relu_5",))], "not directly in it"),
        ([Region(0, 4, keep=("nobody",))], "unknown node"),
    ],
)
def test_bad_region_trees_are_plan_format_errors(regions: list[Region], match: str) -> None:
    graph = chain_graph([10] * 6)
    with pytest.raises(PlanFormatError, match=match):
        build_region_tree(graph, regions)
    with pytest.raises(PlanFormatError, match=match):
        simulate(graph, regions)


def test_random_nodes_cannot_be_kept() -> None:
    graph = skip_graph()
    assert graph.node("drop").random
    with pytest.raises(PlanFormatError, match="random"):
        simulate(graph, [Region(2, 6, keep=("drop",))])
    assert simulate(graph, [Region(2, 6, keep=("mid",))]).recomputed == (2, 3, 5)


@FAST
@given(chains(), st.integers(1, 5), st.data())
def test_regions_past_the_end_are_rejected(graph: ComputeGraph, past: int, data) -> None:
    n = len(graph)
    start = data.draw(st.integers(0, n - 1))
    with pytest.raises(PlanFormatError):
        simulate(graph, [Region(start, n + past)])
    with pytest.raises(PlanFormatError):
        simulate(graph, [_bad(start=0, end=n, children=(_bad(start=start, end=n + past),))])


# ----------------------------------------------------------------------------- oracle
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(max_nodes=6))
def test_sqrt_never_beats_brute_force_and_fails_only_when_nothing_fits(graph: ComputeGraph) -> None:
    scored: list[tuple[int, float]] = []
    for regions in one_level_region_sets(len(graph)):
        report: Report = simulate(graph, regions)
        scored.append((report.peak_bytes, report.recompute_seconds))
    least_peak = min(peak for peak, _ in scored)
    budgets = sorted({peak for peak, _ in scored} | {least_peak - 1, baseline_peak_bytes(graph) + 1})
    with pytest.raises(InfeasibleBudgetError) as stated:
        solve_sqrt(graph, least_peak - 1)
    sqrt_least = stated.value.min_peak_bytes
    assert least_peak <= sqrt_least <= baseline_peak_bytes(graph)
    for budget in budgets:
        if budget <= 0:
            continue
        fitting = [cost for peak, cost in scored if peak <= budget]
        if not fitting:
            with pytest.raises(InfeasibleBudgetError) as info:
                solve_sqrt(graph, budget)
            assert info.value.budget_bytes == budget
            assert info.value.min_peak_bytes == sqrt_least > budget
            continue
        if budget < sqrt_least:  # a heuristic may miss a fitting plan, never invent one
            with pytest.raises(InfeasibleBudgetError) as info:
                solve_sqrt(graph, budget)
            assert info.value.min_peak_bytes == sqrt_least  # the least it states is the same at every budget
            assert simulate(graph, info.value.least_plan).peak_bytes == sqrt_least  # and a plan of its reaches it
            continue
        plan = solve_sqrt(graph, budget)  # at or above the least it states, it always answers
        report = simulate(graph, plan)
        assert report.peak_bytes == plan.peak_bytes <= budget
        assert plan.report.recompute_seconds >= min(fitting)
        assert solve(graph, budget, solver="sqrt").budget.bytes == budget


def test_brute_force_oracle_can_tell_plans_apart() -> None:
    # Guard for the oracle above: on this chain some region set does lower the peak, at a cost.
    graph = chain_graph([100, 100, 400, 400, 100, 100])
    scored = {regions: simulate(graph, regions) for regions in one_level_region_sets(6)}
    best = min(scored.values(), key=lambda r: r.peak_bytes)
    assert best.peak_bytes < baseline_peak_bytes(graph) and best.recompute_flops > 0
    with pytest.raises(InfeasibleBudgetError):
        solve_sqrt(graph, best.peak_bytes - 1)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_chains_brute_force_exhaustively(n: int) -> None:
    # Every (region set, keep set) pair on tiny chains simulates without error and obeys the reference.
    graph = chain_graph([100 * (i + 1) for i in range(n)])
    for regions in one_level_region_sets(n):
        for keeps in product(*[[(), *[(graph.nodes[j].name,) for j in range(r.start, r.end)]] for r in regions]):
            with_keep = tuple(dataclasses.replace(r, keep=k) for r, k in zip(regions, keeps, strict=True))
            report = simulate(graph, with_keep)
            events, recomputed = reference_schedule(graph, with_keep)
            assert [(e.phase, e.node) for e in report.timeline] == events
            assert list(report.recomputed) == recomputed


def test_a_recompute_stops_with_what_the_op_made_by_its_last_save() -> None:
    """Autograd saves an op's inputs before the op runs and its outputs after. CUDA's dropout is
    one kernel that makes its output and its mask and then saves the mask, so when a recompute's
    early stop fires there the output exists too: measured on an H200, counting the mask alone put
    the prediction 5-14% under MemTracker (``benchmarks/cuda_verify.py``). CPU's dropout saves
    the mask as the input of a ``mul`` that has not run yet. ``Node.made_by_last_save`` says
    which (the profiler records it); ``skip_graph``'s ``drop`` saves a hidden mask."""
    graph = skip_graph(mask_bytes=50)
    drop = graph.node("drop")
    mask = next(s for s in drop.saved if graph.storages[s].kind == "hidden")
    one_kernel = dataclasses.replace(
        graph, nodes=tuple(
            dataclasses.replace(n, made_by_last_save=(*n.outputs, mask)) if n.index == drop.index else n
            for n in graph.nodes
        )
    )

    def grown_at_stop(g: ComputeGraph) -> int:
        timeline = [e for e in simulate(g, [Region(2, 4)]).timeline if e.phase == "recompute"]
        at = next(k for k, e in enumerate(timeline) if e.node == drop.index)
        return timeline[at].live_bytes - timeline[at - 1].live_bytes

    assert grown_at_stop(graph) == 50  # by default what it saves of its own: the mask
    assert grown_at_stop(one_kernel) == drop.output_bytes + 50
