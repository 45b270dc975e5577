"""Model -> torch.fx GraphModule, by ``torch.export`` (training IR) or ``torch.fx.symbolic_trace``."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn

from ckptplan.errors import TraceError

TraceMode = Literal["export", "symbolic"]
_OTHER = {"export": "symbolic", "symbolic": "export"}


@dataclass
class Traced:
    """A traced forward: ``gm`` runs it, ``flat_inputs`` are the values of its placeholders."""

    gm: torch.fx.GraphModule
    flat_inputs: list[Any]
    mode: TraceMode


@contextlib.contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """Put every submodule in training mode for the duration, then restore each one's flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def trace_model(model: nn.Module, args: tuple, kwargs: dict | None, mode: TraceMode) -> Traced:
    """Trace ``model(*args, **kwargs)`` in training mode. Failures raise ``TraceError`` naming the
    cause and the other trace option."""
    if mode not in _OTHER:
        raise TraceError(f"Unknown trace mode {mode!r}; use 'export' or 'symbolic'.")
    if not isinstance(model, nn.Module):
        raise TraceError(f"Expected a torch.nn.Module to profile, got {type(model).__name__}.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    with training_mode(model):
        try:
            if mode == "export":
                gm = _export(model, args, kwargs)
                flat = pytree.tree_flatten((args, kwargs))[0]
            else:
                gm = torch.fx.symbolic_trace(model)
                flat = _bind_placeholders(gm, model, args, kwargs)
        except TraceError:
            raise
        except Exception as exc:  # the tracers raise many unrelated types; all mean "cannot trace"
            raise TraceError(_describe(exc, mode, type(model).__name__)) from exc
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        raise TraceError(
            f"Traced graph of {type(model).__name__} takes {len(placeholders)} inputs but {len(flat)} were given; "
            f"try trace={_OTHER[mode]!r}."
        )
    return Traced(gm=gm, flat_inputs=flat, mode=mode)


# Loggers that narrate a failed export at WARNING level; the TraceError we raise says it once.
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Silence what torch.export prints on failure (it dumps the partial graph to stderr)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _export(model: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    with _quiet_export():
        program = torch.export.export(model, args, kwargs)
    return program.module()


def _bind_placeholders(gm: torch.fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict) -> list[Any]:
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.target.lstrip("*")
        values.append(bound.arguments.get(name, node.args[0] if node.args else None))
    return values


def _describe(exc: BaseException, mode: TraceMode, model_name: str) -> str:
    text = str(exc).strip().splitlines()
    first = next((line.strip() for line in text if line.strip()), type(exc).__name__)
    if len(first) > 300:
        first = first[:297] + "..."
    lowered = " ".join(text).lower()
    if "data-dependent" in lowered or "data dependent" in lowered or "control flow" in lowered or "guardondatadependent" in lowered:
        cause = "it has data-dependent control flow"
    else:
        cause = f"{type(exc).__name__}: {first}"
    tracer = "torch.export" if mode == "export" else "torch.fx.symbolic_trace"
    return f"{tracer} could not trace {model_name} ({cause}); try trace={_OTHER[mode]!r}."
