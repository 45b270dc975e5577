"""Replay one training step of a ``ComputeGraph`` under a region plan and track live bytes.

This is the referee every solver's claim is checked against (exposed as
``ckptplan.planner.simulate``). It is torch-free so solvers may call it while searching.

The model of PyTorch (2.x, eager, non-reentrant ``torch.utils.checkpoint``) it encodes:

* **Forward.** Each op allocates its fresh output storages and any hidden tensors it saves.
  A storage stays alive while someone holds it: the running program (until the last use of
  any value living in it; graph outputs until forward ends), autograd (tensors an op saves,
  until that op's backward), a checkpoint, or autocast's cache (the casts of trainable
  parameters, ``Storage.cached``, until the forward or the recompute that made them ends, as
  ``torch.autocast`` empties its cache when the outermost context exits). Inputs of a region
  are held by the caller until the region returns.
* **Checkpointed region.** Ops inside save nothing: autograd gets placeholders. A top-level
  region keeps its inputs (``frame.save_inputs``) until its backward is done; a nested region
  saves its inputs through the enclosing region's hooks, so they are dropped in forward and
  come back when the enclosing region is recomputed. Nodes in ``keep`` have their op outputs
  cached by the selective-checkpoint dispatch mode until recomputation consumes them.
* **Recompute.** Triggered by the first unpack of a saved tensor of the region (innermost
  regions trigger their ancestors first). It reruns the region's forward with its original
  inputs, storing what the region's ops save (and the inputs of nested regions) until each
  op's backward unpacks them, and stops early once the last tensor the region saved in forward
  has been produced again (``early_stop=True``, PyTorch's default).
* **Backward.** Ops run in reverse execution order. Each allocates a gradient for every input
  that needs one (or accumulates into an existing one: a transient of that size), parameter
  gradients the first time (resident until the step ends), then frees the gradient it consumed
  and the tensors it had saved. View ops pass a view of their incoming gradient on (other ops,
  to the inputs in ``Node.grad_aliased_inputs``: a type-promoting ``add``). Backward starts
  from its seed, a scalar ``ones_like(loss)`` (``graph.seed_bytes``) that autograd's graph root
  holds until backward ends, and each loss node receives as its gradient: for ``out.sum()``
  (``profiler.loss``) as a broadcast view, which view ops hand on as it is, and which the first
  gradient added to it replaces by a full-size sum. The scalar ``out.sum()`` made
  (``graph.loss_scalar_bytes``) lives from the end of forward to the end of the step, and so
  does a model's own scalar loss (``graph.loss_is_output``), which the caller holds; with
  ``graph.outputs_live`` the caller holds every output of the model to the end of the step.

Peak = the most bytes live at any op, resident state (parameters, buffers, inputs, optimizer
state) included.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from ckptplan.errors import PlanFormatError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region, validate_regions
from ckptplan.remat import Remat, indices

# What a kept node may free inside (and its selective policy then cache) without the model
# counting it: scalars (a non-random attention frees an 8-byte scale). ``Node.fwd_freed_bytes``.
FREED_SCALAR_BYTES = 16

Phase = Literal["forward", "recompute", "backward"]
# A storage instance: (storage index, tag); tag 0 is the original forward, tag u > 0 the
# copy made when the region with uid u is recomputed.
_Key = tuple[int, int]
_Token = tuple


@dataclass(frozen=True)
class Event:
    """Live bytes right after ``node`` allocated what it needs in ``phase``."""

    phase: Phase
    node: int
    live_bytes: int


@dataclass(frozen=True)
class Report:
    """What one simulated step costs. ``recomputed`` counts every re-execution of a node."""

    peak_bytes: int
    peak_event: Event
    recompute_flops: int
    recompute_seconds: float
    recomputed: tuple[int, ...]
    # ``checkpoint_cost_seconds(graph, regions)``: the machinery's own time, beside the recompute
    # (with ``graph.remat_cost`` per recompute of a rematerialised node).
    checkpoint_seconds: float
    timeline: tuple[Event, ...]
    baseline_resident_bytes: int

    @property
    def cost_seconds(self) -> float:
        """What the plan adds to a step: recompute plus checkpointing's machinery. Solvers
        minimise this."""
        return self.recompute_seconds + self.checkpoint_seconds


@dataclass
class _RegionInfo:
    """A region of the plan with its place in the tree. ``items`` are the nodes directly in it
    and its child regions, in execution order."""

    uid: int
    region: Region
    parent: _RegionInfo | None
    children: list[_RegionInfo]
    keep: frozenset[int]
    input_storages: tuple[int, ...] = ()
    random: bool = False  # a node in it (children's included) draws random numbers

    @property
    def start(self) -> int:
        return self.region.start

    @property
    def end(self) -> int:
        return self.region.end


class _Memory:
    """Storage instances and who holds them; live bytes is the sum over held instances."""

    def __init__(self, resident_bytes: int) -> None:
        self.live_bytes = resident_bytes
        self.peak_bytes = resident_bytes
        self.peak_event = Event("forward", -1, resident_bytes)
        self.timeline: list[Event] = []
        self._holders: dict[_Key, set[_Token]] = {}
        self._sizes: dict[_Key, int] = {}
        self._keys_of_token: dict[_Token, set[_Key]] = defaultdict(set)

    def hold(self, key: _Key, nbytes: int, token: _Token) -> None:
        holders = self._holders.get(key)
        if holders is None:
            holders = self._holders[key] = set()
            self._sizes[key] = nbytes
            self.live_bytes += nbytes
        holders.add(token)
        self._keys_of_token[token].add(key)

    def release(self, key: _Key, token: _Token) -> None:
        holders = self._holders.get(key)
        if holders is None or token not in holders:
            return
        holders.discard(token)
        self._keys_of_token[token].discard(key)
        if not holders:
            del self._holders[key]
            self.live_bytes -= self._sizes.pop(key)

    def release_token(self, token: _Token) -> None:
        """Release every storage ``token`` holds."""
        for key in sorted(self._keys_of_token.get(token, ())):
            self.release(key, token)
        self._keys_of_token.pop(token, None)

    def observe(self, phase: Phase, node: int, extra_bytes: int = 0) -> None:
        event = Event(phase, node, self.live_bytes + extra_bytes)
        self.timeline.append(event)
        if event.live_bytes > self.peak_bytes:
            self.peak_bytes = event.live_bytes
            self.peak_event = event


def build_region_tree(graph: ComputeGraph, regions: tuple[Region, ...] | list[Region]) -> list[_RegionInfo]:
    """Validate ``regions`` against ``graph`` and number them (uid 1.. in pre-order).

    Raises ``PlanFormatError`` for regions that break ``ckptplan.region``'s rules, start or end
    where an in-place op forbids it (``graph.boundaries``), or keep nodes that are not directly in
    them (a node inside a child belongs to the child) or may not be kept (``why_not_keep``).
    """
    n = len(graph.nodes)
    validate_regions(regions, node_count=n, names=graph.index_of)
    counter = [0]

    def make(region: Region, parent: _RegionInfo | None) -> _RegionInfo:
        for edge in (region.start, region.end):
            if edge not in graph.boundaries:
                raise PlanFormatError(
                    f"Region [{region.start}, {region.end}) cannot start or end at {edge}: an in-place op "
                    "there modifies a tensor made before it, which recomputation would need unmodified."
                )
        counter[0] += 1
        info = _RegionInfo(uid=counter[0], region=region, parent=parent, children=[], keep=frozenset())
        info.children.extend(make(child, info) for child in region.children)
        keep: set[int] = set()
        for name in region.keep:
            index = graph.index_of[name]
            if not region.start <= index < region.end or any(c.start <= index < c.end for c in region.children):
                raise PlanFormatError(
                    f"Node {name!r} is kept by region [{region.start}, {region.end}) but is not directly in it."
                )
            reason = why_not_keep(graph, index)
            if reason is not None:
                raise PlanFormatError(f"Node {name!r} cannot be kept: {reason}.")
            keep.add(index)
        info.keep = frozenset(keep)
        # One pass, not networkx's in-edges: docs/design.md, "Where networkx is used and where not".
        inputs: set[int] = set()
        for i in range(region.start, region.end):
            for j in graph.nodes[i].inputs:
                if j < region.start:
                    inputs.update(graph.nodes[j].outputs)
        info.input_storages = tuple(sorted(s for s in inputs if not graph.storages[s].is_static))
        info.random = any(graph.nodes[i].random for i in range(region.start, region.end))
        return info

    return [make(region, None) for region in regions]


def made_at_early_stop(graph: ComputeGraph, i: int) -> frozenset[int]:
    """The storages node ``i`` has allocated when a recompute's early stop fires at its last save."""
    node = graph.nodes[i]
    if node.made_by_last_save is not None:
        return frozenset(node.made_by_last_save)
    return frozenset(s for s in node.saved if graph.storages[s].producer == i)


def why_not_keep(graph: ComputeGraph, index: int) -> str | None:
    """Why a keep-set may not name node ``index``, or None when it may. A kept node's ops run
    under a selective checkpoint policy: in forward it caches what they return, and the
    recompute hands those cached tensors back instead of running the ops. That is exact only
    when the ops' results are all a recompute needs from them, hence:

    1. no random numbers (the recompute replays the RNG stream op by op);
    2. no in-place write: the cached result stands in for the op, so a recompute that skips it
       leaves the tensor it writes into unwritten for the ops after it (a squeeze-excitation's
       ``SiLU(inplace=True)`` kept would feed ``fc2`` its pre-activation input);
    3. no later in-place write into its output (the cache would hold the value after it);
    4. nothing beyond scalars that its dispatched ops return and free (the policy caches that
       too, which the memory model does not count: ``Node.fwd_freed_bytes``).
    """
    node = graph.nodes[index]
    if node.random:
        return "it draws random numbers, and recomputation must replay the random stream op by op"
    if node.inplace:
        return (
            "it writes in place into a tensor made before it, and a selective policy would hand back its "
            "result without the write; keep the op that makes the tensor instead"
        )
    writer = later_inplace_writer(graph, index)
    if writer is not None:
        return f"{writer!r} later modifies its output in place, so the saved value would be stale"
    if node.fwd_freed_bytes > FREED_SCALAR_BYTES:
        return (
            f"its op frees {node.fwd_freed_bytes:,} bytes of intermediates a selective policy would cache too, "
            "which the memory model does not count"
        )
    return None


def _rng_key(slot: int) -> _Key:
    """A key for a stashed RNG state, beside the storages' keys (from 0) and the gradients'
    (small negative): ``slot`` is a region's uid, offset by ``1 << 20`` for the copy its inputs'
    frame holds and ``2 << 20`` for a nested region's from forward, negated for a recompute's fork."""
    return (-(1 << 40) + slot, 0)


def later_inplace_writer(graph: ComputeGraph, index: int) -> str | None:
    """Name of a later in-place node writing into node ``index``'s output storage, if any."""
    later = [w for s in graph.nodes[index].outputs for w in graph.inplace_writers.get(s, ()) if w > index]
    return graph.nodes[min(later)].name if later else None


class _Simulator:
    def __init__(self, graph: ComputeGraph, regions: tuple[Region, ...] | list[Region]) -> None:
        self.g = graph
        self.n = len(graph.nodes)
        self.tops = build_region_tree(graph, regions)
        self.all_regions: list[_RegionInfo] = []
        stack = list(reversed(self.tops))
        while stack:
            info = stack.pop()
            self.all_regions.append(info)
            stack.extend(reversed(info.children))
        # chain[i]: regions containing node i, outermost first.
        self.chain: list[tuple[_RegionInfo, ...]] = [()] * self.n
        for info in self.all_regions:
            for i in range(info.start, info.end):
                self.chain[i] = self.chain[i] + (info,)
        self.mem = _Memory(graph.static.resident_bytes)
        self.input_keys: dict[int, dict[int, _Key]] = {}
        self.cache_keys: dict[int, dict[int, list[_Key]]] = defaultdict(dict)
        self.recomputed_regions: set[int] = set()
        self.recomputed_nodes: list[int] = []
        self._alias_nodes: dict[int, list[int]] = defaultdict(list)
        for node in graph.nodes:
            for s in node.outputs:
                self._alias_nodes[s].append(node.index)

    # ----------------------------------------------------------------- forward runs
    def _last_uses(self, lo: int, hi: int, hi_live: int, root: _RegionInfo | None) -> dict[int, int]:
        """Step after which a run over nodes ``[lo, hi]`` drops each value produced in it.

        A value lives until its last reader up to ``hi_live``; a reader inside a region the run
        enters keeps it until that region returns (the caller holds the region's arguments);
        graph outputs live to the end of forward.
        """
        last: dict[int, int] = {}
        for j in range(lo, hi + 1):
            end = j
            for u in self.g.users[j]:
                if u > hi_live:
                    break
                for info in self.chain[u]:
                    if info is not root and info.start > j and (root is None or self._inside(info, root)):
                        u = max(u, min(info.end - 1, hi_live))
                        break
                end = max(end, u)
            last[j] = end
        if root is None:
            for j in self.g.outputs:
                last[j] = self.n
        return last

    @staticmethod
    def _inside(info: _RegionInfo, root: _RegionInfo) -> bool:
        parent = info.parent
        while parent is not None:
            if parent is root:
                return True
            parent = parent.parent
        return False

    def _run_forward(
        self,
        lo: int,
        hi: int,
        tag: int,
        root: _RegionInfo | None,
        env: dict[int, _Key],
        stop_child: _RegionInfo | None = None,
    ) -> None:
        """Execute nodes ``[lo, hi]``: the whole forward (``root`` None) or a recompute of ``root``.

        ``stop_child``: the recompute ends as this child region of ``root`` saves its inputs
        (its body does not run); values it reads stay alive until then.
        """
        g, mem = self.g, self.mem
        hi_live = stop_child.start if stop_child is not None else hi
        last = self._last_uses(lo, hi, hi_live, root)
        release_at: dict[int, list[int]] = defaultdict(list)
        for j in range(lo, hi + 1):
            for s in g.nodes[j].outputs:
                if g.storages[s].producer == j:
                    release_at[max(last[a] for a in self._aliases(s, lo, hi))].append(s)
        fwd_token = ("fwd", tag)
        for i in range(lo, hi + 1):
            self._enter_regions(i, root, env)
            owner = self.chain[i][-1] if self.chain[i] else None
            kept = owner is not None and i in owner.keep
            if kept and owner is root:
                # Selective checkpointing: the op returns its cached outputs, nothing is recomputed.
                for key in self.cache_keys[owner.uid].pop(i, []):
                    env[key[0]] = key
                    mem.hold(key, g.storages[key[0]].nbytes, fwd_token)
                mem.release_token(("cache", owner.uid, i))
            else:
                if root is not None:
                    self.recomputed_nodes.append(i)
                produced = g.produced_by(i)
                if root is not None and stop_child is None and i == hi:
                    # Early stop fires at this op's last save (``Node.made_by_last_save``).
                    made = made_at_early_stop(g, i)
                    produced = tuple(st for st in produced if st.index in made)
                for storage in produced:
                    key = (storage.index, tag)
                    env[storage.index] = key
                    mem.hold(key, storage.nbytes, fwd_token)
            workspace = 0 if kept and owner is root else g.nodes[i].fwd_workspace_bytes
            mem.observe("forward" if root is None else "recompute", i, workspace)
            self._save(i, owner, root, kept, tag, env)
            for storage in g.produced_by(i):
                if storage.kind == "hidden" and not storage.cached and storage.index in env:
                    mem.release(env[storage.index], fwd_token)
            for s in release_at.pop(i, ()):
                if s in env:
                    mem.release(env[s], fwd_token)
        if stop_child is not None:
            self._save_child_inputs(stop_child, env)
        mem.release_token(fwd_token)

    def _aliases(self, s: int, lo: int, hi: int) -> list[int]:
        """Nodes in ``[lo, hi]`` whose output lives in storage ``s``."""
        return [j for j in self._alias_nodes[s] if lo <= j <= hi]

    def _enter_regions(self, i: int, root: _RegionInfo | None, env: dict[int, _Key]) -> None:
        for info in self.chain[i]:
            if info.start != i or info is root:
                continue
            if info.parent is root:
                # Top level: frame.save_inputs keeps them for real. Child of the region being
                # recomputed: saved into that frame. Deeper: dropped by the enclosing hook.
                self._save_child_inputs(info, env)
            elif root is None and info.random and self.g.rng_state_bytes:
                # A nested region's frame, made in forward, lives as long as the tensors its ops
                # save (holders of it, in the graph until backward passes it), and its stash too.
                self.mem.hold(_rng_key(info.uid + (2 << 20)), self.g.rng_state_bytes, ("stash", info.uid))

    def _save_child_inputs(self, info: _RegionInfo, env: dict[int, _Key]) -> None:
        keys = {s: env.get(s, (s, 0)) for s in info.input_storages}
        self.input_keys[info.uid] = keys
        for s, key in keys.items():
            self.mem.hold(key, self.g.storages[s].nbytes, ("rin", info.uid))
        if info.random and self.g.rng_state_bytes:  # the frame's stash of the RNG state, beside its inputs
            self.mem.hold(_rng_key(info.uid + (1 << 20)), self.g.rng_state_bytes, ("rin", info.uid))

    def _save(
        self, i: int, owner: _RegionInfo | None, root: _RegionInfo | None, kept: bool, tag: int, env: dict[int, _Key]
    ) -> None:
        g, mem = self.g, self.mem
        node = g.nodes[i]
        if owner is root:
            # Outside any region, or directly in the region being recomputed: autograd keeps it.
            for s in node.saved:
                if not g.storages[s].is_static:
                    mem.hold(env.get(s, (s, 0)), g.storages[s].nbytes, ("saved", i))
        elif kept:
            cached = set(node.outputs) | {st.index for st in g.produced_by(i)}
            keys = [env.get(s, (s, 0)) for s in sorted(cached) if not g.storages[s].is_static]
            if root is None:
                # The cache the region's backward will use: made in the original forward.
                for key in keys:
                    mem.hold(key, g.storages[key[0]].nbytes, ("cache", owner.uid, i))
                self.cache_keys[owner.uid][i] = keys
            else:
                # Re-running a nested region inside a recompute makes a second frame whose cache
                # nobody reads; it dies with the recompute.
                for key in keys:
                    mem.hold(key, g.storages[key[0]].nbytes, ("fwd", tag))

    # ----------------------------------------------------------------- recompute
    def _recompute(self, info: _RegionInfo) -> None:
        """Rerun ``info``'s forward in backward, stopping once its last saved tensor is back."""
        self.recomputed_regions.add(info.uid)
        hi, stop_child = self._stop_point(info)
        env = dict(self.input_keys.get(info.uid, {}))
        fork = info.random and self.g.rng_state_bytes
        if fork:  # fork_rng keeps the state it restores afterwards
            self.mem.hold(_rng_key(-info.uid), self.g.rng_state_bytes, ("fork", info.uid))
        self._run_forward(info.start, hi, info.uid, info, env, stop_child)
        if fork:
            self.mem.release_token(("fork", info.uid))
        if info.parent is not None:
            # get_inputs() unpacked them from the parent's frame; they die with this call.
            self.mem.release_token(("rin", info.uid))

    def _stop_point(self, info: _RegionInfo) -> tuple[int, _RegionInfo | None]:
        """Where early stop ends a recompute of ``info``: after the last pack event in its frame,
        i.e. the last node directly in it that saves something, or the last child region (which
        saves its inputs into this frame before its body runs)."""
        children = {c.start: c for c in info.children}
        stop: tuple[int, _RegionInfo | None] = (info.start - 1, None)
        i = info.start
        while i < info.end:
            child = children.get(i)
            if child is not None:
                stop = (child.start - 1, child)
                i = child.end
                continue
            if self.g.nodes[i].saved:
                stop = (i, None)
            i += 1
        return stop

    # ----------------------------------------------------------------- backward
    def run(self) -> Report:
        g, mem = self.g, self.mem
        self._run_forward(0, self.n - 1, 0, None, {})
        steps = {step.node: step for step in gradient_steps(g)}
        _begin_backward(mem, g)
        _hold_outputs(mem, g)
        for i in reversed(range(self.n)):
            step = steps.get(i)
            if step is not None:
                if g.nodes[i].saved:
                    for info in self.chain[i]:
                        if info.uid not in self.recomputed_regions:
                            self._recompute(info)
                if g.nodes[i].bwd_unpack_bytes:
                    mem.observe("backward", i, g.nodes[i].bwd_unpack_bytes)
                _begin_gradients(mem, g, step)
                mem.observe("backward", i, step.extra_bytes(g.nodes[i].bwd_workspace_bytes))
                _end_gradients(mem, step)
                mem.release_token(("saved", i))
            for info in reversed(self.chain[i]):
                if info.start == i:
                    mem.release_token(("rin", info.uid))
                    mem.release_token(("stash", info.uid))
                    for k in list(self.cache_keys[info.uid]):
                        mem.release_token(("cache", info.uid, k))
        recompute_flops = sum(g.nodes[i].fwd_flops for i in self.recomputed_nodes)
        recompute_seconds = sum(g.nodes[i].fwd_cost for i in self.recomputed_nodes)
        return Report(
            peak_bytes=mem.peak_bytes,
            peak_event=mem.peak_event,
            recompute_flops=recompute_flops,
            recompute_seconds=recompute_seconds,
            recomputed=tuple(self.recomputed_nodes),
            checkpoint_seconds=checkpoint_cost_seconds(g, [info.region for info in self.all_regions]),
            timeline=tuple(mem.timeline),
            baseline_resident_bytes=g.static.resident_bytes,
        )


# Gradient id of backward's seed; the gradients ops allocate count up from it.
SEED = 1
_LOSS_KEY: _Key = (-SEED, 1)  # the loss scalar: beside the gradients' (-id, 0) keys


@dataclass(frozen=True)
class GradientStep:
    """What one node's backward does with gradients; no plan changes it.

    ``incoming``: ids of the gradients it consumes: one, or one per output of a multi-output op
    (autograd holds each output's gradient in its own slot until the op's backward runs);
    ``SEED`` is backward's seed, a scalar that the loss nodes hold, for a non-scalar output as
    the broadcast view ``out.sum()``'s backward makes of it, which view ops (``add``, ``view``,
    ``t``) hand on as it is;
    ``allocated``: (gradient id, bytes, receiving node) for each input gradient it creates;
    ``aliased``: receiving nodes it hands a view of ``incoming`` (view ops, and the inputs in
    ``Node.grad_aliased_inputs``), also into a free output slot of a multi-output op;
    ``replaced``: (receiving node, gradient ids) for each node whose gradient was a view (of the
    seed, or of another op's gradient, such as ``cat``'s slices) and that an allocated gradient
    replaces: autograd cannot add into a view, so it adds out of place and drops the view;
    ``param_grads``: parameter storages whose gradient it allocates first; ``transient_bytes``:
    what it adds into gradients that already exist (a temporary of that size); ``copy_bytes``:
    the copies of first gradients made in another layout than their parameter's
    (``Node.param_grad_copies``)."""

    node: int
    incoming: tuple[int, ...]
    allocated: tuple[tuple[int, int, int], ...]
    aliased: tuple[int, ...]
    replaced: tuple[tuple[int, tuple[int, ...]], ...]
    param_grads: tuple[int, ...]
    transient_bytes: int
    copy_bytes: int = 0

    def extra_bytes(self, workspace_bytes: int) -> int:
        """What this step holds beyond its gradients, with the op's backward workspace: the
        accumulation temporaries, which coexist with the workspace, and the layout copies, made
        once the op's backward has returned and its workspace is gone (so the larger of the two
        counts; and before its saved tensors are freed, so the model never falls short)."""
        return self.transient_bytes + max(workspace_bytes, self.copy_bytes)


def gradient_steps(graph: ComputeGraph) -> tuple[GradientStep, ...]:
    """The backward's gradient bookkeeping, in the order backward runs: every node that requires
    grad and receives a gradient (from the loss nodes down)."""
    grads: dict[int, tuple[int, ...]] = {i: (SEED,) for i in graph.loss_nodes}  # node -> ids of its gradients
    slots: dict[int, set[int]] = defaultdict(set)  # multi-output node -> outputs whose gradient arrived
    # Nodes whose gradient is a view: of the seed (the loss nodes, to start with), or of another
    # op's gradient (a slice of cat's, say).
    views_held: set[int] = set(graph.loss_nodes)
    done_params: set[int] = set()
    steps: list[GradientStep] = []
    counter = SEED
    for i in reversed(range(len(graph.nodes))):
        node = graph.nodes[i]
        if not (node.requires_grad and i in grads):
            continue
        incoming = grads[i]
        transient = copies = 0
        allocated: list[tuple[int, int, int]] = []
        aliased: list[int] = []
        replaced: list[tuple[int, tuple[int, ...]]] = []
        views = set(node.grad_inputs) if node.grad_aliases_output else set(node.grad_aliased_inputs)
        for j in sorted(set(node.grad_inputs)):
            size = graph.nodes[j].output_bytes
            slot = _output_slot(graph, i, j) if j in views else None
            if slot is not None and j in grads and slot not in slots[j] and grads[j] != (SEED,):
                grads[j] = grads[j] + incoming  # another output's gradient: its own slot
                aliased.append(j)
            elif j in grads and j not in views_held:
                transient += size  # added in place into j's own gradient
            elif j not in grads and j in views:
                grads[j] = incoming
                aliased.append(j)
                views_held.add(j)
            else:
                # New, or a gradient added to a view (the seed's broadcast view, a slice of
                # cat's gradient): autograd cannot accumulate into a view (input_buffer.cpp's
                # can_accumulate_inplace), so it adds the two out of place and drops the view;
                # j then holds a gradient of its full size.
                if j in grads:
                    replaced.append((j, grads[j]))
                views_held.discard(j)
                counter += 1
                grads[j] = (counter,)
                allocated.append((counter, size, j))
            if slot is not None:
                slots[j].add(slot)
        params = []
        for p in node.param_grads:
            if p in done_params:
                transient += graph.storages[p].nbytes
            else:
                done_params.add(p)
                params.append(p)
                if p in node.param_grad_copies:
                    copies += graph.storages[p].nbytes
        steps.append(
            GradientStep(i, incoming, tuple(allocated), tuple(aliased), tuple(replaced), tuple(params), transient, copies)
        )
    return tuple(steps)


def _output_slot(graph: ComputeGraph, i: int, j: int) -> int | None:
    """The output of multi-output node ``j`` that node ``i`` selects (a getitem of it), if so."""
    outputs = graph.nodes[j].outputs
    if len(outputs) < 2 or not graph.nodes[i].grad_aliases_output or len(graph.nodes[i].outputs) != 1:
        return None
    (storage,) = graph.nodes[i].outputs
    return storage if storage in outputs else None


def _begin_backward(mem: _Memory, graph: ComputeGraph) -> None:
    """What exists when backward starts, to its end: the loss scalar (summed from the outputs, or
    the model's own scalar output, which the caller holds as ``loss``), and the seed, which
    autograd's graph root holds for the whole backward (and each loss node as its gradient)."""
    if graph.loss_scalar_bytes:
        mem.hold(_LOSS_KEY, graph.loss_scalar_bytes, ("loss",))
    elif graph.loss_is_output:
        for i in graph.loss_nodes:
            for s in graph.nodes[i].outputs:
                mem.hold((s, 0), graph.storages[s].nbytes, ("loss",))
    mem.hold((-SEED, 0), graph.seed_bytes, ("root",))
    for i in graph.loss_nodes:
        mem.hold((-SEED, 0), graph.seed_bytes, ("grad", i))


def _hold_outputs(mem: _Memory, graph: ComputeGraph) -> None:
    """The model's outputs, held by the caller to the end of the step when it keeps them
    (``graph.outputs_live``). Storages, which solvers model themselves (``gradient_bytes``
    leaves them out)."""
    if graph.outputs_live:
        for i in graph.outputs:
            for s in graph.nodes[i].outputs:
                if not graph.storages[s].is_static:
                    mem.hold((s, 0), graph.storages[s].nbytes, ("caller",))


def _begin_gradients(mem: _Memory, graph: ComputeGraph, step: GradientStep) -> None:
    """Hold the gradients ``step`` creates (a gradient is held by each node it is owed to)."""
    for gid, size, j in step.allocated:
        mem.hold((-gid, 0), size, ("grad", j))
    for j in step.aliased:
        for gid in step.incoming:
            mem.hold((-gid, 0), 0, ("grad", j))
    for p in step.param_grads:
        mem.hold((p, -1), graph.storages[p].nbytes, ("param_grad",))


def _end_gradients(mem: _Memory, step: GradientStep) -> None:
    """The gradients ``step`` consumed die with it, unless a view of them was handed on; a view
    its new gradients were added to goes once the addition (after the op) is done."""
    for gid in step.incoming:
        mem.release((-gid, 0), ("grad", step.node))
    for j, gids in step.replaced:
        for gid in gids:
            mem.release((-gid, 0), ("grad", j))


@dataclass(frozen=True)
class GradientBytes:
    """Gradient bytes at each backward event, which no plan changes: ``before[i]`` live when node
    i's backward starts, ``during[i]`` at its event (new gradients, accumulation temporaries,
    workspace included); ``runs``: the nodes whose backward runs, in order."""

    before: dict[int, int]
    during: dict[int, int]
    runs: tuple[int, ...]


def gradient_bytes(graph: ComputeGraph) -> GradientBytes:
    """``simulate``'s gradient bookkeeping alone, for solvers that model the rest themselves."""
    mem = _Memory(0)
    before: dict[int, int] = {}
    during: dict[int, int] = {}
    steps = gradient_steps(graph)
    _begin_backward(mem, graph)
    for step in steps:
        before[step.node] = mem.live_bytes
        _begin_gradients(mem, graph, step)
        during[step.node] = mem.live_bytes + step.extra_bytes(graph.nodes[step.node].bwd_workspace_bytes)
        _end_gradients(mem, step)
    return GradientBytes(before=before, during=during, runs=tuple(step.node for step in steps))


def checkpoint_cost_seconds(graph: ComputeGraph, regions: Sequence[Region]) -> float:
    """Seconds ``regions`` (every level, nested ones included) add to a step besides
    recomputation: ``graph.region_cost`` each, ``graph.region_op_cost`` for each node of each
    region, and ``graph.policy_op_cost`` twice (forward and recompute) for each kept node (the
    only nodes ``emit`` runs under a selective policy's dispatch modes; charged twice even when
    the recompute stops before the node)."""
    seconds = 0.0
    for region in regions:
        seconds += graph.region_cost + graph.region_op_cost * (region.end - region.start)
        seconds += 2 * graph.policy_op_cost * len(region.keep)
    return seconds


class PlanLike(Protocol):
    """What ``simulate`` reads of a plan (``ckptplan.plan.Plan`` is one)."""

    @property
    def regions(self) -> tuple[Region, ...]: ...

    @property
    def remat(self) -> tuple[str, ...]: ...


def simulate(graph: ComputeGraph, plan: PlanLike | Sequence[Region] = (), *, remat: Sequence[str] = ()) -> Report:
    """Peak bytes, recompute FLOPs and the memory timeline of one step under ``plan``: its regions
    and the nodes it rematerialises (``plan.remat``, or ``remat`` beside bare regions; see
    ``ckptplan.remat``)."""
    if isinstance(plan, Sequence):
        regions, names = tuple(plan), tuple(remat)
    else:
        regions, names = plan.regions, plan.remat
    if not names:
        with _collector_paused():
            return _Simulator(graph, regions).run()
    rematerialised = Remat(graph, indices(graph, names), regions)
    with _collector_paused():
        report = _Simulator(rematerialised.graph, regions).run()
    again = rematerialised.recomputations
    return replace(
        report,
        recompute_flops=report.recompute_flops + sum(graph.nodes[x].fwd_flops for x in again),
        recompute_seconds=report.recompute_seconds + sum(graph.nodes[x].fwd_cost for x in again),
        checkpoint_seconds=report.checkpoint_seconds + graph.remat_cost * len(again),
        recomputed=report.recomputed + tuple(again),
    )


def baseline_peak_bytes(graph: ComputeGraph) -> int:
    """Peak of one step of ``graph`` without checkpointing (``simulate(graph).peak_bytes``), worked
    out once per graph and kept in the graph object's own ``__dict__``, as ``cached_property``
    keeps the graph's other derived values."""
    peak = graph.__dict__.get("_baseline_peak_bytes")
    if peak is None:
        peak = simulate(graph).peak_bytes
        graph.__dict__["_baseline_peak_bytes"] = peak
    return peak


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (and back on only if it was on).
    A run allocates an object or more per event, and the collections those allocations set off
    would take a large share of it (docs/tuning.md, "simulation"); what a run leaves behind is
    collected once it is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
