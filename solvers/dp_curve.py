"""The chain DP of ``solvers.dp``, vectorised over memory: one pass gives every budget's answer.

``ChainDP`` (the slow, obvious reference, kept beside this fast path and tested against it)
memoises ``suffix`` on the exact memory held outside a group of items. Every step's memory is
that held amount plus a constant, compared with the budget, so the answer depends only on the
*headroom* (budget − held), and the state space can be folded into arrays over it.

Tables (all memory in units of ``mem_unit`` above resident memory, rounded up; ``U`` = the
largest budget asked for, in units):

``suffix[k][b][region][δ][ihs][ihb][first]`` is an array over ``m`` in ``0..U``: entry ``m`` is
``ChainDP.suffix(k, b, region, ms=m+δ, mb=m, ihs, ihb, first)`` at budget ``U`` — the least
recompute cost of the items covering stages ``k..b`` of a frame when ``m`` units are held
outside them during backward and ``m + δ`` during the frame's forward (``δ`` ≥ 0 is the input
of a nested region, held by its recomputation but not by its backward); infinity where nothing
fits. ``choice`` has the same shape: -1 (nothing fits), 0 (stage k runs directly) or ``d + 1``
(a child region over stages ``k..d`` comes first).

Because entry ``m`` at budget ``U`` equals entry 0 at budget ``U − m``, the top-level array
``suffix[0][L-1][top][0][·][·]`` read backwards is the least cost at *every* budget up to ``U``:
the whole cost-against-budget curve, the least reachable peak, and each plan, from one pass of
O(L³) array operations of length ``U``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from ckptplan.plan import Region
from ckptplan.solvers.chain import Chain

INF = math.inf

# suffix key: (k, b, region, delta, ihs, ihb, first)
_Key = tuple[int, int, bool, int, bool, bool, bool]


@dataclass(frozen=True)
class CostCurve:
    """The DP's answer at every budget of one chain at one memory unit.

    ``costs[u]``: least recompute cost with ``u`` units above resident memory (infinity where no
    plan of the chain fits); non-increasing in ``u``."""

    chain: Chain
    unit: int
    costs: np.ndarray
    _dp: CurveDP

    def units(self, budget_bytes: int) -> int:
        """Budget in whole units above resident memory (rounded down), capped at the curve's end."""
        return min((budget_bytes - self.chain.resident_bytes) // self.unit, len(self.costs) - 1)

    def cost(self, budget_bytes: int) -> float:
        u = self.units(budget_bytes)
        return INF if u < 0 else float(self.costs[u])

    def least_units(self) -> int | None:
        """The fewest units at which some plan fits (None if none fits at the curve's end)."""
        finite = np.flatnonzero(np.isfinite(self.costs))
        return int(finite[0]) if finite.size else None

    def regions(self, budget_bytes: int) -> tuple[Region, ...]:
        """The plan behind ``cost(budget_bytes)`` (which must be finite)."""
        return self._dp.regions(len(self.costs) - 1 - self.units(budget_bytes))


class StageUnits:
    """A chain's per-stage quantities in whole memory units (rounded up), shared by both DPs."""

    def __init__(self, chain: Chain, mem_unit: int) -> None:
        self.chain = chain
        self.unit = mem_unit
        up = self._units
        L = len(chain)
        self.L = L
        self.X = [up(b) for b in chain.out_bytes]
        self.H = [up(b) for b in chain.hidden_bytes]
        self.si = chain.saves_input
        self.so = chain.saves_output
        self.f_all = [up(b) for b in chain.fwd_all_bytes]
        self.f_none = [up(b) for b in chain.fwd_none_bytes]
        self.f_stop = [up(b) for b in chain.fwd_stop_bytes]
        self.b_extra = [up(b) for b in chain.bwd_extra_bytes]
        self.skip_fwd = [up(b) for b in chain.skip_fwd_bytes]
        self.skip_bwd = [up(b) for b in chain.skip_bwd_bytes]
        self.cost = chain.cost
        # params_after[k]: parameter gradients already allocated when stage k's backward starts
        self.params_after = [0] * (L + 1)
        for k in reversed(range(L)):
            self.params_after[k] = self.params_after[k + 1] + up(chain.param_grad_bytes[k])
        self.prefix_cost = [0.0]
        for c in chain.cost:
            self.prefix_cost.append(self.prefix_cost[-1] + c)

    def _units(self, n_bytes: int) -> int:
        return -(-int(n_bytes) // self.unit)

    def _in(self, k: int) -> int:
        """Units of stage k's input (the graph input, before stage 0, is resident)."""
        return self.X[k - 1] if k > 0 else 0

    def _grad_in(self, k: int) -> int:
        """Units of the gradient stage k receives (the loss's is a scalar seed)."""
        return self.X[k] if k < self.L - 1 else 0

    def _ctx(self, b: int, region: bool) -> int:
        """Held by gradients while a frame ending at b runs forward: the gradient of its output
        and every parameter gradient after it (none during the original forward)."""
        return self._grad_in(b) + self.params_after[b + 1] if region else 0


class CurveDP(StageUnits):
    """Fills ``suffix`` / ``choice`` (module docstring) for one chain up to ``top_units``."""

    def __init__(self, chain: Chain, top_units: int, mem_unit: int) -> None:
        super().__init__(chain, mem_unit)
        self.U = top_units
        # The memo: key -> choice row. Cost rows live in one matrix per *family* (a key less its
        # k, rows indexed by k) and, for frame starts, also in one per start (rows indexed by the
        # frame's end), so the inner loop reads all of a key's candidates as one slice.
        self._choice: dict[_Key, np.ndarray] = {}
        self._by_family: dict[tuple, np.ndarray] = {}
        self._by_start: dict[tuple, np.ndarray] = {}
        n = top_units + 1
        self._zeros = np.concatenate([np.zeros(n), np.full(n, INF)])  # the empty suffix, padded
        self._infinite = np.full(n, INF)
        self._entries = np.arange(n)
        self._no_choice = np.full(n, -1, dtype=np.int16 if self.L < 2**15 - 1 else np.int32)
        self._family_done: dict[tuple, np.ndarray] = {}
        self._start_done: dict[tuple, np.ndarray] = {}
        self._prefix = np.array(self.prefix_cost)
        # machinery[k, d]: seconds a region over stages k..d adds besides its recompute
        # (``Chain.machinery_cost``; only d ≥ k is read)
        ends = np.array([chain.span(d)[1] for d in range(self.L)], dtype=float)
        starts = np.array(chain.starts[:self.L], dtype=float)
        self._machinery = chain.region_cost + chain.region_op_cost * (ends[None, :] - starts[:, None])
        # forward_need[top][k, d]: the most a child region [k, d] allocates while it runs forward
        # without saving (stage j's allocation over the input it holds), before skips in a
        # recomputation (top: at the top level, with each stage's skips).
        self._forward_need = {top: self._running_need(top) for top in (False, True)}

    def _running_need(self, top: bool) -> np.ndarray:
        L = self.L
        need = np.zeros((L, L), dtype=np.int64)
        for k in range(L):
            terms = [(self.X[d - 1] if d > k else 0) + self.f_none[d] + (self.skip_fwd[d] if top else 0)
                     for d in range(k, L)]
            need[k, k:] = np.maximum.accumulate(np.array(terms, dtype=np.int64))
        return need

    def _shifted(self, values: np.ndarray, h: int, length: int) -> np.ndarray:
        """``values[m + h]`` for ``m < length``: every table row carries an infinite tail as long
        as itself, so a shift within the budget is a plain slice."""
        return values[h:h + length] if h <= self.U + 1 else self._infinite[:length]

    def curve(self) -> CostCurve:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20 * self.L + 1000))  # suffix recurses once per stage
        try:
            values = self.suffix((0, self.L - 1, False, 0, True, True, False))[0] if self.L else self._zeros
        finally:
            sys.setrecursionlimit(limit)
        costs = values[:self.U + 1][::-1].copy()
        # Plans are read from the choice rows alone: the cost matrices can go.
        self._by_family.clear()
        self._by_start.clear()
        return CostCurve(self.chain, self.unit, costs, self)

    def suffix(self, key: _Key) -> tuple[np.ndarray, np.ndarray]:
        """(cost row with its infinite tail, choice row) of ``key``, filled on first use."""
        family = key[1:]
        rows = self._family(family)
        k = key[0]
        if not self._family_done[family][k]:
            b, delta, ihb, first = key[1], key[3], key[5], key[6]
            self._choice[key] = self._suffix(rows[k], *key)
            self._family_done[family][k] = True
            if first:
                self._starts(k, delta, ihb)[b] = rows[k]
                self._start_done[(k, delta, ihb)][b] = True
        return rows[k], self._choice.get(key, self._no_choice)

    def _family(self, family: tuple) -> np.ndarray:
        """Cost rows of ``(k, *family)`` for k in 0..b+1; row b+1 is the empty suffix."""
        rows = self._by_family.get(family)
        if rows is None:
            b = family[0]
            rows = self._by_family[family] = np.full((b + 2, len(self._zeros)), INF)
            rows[b + 1] = self._zeros
            self._family_done[family] = np.zeros(b + 2, dtype=bool)
            self._family_done[family][b + 1] = True
        return rows

    def _starts(self, k: int, delta: int, ih: bool) -> np.ndarray:
        """Cost rows of frames ``(k, d, True, delta, True, ih, True)``, indexed by d."""
        rows = self._by_start.get((k, delta, ih))
        if rows is None:
            rows = self._by_start[(k, delta, ih)] = np.full((self.L, len(self._zeros)), INF)
            self._start_done[(k, delta, ih)] = np.zeros(self.L, dtype=bool)
        return rows

    def _stage_step(self, k: int, b: int, region: bool, ihs: bool, ihb: bool) -> tuple[int, int, int, int]:
        """Stage k run directly: (forward need, backward need, held in forward, held in backward)."""
        alloc = self.f_stop[k] if region and k == b else self.f_all[k]
        held_in_s = self._in(k) if not ihs else 0
        skips = self.skip_bwd[b] if region else self.skip_fwd[k]
        sweep = self._ctx(b, region) + held_in_s + alloc + skips
        hs = self.H[k] + (self.X[k] if self.so[k] else 0) + (held_in_s if self.si[k] else 0)
        hb = self.H[k] + (self.X[k] if self.so[k] else 0) + (self._in(k) if self.si[k] and not ihb else 0)
        backward = hb + self._grad_in(k) + self.params_after[k + 1] + self.b_extra[k] + self.skip_bwd[k]
        return sweep, backward, hs, hb

    def _child_inputs(self, k: int, ihs: bool, ihb: bool) -> tuple[int, int]:
        """A child region starting at stage k: its input's units held in forward / in backward."""
        return (self._in(k) if not ihs else 0), (self._in(k) if not ihb else 0)

    def _suffix(
        self, values: np.ndarray, k: int, b: int, region: bool, delta: int, ihs: bool, ihb: bool, first: bool
    ) -> np.ndarray:
        """Fill ``values`` (entries 0..U, then the infinite tail) for key ``(k, b, ...)``; return
        its choice row."""
        U = self.U
        choice = np.full(U + 1, -1, dtype=np.int16 if self.L < 2**15 - 1 else np.int32)
        # Option 1: stage k runs directly (entries m ≤ cap fit its forward and backward).
        sweep, backward, hs, hb = self._stage_step(k, b, region, ihs, ihb)
        cap = min(U - delta - sweep, U - backward)
        if cap >= 0:
            rest = self.suffix((k + 1, b, region, delta + hs - hb, self.so[k], self.so[k], False))[0]
            values[:cap + 1] = (self.cost[k] if region else 0.0) + self._shifted(rest, hb, cap + 1)
            choice[:cap + 1][np.isfinite(values[:cap + 1])] = 0
        # Option 2: a child region [k, d] comes first; all ends d at once, one row each. The
        # child's forward need grows with d, so the ends that fit are a prefix of k..last_run.
        ctx = self._ctx(b, region)
        rin_s, rin_b = self._child_inputs(k, ihs, ihb)
        skips = self.skip_bwd[b] if region else 0
        last_run = min(b - 1 if region else b, self.chain.last_region_stage(k))
        room = U - delta - ctx - rin_s - skips
        need = self._forward_need[not region][k, k:last_run + 1]
        count = int(np.count_nonzero(need <= room))
        # The child spanning the frame: early stop skips its forward.
        whole = region and not first and room >= 0 and b <= self.chain.last_region_stage(k)
        if (count == 0 and not whole) or rin_b > U:
            return choice
        top_level = not region
        after = (b, region, delta + rin_s - rin_b, False, False, False)
        child_delta, child_ih = (0, True) if top_level else (rin_b, ihb)
        child_shift = rin_b if top_level else 0
        rest_rows = self._family(after)
        child_rows = self._starts(k, child_delta, child_ih)
        rest_done = self._family_done[after]
        child_done = self._start_done[(k, child_delta, child_ih)]
        ends = [*range(k, k + count), *([b] if whole else [])]
        if not (rest_done[k + 1:k + 1 + count].all() and child_done[k:k + count].all()
                and (not whole or (rest_done[b + 1] and child_done[b]))):
            for d in ends:  # fill what the slices below read
                if not rest_done[d + 1]:
                    self.suffix((d + 1, *after))
                if not child_done[d]:
                    self.suffix((k, d, True, child_delta, True, child_ih, True))
        if count:
            caps = room - need[:count]
            width = int(caps[0]) + 1  # the shortest child needs least
            candidates = rest_rows[k + 1:k + 1 + count, rin_b:rin_b + width] + (
                self._prefix[k + 1:k + 1 + count, None] - self._prefix[k] if region else 0.0)
            # Summed in ChainDP's order (sweep + rest + child + machinery), so ties break alike.
            candidates += child_rows[k:k + count, child_shift:child_shift + width]
            candidates += self._machinery[k, k:k + count, None]
            candidates[self._entries[None, :width] > caps[:, None]] = INF
            row = candidates.argmin(axis=0)  # the first end reaching the least cost, as ChainDP picks
            best = candidates[row, self._entries[:width]]
            better = best < values[:width]
            values[:width][better] = best[better]
            choice[:width][better] = (row[better] + (k + 1)).astype(choice.dtype)
        if whole:
            width = room + 1
            candidate = rest_rows[b + 1, rin_b:rin_b + width] + child_rows[b, child_shift:child_shift + width]
            candidate += self._machinery[k, b]
            better = candidate < values[:width]
            values[:width][better] = candidate[better]
            choice[:width][better] = b + 1
        return choice

    def regions(self, m: int) -> tuple[Region, ...]:
        """The top-level plan at entry ``m`` (budget ``U − m``)."""
        return self._walk((0, self.L - 1, False, 0, True, True, False), m)

    def _walk(self, key: _Key, m: int) -> tuple[Region, ...]:
        k, b, region, delta, ihs, ihb, first = key
        regions = []
        while k <= b:
            code = int(self._choice.get((k, b, region, delta, ihs, ihb, first), self._no_choice)[m])
            if code < 0:
                raise ValueError(f"no plan at entry {m} of stages {k}..{b}")
            if code == 0:
                _, _, hs, hb = self._stage_step(k, b, region, ihs, ihb)
                delta, m, ihs, ihb, k = delta + hs - hb, m + hb, self.so[k], self.so[k], k + 1
            else:
                d = code - 1
                rin_s, rin_b = self._child_inputs(k, ihs, ihb)
                if not region:
                    inner = self._walk((k, d, True, 0, True, True, True), m + rin_b)
                else:
                    inner = self._walk((k, d, True, rin_b, True, ihb, True), m)
                start, _ = self.chain.span(k)
                _, end = self.chain.span(d)
                regions.append(Region(start, end, children=inner))
                delta, m, ihs, ihb, k = delta + rin_s - rin_b, m + rin_b, False, False, d + 1
            first = False
        return tuple(regions)


def cost_curve(chain: Chain, top_budget_bytes: int, mem_unit: int) -> CostCurve:
    """The DP's least cost at every budget up to ``top_budget_bytes`` (whole units above resident)."""
    top_units = max(0, (top_budget_bytes - chain.resident_bytes) // mem_unit)
    return CurveDP(chain, top_units, mem_unit).curve()
