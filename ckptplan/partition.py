"""The memory of a partitioned joint graph, as its forward and backward graphs run.

Given the forward values to save, the two graphs are what AOTAutograd's
``_extract_fwd_bwd_modules`` cuts from the joint graph, with the backward in the order
``planner.compiled`` gives it (PyTorch's ``reordering_to_mimic_autograd_engine``): from the
first node that reads a tangent on, the backward graph's nodes in joint order, each preceded by
what it needs that is not yet computed, in joint order; in both graphs each ``getitem`` right
after the tuple it takes apart (PyTorch's ``raise_getitems``). Run as graph modules do (each value freed
after its last use in its graph; the backward's inputs, the saved values and tangents,
too), the live bytes at every node are exact for ``backend="aot_eager"``:

* forward: each value needed for the forward's outputs, its effects (``JointGraph.effects``)
  or a saved value, in joint order; it
  lives from its node to its last use in the forward, or, saved or returned, past the forward;
* between: the caller drops the outputs (unless ``outputs_live``) and its loss's backward hands
  the tangents over; the loss and its seed stay with the caller (``JointGraph.caller_held``,
  ``caller_bytes``);
* backward: the saved values and tangents live until their last use in the backward, every
  value it computes likewise, and the gradients it returns until it ends.

Each node's kernel workspace counts while it runs. The peak adds the primals (parameters,
buffers, inputs), alive throughout, as a plan's peak adds the model's state and inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptplan.errors import CkptPlanError
from ckptplan.joint import JointGraph


@dataclass(frozen=True)
class PartitionReport:
    """What a partition's step does. ``saved``: forward values handed to the backward;
    ``recomputed``: forward values the forward computes and the backward computes again
    (a replayed random draw among them: see ``ckptplan.joint``);
    ``backward_order``: the values the backward graph computes, in order (recomputed ones and
    forward values only the backward needs among them); ``peak_at``: the value at which the
    step peaks (its phase says which graph)."""

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    saved: tuple[int, ...]
    recomputed: tuple[int, ...]
    recompute_seconds: float
    recompute_flops: int
    forward_order: tuple[int, ...]
    backward_order: tuple[int, ...]
    peak_at: int
    peak_in_backward: bool
    live_at_peak: tuple[int, ...]  # values holding a storage at the peak, besides primals


def forward_ancestors(graph: JointGraph, roots: Iterable[int]) -> set[int]:
    """Forward values reached from ``roots`` through forward values."""
    found: set[int] = set()
    stack = [r for r in roots if graph.values[r].phase == "forward"]
    while stack:
        i = stack.pop()
        if i not in found:
            found.add(i)
            stack.extend(j for j in graph.values[i].inputs if graph.values[j].phase == "forward")
    return found


def _last_reads(graph: JointGraph, order: list[int]) -> dict[int, int]:
    """For each value read in ``order``, the position of its last reader."""
    return {j: position for position, i in enumerate(order) for j in graph.values[i].inputs}


def backward_needs(graph: JointGraph, saved: frozenset[int]) -> set[int]:
    """The values the backward computes (backward ones, and forward ones it computes again)."""
    values = graph.values
    needed: set[int] = set()
    stack = list(graph.backward_outputs)
    while stack:
        i = stack.pop()
        if i in needed or i in saved or values[i].phase in ("primal", "tangent"):
            continue
        needed.add(i)
        stack.extend(values[i].inputs)
    return needed


def backward_values(graph: JointGraph, saved: frozenset[int]) -> tuple[list[int], set[int]]:
    """The values the backward computes, in its order, and the forward ones among them."""
    values = graph.values
    needed = backward_needs(graph, saved)
    again = {i for i in needed if values[i].phase == "forward"}
    order: list[int] = []
    placed: set[int] = set()

    def place(i: int) -> None:
        """``i`` after what it needs that is not yet placed, those in joint order."""
        if i in placed:
            return
        todo = [j for j in values[i].inputs if j in needed and j not in placed]
        if not todo:  # the common case: everything it reads is placed
            placed.add(i)
            order.append(i)
            return
        pending = {i}
        while todo:
            j = todo.pop()
            if j in placed or j in pending or j not in needed:
                continue
            pending.add(j)
            todo.extend(values[j].inputs)
        for j in sorted(pending):
            placed.add(j)
            order.append(j)

    # As PyTorch's reordering walks the backward graph (the joint's order): from the first node
    # that reads a tangent, each node in turn, after what it needs that is not yet placed.
    tangent_users = [j for v in values if v.phase == "tangent" for j in graph.users[v.index] if j in needed]
    first = min(tangent_users, default=0)
    for i in sorted(needed):
        if i >= first:
            place(i)
    for i in sorted(needed - placed):  # what nothing from there on needs (no tangent read at all)
        place(i)
    return raise_getitems(graph, order), again


def raise_getitems(graph: JointGraph, order: list[int]) -> list[int]:
    """``order`` with each ``getitem`` moved right after the value it takes apart, as PyTorch's
    ``raise_getitems`` moves them (a tuple then dies with its last part taken, not at a part
    the joint graph takes late)."""
    values = graph.values
    in_order = set(order)
    parts: dict[int, list[int]] = {}
    for i in order:
        if values[i].op == "getitem" and values[i].inputs and values[i].inputs[0] in in_order:
            parts.setdefault(values[i].inputs[0], []).append(i)
    moved = {i for taken in parts.values() for i in taken}
    raised: list[int] = []

    def put(i: int) -> None:
        raised.append(i)
        for part in parts.get(i, ()):  # a part that is a tuple itself is followed by its own parts
            put(part)

    for i in order:
        if i not in moved:
            put(i)
    return raised


def simulate_partition(
    graph: JointGraph, saved: Iterable[int], notes: list[tuple[int, bool, int]] | None = None
) -> PartitionReport:
    """Simulate the step that saves ``saved`` (forward value indices; those the backward then
    never reads are dropped, as the cut drops them; a saved replayed mask is the forward's own,
    ``JointGraph.reading_drawn``). ``notes``, if given, receives every point
    the live bytes are read at, in order: ``(value, in_backward, live bytes)``, the value being
    the one computed there (-1: the backward's start), the bytes without the primals."""
    graph, saved_set = graph.reading_drawn(frozenset(saved))
    values = graph.values
    for i in saved_set:
        if values[i].phase != "forward" or values[i].multi_output:
            raise CkptPlanError(f"{values[i].name} is not a forward tensor; only forward tensors are saved.")
    order_b, again = backward_values(graph, saved_set)
    # A saved value the backward never reads is not saved: the cut drops it from the outputs.
    last_b = _last_reads(graph, order_b)
    saved_set = frozenset(i for i in saved_set if i in last_b or i in graph.backward_outputs)
    missing = [values[i].name for i in again if not values[i].recomputable]
    if missing:
        raise CkptPlanError(
            f"The backward needs {', '.join(sorted(missing)[:3])}, which it cannot compute again; save it."
        )
    forward = raise_getitems(
        graph, sorted(forward_ancestors(graph, (*graph.forward_roots, *saved_set)))
    )
    size = graph.storage_bytes

    held = graph.held_storages
    holders: dict[int, int] = {}  # storage -> values holding it
    live = 0
    holding: set[int] = set()

    def hold(i: int) -> None:
        nonlocal live
        holding.add(i)
        for s in held[i]:
            count = holders.get(s, 0)
            holders[s] = count + 1
            if count == 0:
                live += size[s]

    def release(i: int) -> None:
        nonlocal live
        if i not in holding:
            return
        holding.discard(i)
        for s in held[i]:
            holders[s] -= 1
            if holders[s] == 0:
                live -= size[s]
                del holders[s]

    best = {False: (0, -1, ()), True: (0, -1, ())}  # per graph: live bytes, at value, values live

    def note(i: int, backward: bool) -> None:
        at = live + (values[i].workspace_bytes if i >= 0 else 0)
        if notes is not None:
            notes.append((i, backward, at))
        if at > best[backward][0]:
            best[backward] = (at, i, tuple(sorted(holding)))

    def run(order: list[int], last: dict[int, int], kept: set[int], backward: bool) -> None:
        """Compute ``order``, each value freed after its last reader unless ``kept``."""
        readers: dict[int, list[int]] = {}
        for j, position in last.items():
            if j not in kept:
                readers.setdefault(position, []).append(j)
        for position, i in enumerate(order):
            hold(i)
            note(i, backward)
            for j in readers.get(position, ()):
                release(j)
            if i not in last and i not in kept:
                release(i)

    # Forward.
    run(forward, _last_reads(graph, forward), set(graph.forward_outputs) | saved_set, False)

    # Between: outputs the caller drops, the tangents it hands over, the loss it holds.
    if not graph.outputs_live:
        for i in graph.forward_outputs:
            if i not in saved_set and i not in graph.caller_held:
                release(i)
    for value in values:
        if value.phase == "tangent":
            hold(value.index)
    live += graph.caller_bytes

    # Backward: its inputs and its values freed after their last use; gradients, and what the
    # caller holds, kept.
    kept_b = set(graph.backward_outputs) | set(graph.caller_held)
    if graph.outputs_live:
        kept_b |= set(graph.forward_outputs)
    for i in list(holding):
        if i not in last_b and i not in kept_b:
            release(i)  # a saved value or tangent the backward never reads
    note(-1, True)
    run(order_b, last_b, kept_b, True)
    (forward_peak, _, _), (backward_peak, _, _) = best[False], best[True]
    in_backward = backward_peak > forward_peak
    _, peak_at, live_at_peak = best[in_backward]
    # Computed twice: what both graphs compute, and a random draw the backward replays.
    twice = sorted(i for i in again if i in set(forward) or values[i].replay)
    return PartitionReport(
        peak_bytes=graph.static_bytes + max(forward_peak, backward_peak),
        forward_peak_bytes=graph.static_bytes + forward_peak,
        backward_peak_bytes=graph.static_bytes + backward_peak,
        saved=tuple(sorted(saved_set)),
        recomputed=tuple(twice),
        recompute_seconds=sum(values[i].cost for i in twice),
        recompute_flops=sum(values[i].flops for i in twice),
        forward_order=tuple(forward),
        backward_order=tuple(order_b),
        peak_at=peak_at,
        peak_in_backward=in_backward,
        live_at_peak=live_at_peak,
    )
