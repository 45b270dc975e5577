"""The memory timeline a plan carries: the simulated step's live bytes, downsampled.

A plan file has no graph, so ``ckptplan show`` cannot re-simulate; ``make_plan`` stores this
summary of the simulator's events in ``Prediction.timeline`` instead. Buckets keep the *maximum*
of the events they cover, so the timeline's maximum is the predicted peak, exactly.

Torch-free and free of ``ckptplan.plan`` imports (``plan`` imports this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from ckptplan.simulation import Event

TIMELINE_BUCKETS = 120  # buckets a plan's timeline holds at most


class Timeline(BaseModel):
    """Live bytes over one simulated step, in at most ``TIMELINE_BUCKETS`` buckets.

    ``bytes[k]``: the most bytes live at any simulator event in bucket k; buckets cover
    consecutive events in execution order, as evenly as integers allow. ``backward_start``: the
    first bucket holding a backward or recompute event (``len(bytes)`` if none does).
    ``events``: how many simulator events the buckets cover.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bytes: tuple[Annotated[int, Field(ge=0)], ...]
    backward_start: int = Field(ge=0)
    events: int = Field(ge=0)

    @model_validator(mode="after")
    def _check_counts(self) -> Timeline:
        if self.backward_start > len(self.bytes):
            raise ValueError(f"backward_start {self.backward_start} is past the {len(self.bytes)} buckets")
        if self.events < len(self.bytes):
            raise ValueError(f"{len(self.bytes)} buckets cannot summarise {self.events} events")
        return self

    @property
    def peak_bytes(self) -> int:
        """The most bytes live at any event (0 for an empty timeline)."""
        return max(self.bytes, default=0)


def bucket_bounds(length: int, buckets: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` index ranges splitting ``length`` items into ``min(length, buckets)``
    consecutive, non-empty ranges whose sizes differ by at most one."""
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    count = min(length, buckets)
    return [(k * length // count, (k + 1) * length // count) for k in range(count)]


def max_pool(values: Sequence[int], buckets: int) -> tuple[int, ...]:
    """The maximum of each of ``bucket_bounds(len(values), buckets)``: the overall maximum survives."""
    return tuple(max(values[lo:hi]) for lo, hi in bucket_bounds(len(values), buckets))


def timeline_of(events: Sequence[Event], buckets: int = TIMELINE_BUCKETS) -> Timeline | None:
    """Downsample the simulator's events (``Report.timeline``) into a ``Timeline``; None when
    there are no events (a graph without nodes)."""
    if not events:
        return None
    bounds = bucket_bounds(len(events), buckets)
    first_backward = next((i for i, e in enumerate(events) if e.phase != "forward"), len(events))
    backward_start = next((k for k, (_, hi) in enumerate(bounds) if first_backward < hi), len(bounds))
    return Timeline(
        bytes=max_pool([e.live_bytes for e in events], buckets),
        backward_start=backward_start,
        events=len(events),
    )
