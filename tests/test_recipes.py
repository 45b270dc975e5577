"""The integration recipes in examples/recipes/: a saved plan applied under ``transformers.Trainer``,
in a plain PyTorch loop, and in an FSDP2 loop on two gloo ranks trains exactly as the same steps
without checkpointing, and each rank's measured peak is the plan's prediction."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import ckptplan

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"

# Two training runs that draw the same numbers give the same parameters bit for bit here; the
# tolerance leaves room for nothing but rounding (a step moves parameters by about 1e-3).
TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def recipe(name: str) -> ModuleType:
    """``examples/recipes/<name>.py``, imported by its own name from its folder, so that the
    processes ``mp.spawn`` starts can import it to find the function they run."""
    if str(RECIPES) not in sys.path:
        sys.path.append(str(RECIPES))
    return importlib.import_module(name)


def _assert_same_parameters(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")


# ------------------------------------------------------------------ transformers.Trainer
@pytest.fixture(scope="module")
def trainer_recipe() -> ModuleType:
    pytest.importorskip("transformers")
    return recipe("transformers_trainer")


def test_trainer_with_a_saved_plan_trains_as_without_checkpointing(trainer_recipe: ModuleType, tmp_path: Path) -> None:
    """Two Trainer steps under the plan (dropout on) leave the parameters and loss that two
    Trainer steps of the unmodified model leave."""
    pytest.importorskip("accelerate")  # Trainer needs it
    r = trainer_recipe
    dataset = r.TokenDataset()
    model = r.build_model()
    probe = r.transformers.Trainer(model=model, args=r.training_arguments(tmp_path), train_dataset=dataset)
    call = r.trainer_call_kwargs(probe)
    assert {"input_ids", "labels"} <= set(call)
    plan = r.solve_and_save(model, call, tmp_path / "plan.json")
    assert plan.regions and plan.prediction.peak_bytes < plan.prediction.baseline_peak_bytes

    planned = r.build_model()
    trainer = r.train_with_trainer(planned, dataset, tmp_path / "planned", plan_path=tmp_path / "plan.json")
    assert planned.forward.calls == r.STEPS  # every training step ran the planned module
    reference = r.build_model()
    reference_trainer = r.train_with_trainer(reference, dataset, tmp_path / "reference")

    assert trainer.state.global_step == reference_trainer.state.global_step == r.STEPS
    assert trainer.state.log_history[-1]["train_loss"] == reference_trainer.state.log_history[-1]["train_loss"]
    _assert_same_parameters(planned, reference)
    moved = max((p - q).abs().max().item() for p, q in zip(planned.parameters(), r.build_model().parameters()))
    assert moved > 1e3 * TIGHT["atol"]

    # The model object is still the PreTrainedModel: Trainer saves it with save_pretrained.
    trainer.save_model(tmp_path / "saved")
    reloaded = type(planned).from_pretrained(tmp_path / "saved")
    _assert_same_parameters(reloaded, planned)


def test_routing_runs_the_plan_only_in_training_and_names_a_call_it_was_not_made_for(
    trainer_recipe: ModuleType,
) -> None:
    r = trainer_recipe
    model = r.build_model()
    ids = r.TokenDataset().ids[: r.BATCH]
    graph = ckptplan.profile(model, (), {"input_ids": ids, "labels": ids})
    module = ckptplan.emit(graph, ckptplan.solve(graph, 0.7, solver="dp"))
    original_signature = str(inspect.signature(model.forward))
    forward = r.route_training_forward(model, module)
    assert str(inspect.signature(model.forward)) == original_signature  # what Trainer inspects

    model.eval()
    with torch.no_grad():
        routed = model(input_ids=ids, labels=ids).loss
    assert forward.calls == 0  # eval mode: the model's own forward
    model.train()
    torch.manual_seed(0)
    planned_loss = model(input_ids=ids, labels=ids).loss
    assert forward.calls == 1
    with pytest.raises(ckptplan.CkptPlanError, match="profiled with arguments"):
        model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))

    del model.forward  # undoes the routing
    torch.manual_seed(0)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, planned_loss, **TIGHT)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, routed, **TIGHT)
    assert forward.calls == 1


def test_plain_loop_with_a_saved_plan_trains_as_without_checkpointing(trainer_recipe: ModuleType, tmp_path: Path) -> None:
    """AdamW built on the model's parameters drives the emitted module, which shares them."""
    r = trainer_recipe
    batches = r.plain_batches(r.TokenDataset())
    model = r.build_model()
    plan = r.solve_and_save(model, batches[0], tmp_path / "plan.json")
    assert plan.regions
    module = ckptplan.apply(model, (), ckptplan.load_plan(tmp_path / "plan.json"), batches[0])
    losses = r.train_plain_loop(model, batches, module)
    reference = r.build_model()
    reference_losses = r.train_plain_loop(reference, batches)
    assert losses == reference_losses
    _assert_same_parameters(model, reference)


# ------------------------------------------------------------------ FSDP2 on two gloo ranks
def _fresh_process_threads() -> int:
    """torch's intra-op threads in a newly started process, as the spawned ranks have them."""
    command = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    return int(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp2_loop_trains_as_one_process_within_the_predicted_peak(tmp_path: Path) -> None:
    r = recipe("fsdp2_loop")
    results = r.train_distributed(tmp_path / "plan.json")
    plan = ckptplan.load_plan(tmp_path / "plan.json")
    assert plan.model.sharding is not None and plan.model.sharding.degree == r.WORLD
    assert plan.regions and plan.prediction.peak_bytes < plan.prediction.baseline_peak_bytes

    # Equal to one process running the ranks' slices without checkpointing or sharding, with the
    # ranks' intra-op threads: under pytest-xdist this process runs one, and a matmul summed in
    # another order moved a bias by 9e-5 after the optimizer's steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(_fresh_process_threads())
    try:
        reference = r.train_single()
    finally:
        torch.set_num_threads(threads)
    for rank in range(r.WORLD):
        assert results[rank]["losses"] == pytest.approx([step[rank] for step in reference["losses"]], rel=1e-6)
    for name, tensor in reference["grads"].items():
        torch.testing.assert_close(results[0]["grads"][name], tensor, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")
    for name, tensor in reference["params"].items():
        torch.testing.assert_close(results[0]["params"][name], tensor, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")
    # And, up to the rounding of another summation order, to one forward over the whole batch.
    whole = r.train_single(whole_batch=True)
    means = [sum(results[rank]["losses"][step] for rank in range(r.WORLD)) / r.WORLD for step in range(r.STEPS)]
    assert means == pytest.approx(whole["losses"], rel=1e-5)
    for name, tensor in whole["grads"].items():
        torch.testing.assert_close(results[0]["grads"][name], tensor, rtol=1e-4, atol=1e-6)

    # Each rank's measured peak is the plan's per-rank prediction: the first step's before AdamW
    # has made its state, every later step's with it.
    first_predicted = r.first_step_prediction(r.build_model(), r.rank_slice(r.global_batches()[0], 0), plan)
    for rank in range(r.WORLD):
        first, *later = results[rank]["peaks"]
        assert abs(first - first_predicted) <= 0.03 * first, (rank, first, first_predicted)
        for measured in later:
            assert abs(measured - plan.prediction.peak_bytes) <= 0.03 * measured, (rank, measured)
