"""The models the benchmarks run, by name: the bundled examples and the architectures of
``tests/architectures.py``, each a builder returning ``(model, args, kwargs)``."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` as a module named ``name`` (registered, so its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def builders() -> dict[str, Callable[[], tuple]]:
    found = {}
    for example in ("gpt", "resnet", "unet"):
        build = load(ROOT / "examples" / f"{example}.py", f"ckptplan_bench_{example}").build
        found[example] = lambda build=build: (*build(), {})
    found.update(load(ROOT / "tests" / "architectures.py", "ckptplan_bench_architectures").ARCHITECTURES)
    return found
