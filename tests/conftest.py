"""Shared fixtures and checks: the example models, loaded from examples/ by path, and the
gradient check every emitted module must pass."""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ckptplan.profiler.loss import training_loss

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under ``pytest -n N`` the workers share the machine's cores: one intra-op thread each, so
    # that N workers do not run 2N threads on N cores.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_logging():
    """The CLI's ``-v`` configures the process's logging; each test leaves it as it found it."""
    logger = logging.getLogger("ckptplan")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ckptplan_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["gpt", "resnet", "unet"])
def example_name(request: pytest.FixtureRequest) -> str:
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its element size, for bitwise comparisons (``torch.equal`` on
    floats calls 0.0 and -0.0 equal)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_gradients(model: torch.nn.Module, module: torch.nn.Module, args: tuple) -> None:
    """One seeded training step of ``module`` (which shares ``model``'s parameters) leaves the
    gradients that the same step of a copy of ``model`` does."""
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    training_loss(module(*args)).backward()
    torch.manual_seed(0)
    training_loss(reference(*args)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
