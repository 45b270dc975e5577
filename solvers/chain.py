"""Cut a ``ComputeGraph`` into a chain of stages, the form optimal checkpointing DPs work on.

A pure chain keeps one stage per node (up to ``max_stages``). On a graph with skip connections
— a residual stream, U-Net concatenations, an attention mask shared by every layer — a tensor
may be read more than one stage after the one that made it: a *skip*. The chain does not carry
skips from stage to stage; it charges them per stage instead, with bounds that hold for every
plan (see ``build_chain``): a skip made in stage p is counted from p's forward to the end of
backward's pass through p, twice in backward (the tensor or its recomputed copy, and its
gradient). That is what is lost when a graph is not a chain: memory a plan could free (a skip
dropped after its last forward reader, before backward) is still counted, so the DP may miss
plans that fit; it never accepts one that does not. Where the cuts go is a trade-off: a cut
that a skip spans turns that skip into a conservative charge, a missing cut forbids a region
edge there; ``stage_starts`` takes *clean* cuts (few skips across) and ``solve_dp`` tries a
second, finer chain.

Per stage k (nodes ``[starts[k], starts[k+1])``) the chain records, in bytes:

* ``out_bytes[k]`` (X_k): activations crossing the cut after it — its output, read by stage k+1.
  For the last stage: the graph outputs it produces, held until forward ends.
* ``hidden_bytes[k]`` (H_k): what its ops save for backward besides its input and output.
* ``saves_input[k]`` / ``saves_output[k]``: whether its ops save its input / its output.
* ``fwd_all_bytes[k]``: peak bytes it allocates when run saving everything (its output and H_k
  included); ``fwd_none_bytes[k]``: the same when it saves nothing (inside a checkpointed
  forward); ``fwd_stop_bytes[k]``: when a recomputation stops at its last saving op.
* ``bwd_extra_bytes[k]``: peak bytes its backward allocates beyond what it holds and the
  gradient it receives (input gradient, first parameter gradients, temporaries).
* ``param_grad_bytes[k]``: parameter gradients first allocated by its backward.
* ``cost[k]``: seconds to run it forward again (the graph's roofline cost); ``flops[k]``.
  Each region also costs its machinery's seconds: ``region_cost``, plus ``region_op_cost`` per
  node it spans (``graph.region_cost``, ``graph.region_op_cost``; see ``Chain.machinery_cost``).
* ``skip_fwd_bytes[k]``: skips made in stages ``≤ k``, each once: held during stage k's forward.
* ``skip_bwd_bytes[k]``: the same skips with their gradients (tensor or recomputed copy, and gradient):
  held during stage k's backward and during the recomputation of any region ending at stage k.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptplan.graph import ComputeGraph
from ckptplan.sharding import unit_edges
from ckptplan.solvers import tuning


@dataclass(frozen=True)
class Chain:
    starts: tuple[int, ...]
    out_bytes: tuple[int, ...]
    hidden_bytes: tuple[int, ...]
    saves_input: tuple[bool, ...]
    saves_output: tuple[bool, ...]
    fwd_all_bytes: tuple[int, ...]
    fwd_none_bytes: tuple[int, ...]
    fwd_stop_bytes: tuple[int, ...]
    bwd_extra_bytes: tuple[int, ...]
    param_grad_bytes: tuple[int, ...]
    cost: tuple[float, ...]
    flops: tuple[int, ...]
    skip_fwd_bytes: tuple[int, ...]
    skip_bwd_bytes: tuple[int, ...]
    resident_bytes: int
    node_count: int
    region_cost: float = 0.0  # seconds each region's machinery adds (``graph.region_cost``)
    region_op_cost: float = 0.0  # and each node of it (``graph.region_op_cost``)
    # Per stage k, the last stage a region starting at k may end at (k - 1: none may start
    # there): a region may not span an FSDP unit edge. Empty: no such limit.
    region_last_stage: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.starts)

    def last_region_stage(self, k: int) -> int:
        """The last stage a region starting at stage k may end at (k - 1 when none may start there)."""
        return self.region_last_stage[k] if self.region_last_stage else len(self.starts) - 1

    def span(self, k: int) -> tuple[int, int]:
        """Node range ``[start, end)`` of stage k."""
        end = self.starts[k + 1] if k + 1 < len(self.starts) else self.node_count
        return self.starts[k], end

    def machinery_cost(self, k: int, d: int) -> float:
        """Seconds a region over stages ``k..d`` adds besides its recompute, as
        ``simulation.checkpoint_cost_seconds`` counts them for a region without keeps."""
        return self.region_cost + self.region_op_cost * (self.span(d)[1] - self.starts[k])


def stage_starts(
    graph: ComputeGraph, max_stages: int = tuning.MAX_STAGES, skip_share: float = tuning.SKIP_SHARE,
) -> list[int]:
    """Stage starts: 0 and the *clean* region boundaries, at most ``max_stages`` stages.

    A boundary k is clean when the activations live across it that were made before the
    previous stage start are at most ``skip_share`` of all live across it; such cuts are taken
    greedily left to right. If there are too many, one per window of ``n / max_stages`` nodes is
    kept, the one with the fewest bytes live across it (``_spread``)."""
    n = len(graph.nodes)
    if n == 0:
        return []
    # A sweep over storage lifetimes, not networkx's cuts: docs/design.md, "Where networkx is used and where not".
    last_read = _last_reads(graph)
    across: list[list[int]] = [[] for _ in range(n + 1)]  # storages live across each cut
    for s, last in last_read.items():
        for k in range(graph.storages[s].producer + 1, min(last, n - 1) + 1):
            across[k].append(s)
    crossing = [sum(graph.storages[s].nbytes for s in storages) for storages in across]
    cuts = []
    edges = set(unit_edges(graph))
    for k in range(1, n):
        if k not in graph.boundaries:
            continue
        if k in edges:  # a region may end here and no later (``Chain.region_last_stage``)
            cuts.append(k)
            continue
        previous = cuts[-1] if cuts else 0
        skipped = sum(graph.storages[s].nbytes for s in across[k] if graph.storages[s].producer < previous)
        if skipped <= skip_share * crossing[k]:
            cuts.append(k)
    if len(cuts) > max_stages - 1:
        cuts = _spread(cuts, crossing, n, max_stages)
    return [0, *cuts]


def _spread(cuts: list[int], crossing: list[int], n: int, max_stages: int) -> list[int]:
    """At most one cut per window of ``n / max_stages`` nodes: in each, the one with the fewest
    bytes live across it (the first on ties). Taking the cheapest cuts overall would bunch them
    where a uniform chain's ties fall, at its start, and leave one huge last stage."""
    best: dict[int, int] = {}
    for k in cuts:
        window = k * max_stages // n
        if window and (window not in best or crossing[k] < crossing[best[window]]):
            best[window] = k
    return sorted(best.values())


def _last_reads(graph: ComputeGraph) -> dict[int, int]:
    """For each activation/hidden storage: the last node that reads or saves it (n for graph outputs)."""
    n = len(graph.nodes)
    last: dict[int, int] = {}
    for node in graph.nodes:
        touched = {s for j in node.inputs for s in graph.nodes[j].outputs} | set(node.saved)
        for s in touched:
            if not graph.storages[s].is_static:
                last[s] = max(last.get(s, -1), node.index)
    for j in graph.outputs:
        for s in graph.nodes[j].outputs:
            if not graph.storages[s].is_static:
                last[s] = n
    return last


def build_chain(graph: ComputeGraph, starts: list[int] | None = None) -> Chain:
    """The stage chain of ``graph`` (at ``starts``, default ``stage_starts(graph)``).

    An activation read more than one stage after the one that made it (a skip) is not carried
    from stage to stage. Whatever the plan, a skip ``s`` made in stage p is dead before p's
    forward and after backward leaves p; in between, at most two copies of its bytes are live:
    the tensor (kept by a saver or a region that reads it, or recomputed by a region that
    makes it) and, from its last reader's backward on, its gradient. ``skip_fwd_bytes`` and
    ``skip_bwd_bytes`` charge that bound to every stage from p on, once in forward and twice
    in backward: it overstates memory, never understates it."""
    n = len(graph.nodes)
    starts = stage_starts(graph) if starts is None else starts
    ends = starts[1:] + [n]
    stage_of = [0] * (n + 1)
    for k, (start, end) in enumerate(zip(starts, ends)):
        for i in range(start, end):
            stage_of[i] = k
    stage_of[n] = len(starts)  # graph outputs are read "after" the last stage
    last_read = _last_reads(graph)
    skips = {s for s, last in last_read.items() if stage_of[last] > stage_of[graph.storages[s].producer] + 1
             and not (last == n and stage_of[graph.storages[s].producer] == len(starts) - 1)}
    skip_made = [0] * len(starts)  # skip_made[k]: bytes of the skips made in stage k
    skip_grads = [0] * len(starts)  # ... and of their gradients
    for s in sorted(skips):
        producer = graph.nodes[graph.storages[s].producer]
        skip_made[stage_of[producer.index]] += graph.storages[s].nbytes
        if graph.storages[s].kind == "activation" and producer.requires_grad:
            skip_grads[stage_of[producer.index]] += producer.output_bytes
    skip_fwd, skip_bwd, made, grads = [], [], 0, 0
    for k in range(len(starts)):
        made += skip_made[k]
        grads += skip_grads[k]
        skip_fwd.append(made)
        skip_bwd.append(made + grads)
    crossing = [set() for _ in range(len(starts) + 1)]  # crossing[k]: storages live across stage k's start
    for s, last in last_read.items():
        if s in skips:
            continue
        producer = graph.storages[s].producer
        for k, start in enumerate(starts):
            if producer < start <= last:
                crossing[k].add(s)
    first_param_use: dict[int, int] = {}
    for node in graph.nodes:
        for p in node.param_grads:
            first_param_use[p] = max(first_param_use.get(p, -1), node.index)  # backward meets the last use first

    fields: dict[str, list] = {name: [] for name in (
        "out_bytes", "hidden_bytes", "saves_input", "saves_output", "fwd_all_bytes", "fwd_none_bytes",
        "fwd_stop_bytes", "bwd_extra_bytes", "param_grad_bytes", "cost", "flops")}
    for k, (start, end) in enumerate(zip(starts, ends)):
        inputs = crossing[k]
        outputs = crossing[k + 1] if k + 1 < len(starts) else {
            s for j in graph.outputs if start <= j < end for s in graph.nodes[j].outputs
            if not graph.storages[s].is_static and s not in skips
        }
        saved = {s for i in range(start, end) for s in graph.nodes[i].saved
                 if not graph.storages[s].is_static and s not in skips}
        hidden = saved - inputs - outputs
        out_bytes = _bytes(graph, outputs)
        fields["out_bytes"].append(out_bytes)
        fields["hidden_bytes"].append(_bytes(graph, hidden))
        fields["saves_input"].append(bool(saved & inputs))
        fields["saves_output"].append(bool(saved & outputs))
        fields["fwd_all_bytes"].append(_forward_peak(graph, start, end, outputs, keep_saved=True))
        fields["fwd_none_bytes"].append(_forward_peak(graph, start, end, outputs, keep_saved=False))
        fields["fwd_stop_bytes"].append(_forward_peak(graph, start, end, outputs, keep_saved=True, stop=True))
        params = sum(graph.storages[p].nbytes for p, i in first_param_use.items() if start <= i < end)
        fields["param_grad_bytes"].append(params)
        # The loss scalar and backward's seed are charged to every stage's backward: a few bytes
        # more than ``simulate`` counts where the seed is already gone.
        fields["bwd_extra_bytes"].append(
            _backward_extra(graph, start, end, hidden, first_param_use) + graph.loss_scalar_bytes + graph.seed_bytes
        )
        fields["cost"].append(sum(graph.nodes[i].fwd_cost for i in range(start, end)))
        fields["flops"].append(sum(graph.nodes[i].fwd_flops for i in range(start, end)))
    return Chain(
        starts=tuple(starts),
        skip_fwd_bytes=tuple(skip_fwd),
        skip_bwd_bytes=tuple(skip_bwd),
        resident_bytes=graph.static.resident_bytes,
        node_count=n,
        region_cost=graph.region_cost,
        region_op_cost=graph.region_op_cost,
        region_last_stage=_region_last_stages(graph, starts),
        **{name: tuple(values) for name, values in fields.items()},
    )


def _region_last_stages(graph: ComputeGraph, starts: list[int]) -> tuple[int, ...]:
    """``Chain.region_last_stage`` for stages at ``starts``: a region from stage k may run up to
    the first FSDP unit edge after the stage's start, and not at all from a stage that spans one."""
    edges = unit_edges(graph)
    if not edges:
        return ()
    n = len(graph.nodes)
    ends = [*starts[1:], n]
    last = []
    for k, start in enumerate(starts):
        edge = next((e for e in edges if e > start), n)
        last.append(max((d for d in range(k, len(starts)) if ends[d] <= edge), default=k - 1))
    return tuple(last)


def _bytes(graph: ComputeGraph, storages: set[int]) -> int:
    return sum(graph.storages[s].nbytes for s in storages)


def _forward_peak(graph: ComputeGraph, start: int, end: int, outputs: set[int], *, keep_saved: bool,
                  stop: bool = False) -> int:
    """Peak bytes allocated by nodes ``[start, end)`` run on their own, as the simulator counts
    them: a storage lives until its last reader in the stage, or to the stage's end if it is an
    output or (``keep_saved``) saved. ``stop``: the run ends at the last node that saves
    something, which allocates only what it saves of its own."""
    last_saver = max((i for i in range(start, end) if graph.nodes[i].saved), default=None)
    if stop and last_saver is not None:
        end = last_saver + 1
    saved = {s for i in range(start, end) for s in graph.nodes[i].saved} if keep_saved else set()
    last_use: dict[int, int] = {}
    for i in range(start, end):
        for j in graph.nodes[i].inputs:
            for s in graph.nodes[j].outputs:
                last_use[s] = i
    alive: dict[int, int] = {}
    peak = 0
    for i in range(start, end):
        node = graph.nodes[i]
        produced = graph.produced_by(i)
        if stop and i == end - 1:
            produced = tuple(st for st in produced if st.index in set(node.saved))
        for st in produced:
            alive[st.index] = st.nbytes
        peak = max(peak, sum(alive.values()) + node.fwd_workspace_bytes)
        for st in produced:
            if st.kind == "hidden" and st.index not in saved:
                alive.pop(st.index, None)
        for s in list(alive):
            if s in outputs or s in saved:
                continue
            if last_use.get(s, graph.storages[s].producer) <= i:
                alive.pop(s)
    return peak


def _backward_extra(
    graph: ComputeGraph, start: int, end: int, hidden: set[int], first_param_use: dict[int, int]
) -> int:
    """Peak bytes the backward of nodes ``[start, end)`` allocates on top of the gradient it
    receives and what the stage holds (``hidden`` counted in full): internal and input
    gradients, first parameter gradients and temporaries, less the hidden tensors already
    released by the ops whose backward has finished (so it may be negative)."""
    release_at: dict[int, int] = {}
    for i in range(start, end):
        for s in graph.nodes[i].saved:
            if s in hidden:
                release_at.setdefault(s, i)  # freed after the earliest saver's backward
    held = _bytes(graph, hidden)
    extra, peak = 0, None
    grads: dict[int, int] = {}  # node -> bytes of its pending output gradient (internal only)
    for i in reversed(range(start, end)):
        node = graph.nodes[i]
        if node.requires_grad:
            new = 0 if node.grad_aliases_output else sum(graph.nodes[j].output_bytes for j in set(node.grad_inputs))
            new += sum(graph.storages[p].nbytes for p in node.param_grads if first_param_use.get(p) == i)
            event = held + extra + new + node.bwd_workspace_bytes
            peak = event if peak is None else max(peak, event)
            extra += new - grads.pop(i, 0)
            if not node.grad_aliases_output:
                for j in set(node.grad_inputs):
                    if j >= start:
                        grads[j] = grads.get(j, 0) + graph.nodes[j].output_bytes
        held -= sum(graph.storages[s].nbytes for s, at in release_at.items() if at == i)
    return (peak if peak is not None else 0) - _bytes(graph, hidden)
