"""Plans priced in FLOPs (``ckptplan.profiler.FLOPS``, the CLI's ``--costs flops``): what
``FlopCounterMode`` counts is what they minimise, and a plan's predicted recompute FLOPs is what
that counter measures on the emitted module."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import ckptplan
from ckptplan.profiler.cost import PHILOX_OPS_PER_NUMBER
from ckptplan.profiler.loss import training_loss
from tests.conftest import load_example


def _tiny_gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = load_example("gpt").GPT(n_layer=2, block_size=64)
    return model, (torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64)))


def _step_flops(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    counter = FlopCounterMode(display=False)
    torch.manual_seed(0)
    with counter:
        training_loss(module(*args)).backward()
    return counter.get_total_flops()


def test_an_op_costs_its_flops_a_thousandth_of_a_flop_per_byte_and_its_generator_s_work_per_random_number() -> None:
    model, args = _tiny_gpt()
    graph = ckptplan.profile(model, args, roofline=ckptplan.profiler.FLOPS)
    dropouts = [node for node in graph.nodes if node.op == "aten.dropout.default"]
    assert dropouts
    for node in graph.nodes:
        # A dropout draws one number per element of its (fp32) output; other random ops (attention's
        # dropout inside SDPA) draw numbers the node's outputs do not count.
        drawn = node.output_bytes // 4 if node in dropouts else 0
        least = max(node.fwd_flops, node.bytes_moved / 1000, PHILOX_OPS_PER_NUMBER * drawn) / 1e12
        assert node.fwd_cost >= least * (1 - 1e-9) if node.random else node.fwd_cost == pytest.approx(least)
    for node in dropouts:
        assert node.fwd_cost == pytest.approx(PHILOX_OPS_PER_NUMBER * node.output_bytes / 4 / 1e12)
    assert graph.region_cost == graph.region_op_cost == graph.policy_op_cost == graph.remat_cost == 0.0
    assert graph.priced_in == "flops" and ckptplan.make_plan(graph, []).prediction.priced_in == "flops"
    assert ckptplan.profile(model, args).priced_in == "seconds"


def test_priced_in_flops_the_solver_matches_the_selective_policy_without_recomputing_a_matmul() -> None:
    """At the peak of a region around each block keeping every matmul-like output (torchtitan's
    selective policy), a FLOPs-priced ``ilp`` plan recomputes no matmul: FlopCounterMode counts
    the step's FLOPs unchanged, as the prediction says."""
    model, args = _tiny_gpt()
    graph = ckptplan.profile(model, args, roofline=ckptplan.profiler.FLOPS, spell_out=True)
    blocks: dict[str, list[int]] = {}
    for node in graph.nodes:
        if (found := re.match(r"blocks\.\d+", node.module)) is not None:
            blocks.setdefault(found.group(), []).append(node.index)
    selective = ckptplan.make_plan(graph, [
        ckptplan.Region(nodes[0], nodes[-1] + 1, keep=tuple(
            graph.nodes[i].name for i in nodes if graph.nodes[i].fwd_flops > 0 and not graph.nodes[i].random))
        for nodes in blocks.values()
    ])
    assert selective.prediction.recompute_flops == 0
    budget = selective.prediction.peak_bytes
    assert budget < ckptplan.make_plan(graph, []).prediction.peak_bytes

    plan = ckptplan.solve(graph, budget, solver="ilp", time_limit=4)
    assert plan.regions and plan.prediction.peak_bytes <= budget
    assert plan.prediction.recompute_flops == 0
    module = ckptplan.emit(graph, plan)
    assert _step_flops(module, args) == _step_flops(model, args)
    result = ckptplan.verify(model, args, plan, steps=1)
    assert result.gradients_equal and abs(result.prediction_error) <= 0.03
