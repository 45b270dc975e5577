"""Recipe: train a `transformers` model with a saved ckptplan plan, under `transformers.Trainer`
and in a plain PyTorch loop.

Run it with ``python examples/recipes/transformers_trainer.py`` (CPU, no downloads, a few
seconds; ``Trainer`` needs ``pip install accelerate``). It builds a 2-layer GPT-2 from its config,
solves a plan at 70% of the step's no-checkpoint peak, saves it as JSON, then — as a training
script would — loads the file, applies it and trains two steps with ``Trainer``, and two steps in
a plain loop with a plan made for that loop's call.

What a plan is tied to: the call it was profiled with. ``ckptplan.apply`` re-traces the model with
the same keyword arguments and refuses a plan whose fingerprint (graph, shapes, dtypes) differs,
so profile the model with exactly what the training loop passes:

* ``Trainer`` calls ``model(**inputs)``: the collated batch (here ``input_ids`` and ``labels``)
  and, for a model whose ``forward`` takes ``**kwargs`` (GPT-2's does), ``num_items_in_batch``,
  the batch's label count as a 0-d tensor that the model's loss divides by.
  ``trainer_call_kwargs`` asks the Trainer itself for all of it. Positional or keyword
  ``input_ids`` both work with ``profile`` and the emitted module; keywords match ``Trainer``.
* Shapes are fixed: every batch must have the profiled shape (``per_device_train_batch_size``,
  one sequence length, ``dataloader_drop_last=True``); another shape stops with
  ``Guard failed: input_ids.size()[0] == 4``. Pad to a fixed length, or solve one plan per shape.

Why ``Trainer`` gets the original model, with its training forward routed through the emitted
module (``route_training_forward``), rather than the emitted module itself. Handed the emitted
module, ``Trainer`` does train it, but (transformers 5.x): it reads ``forward``'s signature to
decide whether to pass ``num_items_in_batch``, and the emitted signature (only the profiled
arguments) makes it skip it, so the loss is normalised differently than for the model (here by
124 shifted tokens instead of ``Trainer``'s count of 128); and ``save_model`` fails on GPT-2's
tied embeddings, since a plain module is written with safetensors' ``save_file``, which refuses
shared tensors, and no ``config.json`` is written. Routing keeps the ``PreTrainedModel`` object —
its class, ``config``, ``forward`` signature, ``state_dict`` and ``save_pretrained`` — and
replaces only its instance's ``forward``: a training-mode call goes to the emitted module (which
shares the model's ``Parameter`` objects, so ``Trainer``'s optimizer updates what it computes
with), an eval-mode call to the model's own ``forward``. ``del model.forward`` undoes it. Leave
``gradient_checkpointing`` off: the plan already decides what is recomputed.

Dropout stays on (GPT-2's 0.1): the emitted module runs the model's ops in the model's order, so
a seeded step draws the same masks, and recomputation replays them, so training with the plan
gives the parameters training without it gives (``tests/test_recipes.py`` checks this).
"""

from __future__ import annotations

import functools
import inspect
import logging
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.data import Dataset

import ckptplan

log = logging.getLogger(__name__)

VOCAB, SEQ, BATCH, STEPS = 128, 32, 4, 2


def build_model(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 built from its config (no download), seeded so two builds are equal."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


class TokenDataset(Dataset):
    """``count`` random token sequences of length ``seq``, each its own causal-LM labels (the
    model shifts them). Every item has one shape, as a plan requires."""

    def __init__(self, count: int = 16, seq: int = SEQ, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_arguments(output_dir: str | Path, steps: int = STEPS, batch: int = BATCH) -> transformers.TrainingArguments:
    """CPU, no reporting, ``steps`` optimizer steps of ``batch`` sequences, every batch full."""
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-3,
        dataloader_drop_last=True,  # a partial last batch would have another shape than the plan's
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )


def trainer_call_kwargs(trainer: transformers.Trainer) -> dict[str, Any]:
    """The keyword arguments ``trainer``'s training step passes to ``model(**inputs)`` for one
    batch (its values are the first samples', its shapes and dtypes every batch's).

    Mirrors ``Trainer.compute_loss``: the collated batch on the training device, without
    ``labels`` when a label smoother or ``compute_loss_func`` takes them, plus
    ``num_items_in_batch`` when the model accepts loss kwargs. Reads no random numbers, so the
    training run that follows draws what it would have drawn without this call. Takes a
    map-style dataset whose items hold only arguments of the model's ``forward`` (the Trainer's
    data loader drops other columns; this does not).
    """
    batch_size = trainer.args.per_device_train_batch_size
    samples = [trainer.train_dataset[i] for i in range(batch_size)]
    batch = trainer.data_collator(samples)
    _, num_items = trainer.get_batch_samples(iter([batch]), 1, trainer.args.device)
    call = {k: v.to(trainer.args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if trainer.label_smoother is not None or trainer.compute_loss_func is not None:
        call.pop("labels", None)
    if trainer.model_accepts_loss_kwargs and num_items is not None:
        call["num_items_in_batch"] = num_items
    return call


def solve_and_save(
    model: nn.Module, call: dict[str, Any], path: str | Path, budget: str | float = 0.7, solver: str = "dp"
) -> ckptplan.Plan:
    """Profile ``model(**call)``, solve for ``budget`` and write the plan to ``path`` as JSON
    (atomically, so a reader never sees half a file).

    ``dp`` is exact for the chain it plans and takes a fraction of a second here; ``"auto"``
    also runs ``ilp`` (cheaper plans, seconds to minutes)."""
    graph = ckptplan.profile(model, (), call, outputs_live=False)
    plan = ckptplan.solve(graph, budget, solver=solver)
    ckptplan.save_plan(plan, path)
    return plan


class TrainingForward:
    """A replacement for one model's ``forward``: training-mode calls go to ``module`` (the
    emitted, planned module), eval-mode calls to the model's own ``forward``.

    It carries the model's ``forward`` signature (``functools.update_wrapper``), so ``Trainer``
    and anything else that inspects ``model.forward`` sees the model. ``calls`` counts the
    calls that ran the plan.
    """

    def __init__(self, original: Any, module: nn.Module) -> None:
        self.original = original  # the bound method; its __self__ is the model
        self.module = module
        self.planned_names = tuple(inspect.signature(module.forward).parameters)
        self.calls = 0
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.original.__self__.training:
            return self.original(*args, **kwargs)
        passed = (*self.planned_names[: len(args)], *kwargs)
        if sorted(passed) != sorted(self.planned_names):
            raise ckptplan.CkptPlanError(
                f"The plan was profiled with arguments {list(self.planned_names)} but the model was called with "
                f"{list(passed)}; profile with exactly what the training loop passes (trainer_call_kwargs)."
            )
        self.calls += 1
        return self.module(*args, **kwargs)


def route_training_forward(model: nn.Module, module: nn.Module) -> TrainingForward:
    """Make ``model``'s training-mode calls run ``module`` (see ``TrainingForward``); the model
    object, its class, ``config``, ``state_dict`` and ``save_pretrained`` stay as they were.
    ``del model.forward`` undoes it."""
    forward = TrainingForward(model.forward, module)
    model.forward = forward
    return forward


def train_with_trainer(
    model: nn.Module, dataset: Dataset, output_dir: str | Path, plan_path: str | Path | None = None, steps: int = STEPS
) -> transformers.Trainer:
    """Train ``model`` for ``steps`` steps with ``Trainer``; with ``plan_path``, under that saved
    plan (loaded, applied to the call the Trainer makes, and routed in). Returns the trainer."""
    trainer = transformers.Trainer(model=model, args=training_arguments(output_dir, steps), train_dataset=dataset)
    if plan_path is not None:
        plan = ckptplan.load_plan(plan_path)
        module = ckptplan.apply(model, (), plan, trainer_call_kwargs(trainer))
        route_training_forward(model, module)
    trainer.train()
    return trainer


def plain_batches(dataset: TokenDataset, steps: int = STEPS, batch: int = BATCH) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of ``batch`` sequences, in order: what a plain loop calls the model with."""
    return [
        {"input_ids": dataset.ids[k * batch:(k + 1) * batch], "labels": dataset.ids[k * batch:(k + 1) * batch]}
        for k in range(steps)
    ]


def train_plain_loop(
    model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], module: nn.Module | None = None, lr: float = 1e-3,
    seed: int = 0,
) -> list[float]:
    """A plain PyTorch loop: AdamW on ``model``'s parameters, each step ``module(**batch).loss``
    backward (``module`` defaults to ``model``; an emitted module shares the model's parameters,
    so the optimizer built on the model updates what it computes with). Returns the losses."""
    module = model if module is None else module
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    torch.manual_seed(seed)
    losses = []
    for batch in batches:
        loss = module(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    dataset = TokenDataset()
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        # Once, ahead of training: the plan for the call Trainer will make.
        model = build_model()
        probe = transformers.Trainer(model=model, args=training_arguments(tmp), train_dataset=dataset)
        plan = solve_and_save(model, trainer_call_kwargs(probe), plan_path)
        log.info(
            "plan: %d region(s), predicted peak %s of %s without checkpointing; saved to %s",
            len(plan.regions), ckptplan.format_bytes(plan.prediction.peak_bytes),
            ckptplan.format_bytes(plan.prediction.baseline_peak_bytes), plan_path.name,
        )
        # The training script: a fresh model, the saved plan.
        model = build_model()
        trainer = train_with_trainer(model, dataset, tmp, plan_path=plan_path)
        log.info("Trainer: %d steps with the plan, %d planned forward calls, train loss %.4f",
                 trainer.state.global_step, model.forward.calls, trainer.state.log_history[-1]["train_loss"])
        trainer.save_model(Path(tmp) / "final")  # save_pretrained of the original model object
        log.info("saved with save_pretrained: %s", sorted(p.name for p in (Path(tmp) / "final").iterdir()))

        # A plain loop: its own call (no num_items_in_batch), so its own plan.
        model = build_model()
        batches = plain_batches(dataset)
        plan = solve_and_save(model, batches[0], Path(tmp) / "plain_plan.json")
        module = ckptplan.apply(model, (), ckptplan.load_plan(Path(tmp) / "plain_plan.json"), batches[0])
        losses = train_plain_loop(model, batches, module)
        log.info("plain loop: %d regions, losses %s", len(plan.regions), ", ".join(f"{x:.4f}" for x in losses))
    log.info("done in %.1f s", time.perf_counter() - started)


if __name__ == "__main__":
    main()
