"""The ComputeGraph: a frozen, torch-free description of one training step's forward graph.

Memory is described at the level of *storages* (what the allocator sees), not tensors: a view
shares its base's storage, and autograd may save tensors that are no node's output (dropout
masks, normalisation statistics). Solvers and the simulator only ever see these plain records.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from ckptplan.errors import CkptPlanError

if TYPE_CHECKING:
    import networkx

StorageKind = Literal["activation", "hidden", "input", "param", "buffer"]
STATIC_KINDS: frozenset[str] = frozenset({"input", "param", "buffer"})


@dataclass(frozen=True)
class Storage:
    """One allocation. ``producer`` is the index of the node that allocated it (-1 when static).

    ``kind``: ``activation`` (some node's output), ``hidden`` (allocated by an op and saved for
    backward but returned by no node: masks, statistics), ``input`` (a graph input, held by the
    caller), ``param`` / ``buffer`` (model state). ``trainable`` marks parameters that get a grad.
    ``cached``: a ``hidden`` copy that ``torch.autocast`` made of a tensor that requires grad (a
    trainable parameter) and keeps in its cache until the context exits: the end of forward and
    loss, or of a recompute in backward. Autograd may save it too, or nothing may (a bias).
    """

    index: int
    nbytes: int
    kind: StorageKind
    producer: int = -1
    trainable: bool = False
    cached: bool = False

    @property
    def is_static(self) -> bool:
        return self.kind in STATIC_KINDS


@dataclass(frozen=True)
class Node:
    """One compute op of the forward graph, in execution order.

    ``inputs``: indices of compute nodes whose values this op reads (graph inputs and parameters
    are not nodes; they appear in ``saved`` / ``param_grads`` as storages).
    ``outputs``: storages its output tensors live in (an alias of an input's storage for views).
    ``saved``: non-parameter storages autograd keeps for this op's backward, outputs and hidden
    tensors included. ``grad_inputs``: input nodes that receive a gradient from this op.
    ``param_grads``: trainable parameter storages this op produces a gradient for.
    ``param_grad_copies``: those whose gradient it makes in another layout than the parameter's
    (a convolution after a channels-last permute): autograd stores the first gradient of a
    parameter in the parameter's layout, so it allocates a copy there (``AccumulateGrad``'s
    layout contract) and frees this one.
    ``inplace``: the op writes into one of its inputs (``add_``, ``relu_``) that is an activation
    or a graph input. ``writes``: the storages it writes into in place, model state included
    (batch norm's running statistics); empty where unknown, when ``outputs`` stand for them.
    ``random``: the op draws random numbers (dropout); recomputation replays the RNG stream.
    ``grad_aliases_output``: the gradients it passes to its inputs are views of the gradient
    it receives (view ops), so backward allocates nothing for them.
    ``grad_aliased_inputs``: the input nodes whose gradient is a view of the one it receives:
    all of ``grad_inputs`` for view ops, some for others (an ``add`` of a float32 and a bfloat16
    tensor, as autocast makes them, passes its float32 gradient on and casts a copy for the
    other input). Backward allocates nothing for those either.
    ``output_bytes``: bytes of its floating output tensors (the size of their gradient).
    ``fwd_workspace_bytes`` / ``bwd_workspace_bytes``: temporaries the op allocates and frees
    inside its forward / backward, beyond what it returns (composite ops: math attention,
    cross-entropy).
    ``made_by_last_save``: the storages it allocates that exist when autograd saves its last
    tensor, where a recompute's early stop ends (autograd saves an op's inputs before it runs,
    its outputs after: CUDA's one-kernel dropout has made its output and mask when it saves the
    mask; CPU's, a ``bernoulli_`` then a ``mul`` that saves the mask as an input, has made only
    the mask). None: the storages of its own it saves.
    ``fwd_cost`` / ``bwd_cost``: roofline time estimates in seconds (see profiler.cost).
    ``fwd_freed_bytes``: storages its dispatched ops return in forward that are freed before it
    ends (``torch.diff(x, prepend=...)``'s ``cat``), unlike kernel-internal buffers: a selective
    policy keeping the node caches them too, so such a node is never kept (``keepable``).
    ``bwd_unpack_bytes``: bytes its backward holds while unpacking its saved tensors, before it
    allocates anything, beyond what stays for the whole backward (``bwd_workspace_bytes``): set
    only by ``ckptplan.remat`` for a chain's inputs, recomputed and dropped there.
    """

    index: int
    name: str
    op: str
    module: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    saved: tuple[int, ...]
    grad_inputs: tuple[int, ...] = ()
    param_grads: tuple[int, ...] = ()
    requires_grad: bool = False
    inplace: bool = False
    random: bool = False
    grad_aliases_output: bool = False
    grad_aliased_inputs: tuple[int, ...] = ()
    output_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_workspace_bytes: int = 0
    bwd_workspace_bytes: int = 0
    made_by_last_save: tuple[int, ...] | None = None
    bytes_moved: int = 0
    fwd_cost: float = 0.0
    bwd_cost: float = 0.0
    fwd_freed_bytes: int = 0
    bwd_unpack_bytes: int = 0
    writes: tuple[int, ...] = ()
    param_grad_copies: tuple[int, ...] = ()


@dataclass(frozen=True)
class StaticMemory:
    """Bytes resident for the whole step, plus the gradient bytes backward will allocate.
    ``bucket_bytes``: DDP's gradient buckets (``ckptplan.sharding``, ZeRO stage 0)."""

    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    grad_bytes: int
    optimizer_bytes: int = 0
    optimizer: str | None = None
    bucket_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        """Held from before forward until after backward: state, optimizer state, inputs, buckets."""
        return self.param_bytes + self.buffer_bytes + self.input_bytes + self.optimizer_bytes + self.bucket_bytes

    @property
    def floor_bytes(self) -> int:
        """What every plan's peak holds: the resident bytes and, by the end of backward, the
        gradients (no activation counted). No budget below it can be met."""
        return self.resident_bytes + self.grad_bytes


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: Any) -> TensorSpec:
        """A tensor's shape and dtype name (``"float32"`` for ``torch.float32``)."""
        return cls(shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class ShardSpec:
    """How the training state is split across the ranks of one data-parallel group.

    ``degree``: ranks sharing it. ``stage``: ZeRO stage (1, 2 or 3; FSDP2 ``fully_shard`` is 3), or
    0 for DDP (replicated state plus gradient buckets).
    ``master_dtype``: the dtype sharded parameters, their gradients and the optimizer state are
    kept in, when the model (as profiled) computes in a lower one (FSDP2 mixed precision); None:
    the model's own. ``units``: module paths wrapped as units (default: the repeated blocks).
    """

    degree: int
    stage: int = 3
    master_dtype: str | None = None
    units: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise CkptPlanError(f"The shard degree must be at least 1, got {self.degree}.")
        if self.stage not in (0, 1, 2, 3):
            raise CkptPlanError(f"The ZeRO stage must be 0 (DDP), 1, 2 or 3, got {self.stage}.")
        if self.master_dtype is not None and self.stage != 3:
            raise CkptPlanError("A master dtype needs stage 3 (FSDP2 mixed precision); drop it or use stage 3.")


@dataclass(frozen=True)
class ShardUnit:
    """One FSDP unit: module ``path`` runs nodes ``[start, end)`` and owns ``param_bytes``."""

    path: str
    start: int
    end: int
    param_bytes: int


@dataclass(frozen=True)
class ShardLayout:
    """What ``shard_graph`` needs: the spec, the units in execution order, the root unit's
    parameter bytes, and ``master_scale`` (bytes of the master copy per byte of model parameter)."""

    spec: ShardSpec
    units: tuple[ShardUnit, ...]
    root_param_bytes: int
    master_scale: float = 1.0


@dataclass(frozen=True)
class ComputeGraph:
    """The forward graph of one training step, annotated for planning.

    ``outputs``: node indices whose values the model returns; ``loss_nodes``: those backward
    starts from (see ``profiler.loss.loss_leaves``); ``loss_scalar_bytes`` and ``seed_bytes``: the
    scalars the step adds around backward (``simulation``'s docstring says when each lives). ``traced`` (the torch GraphModule the
    emitter rewrites) and ``model`` (the profiled module) are handles, not part of the
    description: no equality, no hash, never serialised.
    """

    name: str
    nodes: tuple[Node, ...]
    storages: tuple[Storage, ...]
    static: StaticMemory
    outputs: tuple[int, ...]
    loss_nodes: tuple[int, ...]
    inputs: tuple[TensorSpec, ...] = ()
    trace: str = "export"
    # The scalars a step adds around backward (``profiler.loss.training_loss``): the loss that
    # ``out.sum()`` allocates when the model does not return a scalar loss (0 when it does), live
    # from the end of forward to the end of the step; and backward's seed, ``ones_like(loss)``.
    loss_scalar_bytes: int = 0
    seed_bytes: int = 0
    # The loss is the model's own scalar output (``loss_scalar_bytes`` 0), which the caller holds
    # as ``loss`` through backward.
    loss_is_output: bool = False
    # The caller keeps the model's outputs through backward (``out = model(x); loss(out).backward()``
    # with ``out`` still bound, as a plain loop does); False: it drops them once the loss is made
    # (``Trainer``, Lightning, torchtitan), so they die with forward unless backward needs them.
    outputs_live: bool = False
    # What a checkpoint region that draws random numbers stashes of the RNG state where the step
    # runs, to replay its stream when recomputing (``torch.get_rng_state()``: the CPU generator's
    # 5,056 bytes; on CUDA the states are CPU tensors, 0 bytes of device memory). Held with the
    # region's inputs, and once more during its recompute (``torch.random.fork_rng``).
    rng_state_bytes: int = 0
    # Seconds checkpointing's machinery adds to a step (``profiler.cost.Roofline``): per region,
    # per node of a region (its saved-tensor hooks and the recompute's bookkeeping), and per
    # kept node (its selective policy's dispatch modes, once in forward, once in the recompute);
    # and per recompute of a rematerialised node (its saving op's saved-tensor hooks).
    region_cost: float = 0.0
    region_op_cost: float = 0.0
    policy_op_cost: float = 0.0
    remat_cost: float = 0.0
    # What the costs count (``Roofline.priced_in``): "seconds", or "flops" (10¹² per cost-second).
    priced_in: str = "seconds"
    # Where the costs come from (``Roofline.source``): "a100", "measured", "flops" or "custom";
    # empty for graphs made otherwise.
    priced_on: str = ""
    # The dtype name ("bfloat16", "float16") when the step's forward runs under torch.autocast:
    # the graph's bytes are then those of that step, and the fingerprint tells it apart.
    autocast: str | None = None
    # The device kind whose kernels the recorded bytes follow ("cpu", "cuda"; see
    # ``profiler.profile``), None for graphs not profiled from a model.
    target: str | None = None
    # True when ``profile(..., spell_out=True)`` ran composite kernels (math-kernel attention,
    # CPU dropout) as their parts (``profiler.composite``).
    spelled_out: bool = False
    # Set by ``ckptplan.sharding.shard_graph``: the layout one rank's memory follows, and the
    # static memory before sharding (which the fingerprint keeps using).
    sharding: ShardLayout | None = None
    unsharded_static: StaticMemory | None = None
    traced: Any = field(default=None, compare=False, repr=False, hash=False)
    model: Any = field(default=None, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        for position, node in enumerate(self.nodes):
            if node.index != position:
                raise ValueError(f"node {node.name!r} has index {node.index}, expected {position}")

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def memo(self) -> dict[str, Any]:
        """Scratch space for work derived from this graph alone, whatever the budget, filled by
        whoever derives it (``solvers.memo``); not part of the graph's value (never compared,
        hashed or written), and gone with the graph."""
        return {}

    @cached_property
    def index_of(self) -> dict[str, int]:
        return {node.name: node.index for node in self.nodes}

    def node(self, name: str) -> Node:
        return self.nodes[self.index_of[name]]

    @cached_property
    def activation_bytes(self) -> int:
        """Bytes autograd saves for backward in one step without checkpointing (each storage once,
        parameters and graph inputs excluded: they are resident anyway)."""
        saved = {s for node in self.nodes for s in node.saved}
        return sum(self.storages[s].nbytes for s in sorted(saved) if not self.storages[s].is_static)

    def saved_bytes(self, index: int) -> int:
        """Bytes of non-resident storages node ``index`` saves for backward."""
        return sum(self.storages[s].nbytes for s in self.nodes[index].saved if not self.storages[s].is_static)

    def new_bytes(self, index: int) -> int:
        """Bytes node ``index`` allocates in forward (fresh outputs and hidden saved tensors)."""
        return sum(s.nbytes for s in self.produced_by(index))

    def produced_by(self, index: int) -> tuple[Storage, ...]:
        return self._produced[index]

    @cached_property
    def _produced(self) -> tuple[tuple[Storage, ...], ...]:
        produced: list[list[Storage]] = [[] for _ in self.nodes]
        for storage in self.storages:
            if storage.producer >= 0:
                produced[storage.producer].append(storage)
        return tuple(tuple(p) for p in produced)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """``users[i]``: nodes reading node i's value, ascending."""
        users: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for i in sorted(set(node.inputs)):
                users[i].append(node.index)
        return tuple(tuple(u) for u in users)

    @cached_property
    def saved_by(self) -> dict[int, tuple[int, ...]]:
        """``saved_by[s]``: the nodes whose backward saves storage ``s``, ascending."""
        found: dict[int, list[int]] = {}
        for node in self.nodes:
            for s in dict.fromkeys(node.saved):
                found.setdefault(s, []).append(node.index)
        return {s: tuple(nodes) for s, nodes in found.items()}

    @cached_property
    def inplace_writers(self) -> dict[int, tuple[int, ...]]:
        """``inplace_writers[s]``: the in-place nodes writing into storage ``s``, ascending."""
        writers: dict[int, list[int]] = {}
        for node in self.nodes:
            if node.inplace:
                for s in dict.fromkeys(node.writes or node.outputs):
                    writers.setdefault(s, []).append(node.index)
        return {s: tuple(w) for s, w in writers.items()}

    @cached_property
    def boundaries(self) -> frozenset[int]:
        """Positions k in 0..n where a region may start or end: no in-place op at or after k
        writes into an activation produced before k (recomputing from a region's inputs needs
        them unmodified, as non-reentrant checkpoint checks), and none at or after k writes into
        a graph input."""
        blocked: set[int] = set()
        for s, writers in self.inplace_writers.items():
            storage = self.storages[s]
            if storage.kind == "input":
                # The caller's tensor, overwritten: no region before the last write may read it, and
                # none may hold the write (recomputing it would write twice).
                blocked.update(range(writers[-1] + 1))
            elif not storage.is_static:
                blocked.update(k for w in writers if storage.producer < w for k in range(storage.producer + 1, w + 1))
        return frozenset(k for k in range(len(self.nodes) + 1) if k not in blocked)

    @cached_property
    def total_fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    @cached_property
    def step_cost(self) -> float:
        """Estimated seconds of one forward plus backward without recomputation."""
        return sum(n.fwd_cost + n.bwd_cost for n in self.nodes)

    @cached_property
    def fingerprint(self) -> str:
        """Stable hash of structure, sizes and dtypes: equal for the same model and input shapes
        (sharded or not) profiled under the same autocast dtype for the same target's kernels."""
        static = self.unsharded_static or self.static
        payload = {
            "nodes": [
                [n.name, n.op, n.inputs, [self.storages[s].nbytes for s in n.outputs], n.output_bytes]
                for n in self.nodes
            ],
            "inputs": [[list(t.shape), t.dtype] for t in self.inputs],
            "static": [static.param_bytes, static.buffer_bytes, static.grad_bytes],
        }
        if self.autocast is not None:  # only then, so graphs without autocast keep their fingerprint
            payload["autocast"] = self.autocast
        if self.target == "cuda":  # only then, so graphs of CPU kernels keep the fingerprint they had
            payload["target"] = self.target
        blob = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_networkx(self) -> networkx.DiGraph:
        """A DiGraph view: one vertex per node index with its record under ``"node"``."""
        import networkx as nx

        graph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.index, node=node)
        for node in self.nodes:
            for i in node.inputs:
                graph.add_edge(i, node.index)
        return graph
