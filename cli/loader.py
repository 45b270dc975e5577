"""Model files: ``MODEL.py`` or ``MODEL.py:FUNC`` -> a model and its example inputs.

A model file defines ``build()`` (or the function named after the colon) returning
``(model, args)`` or ``(model, args, kwargs)``, or module-level ``model`` and ``example_inputs``;
optionally ``TRAINING``, defaults for how it is trained (``TRAINING_KEYS``).
Every way this can go wrong is a ``ModelFileError`` with one sentence that says what to fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ckptplan.errors import ModelFileError

_DEFAULT_FUNC = "build"
_CONTRACT = (
    "define build() returning (model, args) or (model, args, kwargs), or module-level 'model' and 'example_inputs'"
)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A fresh suffix per load: two model files with one stem (or one file loaded twice) never
# share a sys.modules entry.
_LOAD_COUNTER = itertools.count()


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``MODEL.py[:FUNC]`` argument; ``text`` is the user's spelling, used in messages."""

    path: Path
    func: str | None
    text: str


@dataclass(frozen=True)
class LoadedModel:
    """The model a file built, with positional and keyword example inputs for one step."""

    source: str
    model: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    training: dict[str, str] = field(default_factory=dict)  # the file's TRAINING defaults


def parse_spec(text: str) -> ModelSpec:
    """Split ``path.py:func``. Only a trailing ``:identifier`` counts as a function, so paths
    with colons (Windows drives) still work."""
    head, sep, tail = text.rpartition(":")
    if sep and head and _IDENTIFIER.match(tail):
        return ModelSpec(path=Path(head), func=tail, text=text)
    return ModelSpec(path=Path(text), func=None, text=text)


@contextlib.contextmanager
def load_model(text: str) -> Iterator[LoadedModel]:
    """Import the model file and build its model; the file's module and folder stay importable
    until the block ends, because tracing may look up the module by name."""
    spec = parse_spec(text)
    _check_file(spec)
    with _imported(spec) as module:
        loaded = _build(spec, module)
        yield dataclasses.replace(loaded, training=_training(spec, module))


TRAINING_KEYS = ("optimizer", "master_dtype", "autocast", "target", "outputs")
# Spellings of the dtypes torch.autocast lowers to, by the torch dtype name each means
# (``--autocast`` and TRAINING's "autocast").
AUTOCAST_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
TARGETS = ("cpu", "cuda")
OUTPUTS = ("kept", "dropped")  # TRAINING's "outputs": the loop keeps them through backward, or drops them


def _training(spec: ModelSpec, module: ModuleType) -> dict[str, str]:
    """The optional module-level ``TRAINING`` dict: how the model is trained, used where the
    command line does not say (``{"optimizer": "adamw", "master_dtype": "float32",
    "autocast": "bf16", "target": "cuda", "outputs": "dropped"}``). ``autocast`` comes back as a
    torch dtype name."""
    training = getattr(module, "TRAINING", {})
    where = f"TRAINING in {str(spec.path)!r}"
    if not isinstance(training, dict) or not all(isinstance(v, str) for v in training.values()):
        raise ModelFileError(f"{where} must be a dict of strings, e.g. {{'optimizer': 'adamw'}}.")
    unknown = sorted(set(training) - set(TRAINING_KEYS))
    if unknown:
        raise ModelFileError(f"{where} has key {unknown[0]!r}; use only {', '.join(map(repr, TRAINING_KEYS))}.")
    training = dict(training)
    if "autocast" in training:
        name = AUTOCAST_DTYPES.get(training["autocast"].strip().lower())
        if name is None:
            raise ModelFileError(f"{where} has autocast {training['autocast']!r}; use 'bf16' or 'fp16'.")
        training["autocast"] = name
    if "target" in training and training["target"] not in TARGETS:
        raise ModelFileError(f"{where} has target {training['target']!r}; use 'cpu' or 'cuda'.")
    if "outputs" in training and training["outputs"] not in OUTPUTS:
        raise ModelFileError(f"{where} has outputs {training['outputs']!r}; use 'kept' or 'dropped'.")
    return training


def _check_file(spec: ModelSpec) -> None:
    path = spec.path
    if not path.exists():
        raise ModelFileError(f"Model file {str(path)!r} does not exist.")
    if path.is_dir() or path.suffix != ".py":
        raise ModelFileError(
            f"Model file {str(path)!r} is not a .py file; give a Python file that defines build() or 'model'."
        )


@contextlib.contextmanager
def _imported(spec: ModelSpec) -> Iterator[ModuleType]:
    path = spec.path.resolve()
    name = f"_ckptplan_model_{_safe(path.stem)}_{next(_LOAD_COUNTER)}"
    import_spec = importlib.util.spec_from_file_location(name, path)
    if import_spec is None or import_spec.loader is None:
        raise ModelFileError(f"Model file {str(spec.path)!r} cannot be imported as a Python module.")
    module = importlib.util.module_from_spec(import_spec)
    folder = str(path.parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        try:
            import_spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # user code may raise anything; report it, no traceback
            raise ModelFileError(f"Importing {spec.path} raised {_describe(exc)}") from exc
        yield module
    finally:
        sys.modules.pop(name, None)
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _build(spec: ModelSpec, module: ModuleType) -> LoadedModel:
    func_name = spec.func or (_DEFAULT_FUNC if hasattr(module, _DEFAULT_FUNC) else None)
    if func_name is None:
        return _from_globals(spec, module)
    func = getattr(module, func_name, None)
    if func is None:
        raise ModelFileError(
            f"Model file {str(spec.path)!r} has no function {func_name!r}; define it or drop ':{func_name}'."
        )
    if not callable(func):
        raise ModelFileError(
            f"{func_name!r} in {str(spec.path)!r} is not a function; it must return (model, args[, kwargs])."
        )
    where = f"{spec.path}:{func_name}()"
    try:
        built = func()
    except (Exception, SystemExit) as exc:
        raise ModelFileError(f"Calling {where} raised {_describe(exc)}") from exc
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise ModelFileError(
            f"{where} returned {_kind(built)}; it must return a tuple (model, args) or (model, args, kwargs)."
        )
    kwargs = built[2] if len(built) == 3 else None
    return _checked(where, built[0], built[1], kwargs)


def _from_globals(spec: ModelSpec, module: ModuleType) -> LoadedModel:
    if not hasattr(module, "model"):
        raise ModelFileError(f"Model file {str(spec.path)!r} defines neither build() nor 'model'; {_CONTRACT}.")
    if not hasattr(module, "example_inputs"):
        raise ModelFileError(
            f"Model file {str(spec.path)!r} defines 'model' but not 'example_inputs'; "
            "add a tuple of inputs or a dict with 'args' and 'kwargs'."
        )
    inputs = module.example_inputs
    where = f"{spec.path}:model"
    if isinstance(inputs, dict):
        unknown = sorted(set(inputs) - {"args", "kwargs"})
        if unknown:
            raise ModelFileError(
                f"example_inputs in {str(spec.path)!r} has key {unknown[0]!r}; use only 'args' and 'kwargs'."
            )
        return _checked(where, module.model, inputs.get("args", ()), inputs.get("kwargs"))
    return _checked(where, module.model, inputs, None)


def _checked(where: str, model: Any, args: Any, kwargs: Any) -> LoadedModel:
    from torch import Tensor, nn  # here, not at the top: `show` and `schema` never need torch

    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{where} gave a model of type {type(model).__name__}; it must be a torch.nn.Module.")
    if isinstance(args, Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise ModelFileError(f"{where} gave args of type {type(args).__name__}; give a tuple of inputs or one tensor.")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ModelFileError(f"{where} gave kwargs of type {type(kwargs).__name__}; give a dict or leave it out.")
    return LoadedModel(source=where, model=model, args=tuple(args), kwargs=dict(kwargs or {}))


def _describe(exc: BaseException) -> str:
    """``ZeroDivisionError: division by zero.`` — first line only, so the error stays one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return f"{type(exc).__name__}."
    message = lines[0]
    return f"{type(exc).__name__}: {message}" + ("" if message.endswith(".") else ".")


def _kind(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} items"
    return f"a {type(value).__name__}"


def _safe(stem: str) -> str:
    return re.sub(r"\W", "_", stem)
