"""The solvers' tuning constants, in one table. Where a constant rests on a measurement, it is in
``docs/tuning.md``, in the section its group's comment names (a module's name where one module
reads the group). Solvers read them as ``tuning.NAME`` when they run, so a test that changes one
patches it here; the few read at import keep their value (default arguments, ``registry``'s
limits, and the constants defined from others below)."""

from __future__ import annotations

# Default time limits (docs/tuning.md, "Default time limits"): the seconds a solve takes when the
# caller gives no limit (``registry``; ``sqrt`` and ``dp`` run until done). The phases end before
# the limit's end by STOP_SECONDS (CP-SAT returns up to about a tenth of a second after its
# wall-clock limit on models of a few hundred nodes) and FINISH_SIMULATIONS simulations of the
# whole graph, each priced as LARGE_SIMULATE_SECONDS_PER_NODE (``orchestrate.finish_seconds``).
AUTO_SECONDS = 10.0
AUTO_LARGE_SECONDS = 30.0  # ``auto`` on graphs of more than LARGE_NODES nodes
LARGE_NODES = 600
ILP_SECONDS = 60.0
STOP_SECONDS = 0.1
FINISH_SIMULATIONS = 4

# ilp (docs/tuning.md, "ilp", "Least peaks")
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
DEFAULT_WINDOW = 128  # longest region, in nodes, the model considers on graphs longer than this
MIN_SEARCH_SECONDS = 0.1  # the least a proof or lazy search is given when its share has run out
# Running sums of the model's memory rows longer than this fold into an integer variable, so that
# no constraint is long (a model-size guard; not measured).
FOLD_TERMS = 64

# ilp_lazy (docs/tuning.md, "ilp_lazy"). Deferred rows stated up front are those of the events
# where the start plan holds the most bytes. The reproducible search (one worker) states
# SEEDED_ROWS and adds every row a plan breaks: its first plans break rows near the start plan's
# peak, and each round that then restarts pays CP-SAT's presolve again. The proof phase states
# PROOF_SEEDED_ROWS and adds, per round, PROOF_ROWS_PER_ROUND rows of the fullest events the plan
# that stopped it breaks: each row brings the ``alive``, copy and recompute variables it reads,
# and rows that do not bind at the optimum still weaken the LP bound.
PROOF_WORKERS = 3  # the proof phase's workers on fewer cores than FULL_PORTFOLIO_WORKERS
SEEDED_ROWS = 8
PROOF_SEEDED_ROWS = 1
PROOF_ROWS_PER_ROUND = 1
# From a start with a region longer than the model's window (no hint): at least this many rows up
# front, each at least UNHINTED_ROW_GAP nodes from the others (the start's fullest events
# cluster around its own peaks), and every row a plan breaks joins.
UNHINTED_SEEDED_ROWS = 4
UNHINTED_ROW_GAP = 4
MIN_CLOCK_SECONDS = 0.01  # a deterministic clock with less left than this ends the search; nor is one set lower

# cpsat (docs/tuning.md, "cpsat"). From FULL_PORTFOLIO_WORKERS workers on, CP-SAT runs its own
# portfolio (what its documentation recommends: one worker per core). Below it, a portfolio's
# full-problem workers are only BOUND_SUBSOLVERS, beside CP-SAT's first-solution and neighbourhood
# workers: its LP with cuts and symmetry, which raises the lower bound, and its tree search on the
# LP bound, which closes proofs where the LP bound stalls.
MIN_WALL_SECONDS = 1.0  # the wall-clock backup of even the shortest search
FULL_PORTFOLIO_WORKERS = 8
BOUND_SUBSOLVERS = ("max_lp_sym", "lb_tree_search")
HINT_SECONDS = 10.0  # the most a complete hint may take (a copy of the model with the plan fixed)

# polish: ``auto``'s portfolio phase (docs/tuning.md, "polish")
POLISH_SHARE = 0.5  # of the time before the joint search (JOINT_SHARE): the portfolio's, at least
POLISH_MIN_SECONDS = 1.0  # the least time worth starting the portfolio for (its model's build comes first)
# The longest regions, in nodes, the portfolio allows first, then (each once the one before is
# proven) wider, up to ``ilp``'s own window.
POLISH_WINDOWS = (32, 64)
SPLIT_START_SHARE = 0.1  # of the portfolio's time at most, for simulating cuts of a start too long to hint
POLISH_MAX_NODES = LARGE_NODES  # larger graphs are left to the block-by-block plan
# The joint search's memory rows from a start it takes as a hint: stated up front, and added per
# round (None: every row a plan breaks; ``ilp_lazy.search_lazily``).
POLISH_JOINT_ROWS = (8, None)

# remat_plans: how a solve weighs rematerialisation (docs/tuning.md, "polish", "remat_ilp")
PLAIN_SHARE = 0.4  # with the joint search: the plain solve's part, to 1 - PLAIN_SHARE - JOINT_SHARE for the other solve
JOINT_SHARE = 0.2  # of ``with_remat``'s time limit: the joint neighbourhood search
SHED_SIMULATED_NODES = 20_000  # ``shed_remat`` simulates at most this many nodes' worth of plans ...
SHED_MIN_PLANS = 8  # ... or this many plans, whichever is more
# Graphs up to this many nodes get the portfolio search of regions and rematerialisation together
# (``polish.polish(joint=True)``) from the plain solve's plan, in place of the solve on the
# rematerialised graph and the neighbourhood search; larger ones get it from the cheaper of the
# plain plan and the rematerialised graph's.
JOINT_PORTFOLIO_MAX_NODES = FLAT_MAX_NODES
# Above JOINT_PORTFOLIO_MAX_NODES, from a start the joint search cannot take as a hint
# (``polish.hints``), a portfolio of regions alone on the graph the start was solved on runs
# first, for this share of the portfolios' time, and the joint one starts from its plan.
UNHINTED_ALONE_SHARE = 0.75
# Where candidates are more than ALONE_FIRST_DENSITY of the graph's nodes, the joint model's LP
# bound is weak and its portfolio wanders: a portfolio of regions alone runs first, for at most
# ALONE_FIRST_SHARE of the portfolio's time (less when it proves its plan sooner), and the joint
# portfolio starts from its plan.
ALONE_FIRST_DENSITY = 0.5
ALONE_FIRST_SHARE = 0.25

# remat_ilp: the joint model's neighbourhood search (docs/tuning.md, "remat_ilp")
REMAT_STEP_DETERMINISTIC_SECONDS = 0.25  # CP-SAT's deterministic clock per neighbourhood step
REMAT_STEP_SECONDS = 0.3  # about what one step takes
# The longest region the joint model allows, unless the start plan holds a longer one: the
# model's size, and each step's presolve, grow with it.
REMAT_WINDOW = 32
# The least time worth a joint search: building the model comes first (about
# BUILD_SECONDS_PER_PAIR per node and window step).
REMAT_MIN_SECONDS = 1.5

# blocks: block-by-block solving (docs/tuning.md, "blocks")
POLICY_BUDGETS = 3  # block budgets per ballast, evenly from its least to its unplanned peak
# The ballasts: the rest of the step, in the block's activation bytes (0 favours a low peak inside
# the block, more favours storing little). The largest is raised to the block's own unplanned
# peak where that is more, so that the ballast's events are the block graph's peak whatever the
# plan, and a budget bounds exactly what the block stores.
BALLAST_SHARES = (0.0, 1.0, 4.0)
# Extra solves with the largest ballast, each in the widest gap left on the frontier of (peak,
# recompute cost) (``blocks.Frontier``), down to gaps of 1/FRONTIER_RESOLUTION of the budgets'
# range: evenly spaced budgets miss the cheap plans that free a little.
FRONTIER_SOLVES = 12
FRONTIER_RESOLUTION = 100
KEEP_STEPS = 4  # keep-set sizes of ``ranked_keep_policies``: 0, 1/4, ..., all of the keepable nodes
SMALL_REGION_NODES = 4  # ``small_region_policies``: regions of at most this many nodes,
SMALL_REGION_POLICIES = 4  # the best 1, 2, ..., this many of them
# What measuring them costs (about 4 simulations of the block per node: quadratic in its size),
# per pair of the block's nodes, out of the block's seconds.
SMALL_REGION_SECONDS_PER_PAIR = 80e-6
FREED_UNITS = 4000  # buckets of freed bytes in which the choice DP keeps one state
BLOCK_MAX_REPAIRS = 4  # re-choices with a lowered budget when the assembled plan overshoots
# With this many seconds per block solve, the lowest budget tried is the least peak the flat ilp
# finds.
THOROUGH_SECONDS = 0.2
# Below this many seconds per block solve, there are no flat solves: building and solving each
# small model costs more than its limit.
BLOCK_MIN_SOLVE_SECONDS = 0.05
# What block policies cost beyond the limits they are given, per node of the block, so that the
# split of the seconds depends on the graph and never on the clock (plans stay reproducible): a
# flat solve beyond its CP-SAT limit (model build, hint completion, the solver's start), dp's warm
# plan, and one quick policy (ballast, budget).
BLOCK_SOLVE_SECONDS_PER_NODE = 0.0045
BLOCK_DP_SECONDS_PER_NODE = 0.0013
BLOCK_QUICK_SECONDS_PER_NODE = 0.0045
# The least-peak choice (``blocks.least_peak``) bisects its budget down to this many steps of the
# range from resident memory to the no-checkpoint peak.
LEAST_PEAK_STEPS = 4096
MIN_BLOCK_NODES = 4  # smaller blocks leave nothing to decide inside them: no decomposition

# dp and its stage chains (docs/tuning.md, "dp")
DEFAULT_MEM_UNITS = 1000  # memory resolution: resident memory to the no-checkpoint peak in this many units
MAX_MEM_UNITS = 16384  # the finest resolution a caller's ``mem_unit`` may ask for (the tables' size)
MAX_STAGES = 32  # stages of a chain at most (``chain.stage_starts``)
# What one candidate chain's curve is budgeted per node under a time limit: the limit buys
# ``time_limit / (CHAIN_SECONDS_PER_NODE * nodes)`` chains (at least one), a count and not the
# clock, so a plan does not depend on the machine's load.
CHAIN_SECONDS_PER_NODE = 0.0013
# A cut may split a tensor off from its readers (making it a skip) only if such tensors are at
# most this share of what crosses the cut: an attention mask shared by all layers may be
# carried, a residual stream may not.
SKIP_SHARE = 1 / 16
# Stage chains tried on graphs with skips (``chain.stage_starts``'s ``skip_share``): clean cuts
# only, cuts leaving a quarter of the crossing bytes as skips, any cut. A finer chain allows more
# region edges but charges more skips conservatively; neither contains the other's plans.
CHAIN_SKIP_SHARES = (SKIP_SHARE, 1 / 4, 1.0)
DP_MAX_REPAIRS = 4  # re-solves below the budget when a merged-stage plan overshoots under simulate

# sqrt: how many thresholds to try, spread geometrically between the largest single op's saved
# bytes and the whole graph's; and the quantiles of crossing bytes that define "cheap" cuts (a
# spread chosen, not tuned by a measurement).
SQRT_THRESHOLDS = 24
SQRT_CUT_QUANTILES = (0.0, 0.25, 0.5)

# Compiled steps' partitions (docs/tuning.md, "partition_exact"). The greedy search runs at most
# GREEDY_ROUNDS_PER_CANDIDATE rounds per candidate value (each round removes one).
GREEDY_ROUNDS_PER_CANDIDATE = 2
# The seconds each solver takes when the caller gives no limit: ``auto`` runs the greedy search,
# then the exact model for the rest of its time; ``exact`` the same for longer; ``greedy`` the
# greedy search alone.
PARTITION_SECONDS = {"auto": 30.0, "exact": 120.0, "greedy": 0.0}
# Shares of the time asked, each sized on a clock of work rather than the wall clock so that the
# search ends the same on every run:
GREEDY_SHARE = 0.5  # the greedy search, ...
SIMULATED_VALUES_PER_SECOND = 170_000  # ... counted in joint-graph values simulated
PARTITION_LEAST_SHARE = 0.3  # the least-peak search when the greedy search fits nothing, ...
PARTITION_LEAST_CLOCK = 0.1  # ... counted in CP-SAT's deterministic seconds
# A start that recomputes less than the best that fits is searched from too when it peaks at most
# this share of the budget over it.
NEAR_FITTING = 0.01
EXACT_ROWS_PER_ROUND = 12  # memory rows the exact model adds per broken solution: its fullest points
EXACT_LEAST_PROBES = 10  # budgets the least-peak bisection tries at most ...
EXACT_LEAST_RESOLUTION = 0.005  # ... stopping when the least found is within this share of a proved bound
EXACT_WORKERS = 2  # CP-SAT workers: better plans in the time than one, not reproducible under a limit
