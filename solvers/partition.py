"""Which forward values a compiled step saves for its backward, under a byte budget.

A pure kernel over a ``JointGraph``: every candidate is scored by ``simulate_partition``, the
exact model of the two graphs it gives, so what it returns holds by construction.

The search is greedy, in the manner of the memory-peak heuristics of Checkmate's baselines and
of PyTorch's own partitioner: start from saving every forward value the backward reads (no
recomputation), or from a partition the caller hands over when that is better; while the peak
is over the budget, among the saved values live at the peak, stop saving the one that lowers
the peak most per second of recomputation it adds (recomputed from what stays saved, from its
own inputs saved instead, or with the dropout masks it would replay saved instead), or, once
some of those moves bring the peak within the budget, the cheapest of them; then, in order of
cost, save again each recomputed value whose saving keeps the peak within the budget. When a
start fits, the starts that recompute less but peak just over the budget (``tuning.NEAR_FITTING``) are
searched from too, the nearest first (PyTorch's partition at its own measured peak can run a
few bytes over it in the order ckptplan runs the two graphs), and the cheapest fit wins.
Values that draw random numbers or write to state are never recomputed as they ran: a dropout
mask is saved, or replayed from the generator's saved state (``ckptplan.joint``), so gradients
equal eager's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptplan.joint import JointGraph
from ckptplan.partition import PartitionReport, backward_needs, simulate_partition
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext

_EPSILON_SECONDS = 1e-12  # a move that recomputes nothing costly still divides by something


@dataclass(frozen=True)
class Partition:
    """A decision, as its report. ``feasible``: its peak is within the budget asked. ``origin``:
    the search that found it (``"greedy"``, this module's; ``"exact"``, ``partition_exact``'s).
    ``status``: ``"optimal"``, no saved set within the budget recomputes fewer seconds (proved);
    ``"infeasible"``, none is within the budget (proved; the report is the least peak found);
    ``"feasible"``, within the budget, not proved least; ``"heuristic"``, no proof was sought."""

    report: PartitionReport
    feasible: bool
    origin: str = "greedy"
    status: str = "heuristic"

    @property
    def saved(self) -> frozenset[int]:
        return frozenset(self.report.saved)


def must_save(graph: JointGraph, saved: frozenset[int]) -> frozenset[int]:
    """``saved`` with every value the backward would need but cannot compute again."""
    graph, saved = graph.reading_drawn(saved)
    while True:
        again = {i for i in backward_needs(graph, saved) if graph.values[i].phase == "forward"}
        missing = set()
        stack = [i for i in again if not graph.values[i].recomputable]
        while stack:
            i = stack.pop()
            if graph.values[i].multi_output:  # save the parts the backward needs instead
                stack.extend(j for j in graph.users[i] if j in again)
            else:
                missing.add(i)
        if not missing:
            return saved
        saved = saved | missing


def no_recompute(graph: JointGraph) -> frozenset[int]:
    """Save every forward tensor the backward reads: what ``default_partition`` saves."""
    return must_save(graph, frozenset(i for i in graph.saveable if not graph.values[i].multi_output))


def solve_partition(
    graph: JointGraph, budget_bytes: int, starts: Iterable[Iterable[int]] = (), ctx: SolveContext | None = None,
    work_values: int | None = None,
) -> Partition:
    """The saved set for ``budget_bytes``; when none is found within it, the least peak found.
    ``starts``: other saved sets to search from besides saving everything the backward reads
    (PyTorch's own min-cut partition, say); the search starts from the one that fits with least
    recomputation (and from those just over the budget that recompute less: see the module
    docstring), or, when none fits, from the one of least peak. ``ctx``: its deadline, or Ctrl-C (which sets its cancel flag), ends the
    search with the best partition so far (None: the search runs until it is done, and Ctrl-C
    raises). ``work_values``: the search also ends once its simulations have gone over that many
    values in all (None: no such end), a clock of work that ends it the same on every run.

    While the peak is over the budget the moves do not depend on the budget, so at every budget
    below the least peak it reaches the search ends with the same partition (unless ``ctx``'s
    deadline comes first)."""
    work = _Work(graph, ctx, work_values)
    # Each distinct start once (PyTorch's partitions at several settings often coincide).
    options = list(dict.fromkeys([no_recompute(graph), *(must_save(graph, frozenset(start)) for start in starts)]))
    reports = [work.simulate(option) for option in options]
    fitting = [r for r in reports if r.peak_bytes <= budget_bytes]
    if fitting:
        first = min(fitting, key=_price)
        near = budget_bytes + int(tuning.NEAR_FITTING * budget_bytes)
        cheaper = sorted((r for r in reports if budget_bytes < r.peak_bytes <= near
                          and r.recompute_seconds < first.recompute_seconds),
                         key=lambda r: (r.peak_bytes, r.recompute_seconds))  # the nearest to fitting first
        origins = [first, *cheaper]
    else:  # the least peak first: what the search then reaches does not depend on the budget
        origins = [min(reports, key=lambda r: (r.peak_bytes, r.recompute_seconds))]
    found: list[PartitionReport] = []
    descent = _Descent(origins[0])
    try:
        for origin in origins:
            descent = _Descent(origin)
            _descend(graph, descent, budget_bytes, work)
            found.append(descent.report)
            if work.over():
                break
    except KeyboardInterrupt:
        if ctx is None:
            raise
        ctx.cancel.set()  # the partitions so far stand; the caller's later phases see the flag
        found.append(descent.report)
    fits = [r for r in found if r.peak_bytes <= budget_bytes]
    report = min(fits, key=_price) if fits else found[0]
    return Partition(report=report, feasible=report.peak_bytes <= budget_bytes)


def _price(report: PartitionReport) -> tuple[float, int]:
    """The order in which partitions within the budget are preferred: less recomputation, then a
    lower peak."""
    return report.recompute_seconds, report.peak_bytes


@dataclass
class _Descent:
    """One descent's partition so far (kept current, so that Ctrl-C loses nothing)."""

    report: PartitionReport


def _descend(graph: JointGraph, descent: _Descent, budget_bytes: int, work: _Work) -> None:
    """Moves from ``descent.report`` while its peak is over ``budget_bytes`` (at most
    ``tuning.GREEDY_ROUNDS_PER_CANDIDATE`` per saveable value), then, once it fits, saves back what fits."""
    rounds = tuning.GREEDY_ROUNDS_PER_CANDIDATE * max(1, len(graph.saveable))
    while descent.report.peak_bytes > budget_bytes and rounds > 0 and not work.over():
        rounds -= 1
        move = _best_move(graph, descent.report, budget_bytes, work)
        if move is None:
            break
        descent.report = move
    if descent.report.peak_bytes <= budget_bytes:
        descent.report = _save_back(graph, descent.report, budget_bytes, work)


class _Work:
    """The search's simulations, counted in values simulated against an allowance (None: none),
    and the context whose deadline and Ctrl-C end it too (None: neither)."""

    def __init__(self, graph: JointGraph, ctx: SolveContext | None, allowance: int | None) -> None:
        self.graph, self.ctx, self.left = graph, ctx, allowance

    def simulate(self, saved: Iterable[int]) -> PartitionReport:
        if self.left is not None:
            self.left -= len(self.graph.values)
        return simulate_partition(self.graph, saved)

    def over(self) -> bool:
        """The allowance spent, the context over, or Ctrl-C pressed."""
        return (self.left is not None and self.left <= 0) or (self.ctx is not None and self.ctx.over())


def _best_move(graph: JointGraph, report: PartitionReport, budget_bytes: int, work: _Work) -> PartitionReport | None:
    """The report of the cheapest move that brings the peak within ``budget_bytes``, else of the
    move that lowers the peak most per second of recomputation added (of those tried before
    ``work`` is over), or None."""
    values = graph.values
    saved = frozenset(report.saved)
    static = graph.static_storages
    # Saved values live at the peak, and the saved values that keep a value live there by
    # being computed from it later in the forward (the forward computes in joint order, where
    # values only the backward reads come last).
    held = [i for i in report.live_at_peak if i not in saved and values[i].phase == "forward"]
    later = _forward_descendants(graph, held) & saved
    candidates = sorted(
        i for i in {*report.live_at_peak, *later}
        if i in saved and values[i].recomputable and any(s not in static for s in values[i].storages)
    )
    # A move must lower the step's peak, or, where the forward and the backward peak alike,
    # lower the graph's peak the step is at without raising the other.
    at_peak = "backward_peak_bytes" if report.peak_in_backward else "forward_peak_bytes"
    best, best_score = None, (0, 0.0)
    fit: PartitionReport | None = None  # the cheapest move within the budget
    for i in candidates:
        inputs = {j for j in values[i].inputs if values[j].phase == "forward" and not values[j].multi_output}
        options = [saved - {i}, (saved - {i}) | inputs]
        for k, option in enumerate(options):  # grows: the first with its replayed masks saved instead
            if work.over():
                return fit or best
            option = must_save(graph, frozenset(option))
            if option == saved:
                continue
            trial = work.simulate(option)
            replayed = {graph.drawn_for[j] for j in trial.recomputed if j in graph.drawn_for}
            if k == 0 and replayed:
                options.append(options[0] | replayed)
            if trial.peak_bytes <= budget_bytes and (fit is None or _price(trial) < _price(fit)):
                fit = trial
            gain = report.peak_bytes - trial.peak_bytes
            local = getattr(report, at_peak) - getattr(trial, at_peak)
            if gain < 0 or (gain == 0 and local <= 0):
                continue
            added = max(trial.recompute_seconds - report.recompute_seconds, _EPSILON_SECONDS)
            score = (1, gain / added) if gain > 0 else (0, local / added)
            if score > best_score:
                best, best_score = trial, score
    return fit or best


def _forward_descendants(graph: JointGraph, roots: list[int]) -> set[int]:
    found: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        for j in graph.users[i]:
            if j not in found and graph.values[j].phase == "forward":
                found.add(j)
                stack.append(j)
    return found


def _save_back(graph: JointGraph, report: PartitionReport, budget_bytes: int, work: _Work) -> PartitionReport:
    """Save again the recomputed values, costliest first, while the peak stays in budget (and
    ``work`` is not over)."""
    for i in sorted(report.recomputed, key=lambda i: (-graph.values[i].cost, i)):
        if work.over():
            break
        if i not in report.recomputed or graph.values[i].multi_output:  # saved back with another
            continue
        trial = work.simulate({*report.saved, i})
        if trial.peak_bytes <= budget_bytes and trial.recompute_seconds < report.recompute_seconds:
            report = trial
    return report
