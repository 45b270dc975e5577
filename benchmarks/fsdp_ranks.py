"""Per-rank peak under FSDP2, predicted against measured, on two gloo ranks on CPU.

    python benchmarks/fsdp_ranks.py [--world 2]

For the GPT example (6 blocks, smaller batch) and a Linear/Tanh stack: ``profile(..., shard=
ShardSpec(world))`` and ``solve`` at several per-rank budgets, once; then every rank applies the
plan (``ckptplan.apply``), shards the model's blocks and the emitted module with ``fully_shard``,
runs two training steps on the same data, and reports MemTracker's peak of the second step and
whether the gathered gradients equal a single-process step's. Prints Markdown and writes it to
``benchmarks/results/fsdp_ranks.md``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import platform
import socket
from pathlib import Path

import results_file  # benchmarks/results_file.py, beside this script
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ckptplan
from ckptplan.profiler.loss import training_loss
from ckptplan.units import format_bytes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BUDGETS = (None, 0.85, 0.7, 0.5)  # None: no checkpointing


def gpt() -> tuple[nn.Module, tuple, nn.ModuleList]:
    spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLES / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, args = module.build(batch=4, seq=128)
    return model, args, model.blocks


def stack() -> tuple[nn.Module, tuple, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh()) for _ in range(6)])
    return model, (torch.randn(4096, 256),), model


MODELS = {"gpt (6 blocks)": gpt, "linear-tanh stack (6 blocks)": stack}


def rank_main(rank: int, world: int, port: int, name: str, plan_json: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model, args, blocks = MODELS[name]()
        reference = copy.deepcopy(model)
        torch.manual_seed(0)
        training_loss(reference(*args)).backward()
        plan = ckptplan.Plan.from_json(plan_json)
        module = ckptplan.apply(model, args, plan)  # every rank runs the plan solved once, below
        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        for _ in range(2):
            for p in module.parameters():
                p.grad = None
            tracker = MemTracker()
            tracker.track_external(module, *args)
            torch.manual_seed(0)
            with tracker:
                training_loss(module(*args)).backward()
        error = max((p.grad.full_tensor() - q.grad).abs().max().item()
                    for p, q in zip(module.parameters(), reference.parameters()))
        peak = int(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
        out[rank] = (plan.prediction.peak_bytes, peak, error, plan.solver.name)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    options = parser.parse_args()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{options.world} gloo ranks on CPU\n")
    print("| model | budget (of the per-rank no-checkpoint peak) | solver | rank | predicted peak | measured peak "
          "| error | gradients equal |")
    print("|---|---|---|---|---|---|---|---|")
    for name, build in MODELS.items():
        model, args, _ = build()
        graph = ckptplan.profile(model, args, shard=ckptplan.ShardSpec(options.world), outputs_live=False)
        for budget in BUDGETS:
            try:
                plan = ckptplan.make_plan(graph, []) if budget is None else ckptplan.solve(graph, budget, time_limit=20)
            except ckptplan.InfeasibleBudgetError as error:
                print(f"| {name} | {budget:.0%} | infeasible: least {format_bytes(error.min_peak_bytes)} | | | | | |")
                continue
            with mp.Manager() as manager:
                results = manager.dict()
                mp.spawn(rank_main, args=(options.world, free_port(), name, plan.to_json(), results),
                         nprocs=options.world)
                results = dict(results)
            for rank in sorted(results):
                predicted, measured, error, solver = results[rank]
                label = "none" if budget is None else f"{budget:.0%}"
                print(f"| {name} | {label} | {solver if budget is not None else '-'} | {rank} | "
                      f"{format_bytes(predicted)} | {format_bytes(measured)} | {(predicted - measured) / measured:+.2%} | "
                      f"{'yes' if error <= 1e-5 else f'no ({error:.2g})'} |", flush=True)


TITLE = "Per-rank peak under FSDP2, predicted against measured"
ABOUT = (
    "Two gloo ranks on CPU. Each plan is solved once for one rank (`profile(..., shard=ShardSpec(2))`), every rank "
    "applies it (`ckptplan.apply`), shards the model's blocks and the emitted module with `fully_shard`, and runs "
    "two steps on the same data; the peak is MemTracker's for the second step, the gradients are gathered "
    "(`full_tensor()`) and compared with a single-process step. The prediction allows, in forward, for the "
    "prefetched all-gather and the reduce-scatter buffer (`ckptplan/sharding.py`)."
)

if __name__ == "__main__":
    with results_file.recorded(__file__, TITLE, ABOUT):
        main()
