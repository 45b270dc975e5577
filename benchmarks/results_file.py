"""Each benchmark's results file: ``benchmarks/results/<script>.md`` (and ``<script>.json`` where the
script has rows), written by the script at the end of a run and headed by the command line that
made it and the machine it ran on. Rerunning the command regenerates the file; its history is git's.

A script runs its ``main`` under ``recorded``: what it prints still goes to the screen, and when the
run ends without an error the same text becomes its results file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def path(script: str, suffix: str = ".md", variant: str = "") -> Path:
    """The results file of ``script`` (its path or name), or of one ``variant`` of its runs."""
    return RESULTS / f"{Path(script).stem}{'_' + variant if variant else ''}{suffix}"


def command() -> str:
    """This run's command line, with the script's path from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else sys.argv[0]
    return shlex.join(["python", shown, *sys.argv[1:]])


def machine() -> str:
    """Platform, cores (and GPU, where there is one), torch and Python versions."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{platform.system()} {platform.machine()}, {cores} cores{gpu}, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def write(script: str, title: str, lines: Sequence[str], *, about: str = "",
          rows: list[dict[str, Any]] | None = None, variant: str = "") -> Path:
    """Write ``lines`` as the results file of ``script`` under its title, this run's command and
    machine, and ``about`` (how to read it); ``rows``, if given, to ``<script>.json`` beside it.
    ``variant``: the file is ``<script>_<variant>.md`` (a run of the script's that is not its
    default one keeps its own file)."""
    head = [f"# {title}", "", f"`{command()}` on {machine()}.", ""]
    if about:
        head += [about, ""]
    target = path(script, variant=variant)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join([*head, *lines]).rstrip("\n") + "\n")
    if rows is not None:
        document = {"command": command(), "machine": machine(), "rows": rows}
        path(script, ".json", variant).write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    print(f"written to {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}", file=sys.stderr)
    return target


class _Tee:
    """A text stream that writes to ``stream`` and keeps a copy."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self.stream, name)


class Record:
    """What ``recorded`` yields: set ``rows`` to also write them as ``<script>.json``."""

    rows: list[dict[str, Any]] | None = None


@contextlib.contextmanager
def recorded(script: str, title: str, about: str = "", *, variant: str = "") -> Iterator[Record]:
    """Run the block with what it prints to stdout also kept; if it ends without an exception
    (``--help`` and argument errors raise ``SystemExit``), write that as the results file (of
    ``variant``: a mode of the script that measures something else keeps its own file)."""
    record = Record()
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield record
    finally:
        sys.stdout = tee.stream
    write(script, title, tee.kept.getvalue().splitlines(), about=about, rows=record.rows, variant=variant)
