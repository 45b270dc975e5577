"""Model -> torch.fx GraphModule, by ``torch.export`` (training IR) or ``torch.fx.symbolic_trace``."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from ckptplan.errors import TraceError
from ckptplan.profiler.masks import restore_masks

log = logging.getLogger(__name__)

TraceMode = Literal["export", "symbolic"]
# The device kind whose kernels a profile models where they save different tensors (dropout).
Target = Literal["cpu", "cuda"]
_OTHER = {"export": "symbolic", "symbolic": "export"}


@dataclass
class Traced:
    """A traced forward: ``gm`` runs it, ``flat_inputs`` are the values of its placeholders."""

    gm: torch.fx.GraphModule
    flat_inputs: list[Any]
    mode: TraceMode


@dataclass(frozen=True)
class Autocast:
    """The ``torch.autocast`` a profiled step's forward runs under.

    The step is PyTorch's mixed-precision recipe: forward and loss inside the context, backward
    outside it. ``device_type`` is that of the model's tensors; a model on ``meta`` (which has no
    autocast dispatch key) is recorded as fake ``meta_as`` tensors under that device's autocast.
    """

    dtype: torch.dtype
    device_type: str
    meta_as: torch.device | None = None

    @classmethod
    def for_model(cls, dtype: torch.dtype, model: nn.Module, flat_inputs: list[Any]) -> Autocast:
        """The autocast of ``model``'s device (``model_device_type``)."""
        device_type = model_device_type(model, flat_inputs)
        if device_type != "meta":
            return cls(dtype, device_type)
        log.warning(
            "%s is on the meta device, which has no autocast: recording it as CPU tensors under CPU "
            "autocast, whose casting rules differ from CUDA's for some ops (CUDA keeps softmax and "
            "layer_norm in float32).", type(model).__name__,
        )
        return cls(dtype, "cpu", meta_as=torch.device("cpu"))

    def forward(self) -> contextlib.AbstractContextManager:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self) -> contextlib.AbstractContextManager:
        """Autocast off, as outside the user's context. Entered inside ``forward()``, it keeps
        autocast's cache of parameter casts (that empties when the outermost context exits)."""
        return torch.autocast(device_type=self.device_type, enabled=False)


def model_device(model: nn.Module, flat_inputs: list[Any]) -> torch.device:
    """The device a step of ``model`` runs on: that of its first floating parameter or buffer,
    else of its first floating input; the CPU when it has none."""
    tensors = [*model.parameters(), *model.buffers(), *(x for x in flat_inputs if isinstance(x, torch.Tensor))]
    return next((t.device for t in tensors if t.is_floating_point()), torch.device("cpu"))


def model_device_type(model: nn.Module, flat_inputs: list[Any]) -> str:
    """The kind of ``model_device``: ``"cpu"``, ``"cuda"``, ``"meta"``..."""
    return model_device(model, flat_inputs).type


@contextlib.contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """The modes of a training step for the duration: a model in training mode as it is (a
    submodule its user keeps in eval, such as a frozen batch norm, stays so); a model in eval
    mode with every submodule put in training mode, each one's flag restored afterwards."""
    if model.training:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def trace_model(
    model: nn.Module, args: tuple, kwargs: dict | None, mode: TraceMode, autocast: Autocast | None = None
) -> Traced:
    """Trace ``model(*args, **kwargs)`` in training mode. Failures raise ``TraceError`` naming the
    cause and the other trace option.

    ``autocast``: export under it. The graph keeps whole ops (autocast casts at run time, below
    this IR), but what the model's code reads from dtypes is baked in as the autocast step sees
    it: ``x.to(q.dtype)``, ``torch.finfo(x.dtype).min``, export's dtype assertions."""
    if mode not in _OTHER:
        raise TraceError(f"Unknown trace mode {mode!r}; use 'export' or 'symbolic'.")
    if not isinstance(model, nn.Module):
        raise TraceError(f"Expected a torch.nn.Module to profile, got {type(model).__name__}.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    if not model.training:
        log.warning(
            "%s is in eval mode; ckptplan plans a training step, so it traces the model in training mode "
            "(dropout and batch norm as they train) and leaves its mode as it was; call model.train() first "
            "to keep a submodule in eval (a frozen batch norm) as your step does.", type(model).__name__,
        )
    with training_mode(model):
        try:
            if mode == "export" and autocast is not None:
                gm = _export_under(autocast, model, args, kwargs)
                flat = pytree.tree_flatten((args, kwargs))[0]
            elif mode == "export":
                gm = _export(model, args, kwargs)
                flat = pytree.tree_flatten((args, kwargs))[0]
            else:
                gm = _symbolic_trace(model)
                flat = _bind_placeholders(gm, model, args, kwargs)
        except TraceError:
            raise
        except Exception as exc:  # the tracers raise many unrelated types; all mean "cannot trace"
            hint = _cache_hint(model) if mode == "symbolic" or "cache" in str(exc).lower() else None
            raise TraceError(hint or _describe(exc, mode, model)) from exc
    restore_masks(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        raise TraceError(
            f"Traced graph of {type(model).__name__} takes {len(placeholders)} inputs but {len(flat)} were given; "
            f"try trace={_OTHER[mode]!r}."
        )
    return Traced(gm=gm, flat_inputs=flat, mode=mode)


def _symbolic_trace(model: nn.Module) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace``, refusing a model whose forward writes into its own state:
    the tracer reads parameters and buffers as real tensors, so such a write (a step counter's
    ``add_``) runs once while tracing and never in the traced graph."""
    versions = [(name, t, t._version) for name, t in named_state(model) if not t.is_inference()]
    gm = torch.fx.symbolic_trace(model)
    written = [name for name, t, version in versions if t._version != version]
    if written:
        raise TraceError(
            f"torch.fx.symbolic_trace ran {type(model).__name__}'s in-place update of {written[0]!r} while tracing "
            "instead of recording it, so the traced step would never update it (tracing has updated it once); "
            "use trace='export'."
        )
    return gm


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


def _export_under(autocast: Autocast, model: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    """Export under ``autocast``, so that what the model's code reads from dtypes is what the
    autocast step reads. A meta model is exported on fake ``autocast.meta_as`` copies of its
    state and inputs (meta tensors pass autocast by, and would bake float32 in), and the graph
    then gets the model's own meta parameters and buffers back, as a plain export shares them."""
    if autocast.meta_as is None:
        with autocast.forward():
            return _export(model, args, kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state: dict[str, torch.Tensor] = {}
    memo: dict[int, torch.Tensor] = {}
    for name, tensor in named_state(model):
        if id(tensor) not in memo:
            fake = fake_copy(mode, tensor, autocast.meta_as)
            memo[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
        state[name] = memo[id(tensor)]
    fake_args, fake_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: fake_copy(mode, t, autocast.meta_as), (args, kwargs)
    )
    with _reparametrize_module(model, state), autocast.forward():
        gm = _export(model, fake_args, fake_kwargs)
    own = dict(named_state(model))
    for name, _ in named_state(gm):
        if name not in own:
            raise TraceError(f"Exporting {type(model).__name__} under autocast made state {name!r} it does not have.")
        owner_path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_path)
        slots = owner._parameters if leaf in owner._parameters else owner._buffers
        slots[leaf] = own[name]
    return gm


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers, by every name they have (tied ones more than once)."""
    return list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))


def fake_copy(mode: FakeTensorMode, t: torch.Tensor, meta_as: torch.device | None = None) -> torch.Tensor:
    """A fake copy of ``t`` in ``mode``; with ``meta_as``, a meta tensor's copy is on that device."""
    if meta_as is not None and t.device.type == "meta":
        return mode.fake_tensor_converter.from_meta_and_device(mode, t, meta_as)
    return mode.from_tensor(t, static_shapes=True)


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


def _cache_hint(model: nn.Module) -> str | None:
    """What to do about a ``transformers`` model whose config asks for its key/value cache, which
    neither tracer can follow (export meets the cache object in the outputs, symbolic tracing the
    model's signature); None for any other model."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return None
    return (
        f"{type(model).__name__} returns its key/value cache (its config has use_cache=True), which cannot be traced "
        "and which a training step does not use: set model.config.use_cache = False before planning "
        "(transformers turns the cache off itself when it checkpoints)."
    )


def _describe(exc: BaseException, mode: TraceMode, model: nn.Module) -> str:
    """One sentence: which tracer failed on ``model``, on what construct, where in the user's
    code (the module and the line), and the other tracer to try."""
    text = str(exc).strip().splitlines()
    first = next((line.strip() for line in text if line.strip()), type(exc).__name__)
    if len(first) > 300:
        first = first[:297] + "..."
    lowered = " ".join(text).lower()
    if "data-dependent" in lowered or "data dependent" in lowered or "control flow" in lowered or "guardondatadependent" in lowered:
        cause = "data-dependent control flow"
    else:
        cause = f"{type(exc).__name__}: {first}"
    where = _user_frame(exc, text)
    if where is not None:
        cause += f", in {_module_at(model, *where)} at {where[0]}:{where[1]}"
    tracer = "torch.export" if mode == "export" else "torch.fx.symbolic_trace"
    if cause.startswith("data-dependent"):  # neither tracer follows a branch on tensor values
        advice = "make the branch independent of tensor values (torch.where), or move it out of the model's forward"
    else:
        advice = f"try trace={_OTHER[mode]!r}"
    return f"{tracer} could not trace {type(model).__name__} ({cause}); {advice}."


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def _user_frame(exc: BaseException, text: list[str]) -> tuple[str, int, str] | None:
    """(file, line, function) of the model's code where tracing failed: the call torch.export
    names ("The following call raised this error"), else the innermost traceback frame outside
    torch and ckptplan."""
    for k, line in enumerate(text):
        if "following call raised this error" in line and k + 1 < len(text):
            match = _FRAME.search(text[k + 1])
            if match:
                return match["file"], int(match["line"]), match["function"]
    frames = traceback.extract_tb(exc.__traceback__)
    packages = [torch, *(m for name, m in sys.modules.items() if name.split(".")[0] == "ckptplan")]
    ours = tuple({os.path.dirname(m.__file__) + os.sep for m in packages if getattr(m, "__file__", None)})
    user = [f for f in frames if not f.filename.startswith(ours) and "<frozen" not in f.filename]
    if not user or user[-1].lineno is None:
        return None
    return user[-1].filename, user[-1].lineno, user[-1].name


def _module_at(model: nn.Module, file: str, line: int, function: str) -> str:
    """The submodule whose class defines ``function`` around ``file``:``line`` (its path in the
    model, or the class), else ``function`` itself."""
    for path, module in model.named_modules():
        code = getattr(getattr(type(module), function, None), "__code__", None)
        if code is not None and code.co_filename == file and code.co_firstlineno <= line:
            last = max((lineno for _, _, lineno in code.co_lines() if lineno is not None), default=code.co_firstlineno)
            if line <= last:
                return f"{path or type(model).__name__} ({type(module).__name__}.{function})"
    return function
