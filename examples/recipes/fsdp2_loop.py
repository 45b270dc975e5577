"""Recipe: a torchtitan-style FSDP2 training loop under a saved ckptplan plan for sharded training.

Run it with ``python examples/recipes/fsdp2_loop.py`` (CPU, two gloo ranks, no downloads; about
20 seconds). It trains ``examples/gpt.py``'s GPT (4 blocks, width 64) data-parallel on two ranks:

1. rank 0 profiles one rank's step (``ckptplan.ShardSpec(world)``: FSDP2 ``fully_shard`` per
   block, AdamW state sharded too), solves at 60% of that step's no-checkpoint peak and saves the
   plan JSON; the other ranks wait at a barrier, then every rank loads the same file (a per-rank
   solve under a time limit need not give every rank the same regions);
2. every rank ``ckptplan.apply``-s the plan to its model, then shards as a training script does:
   ``fully_shard`` on each of the *model's* blocks, then on the emitted module as the root (the
   emitted module calls each block module around that block's ops, so FSDP2's all-gather and
   reshard hooks run; its regions stay inside blocks);
3. AdamW on the emitted module's parameters (the model's, now sharded ``DTensor`` s), and a few
   steps, each rank on its own slice of the global batch; PyTorch's ``MemTracker`` measures each
   rank's forward+backward peak.

The plan names the optimizer, so its prediction is the steady-state step's, with AdamW's sharded
state resident. AdamW makes that state lazily, in the first ``optimizer.step()``: the first step's
forward and backward run without it, so its prediction is the same plan simulated for the step
without optimizer state (``first_step_prediction``); later steps are held to the plan's own.

Dropout is off (``dropout=0.0``), so that a single process can reproduce the ranks' arithmetic:
``train_single`` runs each step's rank slices one after another without checkpointing or
sharding and averages their gradients, and the two-rank run's losses, last gradients and
parameters equal it (bit for bit here; ``tests/test_recipes.py`` checks them with
``torch.testing.assert_close``). Against one forward over the whole global batch the gradients
differ by rounding only (about 2e-7), which AdamW's per-element normalisation amplifies in the
parameters. With dropout on, each rank draws masks from its own generator, which no sequential
run draws in the same order.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ckptplan

log = logging.getLogger(__name__)

WORLD, STEPS, BATCH_PER_RANK, SEQ, VOCAB = 2, 3, 4, 64, 256
BUDGET = 0.6
LR = 1e-3
_GPT_FILE = Path(__file__).resolve().parents[1] / "gpt.py"


def _load_gpt_example() -> Any:
    """``examples/gpt.py``, loaded by path (``examples`` is not a package)."""
    spec = importlib.util.spec_from_file_location("ckptplan_example_gpt", _GPT_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(seed: int = 0) -> nn.Module:
    """``examples/gpt.py``'s GPT at 4 blocks of width 64, dropout off; seeded, so every rank (and
    the single-process reference) starts from the same weights."""
    gpt = _load_gpt_example()
    torch.manual_seed(seed)
    return gpt.GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=64, dropout=0.0)


def global_batches(steps: int = STEPS, world: int = WORLD, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``(idx, targets)``, ``BATCH_PER_RANK`` sequences per rank."""
    generator = torch.Generator().manual_seed(seed)
    rows = BATCH_PER_RANK * world
    return [
        (torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
         torch.randint(0, VOCAB, (rows, SEQ), generator=generator))
        for _ in range(steps)
    ]


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s rows of a global batch, as a distributed sampler hands them out."""
    return tuple(t[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK] for t in batch)


def solve_and_save(model: nn.Module, args: tuple, world: int, path: str | Path,
                   budget: str | float = BUDGET) -> ckptplan.Plan:
    """Plan one of ``world`` FSDP2 ranks (``fully_shard`` per block, AdamW) for one rank's batch
    ``args`` at ``budget`` and write the plan to ``path`` (atomically)."""
    graph = ckptplan.profile(model, args, optimizer="adamw", shard=ckptplan.ShardSpec(world), outputs_live=False)
    plan = ckptplan.solve(graph, budget, solver="dp")
    ckptplan.save_plan(plan, path)
    return plan


def first_step_prediction(model: nn.Module, args: tuple, plan: ckptplan.Plan) -> int:
    """The per-rank peak ``plan`` gives the first step, before AdamW has made its state: the plan
    simulated on the same sharded step profiled without an optimizer."""
    sharding = plan.model.sharding
    graph = ckptplan.profile(model, args, shard=ckptplan.ShardSpec(sharding.degree, units=sharding.units), outputs_live=False)
    return ckptplan.simulate(graph, plan).peak_bytes


def shard_planned(model: nn.Module, module: nn.Module, world: int) -> None:
    """FSDP2 as a training script applies it: each of the model's blocks, then the emitted module
    as the root (which shares the model's remaining parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(rank: int, world: int, port: int, plan_path: str, steps: int, results: dict) -> None:
    """One rank's training job (``mp.spawn`` calls it): rank 0 solves and saves the plan unless
    ``plan_path`` exists; every rank loads and applies it, shards and trains ``steps`` steps.

    ``results[rank]`` gets a dict: per-step ``losses`` (of this rank's slice) and measured
    ``peaks``, and the plan's ``predicted_peak``; rank 0's also holds the whole ``params`` after
    training and the ``grads`` of the last step, gathered from the shards (``full_tensor``), by
    parameter name."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        batches = [rank_slice(batch, rank) for batch in global_batches(steps, world)]
        model = build_model()
        if rank == 0 and not Path(plan_path).exists():
            solve_and_save(model, batches[0], world, plan_path)
        dist.barrier()
        plan = ckptplan.load_plan(plan_path)
        module = ckptplan.apply(model, batches[0], plan, optimizer="adamw")
        shard_planned(model, module, world)
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        losses, peaks = [], []
        for step, (idx, targets) in enumerate(batches):
            tracker = MemTracker()
            tracker.track_external(module, optimizer, idx, targets)
            with tracker:
                loss = module(idx, targets)["loss"]
                loss.backward()
            peaks.append(int(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())))
            losses.append(loss.item())
            if step == len(batches) - 1:
                grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        params = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
        result = {"losses": losses, "peaks": peaks, "predicted_peak": plan.prediction.peak_bytes}
        if rank == 0:
            result.update(params=params, grads=grads)
        results[rank] = result
    finally:
        dist.destroy_process_group()


def train_distributed(plan_path: str | Path, world: int = WORLD, steps: int = STEPS) -> dict[int, dict]:
    """Spawn ``world`` gloo ranks running ``train_rank``; returns each rank's results. The plan is
    solved and written to ``plan_path`` by rank 0 unless the file exists."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(train_rank, args=(world, _free_port(), str(plan_path), steps, results), nprocs=world)
        return dict(results)


def train_single(world: int = WORLD, steps: int = STEPS, whole_batch: bool = False) -> dict[str, Any]:
    """The reference: one process, no checkpointing, no sharding, AdamW on the same data.

    By default each step runs the ranks' slices one after another, each loss scaled by
    ``1/world``, so the gradient is the ranks' average summed in the order FSDP2's reduce-scatter
    sums it; ``losses`` then holds each step's per-slice losses. With ``whole_batch`` each step
    is one forward over the global batch (``losses``: one per step): the same gradient up to
    rounding, which AdamW's per-element normalisation amplifies in the parameters (an element
    whose gradient is near zero moves by up to the learning rate either way)."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses: list[Any] = []
    batches = global_batches(steps, world)
    for step, batch in enumerate(batches):
        if whole_batch:
            loss = model(*batch)["loss"]
            loss.backward()
            losses.append(loss.item())
        else:
            step_losses = []
            for rank in range(world):
                loss = model(*rank_slice(batch, rank))["loss"]
                (loss / world).backward()
                step_losses.append(loss.item())
            losses.append(step_losses)
        if step == len(batches) - 1:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "grads": grads}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element-wise difference between two name -> tensor maps with the same names."""
    return max((a[name] - b[name]).abs().max().item() for name in b)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not dist.is_available() or not dist.is_gloo_available():
        raise SystemExit("This recipe needs torch.distributed with the gloo backend.")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        results = train_distributed(plan_path)
        plan = ckptplan.load_plan(plan_path)
    log.info("plan (solved and saved by rank 0): %d regions, per-rank peak %s predicted, %s without checkpointing",
             len(plan.regions), ckptplan.format_bytes(plan.prediction.peak_bytes),
             ckptplan.format_bytes(plan.prediction.baseline_peak_bytes))
    predicted_first = first_step_prediction(build_model(), rank_slice(global_batches()[0], 0), plan)
    for rank, result in sorted(results.items()):
        first, *later = result["peaks"]
        log.info(
            "rank %d: losses %s; measured peak %s on the first step (predicted %s), %s after (predicted %s)",
            rank, ", ".join(f"{x:.4f}" for x in result["losses"]),
            ckptplan.format_bytes(first), ckptplan.format_bytes(predicted_first),
            ", ".join(ckptplan.format_bytes(p) for p in later), ckptplan.format_bytes(result["predicted_peak"]),
        )
    reference = train_single()
    log.info("one process, no checkpointing: largest difference in parameters %.2e, in last gradients %.2e",
             largest_difference(results[0]["params"], reference["params"]),
             largest_difference(results[0]["grads"], reference["grads"]))
    log.info("done in %.1f s", time.perf_counter() - started)


if __name__ == "__main__":
    main()
