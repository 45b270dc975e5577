"""Mixed precision: profiling a step whose forward runs under ``torch.autocast``.

The step is PyTorch's AMP recipe, forward and loss inside ``torch.autocast``, backward outside
it; the prediction is checked against MemTracker over that step on CPU, for the model and for an
emitted module, and the emitted module's gradients against the model's under the same recipe.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import ckptplan
from ckptplan.cli.main import app
from ckptplan.profiler.loss import training_loss
from ckptplan.simulation import baseline_peak_bytes
from tests.conftest import load_example

TOLERANCE = 0.03  # relative, as tests/test_measured.py
Graphs = tuple[nn.Module, tuple, ckptplan.ComputeGraph, ckptplan.ComputeGraph]  # model, args, fp32, bf16


def small_gpt(device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """examples/gpt.py at 2 layers, sequence 128, batch 8: activations dominate the step."""
    gpt = load_example("gpt")
    torch.manual_seed(0)
    with torch.device(device):
        model = gpt.GPT(n_layer=2, block_size=128)
        args = (torch.randint(0, 256, (8, 128)), torch.randint(0, 256, (8, 128)))
    return model, args


@pytest.fixture(scope="module")
def model_and_graphs() -> Graphs:
    model, args = small_gpt()
    return model, args, ckptplan.profile(model, args), ckptplan.profile(model, args, autocast=torch.bfloat16)


def autocast_step(module: nn.Module, args: tuple, seed: int = 0) -> None:
    """One step of the AMP recipe: forward and loss under CPU autocast, backward outside it."""
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = training_loss(module(*args))
    loss.backward()


def measured_peak(module: nn.Module, args: tuple) -> int:
    """The allocator's peak over ``autocast_step`` (``measure_step``, seeded as that step is)."""
    torch.manual_seed(0)
    return ckptplan.measure_step(module, args, autocast=torch.bfloat16).peak_bytes


def assert_close(predicted: int, measured: int, what: str) -> None:
    error = abs(predicted - measured) / measured
    assert error <= TOLERANCE, f"{what}: predicted {predicted} vs measured {measured} ({100 * error:.2f}%)"


def test_linear_outputs_and_weight_casts_are_saved_in_bfloat16(model_and_graphs: Graphs) -> None:
    model, _, fp32, bf16 = model_and_graphs
    assert bf16.autocast == "bfloat16" and fp32.autocast is None
    assert [n.name for n in bf16.nodes] == [n.name for n in fp32.nodes]
    linears = [(a, b) for a, b in zip(fp32.nodes, bf16.nodes) if a.op == "aten.linear.default"]
    assert linears
    for full, mixed in linears:  # autocast runs linear in bfloat16: half the bytes, and its gradient
        assert mixed.output_bytes * 2 == full.output_bytes, mixed.name
        assert [bf16.storages[s].nbytes * 2 for s in mixed.outputs] == [fp32.storages[s].nbytes for s in full.outputs]
    # CPU autocast leaves layer_norm alone: its float32 input stays float32.
    norms = [(a, b) for a, b in zip(fp32.nodes, bf16.nodes) if a.op == "aten.layer_norm.default"]
    assert norms and all(a.output_bytes == b.output_bytes for a, b in norms)
    # The first qkv linear saves autocast's bfloat16 copy of its weight, made by that op.
    qkv = next(b for _, b in linears if b.module == "blocks.0.attn.qkv")
    weight_cast = model.blocks[0].attn.qkv.weight.numel() * 2
    hidden = [bf16.storages[s] for s in qkv.saved if bf16.storages[s].kind == "hidden"]
    assert any(s.nbytes == weight_cast and s.producer == qkv.index for s in hidden)
    assert bf16.activation_bytes < fp32.activation_bytes
    assert baseline_peak_bytes(bf16) < baseline_peak_bytes(fp32)
    assert bf16.fingerprint != fp32.fingerprint


def test_float16_has_bfloat16_bytes_and_its_own_fingerprint(model_and_graphs: Graphs) -> None:
    model, args, _, bf16 = model_and_graphs
    fp16 = ckptplan.profile(model, args, autocast=torch.float16)
    assert fp16.autocast == "float16"
    assert [n.output_bytes for n in fp16.nodes] == [n.output_bytes for n in bf16.nodes]
    assert fp16.activation_bytes == bf16.activation_bytes
    assert fp16.fingerprint != bf16.fingerprint


def test_autocast_takes_a_low_precision_dtype_only() -> None:
    model, args = nn.Linear(4, 4), (torch.randn(2, 4),)
    for wrong in ("bf16", torch.float32, torch.int8):
        with pytest.raises(ckptplan.CkptPlanError, match="autocast must be torch.bfloat16"):
            ckptplan.profile(model, args, autocast=wrong)


def test_meta_model_profiles_like_the_same_model_on_cpu() -> None:
    """The meta device has no autocast; the profiler records it as fake CPU tensors, so a model
    too large to build profiles as it would on CPU (but for the kernel workspaces that only a
    real run of each op measures)."""
    cpu = ckptplan.profile(*small_gpt("cpu"), autocast=torch.bfloat16, workspaces=False)
    meta = ckptplan.profile(*small_gpt("meta"), autocast=torch.bfloat16)
    assert meta.nodes == cpu.nodes and meta.storages == cpu.storages and meta.static == cpu.static
    assert meta.fingerprint == cpu.fingerprint


def test_predicted_peak_matches_memtracker_under_autocast(model_and_graphs: Graphs) -> None:
    model, args, _, graph = model_and_graphs
    assert_close(baseline_peak_bytes(graph), measured_peak(model, args), "no checkpoint")
    plan = ckptplan.solve(graph, 0.7, solver="sqrt")
    assert plan.regions, "a 0.7 budget should need checkpointing"
    emitted = ckptplan.emit(graph, plan)
    measured = measured_peak(emitted, args)
    assert_close(plan.prediction.peak_bytes, measured, "sqrt plan at 0.7")
    assert measured <= plan.budget.bytes * (1 + TOLERANCE)


def assert_same_autocast_gradients(model: nn.Module, module: nn.Module, args: tuple) -> None:
    """``tests.conftest.assert_same_gradients`` for the AMP recipe: one seeded ``autocast_step``
    of ``module`` (sharing ``model``'s parameters) leaves the gradients the same step of a copy of
    ``model`` does, in float32."""
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    autocast_step(module, args)
    autocast_step(reference, args)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_emitted_module_gradients_equal_the_models_under_autocast(model_and_graphs: Graphs) -> None:
    model, args, _, graph = model_and_graphs
    emitted = ckptplan.emit(graph, ckptplan.solve(graph, 0.7, solver="sqrt"))
    assert_same_autocast_gradients(model, emitted, args)


def test_apply_profiles_under_the_plans_autocast(model_and_graphs: Graphs) -> None:
    model, args, _, graph = model_and_graphs
    plan = ckptplan.Plan.from_json(ckptplan.solve(graph, 0.7, solver="sqrt").to_json())
    assert plan.model.autocast == "bfloat16" and plan.regions
    module = ckptplan.apply(model, args, plan)  # no autocast argument: the plan says bfloat16
    assert module.ckptplan_plan is plan
    assert_same_autocast_gradients(model, module, args)
    # The same regions recorded as a full-precision plan are refused: its fingerprint is fp32's.
    unmixed = plan.model_copy(update={"model": plan.model.model_copy(update={"autocast": None})})
    with pytest.raises(ckptplan.FingerprintMismatchError):
        ckptplan.apply(model, args, unmixed)


def test_checkpoint_takes_autocast() -> None:
    model, args = small_gpt()
    module = ckptplan.checkpoint(model, args, budget=0.7, solver="sqrt", autocast=torch.bfloat16)
    assert module.ckptplan_plan.model.autocast == "bfloat16"
    assert_same_autocast_gradients(model, module, args)


def test_verify_runs_the_plans_autocast_step(model_and_graphs: Graphs) -> None:
    model, args, _, graph = model_and_graphs
    plan = ckptplan.solve(graph, 0.7, solver="sqrt")
    result = ckptplan.verify(model, args, plan, steps=1)
    assert result.gradients_equal and result.within_budget
    assert abs(result.prediction_error) <= TOLERANCE, result.to_dict()
    assert_close(baseline_peak_bytes(graph), result.original_peak_bytes, "verify's no-checkpoint step")
    tensors = ckptplan.measure_step(model, args, autocast=torch.bfloat16, counter="tensors").peak_bytes
    assert tensors <= measured_peak(model, args)  # the allocator also counts what kernels allocate inside


TINY = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(16, 16), nn.ReLU())])
    return model, (torch.randn(256, 16),)
"""


def test_cli_autocast_option(tmp_path: Path) -> None:
    model_file = tmp_path / "tiny.py"
    model_file.write_text(TINY)
    runner = CliRunner()
    plain = runner.invoke(app, ["profile", str(model_file), "--json"], catch_exceptions=False)
    mixed = runner.invoke(app, ["profile", str(model_file), "--json", "--autocast", "bf16"], catch_exceptions=False)
    assert plain.exit_code == 0 and mixed.exit_code == 0, mixed.output
    assert '"fingerprint"' in mixed.stdout and mixed.stdout != plain.stdout
    # 0.95: the fp16 linears' measured workspaces vary with the CPU and its intra-op threads; sqrt's
    # least has measured 0.91 and 0.94 of the peak.
    solved = runner.invoke(
        app, ["solve", str(model_file), "--budget", "0.95", "--solver", "sqrt", "--autocast", "fp16", "--json"],
        catch_exceptions=False,
    )
    assert solved.exit_code == 0, solved.output
    wrong = runner.invoke(app, ["sweep", str(model_file), "--autocast", "int8"], catch_exceptions=False)
    assert wrong.exit_code == 2
    message = " ".join(re.sub(r"[│╭╮╰╯─]", " ", wrong.stderr).split())
    assert "'int8' is not an autocast dtype; use bf16 or fp16." in message
    assert "Traceback" not in wrong.output


def test_cli_verify_runs_an_autocast_plans_step(tmp_path: Path) -> None:
    model_file = tmp_path / "tiny.py"
    model_file.write_text(TINY + "\nTRAINING = {'autocast': 'bf16'}\n")
    plan_file = tmp_path / "plan.json"
    runner = CliRunner()
    # 0.95: the bf16 linears' measured workspaces grow with the intra-op threads (one per pytest-xdist
    # worker, two alone), and sqrt's least is 0.90 of the peak with two.
    solved = runner.invoke(
        app, ["solve", str(model_file), "--budget", "0.95", "--solver", "sqrt", "--out", str(plan_file)],
        catch_exceptions=False,
    )
    assert solved.exit_code == 0, solved.output
    assert ckptplan.load_plan(plan_file).model.autocast == "bfloat16"
    shown = runner.invoke(app, ["show", str(plan_file)], catch_exceptions=False)
    assert "autocast" in shown.stderr and "bfloat16" in shown.stderr
    verified = runner.invoke(
        app, ["verify", str(model_file), "--plan", str(plan_file), "--steps", "1", "--json"], catch_exceptions=False
    )
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.stdout)
    assert report["gradients_equal"] and abs(report["prediction_error"]) <= TOLERANCE, report


class ConvGroupNorm(nn.Module):
    """Convolutions (bfloat16 under CPU autocast) into GroupNorms with float32 weights: the
    mixed-precision normalisation whose fake kernels disagree with the eager ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(4, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_mixed_precision_group_norm_matches_memtracker() -> None:
    torch.manual_seed(0)
    model, args = ConvGroupNorm(), (torch.randn(8, 4, 64, 64),)
    graph = ckptplan.profile(model, args, autocast=torch.bfloat16)
    norms = [n for n in graph.nodes if n.op == "aten.group_norm.default"]
    for node in norms:  # eager CPU keeps the per-group mean and rstd in float32
        stats = [graph.storages[s].nbytes for s in node.saved if graph.storages[s].kind == "hidden"]
        assert stats == [8 * 4 * 4, 8 * 4 * 4], node.name
    # its backward returns the input gradient in bfloat16: no float32 copy of the input
    assert all(n.bwd_workspace_bytes < n.output_bytes for n in norms)
    assert_close(baseline_peak_bytes(graph), measured_peak(model, args), "conv + group norm")


class ReadsDtypes(nn.Module):
    """Code that reads a dtype (``.to(h.dtype)``, as attention code does): export bakes in the
    dtype it saw, so the graph must be traced under autocast too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        p = torch.softmax(h.float(), dim=-1).to(h.dtype)
        return self.b(torch.tanh(p))


def test_code_that_reads_dtypes_is_traced_as_autocast_runs_it() -> None:
    torch.manual_seed(0)
    model, args = ReadsDtypes(), (torch.randn(64, 32),)
    graph = ckptplan.profile(model, args, autocast=torch.bfloat16)
    cast_back = next(n for n in graph.nodes if n.op == "aten.to.dtype" and n.inputs and "softmax" in graph.nodes[n.inputs[0]].name)
    assert cast_back.output_bytes == 64 * 64 * 2  # back to bfloat16, as h.dtype is under autocast
    plan = ckptplan.make_plan(graph, [ckptplan.Region(0, len(graph.nodes) - 1)])
    emitted = ckptplan.emit(graph, plan)
    reference = copy.deepcopy(model)
    autocast_step(emitted, args)
    autocast_step(reference, args)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
