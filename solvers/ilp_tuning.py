"""ilp's tuning constants, one line each: the measurements behind them are in ``docs/tuning.md``
("ilp"), under the constant's name. ``ilp``, ``ilp_flat`` and ``remat_ilp`` read them here, as
``tuning.NAME``, so that one table sets them all."""

from __future__ import annotations

DETERMINISTIC_SECONDS_PER_SECOND = 0.3  # CP-SAT deterministic seconds per second asked for
LNS_WINDOW = 24  # nodes whose decisions one local-search step frees
LNS_DETERMINISTIC_SECONDS = 1.0  # deterministic-time limit of one local-search step
GLOBAL_SHARE = 0.5  # of the reproducible search: the lazy search; the rest is local search
REFINE_SHARE = 0.1  # of the limit: more keeps on the warm plans (``refine``) ...
REFINE_MIN_SECONDS = 0.02  # ... and at least this
SIMULATE_SECONDS_PER_NODE = 15e-6  # what one refine move is priced at, per node
FLAT_MAX_NODES = 400  # larger graphs of repeated blocks are solved block by block
POLICY_SHARE = 0.5  # of ``solve_hierarchical``'s limit: the block policies
LARGE_POLICY_SHARE = 0.7  # ... on larger graphs given warm plans and LARGE_POLICY_MIN_SECONDS
LARGE_POLICY_MIN_SECONDS = 10.0
LARGE_REFINE_SHARE = 0.15  # of the limit, on larger graphs: ``keep_more``'s moves
LARGE_SIMULATE_SECONDS_PER_NODE = 40e-6  # what one of those moves is priced at, per node
QUICK_PROOF_MAX_NODES = 1_200  # up to here the proof phase follows the blocks when it gets MIN_PROOF_SECONDS
SLOW_PROOF_MIN_SECONDS = 100.0  # larger graphs need this much for it
LEAST_SHARE = 0.5  # of the limit, when no warm plan fits: the least-peak search
HIERARCHICAL_SHARE = 0.25  # of the limit, without a proof phase to follow: the block-by-block warm start
MIN_PROOF_SECONDS = 10.0  # the least time worth a proof phase
PROOF_SHARE = 0.3  # of the limit, kept for the proof phase when that is MIN_PROOF_SECONDS or more
LARGE_PROOF_SHARE = 0.5  # the same above FLAT_MAX_NODES
BUILD_SECONDS_PER_PAIR = 75e-6  # building the CP-SAT model, per (node, node of its window)
SIMPLIFY_GRACE = 0.05  # of the proof phase's time: simplifying the plan it found, past its end
