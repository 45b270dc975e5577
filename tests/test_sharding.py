"""Sharded data parallelism (``ckptplan.sharding``): the per-rank memory terms, the per-rank peak
predicted for FSDP2 (``fully_shard`` per block, 2 ranks, gloo on CPU) against MemTracker, and an
emitted module trained under FSDP2."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ckptplan
from ckptplan.errors import CkptPlanError, InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes, simulate
from tests.conftest import assert_same_gradients

WIDTH, LAYERS, BATCH = 256, 4, 512


def stack() -> tuple[nn.Sequential, torch.Tensor]:
    """Blocks of Linear-Tanh-Linear-Tanh: FSDP2 wraps each block as a unit."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    return nn.Sequential(*blocks), torch.randn(BATCH, WIDTH)


def test_spec_rejects_what_it_cannot_model() -> None:
    with pytest.raises(CkptPlanError, match="at least 1"):
        ckptplan.ShardSpec(0)
    with pytest.raises(CkptPlanError, match="0 \\(DDP\\), 1, 2 or 3"):
        ckptplan.ShardSpec(8, stage=4)
    with pytest.raises(CkptPlanError, match="stage 3"):
        ckptplan.ShardSpec(8, stage=1, master_dtype="float32")


def test_ddp_adds_its_gradient_buckets_and_shards_nothing() -> None:
    """ZeRO stage 0, plain DDP: each rank holds the whole state plus buckets as large as the
    trainable parameters (checked against DDP's own report in the two-rank test below)."""
    model, x = stack()
    model[0][0].requires_grad_(False)
    whole = ckptplan.profile(model, (x,), optimizer="adamw")
    ddp = ckptplan.profile(model, (x,), optimizer="adamw", shard=ckptplan.ShardSpec(4, stage=0))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert ddp.static.bucket_bytes == trainable and whole.static.bucket_bytes == 0
    assert ddp.static.resident_bytes == whole.static.resident_bytes + trainable
    assert baseline_peak_bytes(ddp) == baseline_peak_bytes(whole) + trainable
    plan = ckptplan.solve(ddp, 0.95, solver="dp")
    assert ckptplan.Plan.from_json(plan.to_json()).model.sharding.stage == 0
    assert plan.model.fingerprint == ckptplan.make_plan(whole, []).model.fingerprint


def test_static_terms_are_divided_by_the_degree() -> None:
    model, x = stack()
    whole = ckptplan.profile(model, (x,), optimizer="adamw")
    unit_bytes = sum(p.numel() * 4 for p in model[0].parameters())
    for stage in (1, 2, 3):
        rank = ckptplan.profile(model, (x,), optimizer="adamw", shard=ckptplan.ShardSpec(4, stage=stage))
        assert rank.fingerprint == whole.fingerprint  # a plan applies to the model either way
        assert rank.static.optimizer_bytes == -(-whole.static.optimizer_bytes // 4)
        sharded_grads = stage >= 2
        assert rank.static.grad_bytes == (whole.static.grad_bytes // 4 if sharded_grads else whole.static.grad_bytes)
        assert rank.static.param_bytes == (whole.static.param_bytes // 4 if stage == 3 else whole.static.param_bytes)
    rank = ckptplan.profile(model, (x,), shard=ckptplan.ShardSpec(4))
    assert [(u.path, u.param_bytes) for u in rank.sharding.units] == [(str(i), unit_bytes) for i in range(LAYERS)]
    # A unit's gathered parameters are live while it runs: its first op sees them and its neighbours'.
    first = rank.sharding.units[1].start
    assert rank.nodes[first].fwd_workspace_bytes - whole.nodes[first].fwd_workspace_bytes == 3 * unit_bytes


def test_master_dtype_counts_fp32_copies_of_a_bf16_model() -> None:
    model, x = stack()
    model = model.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    bf16 = ckptplan.profile(model, (x,), optimizer="adamw", shard=ckptplan.ShardSpec(2))
    mixed = ckptplan.profile(model, (x,), optimizer="adamw", shard=ckptplan.ShardSpec(2, master_dtype="float32"))
    assert mixed.sharding.master_scale == 2.0
    assert mixed.static.grad_bytes == 2 * bf16.static.grad_bytes
    assert mixed.static.optimizer_bytes == pytest.approx(2 * bf16.static.optimizer_bytes, rel=1e-3)


def test_unknown_units_are_one_clear_error() -> None:
    model, x = stack()
    with pytest.raises(CkptPlanError, match="no module 'layers.0'"):
        ckptplan.profile(model, (x,), shard=ckptplan.ShardSpec(2, units=("layers.0",)))


# ------------------------------------------------------------------ FSDP2 on two ranks, measured
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _second_step_peak(module: nn.Module, x: torch.Tensor) -> int:
    """MemTracker's peak over the second of two training steps of ``module`` (the steady state a
    training loop sees: FSDP2's buffers exist by then)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from ckptplan.profiler.loss import training_loss

    for _ in range(2):
        for p in module.parameters():
            p.grad = None
        tracker = MemTracker()
        tracker.track_external(module, x)
        with tracker:
            training_loss(module(x)).backward()
    return int(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))


def _fsdp2_peak(world: int, checkpointed: bool) -> int:
    """This rank's MemTracker peak over the second step of the stack under FSDP2, each block
    checkpointed with ``torch.utils.checkpoint`` when ``checkpointed``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint


    class Checkpointed(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    model, x = stack()
    if checkpointed:
        for i in range(LAYERS):
            model[i] = Checkpointed(model[i])
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _second_step_peak(model, x)


def _fsdp2_emitted(world: int) -> tuple[int, int, float]:
    """(measured peak, predicted peak, largest gradient error) of an emitted module under FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckptplan.profiler.loss import training_loss

    model, x = stack()
    reference = copy.deepcopy(model)
    training_loss(reference(x)).backward()
    graph = ckptplan.profile(model, (x,), shard=ckptplan.ShardSpec(world), outputs_live=False)  # as _rank's loops
    # Every block but the first checkpointed, keeping its first Linear's output.
    regions = [ckptplan.Region(u.start, u.end, keep=(graph.nodes[u.start].name,)) for u in graph.sharding.units[1:]]
    plan = ckptplan.make_plan(graph, regions)
    emitted = ckptplan.emit(graph, plan)
    mesh = init_device_mesh("cpu", (world,))
    for block in model:  # the model's own blocks, as a training script shards them
        fully_shard(block, mesh=mesh)
    fully_shard(emitted, mesh=mesh)
    peak = _second_step_peak(emitted, x)
    grad_error = max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(emitted.parameters(), reference.parameters())
    )
    return peak, plan.prediction.peak_bytes, grad_error


def _ddp_emitted(rank: int, world: int) -> tuple:
    """An emitted module under DDP, each rank on its own slice of the batch: (gradients after
    the first step, regions, predicted bucket bytes, DDP's bucket bytes, predicted peak, measured peak)."""
    from torch.nn.parallel import DistributedDataParallel

    from ckptplan.profiler.loss import training_loss

    model, x = stack()
    shard = x.chunk(world)[rank]  # each rank its own slice of the batch
    graph = ckptplan.profile(model, (shard,), shard=ckptplan.ShardSpec(world, stage=0), outputs_live=False)
    # Blocks 2-4 in one region holding two nested ones, the first block's second Linear kept.
    plan = ckptplan.make_plan(graph, [
        ckptplan.Region(0, 4, keep=(graph.nodes[2].name,)),
        ckptplan.Region(4, 16, children=(ckptplan.Region(4, 8), ckptplan.Region(8, 12))),
    ])
    emitted = DistributedDataParallel(ckptplan.emit(graph, plan))
    training_loss(emitted(shard)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    # DDP rebuilds its buckets in the second step's forward; from the third on they exist
    # before the step. MemTracker counts each from the reducer's first write into it (a
    # ``mul.out`` of a gradient scaled by 1/world) on: here before the step's peak.
    training_loss(emitted(shard)).backward()
    buckets = sum(int(b) for b in emitted._get_ddp_logging_data()["bucket_sizes"].split(", "))
    # Tensor by tensor: the buckets exist before the step, where the allocator's count of it
    # (``measure_step``'s default) starts; MemTracker sees the reducer write into them.
    measured = ckptplan.measure_step(emitted, (shard,), counter="tensors", outputs_live=False).peak_bytes
    return grads, len(plan.regions), graph.static.bucket_bytes, buckets, plan.prediction.peak_bytes, measured


def _rank(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = {
            "no-checkpoint": _fsdp2_peak(world, checkpointed=False),
            "block-checkpoint": _fsdp2_peak(world, checkpointed=True),
            "fsdp2": _fsdp2_emitted(world),
            "ddp": _ddp_emitted(rank, world),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_ranks_measure_what_is_predicted_with_the_single_process_gradients() -> None:
    """Two gloo ranks, spawned once for every scenario (the spawn costs more than the scenarios):

    - FSDP2 (``fully_shard`` per block), without checkpointing and with every block in
      ``torch.utils.checkpoint``: each rank's peak is the simulator's per-rank prediction.
    - An emitted module (keep-set regions) under FSDP2, same data on both ranks: the gradients
      are the single-process ones and the peak is the prediction.
    - DDP around an emitted module (a keep-set region and nested regions): each rank's
      gradients after the all-reduce are the average of the single-process gradients of the two
      slices of the batch; a plan made for DDP (ZeRO stage 0) counts DDP's gradient buckets as
      DDP itself reports them; the peak is the prediction.

    Peaks are within 3% of MemTracker's."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(2, _free_port(), results), nprocs=2)
        results = dict(results)

    model, x = stack()
    graph = ckptplan.profile(model, (x,), shard=ckptplan.ShardSpec(2), outputs_live=False)  # the ranks' loops drop them
    for scenario, regions in (
        ("no-checkpoint", []),
        ("block-checkpoint", [ckptplan.Region(u.start, u.end) for u in graph.sharding.units]),
    ):
        predicted = simulate(graph, regions).peak_bytes
        for rank in (0, 1):
            measured = results[rank][scenario]
            assert abs(predicted - measured) <= 0.03 * measured, (scenario, rank, measured, predicted)

    for rank in (0, 1):
        measured, predicted, grad_error = results[rank]["fsdp2"]
        assert grad_error == 0.0  # same data on both ranks: the averaged gradient is the single-process one
        assert abs(predicted - measured) <= 0.03 * measured, ("emitted under FSDP2", rank, measured, predicted)

    from ckptplan.profiler.loss import training_loss

    expected = None
    for shard in x.chunk(2):
        reference = copy.deepcopy(model)
        training_loss(reference(shard)).backward()
        grads = [p.grad for p in reference.parameters()]
        expected = grads if expected is None else [(a + b) / 2 for a, b in zip(expected, grads)]
    for rank in (0, 1):
        grads, regions, bucket_bytes, reported, predicted, measured = results[rank]["ddp"]
        assert regions > 0
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)
        assert bucket_bytes == reported == sum(p.numel() * p.element_size() for p in model.parameters())
        assert abs(predicted - measured) <= 0.03 * measured, ("emitted under DDP", rank, predicted, measured)


def test_a_region_across_two_shard_units_is_refused_at_emit() -> None:
    from ckptplan.errors import PlanFormatError

    model, x = stack()
    graph = ckptplan.profile(model, (x,), shard=ckptplan.ShardSpec(2))
    first, second = graph.sharding.units[:2]
    plan = ckptplan.make_plan(graph, [ckptplan.Region(first.start + 2, second.start + 2)])
    with pytest.raises(PlanFormatError, match="crosses the edge of shard unit '0'"):
        ckptplan.emit(graph, plan)


@pytest.mark.parametrize("solver", ["sqrt", "dp", "ilp"])
def test_every_solver_plans_regions_inside_shard_units(solver: str) -> None:
    from ckptplan.sharding import unit_edges
    from tests.test_blocks import small_gpt

    model, args = small_gpt(n_layer=4)
    graph = ckptplan.profile(model, args, shard=ckptplan.ShardSpec(4))
    edges = unit_edges(graph)
    assert len(edges) >= 4
    plan = ckptplan.solve(graph, 0.8, solver=solver, time_limit=2)
    for top in plan.regions:
        for region in top.walk():
            assert not any(region.start < e < region.end for e in edges), (region, edges)
    assert_same_gradients(model, ckptplan.emit(graph, plan), args)


@pytest.mark.parametrize("solver", ["sqrt", "dp", "auto"])
def test_the_least_peak_an_error_names_is_a_budget_that_solves(solver: str) -> None:
    """On a sharded graph, where a region may not span two units, the least peak
    ``InfeasibleBudgetError`` names must be one the solver's plans reach. It had been the least
    of plans planned across the units' edges and cut there afterwards: GPT-3 at 80 GB, 64-way,
    named 60.87 GiB for sqrt, whose cut plan peaks at 60.80; here dp named 2.79 MiB, where its
    cut plan peaked at 3.25."""
    from tests.test_blocks import small_gpt

    model, args = small_gpt(n_layer=4)
    graph = ckptplan.profile(model, args, shard=ckptplan.ShardSpec(4))
    with pytest.raises(InfeasibleBudgetError) as error:
        ckptplan.solve(graph, graph.static.floor_bytes, solver=solver, time_limit=2)
    least = error.value.min_peak_bytes
    plan = ckptplan.solve(graph, least, solver=solver, time_limit=2)
    assert simulate(graph, plan).peak_bytes <= least
