"""Time estimates for ops and for checkpointing's own machinery, so pointwise ops that FLOP
counters ignore still cost time, and so do the regions and selective policies a plan adds.

An op's time is ``op_seconds + max(flops / peak_flops, bytes_moved / bandwidth, drawn * draw_seconds)``:
the roofline (Williams et al. 2009, "Roofline") with a third ceiling for random numbers drawn
(dropout's masks: their generator's integer work, which FLOP counters do not see), plus a fixed
launch/dispatch cost per op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Roofline:
    """A device's throughput and the fixed costs a plan pays per op and per checkpoint.

    Defaults: NVIDIA A100 80GB SXM datasheet, dense BF16 tensor-core peak 312 TFLOP/s and
    2.039 TB/s HBM2e bandwidth; no fixed costs, since on a GPU the host's dispatch and
    checkpoint bookkeeping run ahead of the kernels and hide behind them on models large
    enough to need checkpointing. ``ckptplan.measure_roofline()`` measures all seven numbers on
    the host it runs on, where they do not hide (docs/tuning.md, "Cost models").

    ``op_seconds``: fixed cost of running one graph op (dispatch, kernel launch).
    ``region_seconds``: what one checkpoint region adds to a step besides its recompute
    (checkpoint's frame, saving and restoring the RNG state, starting the recompute in backward).
    ``region_op_seconds``: what each op inside a region adds besides its own recompute: the
    saved-tensor hooks (Python) that pack each tensor it saves in forward, pack it again in
    the recompute and unpack it in backward, and autograd's recording of the recomputed op.
    ``policy_op_seconds``: what each kept node adds, once in forward and once in the recompute:
    ``emit`` runs it inside a selective policy's dispatch mode, which sees every op it
    dispatches (the region's other nodes run outside any mode).
    ``remat_seconds``: what each recompute of a rematerialised op (``ckptplan.remat``; one per
    op that saves its output) adds besides the op's own time: recording how to recompute it in
    forward, and the saved-tensor hooks (Python) that pack what the saving op stores in forward
    and unpack it in backward.
    ``draw_seconds``: the time one random number takes to draw, on the generator's arithmetic
    alone: Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3", the
    generator of CUDA's dropout) runs 10 rounds of two 32-bit multiply-highs and a few xors and adds
    per 4 numbers, about ``PHILOX_OPS_PER_NUMBER`` integer operations per number, which an A100
    runs at its 19.5 TOPS INT32 datasheet rate: a GPU's dropout stays memory-bound, a CPU's is
    not (``measure_roofline`` times one).
    ``priced_in``: what a cost-second stands for, ``"seconds"`` or ``"flops"`` (``FLOPS``: 10¹²
    FLOPs), so that a plan's overhead can say whether it is a share of the step's time or FLOPs.
    ``source``: where the numbers come from, for the plan to say: ``"a100"`` (``A100``),
    ``"measured"`` (``measure_roofline``), ``"flops"`` (``FLOPS``) or ``"custom"``.
    """

    peak_flops_per_s: float = 312e12
    bandwidth_bytes_per_s: float = 2.039e12
    op_seconds: float = 0.0
    region_seconds: float = 0.0
    region_op_seconds: float = 0.0
    policy_op_seconds: float = 0.0
    remat_seconds: float = 0.0
    draw_seconds: float = 0.0
    priced_in: Literal["seconds", "flops"] = "seconds"
    source: Literal["a100", "measured", "flops", "custom"] = "custom"

    def seconds(self, flops: float, bytes_moved: float, drawn: int = 0) -> float:
        """An op's time: ``flops`` as ``FlopCounterMode`` counts them, ``bytes_moved`` read and
        written, ``drawn`` random numbers drawn."""
        return self.op_seconds + max(
            flops / self.peak_flops_per_s, bytes_moved / self.bandwidth_bytes_per_s, drawn * self.draw_seconds
        )


# Philox4x32-10's integer operations per number: 10 rounds of (2 multiplies, each a high and a
# low word, + 2 xors + 2 key adds), per 4 numbers.
PHILOX_OPS_PER_NUMBER = 20
A100 = Roofline(draw_seconds=PHILOX_OPS_PER_NUMBER / 19.5e12, source="a100")

# Recomputation priced in FLOPs as ``torch.utils.flop_counter.FlopCounterMode`` counts them
# (matmul-like ops only), one cost-second per 10¹² FLOPs: a plan's cost is then its recompute
# FLOPs, and its overhead those FLOPs over the step's. A byte moved costs a thousandth of a
# FLOP: among plans recomputing as many FLOPs the one moving fewer bytes wins, and bytes
# outweigh a matmul only where the ops weighed against it move a thousand times more bytes than
# it does FLOPs. A random number drawn costs its generator's integer operations as FLOPs
# (``PHILOX_OPS_PER_NUMBER``), so that drawing a dropout mask again is not priced as a copy. No
# fixed costs.
FLOPS = Roofline(peak_flops_per_s=1e12, bandwidth_bytes_per_s=1e15, draw_seconds=PHILOX_OPS_PER_NUMBER / 1e12,
                 priced_in="flops", source="flops")
