"""The JointGraph: a frozen, torch-free description of the joint forward-backward graph that
AOTAutograd traces for a compiled training step.

Under ``torch.compile`` the step is one graph: the forward's ops, then the backward's, reading
the forward's values directly. Partitioning it into the forward and backward graphs that run
is one decision: which forward values the forward hands to the backward (*saved*); every other
forward value the backward needs is computed again there (*recomputed*). ``ckptplan.partition``
simulates the two graphs a decision gives; ``ckptplan.solvers.partition`` makes the decision.

Values are nodes of the joint graph in its order, each with the storages it holds (a view
shares its base's storage; a multi-output op holds all its outputs' storages, and each
``getitem`` its own one's).

A random draw is never computed again as it ran: it would draw other numbers. Where the reader
of the joint graph (``profiler.joint``) finds a dropout in training, the forward draws it
saving the generator's state, and the backward may *replay* it: draw the same mask again from
that saved state (a few bytes) instead of holding the mask. The graph then holds the forward's
own values computed from draws (the mask, the dropout's output, and every forward value after
them, directly or not), and a twin of each computed from the replays, which is what the
backward reads (``JointGraph.replays``); so the backward may compute anything downstream of a
dropout again, as it may anything else. The forward never computes a twin: saving one means
saving its original, which the backward then reads in its place
(``JointGraph.reading_drawn``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

Phase = Literal["primal", "tangent", "forward", "backward"]


@dataclass(frozen=True)
class JointValue:
    """One node of the joint graph.

    ``phase``: ``primal`` (a parameter, buffer or input of the step), ``tangent`` (the gradient
    of a forward output, which the caller's loss hands to the backward), ``forward`` (depends on
    no tangent: the forward may compute it, and the backward may compute it again) or
    ``backward``. ``inputs``: indices of the values it reads. ``storages``: the storages it
    holds. ``cost``: seconds to compute it, ``flops`` its FLOPs. ``recomputable``: the backward
    may compute it again (not a random draw, which would differ; not a write to state).
    ``multi_output``: its value is a tuple that ``getitem`` values take apart; never saved
    itself (its parts are). ``workspace_bytes``: what its kernel allocates and frees while it
    runs, beyond its outputs (measured by running it, where the tensors are real).
    ``replay``: it draws a forward's random numbers again from their saved state (or takes such
    a draw apart): the forward never computes it, and the backward computing it is recomputation.
    """

    index: int
    name: str
    op: str
    phase: Phase
    inputs: tuple[int, ...] = ()
    storages: tuple[int, ...] = ()
    cost: float = 0.0
    flops: int = 0
    recomputable: bool = True
    multi_output: bool = False
    workspace_bytes: int = 0
    replay: bool = False


@dataclass(frozen=True)
class JointGraph:
    """The joint graph of one compiled training step.

    ``storage_bytes[s]``: bytes of storage ``s``. ``forward_outputs``: the values the forward
    returns to the caller (the model's outputs, updated buffers). ``backward_outputs``: the
    values the backward returns (the gradients of the primals). ``effects``: forward values
    computed for what they write, not for a reader (inductor's joint graph writes a batch
    norm's running statistics into its buffers with ``copy_``); the forward computes them, and
    what they read, whatever it saves. ``outputs_live``: the caller holds the forward's outputs
    until backward ends (see ``ComputeGraph.outputs_live``). ``replays``: pairs ``(twin,
    original)``: a replayed mask or dropout output, or a value computed from one, and the
    forward's own value it stands for; saving either means the forward saves ``original`` and the backward reads it
    for ``twin`` (``reading_drawn``). ``caller_held``: values the caller holds until backward
    ends whatever ``outputs_live`` says: a scalar output that is itself the loss it calls
    ``backward()`` on, and that output's tangent, the seed ``backward()`` makes for it.
    ``caller_bytes``: what the caller holds meanwhile beyond the graph's values: the loss it
    sums the outputs into and that loss's seed (``profiler.loss.training_loss``).
    ``resident_bytes``: the model's state and the step's inputs as the caller holds them, each
    storage once (0: the primals alone). What of them the step never reads (a buffer only another
    method uses), ``unread_bytes``, is resident throughout, as the primals are, and counted with
    them in ``static_bytes``.
    """

    name: str
    values: tuple[JointValue, ...]
    storage_bytes: tuple[int, ...]
    forward_outputs: tuple[int, ...]
    backward_outputs: tuple[int, ...]
    outputs_live: bool = True
    effects: tuple[int, ...] = ()
    priced_on: str | None = None
    replays: tuple[tuple[int, int], ...] = ()
    caller_held: tuple[int, ...] = ()
    caller_bytes: int = 0
    resident_bytes: int = 0

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """For each value, the values that read it, in order."""
        found: list[list[int]] = [[] for _ in self.values]
        for value in self.values:
            for i in dict.fromkeys(value.inputs):
                found[i].append(value.index)
        return tuple(tuple(u) for u in found)

    @cached_property
    def static_storages(self) -> frozenset[int]:
        """The primals' storages: alive for the whole step, before and after it."""
        return frozenset(s for v in self.values if v.phase == "primal" for s in v.storages)

    @cached_property
    def held_storages(self) -> tuple[tuple[int, ...], ...]:
        """For each value, the storages it holds that are not the primals' (what holding it
        adds to the live bytes)."""
        static = self.static_storages
        return tuple(tuple(s for s in v.storages if s not in static) for v in self.values)

    @cached_property
    def primal_bytes(self) -> int:
        """Bytes of the primals' storages, each once."""
        return sum(self.storage_bytes[s] for s in self.static_storages)

    @cached_property
    def static_bytes(self) -> int:
        return max(self.primal_bytes, self.resident_bytes)

    @cached_property
    def unread_bytes(self) -> int:
        return self.static_bytes - self.primal_bytes

    @cached_property
    def forward_roots(self) -> tuple[int, ...]:
        """What the forward computes whatever it saves: its outputs and its effects."""
        return (*self.forward_outputs, *self.effects)

    @cached_property
    def saveable(self) -> tuple[int, ...]:
        """Forward values the backward reads directly: the candidates to save."""
        found = {i for v in self.values if v.phase == "backward" for i in v.inputs
                 if self.values[i].phase == "forward"}
        return tuple(sorted(found))

    @cached_property
    def fingerprint(self) -> str:
        """Stable hash of the values (names, ops, phases, inputs, storages) and storage sizes:
        equal for the joint graph of the same model, input shapes and dtypes."""
        payload = {
            "values": [[v.name, v.op, v.phase, list(v.inputs), list(v.storages)] for v in self.values],
            "storages": list(self.storage_bytes),
            "outputs": [list(self.forward_outputs), list(self.backward_outputs)],
        }
        if self.effects:
            payload["effects"] = list(self.effects)
        if self.replays:
            payload["replays"] = [list(pair) for pair in self.replays]
        blob = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @cached_property
    def drawn_for(self) -> dict[int, int]:
        """For each twin of ``replays``, the forward's own value it stands for at last (a twin
        may stand for another twin, which stands for a forward value)."""
        direct = dict(self.replays)
        found = {}
        for twin, first in direct.items():
            original = first
            while original in direct:
                original = direct[original]
            found[twin] = original
        return found

    @cached_property
    def twins_of(self) -> dict[int, tuple[int, ...]]:
        """For each original of ``drawn_for``, the twins that stand for it."""
        found: dict[int, list[int]] = {}
        for twin, original in self.drawn_for.items():
            found.setdefault(original, []).append(twin)
        return {original: tuple(twins) for original, twins in found.items()}

    def reading_drawn(self, saved: frozenset[int]) -> tuple[JointGraph, frozenset[int]]:
        """The graph that runs when ``saved`` is saved, and what it saves: where ``saved`` holds a
        twin or its original (``replays``), the forward saves the original, and whatever reads
        one of its twins reads it instead (the twin then never runs)."""
        if not self.replays:
            return self, saved
        drawn = self.drawn_for
        saved = frozenset(drawn.get(i, i) for i in saved)
        swap = {twin: original for twin, original in drawn.items() if original in saved}
        if not swap:
            return self, saved
        key = frozenset(swap)
        cache = self._read_drawn
        if key not in cache:
            values = tuple(
                replace(v, inputs=tuple(dict.fromkeys(swap.get(i, i) for i in v.inputs)))
                if any(i in swap for i in v.inputs) else v
                for v in self.values
            )
            cache[key] = replace(self, values=values, replays=tuple(p for p in self.replays if p[0] not in swap))
        return cache[key], saved

    @cached_property
    def _read_drawn(self) -> dict[frozenset[int], JointGraph]:
        return {}

    def index_of(self, name: str) -> int:
        for value in self.values:
            if value.name == name:
                return value.index
        raise KeyError(name)
