"""Roofline time estimates for ops, so pointwise ops that FLOP counters ignore still cost time.

time = max(flops / peak_flops, bytes_moved / bandwidth)   (Williams et al. 2009, "Roofline").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Roofline:
    """Device throughput. Defaults: NVIDIA A100 80GB SXM datasheet, dense BF16 tensor-core peak
    312 TFLOP/s and 2.039 TB/s HBM2e bandwidth."""

    peak_flops_per_s: float = 312e12
    bandwidth_bytes_per_s: float = 2.039e12

    def seconds(self, flops: float, bytes_moved: float) -> float:
        return max(flops / self.peak_flops_per_s, bytes_moved / self.bandwidth_bytes_per_s)


A100 = Roofline()
