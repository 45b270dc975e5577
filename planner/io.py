"""Writing plans: atomically, and never over a file that is not a plan unless asked."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ckptplan.errors import CkptPlanError
from ckptplan.plan import PartitionPlan, Plan


def check_plan_target(path: str | Path, *, overwrite: bool) -> Path:
    """Raise ``CkptPlanError`` if a plan cannot be written to ``path``: a directory, a missing
    folder, or an existing file without ``overwrite``."""
    path = Path(path)
    if path.is_dir():
        raise CkptPlanError(f"Cannot write the plan to {str(path)!r}: it is a directory.")
    if path.exists() and not overwrite:
        raise CkptPlanError(f"{str(path)!r} already exists; pass --force to overwrite it.")
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise CkptPlanError(f"Cannot write the plan to {str(path)!r}: folder {str(directory)!r} does not exist.")
    return path


def save_plan(plan: Plan | PartitionPlan, path: str | Path, *, overwrite: bool = True) -> Path:
    """Write ``plan`` as JSON to ``path`` via a temporary file and rename, so a crash or full
    disk never leaves a half-written plan. With ``overwrite=False`` an existing file is an error."""
    path = check_plan_target(path, overwrite=overwrite)
    directory = path.parent if str(path.parent) else Path(".")
    text = plan.to_json()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
