"""Hierarchical solving of graphs built from repeated blocks (what ``ilp`` does on large graphs).

A transformer traced at aten level repeats one block's ops once per layer (a 96-layer GPT-3-shaped
graph has about 4,600 nodes). The flat ilp model grows as nodes × region width, yet the decision
is made per block. So, in four steps:

1. ``ckptplan.repeats.find_blocks``: the repeated blocks (modules ``<path>.<i>``) and their
   classes (blocks whose nodes match op for op and byte for byte).
2. ``block_policies``: for each class, one block is solved as a graph of its own (``block_graph``)
   by the flat ``ilp`` at several budgets. Each plan found is a *policy*: regions and keep-sets
   relative to the block's first node. "No checkpoint", "one region over the block" (keeping
   more or fewer of its ops) and the small regions that free the most bytes per recompute
   second are always policies.
3. ``measure``: each policy is simulated on the whole graph at one *probe* block of its class
   (every other block unplanned). That gives, exactly, its recompute cost, ``freed_bytes`` (how
   much less is live from the end of the block's forward until its backward starts) and the
   peaks of the block's forward window and backward window (backward and recompute events).
4. ``choose``: blocks run in order and are differentiated in reverse order, so while block k
   runs (either way) exactly the blocks before it hold their stored activations. With the
   unplanned step's live bytes ``base(e)`` at each event e, the peak of an assignment is modelled
   as ``max_e base(e) + own(e) - freed(blocks before e)``, ``own`` being the policy's change of
   its own windows. A dynamic program over the blocks picks one policy per block:

   ``front[k]`` = the Pareto set of (``freed``, recompute cost) over policy choices for blocks
   ``0..k-1`` whose every event so far fits the budget; ``freed`` is the bytes those blocks
   free, exactly. To bound the set, states whose ``freed`` fall in the same ``unit`` of bytes
   (``tuning.FREED_UNITS`` units span the most the blocks can free) keep only the cheapest one, which
   loses optimality, never feasibility. Block k with policy p is allowed from a state when
   ``window_peak(p) + offset(k) - freed ≤ budget`` for both of its windows, where ``offset(k)``
   shifts the probe's windows to block k's place in the unplanned step.

The assembled plan is simulated; if the additive model underestimated it (blocks that are not
independent), the choice is redone with the budget lowered by the overshoot. The result is
optimal only within this decomposition, so its status is ``feasible``.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph, Node, StaticMemory, Storage
from ckptplan.region import Region
from ckptplan.repeats import Block, find_blocks
from ckptplan.simulation import Report, baseline_peak_bytes, simulate
from ckptplan.solvers import tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp_flat import solve_flat, starting_plan, warm_plans
from ckptplan.solvers.ilp_model import keepable
from ckptplan.solvers.refine import keep_priority
from ckptplan.solvers.solution import Solution, solution
from ckptplan.solvers.sqrt import least_peak_regions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyEffect:
    """One policy measured at its class's probe block (see the module docstring)."""

    regions: tuple[Region, ...]  # relative to the block's first node; keep-sets name the probe's nodes
    cost_seconds: float
    freed_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int


@dataclass(frozen=True)
class Decomposition:
    """Blocks in execution order, the class of each, per class its probe block and measured
    policies, and per block each policy placed on it (None where its cuts are not valid)."""

    blocks: tuple[Block, ...]
    class_of: tuple[int, ...]
    probes: tuple[int, ...]  # per class: the index into ``blocks`` of its probe block
    policies: tuple[tuple[PolicyEffect, ...], ...]  # per class
    placements: tuple[tuple[tuple[Region, ...] | None, ...], ...]  # per block, per policy of its class

    def describe(self) -> str:
        sizes = sorted({b.end - b.start for b in self.blocks})
        counts = [self.class_of.count(c) for c in range(len(self.probes))]
        return (
            f"{len(self.blocks)} repeated blocks of {'/'.join(map(str, sizes))} nodes in {len(self.probes)} "
            f"class(es) ({', '.join(map(str, counts))}), {sum(len(p) for p in self.policies)} block policies "
            "made on one block per class, one policy per block chosen by dynamic programming"
        )


@dataclass(frozen=True)
class Windows:
    """The unplanned step seen block by block: live bytes at each block's first forward event
    and at its first backward event, per k the peak of the events outside blocks while blocks
    0..k-1 hold their activations, and the live bytes at the last forward event."""

    fwd_start: tuple[int, ...]
    bwd_start: tuple[int, ...]
    outside_peak: tuple[int, ...]  # len(blocks) + 1 entries
    last_forward_live: int


def block_graph(graph: ComputeGraph, block: Block, ballast_bytes: int = 0) -> ComputeGraph:
    """The block's nodes as a graph of their own, for finding policies (they are measured on the
    whole graph afterwards, so approximations here cost quality, never correctness). Storages
    made before the block become resident inputs. One synthetic last node, ``ballast``, reads
    the block's values that later nodes read and is the loss; it stands for the rest of the
    step, holding ``ballast_bytes`` during its forward and its backward, so that what the
    block stores until its backward weighs against the budget as it does among other blocks."""
    lo, hi = block.start, block.end
    used: list[int] = []
    for node in graph.nodes[lo:hi]:
        used.extend([*node.outputs, *node.saved, *node.param_grads, *node.writes])
        used.extend(s.index for s in graph.produced_by(node.index))
    remap = {s: k for k, s in enumerate(dict.fromkeys(used))}
    storages = []
    for s, k in remap.items():
        old = graph.storages[s]
        inside = lo <= old.producer < hi
        kind = old.kind if inside or old.is_static else "input"
        storages.append(Storage(k, old.nbytes, kind, old.producer - lo if inside else -1, old.trainable,
                                cached=old.cached and inside))
    nodes = [
        replace(
            node,
            index=node.index - lo,
            inputs=tuple(i - lo for i in node.inputs if i >= lo),
            outputs=tuple(remap[s] for s in node.outputs),
            saved=tuple(remap[s] for s in node.saved),
            grad_inputs=tuple(i - lo for i in node.grad_inputs if i >= lo),
            grad_aliased_inputs=tuple(i - lo for i in node.grad_aliased_inputs if i >= lo),
            param_grads=tuple(remap[s] for s in node.param_grads),
            writes=tuple(remap[s] for s in node.writes),
            param_grad_copies=tuple(remap[s] for s in node.param_grad_copies),
        )
        for node in graph.nodes[lo:hi]
    ]
    read_later = tuple(i - lo for i in range(lo, hi) if any(u >= hi for u in graph.users[i]) or i in graph.outputs)
    nodes.append(
        Node(
            index=hi - lo, name="ballast", op="ballast", module="", inputs=read_later, outputs=(), saved=(),
            grad_inputs=tuple(i for i in read_later if nodes[i].requires_grad), requires_grad=True,
            fwd_workspace_bytes=ballast_bytes, bwd_workspace_bytes=ballast_bytes,
        )
    )
    trainable = sum(s.nbytes for s in storages if s.kind == "param" and s.trainable)
    static = StaticMemory(
        param_bytes=sum(s.nbytes for s in storages if s.kind == "param"),
        buffer_bytes=sum(s.nbytes for s in storages if s.kind == "buffer"),
        input_bytes=sum(s.nbytes for s in storages if s.kind == "input"),
        grad_bytes=trainable,
    )
    return ComputeGraph(
        name=f"{graph.name}:{block.path}", nodes=tuple(nodes), storages=tuple(storages), static=static,
        outputs=(hi - lo,), loss_nodes=(hi - lo,), trace=graph.trace,
        region_cost=graph.region_cost, region_op_cost=graph.region_op_cost, policy_op_cost=graph.policy_op_cost,
    )


def block_policies(graph: ComputeGraph, block: Block, ctx: SolveContext) -> list[tuple[Region, ...]]:
    """Candidate policies for ``block`` (relative regions, keep-sets naming the block's nodes):
    none, ``ranked_keep_policies``, ``small_region_policies`` (whose measuring comes out of
    ``seconds``), and the flat ilp's plans of ``block_graph`` at ``tuning.POLICY_BUDGETS`` budgets from
    a least peak to its unplanned peak, for each ballast of ``tuning.BALLAST_SHARES``, and with the
    largest ballast at ``tuning.FRONTIER_SOLVES`` more budgets where its frontier has the widest gaps.
    Each solve starts from the ranked policies, the plans found so far and the ``sqrt`` and
    ``dp`` plans; the least peak is the lowest of theirs, or the flat ilp's when ``seconds``
    allows ``tuning.THOROUGH_SECONDS`` per solve. ``seconds`` is shared out by the block's size
    (``tuning.BLOCK_SOLVE_SECONDS_PER_NODE`` and its siblings), not by the clock, so every run makes the same
    solves with the same limits. Below ``tuning.BLOCK_MIN_SOLVE_SECONDS`` per solve there are no flat solves:
    each budget's policy is the ilp's starting plan instead (``ilp_flat.starting_plan``: those warm
    plans with keeps added or shed by ``solvers.refine``), for as many ballasts and budgets, in
    order, as ``seconds`` pays for. ``seconds`` is ``ctx.limit``; the solves end by its deadline."""
    seconds = ctx.limit
    length = block.end - block.start
    ranked = ranked_keep_policies(graph, block)
    alone = baseline_peak_bytes(block_graph(graph, block))
    found: list[tuple[Region, ...]] = [(), *ranked, *small_region_policies(graph, block, alone)]
    activation = sum(graph.saved_bytes(i) for i in range(block.start, block.end))
    nodes = length + 1  # the block graph's, with its ballast
    seconds = max(0.0, seconds - tuning.SMALL_REGION_SECONDS_PER_PAIR * length**2)  # what the small regions took
    # per solve; dp's limit for its warm plans
    slot = seconds / (len(tuning.BALLAST_SHARES) * (tuning.POLICY_BUDGETS + 1) + tuning.FRONTIER_SOLVES)
    # dp's plans warm-start every solve (docs/tuning.md, "blocks")
    # the CP-SAT limit of each
    per_solve = slot - (tuning.BLOCK_SOLVE_SECONDS_PER_NODE + tuning.BLOCK_DP_SECONDS_PER_NODE) * nodes
    thorough = per_solve >= tuning.THOROUGH_SECONDS
    # Too short for CP-SAT solves: each budget's policy is the ilp's refined starting plan
    # (docs/tuning.md, "blocks").
    quick = per_solve < tuning.BLOCK_MIN_SOLVE_SECONDS
    # starting plans paid for, in the loops' order
    quick_left = int(seconds / (tuning.BLOCK_QUICK_SECONDS_PER_NODE * nodes))
    for share in tuning.BALLAST_SHARES:
        ballast = int(share * activation)
        sub = block_graph(graph, block, max(ballast, alone) if share == tuning.BALLAST_SHARES[-1] else ballast)
        top = baseline_peak_bytes(sub)
        # The ranked policies warm-start each solve, and with sqrt's least-peak plan they set the
        # lowest budget tried when time is short: simulating them is cheap, where the flat
        # least-peak search is not (docs/tuning.md, "blocks").
        starts = [
            solution(sub, policy, "ranked")
            for policy in ranked
        ]
        least = min([least_peak_regions(sub)[1], *(p.peak_bytes for p in starts)])
        if thorough:
            try:
                solve_flat(sub, sub.static.resident_bytes, ctx.within(per_solve).unscored(), warm=(), announce=False, lazy=False)
                least = sub.static.resident_bytes
            except InfeasibleBudgetError as error:
                least = min(least, error.min_peak_bytes)
        frontier = Frontier()
        frontier.add(top, solution(sub, (), "none", status="optimal"))
        resolution = max(1, (top - least) // tuning.FRONTIER_RESOLUTION)
        for k in range(tuning.POLICY_BUDGETS + (tuning.FRONTIER_SOLVES if share == tuning.BALLAST_SHARES[-1] else 0)):
            if quick:
                if quick_left <= 0:
                    break
                quick_left -= 1
            if k < tuning.POLICY_BUDGETS:
                budget = least + (top - least) * k // tuning.POLICY_BUDGETS
            else:
                gap = frontier.widest_gap(resolution=resolution)
                if gap is None:
                    break
                budget = gap
            warm = [p for p in [*starts, *frontier.plans] if p.peak_bytes <= budget]
            frontier.add(budget, _block_plan(sub, budget, warm, ctx, seconds=None if quick else per_solve, slot=slot))
        for plan in frontier.plans:
            clipped = tuple(Region(r.start, min(r.end, length), keep=r.keep) for r in plan.regions if r.start < length)
            if all(not r.children for r in clipped):
                found.append(clipped)
    return list(dict.fromkeys(found))


def _block_plan(
    sub: ComputeGraph, budget: int, warm: list[Solution], ctx: SolveContext, *, seconds: float | None, slot: float
) -> Solution | None:
    """The block graph ``sub``'s plan within ``budget`` (None if none is found): the flat ilp's
    with ``seconds``, or without (None) the ilp's starting plan. Either starts from ``warm`` and
    from the ``sqrt`` and ``dp`` plans (``slot``: dp's limit)."""
    warm = [*warm, *warm_plans(sub, budget, ctx.within(slot).unscored())]
    if seconds is None:
        regions = starting_plan(sub, warm, budget)
        return None if regions is None else solution(sub, regions, "refine")
    try:
        return solve_flat(sub, budget, ctx.within(seconds).unscored(), warm=warm, announce=False, lazy=False)
    except InfeasibleBudgetError:
        return None


class Frontier:
    """The block graph's plans found so far, and where their Pareto frontier of (peak, recompute
    cost) is least explored. A solve at budget ``x`` that returns a plan costing ``y`` shows
    that no plan peaking at ``x`` or less costs less than ``y``. So between two neighbours on
    the frontier, a (lower peak, costlier) and b, the plans still unexplored peak between the
    highest budget whose solve cost as much as a and b's peak; ``widest_gap`` names the middle
    of the gap whose box (those bytes × the cost between a and b) is largest. (Quick policies,
    the ilp's starting plans, need not be the cheapest within their budget: for them this only
    guides where to look.)"""

    def __init__(self) -> None:
        self.plans: list[Solution] = []  # the distinct plans found, in the order found
        self._solves: list[tuple[int, float]] = []  # (budget, cost of the plan returned; inf: none)

    def add(self, budget: int, plan: Solution | None) -> None:
        self._solves.append((budget, math.inf if plan is None else plan.cost_seconds))
        if plan is not None and all(old.regions != plan.regions for old in self.plans):
            self.plans.append(plan)

    def widest_gap(self, *, resolution: int) -> int | None:
        """The budget in the middle of the widest unexplored gap at least ``resolution`` bytes
        wide on each side; None when there is none."""
        pareto: list[Solution] = []
        for plan in sorted(self.plans, key=lambda p: (p.peak_bytes, p.cost_seconds)):
            if not pareto or plan.cost_seconds < pareto[-1].cost_seconds:
                pareto.append(plan)
        best, widest = None, 0.0
        for a, b in itertools.pairwise(pareto):
            cost_a, high = a.cost_seconds, b.peak_bytes
            low = max([a.peak_bytes, *(x for x, y in self._solves if y >= cost_a and x < high)])
            box = (high - low) * (cost_a - b.cost_seconds)
            if high - low >= 2 * resolution and box > widest:
                best, widest = (low + high) // 2, box
        return best


def ranked_keep_policies(graph: ComputeGraph, block: Block) -> list[tuple[Region, ...]]:
    """One region over the block keeping the ``k`` nodes whose recomputation costs most per byte
    kept, for ``k`` from none to all (``tuning.KEEP_STEPS`` steps), and keeping exactly the nodes with
    FLOPs (the matmul outputs, which Megatron's selective recompute keeps; Korthikanti et al.
    2022). Fast to make, and a frame for the ilp's finer plans."""
    ranked = sorted(
        (i for i in range(block.start, block.end) if keepable(graph, i)),
        key=lambda i: (-keep_priority(graph, i), i),
    )
    length = block.end - block.start
    keep_sets = [ranked[: len(ranked) * k // tuning.KEEP_STEPS] for k in range(tuning.KEEP_STEPS + 1)]
    keep_sets.append([i for i in ranked if graph.nodes[i].fwd_flops > 0])
    policies = []
    for keep in keep_sets:
        names = tuple(graph.nodes[i].name for i in sorted(keep))
        policies.append((Region(0, length, keep=names),))
    return list(dict.fromkeys(policies))


def small_region_policies(graph: ComputeGraph, block: Block, ballast_bytes: int) -> list[tuple[Region, ...]]:
    """Regions of at most ``tuning.SMALL_REGION_NODES`` nodes, without keep-sets: each such region is
    measured alone on ``block_graph`` with ``ballast_bytes``, the block graph's own unplanned
    peak, as ballast (so its peak falls by what the block stores less), and, in order of bytes freed per second of recompute,
    those not overlapping a better one are taken; the policies are the first 1, 2, ...,
    ``tuning.SMALL_REGION_POLICIES`` of them (a region that frees bytes at no cost first). Recomputing
    attention's core alone, the heart of Megatron's selective recompute (Korthikanti et al.
    2022), is such a policy; the ranked keep policies, one region over the whole block, reach it
    only by keeping every other op at a dispatch cost each (what that costs: docs/tuning.md,
    "blocks")."""
    lo = block.start
    sub = block_graph(graph, block, ballast_bytes)
    top = baseline_peak_bytes(sub)
    scored = []
    for start in range(lo, block.end):
        if start not in graph.boundaries:
            continue
        for end in range(start + 1, min(start + tuning.SMALL_REGION_NODES, block.end) + 1):
            if end not in graph.boundaries:
                continue
            report = simulate(sub, (Region(start - lo, end - lo),))
            freed = top - report.peak_bytes
            if freed > 0:
                per_second = freed / report.cost_seconds if report.cost_seconds > 0 else math.inf
                scored.append((-per_second, start - lo, end - lo))
    chosen: list[Region] = []
    for _, start, end in sorted(scored):
        if len(chosen) == tuning.SMALL_REGION_POLICIES:
            break
        if all(end <= r.start or r.end <= start for r in chosen):
            chosen.append(Region(start, end))
    return [tuple(sorted(chosen[:count], key=lambda r: r.start)) for count in range(1, len(chosen) + 1)]


def shift(graph: ComputeGraph, policy: tuple[Region, ...], source: Block, target: Block) -> tuple[Region, ...] | None:
    """``policy`` (regions relative to ``source``, keep-sets naming ``source``'s nodes) placed on
    ``target``; None when its region edges are not valid cuts there."""
    regions = []
    for region in policy:
        start, end = target.start + region.start, target.start + region.end
        if start not in graph.boundaries or end not in graph.boundaries:
            return None
        keep = tuple(
            graph.nodes[graph.index_of[name] - source.start + target.start].name for name in region.keep
        )
        regions.append(Region(start, end, keep=keep))
    return tuple(regions)


def measure(graph: ComputeGraph, block: Block, placed: tuple[Region, ...], windows: Windows) -> PolicyEffect:
    """Simulate ``placed`` (a policy already placed on ``block``) with every other block unplanned."""
    report = simulate(graph, placed)
    fwd = bwd = last_forward_live = 0
    for event in report.timeline:
        inside = block.start <= event.node < block.end
        if event.phase == "forward":
            last_forward_live = event.live_bytes
            if inside:
                fwd = max(fwd, event.live_bytes)
        elif inside:
            bwd = max(bwd, event.live_bytes)
    relative = tuple(Region(r.start - block.start, r.end - block.start, keep=r.keep) for r in placed)
    return PolicyEffect(relative, report.cost_seconds, windows.last_forward_live - last_forward_live, fwd, bwd)


def block_windows(blocks: Sequence[Block], base: Report) -> Windows:
    """``Windows`` of the unplanned step ``base``."""
    starts = [b.start for b in blocks]
    fwd_start: dict[int, int] = {}
    bwd_start: dict[int, int] = {}
    outside = [0] * (len(blocks) + 1)
    last_forward_live = 0
    for event in base.timeline:
        k = bisect.bisect_right(starts, event.node) - 1  # the last block starting at or before the node
        if k >= 0 and event.node < blocks[k].end:
            target = fwd_start if event.phase == "forward" else bwd_start
            target.setdefault(k, event.live_bytes)
        else:
            outside[k + 1] = max(outside[k + 1], event.live_bytes)
        if event.phase == "forward":
            last_forward_live = event.live_bytes
    return Windows(
        tuple(fwd_start[k] for k in range(len(blocks))),
        tuple(bwd_start.get(k, 0) for k in range(len(blocks))),
        tuple(outside),
        last_forward_live,
    )


def decompose(graph: ComputeGraph, ctx: SolveContext) -> tuple[Decomposition, Windows] | None:
    """Blocks, their policies (found in ``ctx.limit`` seconds, shared by the classes of blocks)
    and measured effects; None when the graph has no repeated blocks of at least
    ``tuning.MIN_BLOCK_NODES`` nodes."""
    blocks, class_of = find_blocks(graph)
    if max((b.end - b.start for b in blocks), default=0) < tuning.MIN_BLOCK_NODES:
        return None
    windows = block_windows(blocks, simulate(graph, ()))
    classes = max(class_of) + 1
    probes, policies = [], []
    for c in range(classes):
        members = [k for k, cls in enumerate(class_of) if cls == c]
        probe = members[len(members) // 2]
        probes.append(probe)
        effects = []
        for policy in block_policies(graph, blocks[probe], ctx.within(ctx.limit / classes)):
            placed = shift(graph, policy, blocks[probe], blocks[probe])
            if placed is not None:
                effects.append(measure(graph, blocks[probe], placed, windows))
        policies.append(tuple(effects))
    placements = tuple(
        tuple(shift(graph, e.regions, blocks[probes[c]], block) for e in policies[c])
        for block, c in zip(blocks, class_of)
    )
    dec = Decomposition(tuple(blocks), tuple(class_of), tuple(probes), tuple(policies), placements)
    return dec, windows


def choose(dec: Decomposition, windows: Windows, budget_bytes: int) -> list[int] | None:
    """One policy index per block minimising total recompute cost under the additive model
    (``front`` as defined in the module docstring); None when no choice fits."""
    most_freed = sum(max(0, *(e.freed_bytes for e in dec.policies[c])) for c in dec.class_of)
    unit = max(1, math.ceil(most_freed / tuning.FREED_UNITS))
    front: list[tuple[int, float, tuple | None]] = [(0, 0.0, None)]  # (freed bytes, cost, choices)
    for k in range(len(dec.blocks) + 1):
        front = [state for state in front if windows.outside_peak[k] - state[0] <= budget_bytes]
        if k == len(dec.blocks) or not front:
            break
        c = dec.class_of[k]
        fwd_offset = windows.fwd_start[k] - windows.fwd_start[dec.probes[c]]
        bwd_offset = windows.bwd_start[k] - windows.bwd_start[dec.probes[c]]
        best: dict[int, tuple[float, int, tuple]] = {}  # per unit of freed bytes: the cheapest state
        for freed, cost, choices in front:
            for p, effect in enumerate(dec.policies[c]):
                if dec.placements[k][p] is None:
                    continue
                peak = max(effect.fwd_peak_bytes + fwd_offset, effect.bwd_peak_bytes + bwd_offset)
                if peak - freed > budget_bytes:
                    continue
                after = freed + effect.freed_bytes
                total = cost + effect.cost_seconds
                bucket = after // unit
                if bucket not in best or (total, -after) < (best[bucket][0], -best[bucket][1]):
                    best[bucket] = (total, after, (choices, p))
        front, cheapest = [], math.inf
        for bucket in sorted(best, reverse=True):  # Pareto: keep a state only if cheaper than all freeing more
            total, after, choices = best[bucket]
            if total < cheapest:
                front.append((after, total, choices))
                cheapest = total
    if not front:
        return None
    _, _, choices = min(front, key=lambda state: (state[1], -state[0]))
    picked: list[int] = []
    while choices is not None:
        choices, p = choices
        picked.append(p)
    return picked[::-1]


def assemble(dec: Decomposition, picked: Sequence[int]) -> tuple[Region, ...]:
    """The whole graph's regions for one policy index per block."""
    return tuple(r for k, p in enumerate(picked) for r in dec.placements[k][p] or ())


def solve_blocks(
    graph: ComputeGraph, budget_bytes: int, dec: Decomposition, windows: Windows
) -> tuple[tuple[Region, ...], Report, int] | None:
    """The cheapest assembled plan that ``simulate`` confirms within ``budget_bytes``: choose,
    simulate, and on an overshoot choose again below the budget by that much (at most
    ``tuning.BLOCK_MAX_REPAIRS`` times). Returns (regions, report, repairs) or None."""
    target = budget_bytes
    for repairs in range(tuning.BLOCK_MAX_REPAIRS + 1):
        picked = choose(dec, windows, target)
        if picked is None:
            return None
        regions = assemble(dec, picked)
        report = simulate(graph, regions)
        if report.peak_bytes <= budget_bytes:
            return regions, report, repairs
        log.info("block plan overshoots by %d bytes; choosing again below the budget", report.peak_bytes - budget_bytes)
        target -= report.peak_bytes - budget_bytes
    return None


def least_peak(graph: ComputeGraph, dec: Decomposition, windows: Windows) -> tuple[int, tuple[Region, ...]]:
    """The least simulated peak of a plan the choice reaches (bisection on its budget), and that
    plan (no regions when none beats the step without checkpointing)."""
    lo, hi = graph.static.resident_bytes, baseline_peak_bytes(graph)
    best: tuple[int, tuple[Region, ...]] = (hi, ())
    while hi - lo > max(1, (baseline_peak_bytes(graph) - graph.static.resident_bytes) // tuning.LEAST_PEAK_STEPS):
        mid = (lo + hi) // 2
        picked = choose(dec, windows, mid)
        if picked is None:
            lo = mid
            continue
        hi = mid
        regions = assemble(dec, picked)
        best = min(best, (simulate(graph, regions).peak_bytes, regions), key=lambda found: found[0])
    return best
