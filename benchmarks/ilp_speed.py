"""The ``ilp`` solver against ``sqrt`` and ``dp`` in one process: model size, time, status, gap
and the recompute overhead of each plan, on the examples and a ``transformers`` GPT-2.

    python benchmarks/ilp_speed.py [--time-limit 60] [--workers 1]
                                   [--proof-only | --limits 2,6,15 [--solver ilp|auto]]
                                   [--graphs unet,resnet,gpt,gpt2:2]

Each graph is solved at 70% and 50% of its no-checkpoint peak. ``ilp`` runs with the given time
limit (model building included) and starts from the ``dp``/``sqrt`` plans and the block-by-block
plan, which is also shown alone (given the whole limit; ``ilp`` gives it a quarter, or, when
the proof phase follows it at once, 70% up to 400 nodes and half above: ``ilp.proof_follows``,
``ilp.blocks_share``); "start" is
the plan the search starts from (the cheapest of those, refined by ``solvers.refine``); "gap" is
CP-SAT's proven relative gap (1.0: no lower bound better than zero was proven), "proof phase"
what the proof phase (``solvers.ilp_lazy``, ``proof_workers()`` workers) needed of the memory rows it leaves
out (absent when the reproducible search proved the plan itself). Prints a Markdown table and
writes it to ``benchmarks/results/ilp_speed.md`` (at another ``--time-limit``,
``ilp_speed_<limit>s.md``; the modes below write ``ilp_speed_<mode>.md``).

``--limits 2,6,15``: instead, ``ilp`` (or with ``--solver auto``, ``auto``) at each of those time
limits: the seconds it took against the limit asked, and the plan's overhead (does it keep to
its limit?).

``--proof-only``: the proof phase alone (``ilp_lazy.proof_search``) from
the block-by-block plan (or, where that is not one level, the start ``ilp``'s search takes:
``ilp_flat.starting_plan``), given the whole time limit:
how long a proof takes when nothing else runs first, and the size of the relaxation it ended
with ("variables", "constraints": the decisions, the forward rows and the rows it added, each
with the variables only it reads).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import time
from pathlib import Path

import results_file  # benchmarks/results_file.py, beside this script
import torch

import ckptplan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.simulation import baseline_peak_bytes
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.ilp import blocks_share, solve_hierarchical, solve_ilp
from ckptplan.solvers.ilp_flat import starting_plan, warm_plans, warm_solvers
from ckptplan.solvers.ilp_lazy import proof_search
from ckptplan.solvers.ilp_model import COST_SCALE, build_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FRACTIONS = (0.7, 0.5)
DEFAULT_LIMIT = 60.0
DEFAULT_GRAPHS = ("unet", "resnet", "gpt", "gpt2:2")


def example_graph(name: str) -> ckptplan.ComputeGraph:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, args = module.build()
    return ckptplan.profile(model, args, outputs_live=False)


def gpt2_graph(layers: int) -> ckptplan.ComputeGraph | None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    config = GPT2Config(
        n_layer=layers, n_embd=128, n_head=4, n_positions=256, vocab_size=1000, bos_token_id=0, eos_token_id=0, use_cache=False
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (8, 256))
    return ckptplan.profile(model, (ids,), {"labels": ids}, outputs_live=False)


def overhead(graph: ckptplan.ComputeGraph, budget: int, solver: str) -> str:
    try:
        return f"{ckptplan.solve(graph, budget, solver=solver, remat=False).prediction.overhead:.3f}"
    except InfeasibleBudgetError:
        return "infeasible"


def by_blocks(graph: ckptplan.ComputeGraph, budget: int, time_limit: float) -> tuple[str, float]:
    """The block-by-block plan alone (what ``ilp`` starts from on graphs above 400 nodes, and returns
    there after ``keep_more`` when the limit leaves no proof phase), and its time."""
    started = time.perf_counter()
    try:
        plan = solve_hierarchical(graph, budget, SolveContext.limited(time_limit), warm=())
    except InfeasibleBudgetError:
        return "infeasible", time.perf_counter() - started
    overhead = "no blocks" if plan is None else f"{plan.cost_seconds / graph.step_cost:.3f}"
    return overhead, time.perf_counter() - started


def start_overhead(graph: ckptplan.ComputeGraph, budget: int, time_limit: float) -> str:
    """The overhead of the plan the ilp's search starts from (``starting_plan``: the ``dp``,
    ``sqrt`` and block-by-block plans, the last with the share of the limit ``solve_ilp`` gives
    it, refined by ``solvers.refine``)."""
    warm = warm_plans(graph, budget, SolveContext.limited(time_limit), names=warm_solvers(graph))
    try:
        block_plan = solve_hierarchical(graph, budget, SolveContext.limited(time_limit * blocks_share(graph, time_limit)),
                                        warm=())
    except InfeasibleBudgetError:
        block_plan = None
    regions = starting_plan(graph, warm + ([block_plan] if block_plan is not None else []), budget)
    if regions is None:
        return "-"
    return f"{ckptplan.simulate(graph, ckptplan.make_plan(graph, regions)).cost_seconds / graph.step_cost:.3f}"


def proof_only(graphs: dict[str, ckptplan.ComputeGraph], time_limit: float) -> None:
    print("| graph | nodes | budget | start | start overhead | overhead | status | gap | rounds | rows added "
          "| variables | constraints | proof s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, graph in graphs.items():
        for fraction in FRACTIONS:
            budget = int(fraction * baseline_peak_bytes(graph))
            try:
                blocks = solve_hierarchical(graph, budget, SolveContext.limited(time_limit), warm=())
            except InfeasibleBudgetError:
                blocks = None
            if blocks is not None and not any(region.children for region in blocks.regions):
                origin, regions = "block by block", blocks.regions
            else:  # the start ilp's search takes: the cheapest one-level warm plan, refined
                warm = warm_plans(graph, budget, SolveContext.limited(time_limit), names=warm_solvers(graph))
                origin, regions = "refined warm plan", starting_plan(graph, warm, budget)
            if regions is None:
                print(f"| {name} | {len(graph.nodes)} | {fraction:.0%} | no one-level plan fits | | | | | | | | | |")
                continue
            start_cost = ckptplan.simulate(graph, ckptplan.make_plan(graph, regions)).cost_seconds
            proof = proof_search(graph, budget, regions, SolveContext.limited(time_limit), seconds=time_limit,
                                 announce=False)
            gap = 0.0 if proof.cost <= 0 else (proof.cost - proof.bound) / proof.cost
            print(f"| {name} | {len(graph.nodes)} | {fraction:.0%} | {origin} | {start_cost / graph.step_cost:.3f} | "
                  f"{proof.cost / COST_SCALE / graph.step_cost:.3f} | {proof.status.lower()} | "
                  f"{gap:.2f} | {proof.rounds} | {proof.rows} of {proof.deferred} | {proof.variables:,} | "
                  f"{proof.constraints:,} | {proof.seconds:.1f} |", flush=True)


def limits(graphs: dict[str, ckptplan.ComputeGraph], seconds: list[float], solver: str) -> None:
    print(f"| graph | nodes | budget | limit s | {solver} s | over the limit s | overhead | status |")
    print("|---|---|---|---|---|---|---|---|")
    for name, graph in graphs.items():
        for fraction in FRACTIONS:
            budget = int(fraction * baseline_peak_bytes(graph))
            for limit in seconds:
                started = time.perf_counter()
                try:
                    # remat=False: the time limit is the ilp pipeline's alone (auto would share it
                    # with a second solve on the rematerialised graph).
                    plan = ckptplan.solve(graph, budget, solver=solver, time_limit=limit, remat=False)
                    overhead, status = f"{plan.prediction.overhead:.3f}", plan.solver.status
                except InfeasibleBudgetError:
                    overhead, status = "-", "infeasible"
                took = time.perf_counter() - started
                print(f"| {name} | {len(graph.nodes)} | {fraction:.0%} | {limit:g} | {took:.1f} | {took - limit:+.1f} | "
                      f"{overhead} | {status} |", flush=True)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=DEFAULT_LIMIT)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--proof-only", action="store_true", help="the proof phase alone, from the block-by-block plan (or ilp's refined start)")
    parser.add_argument("--limits", help="comma-separated time limits: the seconds ilp takes at each")
    parser.add_argument("--solver", default="ilp", choices=("ilp", "auto"),
                        help="the solver --limits times: ilp alone, or auto (sqrt and dp first, their plans its warm starts)")
    parser.add_argument("--graphs", default=",".join(DEFAULT_GRAPHS),
                        help="examples by name and gpt2:N, a transformers GPT-2 of N layers "
                             f"(default {','.join(DEFAULT_GRAPHS)})")
    return parser.parse_args()


def main(options: argparse.Namespace) -> None:
    graphs = {}
    for name in options.graphs.split(","):
        if name.startswith("gpt2:"):
            layers = int(name.partition(":")[2])
            gpt2 = gpt2_graph(layers)
            if gpt2 is not None:
                graphs[f"transformers GPT-2 ({layers} layers)"] = gpt2
        else:
            graphs[name] = example_graph(name)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"time limit {options.time_limit:g} s, {options.workers} worker(s)\n")
    if options.proof_only:
        proof_only(graphs, options.time_limit)
        return
    if options.limits:
        limits(graphs, [float(x) for x in options.limits.split(",")], options.solver)
        return
    print("| graph | nodes | variables | constraints | build s | budget | sqrt overhead | dp overhead "
          "| block-by-block overhead | s | start overhead | ilp overhead | ilp status | gap | ilp s | proof phase |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, graph in graphs.items():
        started = time.perf_counter()
        _, variables = build_model(graph, baseline_peak_bytes(graph))
        build_seconds = time.perf_counter() - started
        for fraction in FRACTIONS:
            budget = int(fraction * baseline_peak_bytes(graph))
            blocks, block_seconds = by_blocks(graph, budget, options.time_limit)
            start = start_overhead(graph, budget, options.time_limit)
            started = time.perf_counter()
            try:
                plan = solve_ilp(graph, budget, SolveContext.limited(options.time_limit), workers=options.workers)
                ilp = f"{plan.cost_seconds / graph.step_cost:.3f}"
                status, gap = plan.status, "-" if plan.gap is None else f"{plan.gap:.2f}"
                proof = plan.note.rpartition(": ")[2] if "proof phase" in plan.note else "-"
            except InfeasibleBudgetError:
                ilp, status, gap, proof = "infeasible", "infeasible", "-", "-"
            seconds = time.perf_counter() - started
            print(f"| {name} | {len(graph.nodes)} | {variables.counts['variables']:,} | "
                  f"{variables.counts['constraints']:,} | {build_seconds:.1f} | {fraction:.0%} | "
                  f"{overhead(graph, budget, 'sqrt')} | {overhead(graph, budget, 'dp')} | {blocks} | "
                  f"{block_seconds:.1f} | {start} | {ilp} | {status} | "
                  f"{gap} | {seconds:.1f} | {proof} |", flush=True)


TITLE = "`ilp` against `dp` and `sqrt`"
FIRST_TABLE = (
    "Each graph at 70% and 50% of its no-checkpoint peak; the solvers in one process. \"overhead\" is the predicted "
    "recompute overhead (`Plan.prediction.overhead`; lower is better), \"gap\" the proven relative gap (1.00: no "
    "lower bound above zero was proven), \"ilp s\" the `ilp` wall time including its warm starts and model building, "
    "\"s\" what the block-by-block plan took alone, given the whole limit, \"start overhead\" that of the plan the "
    "search starts from (the cheapest warm plan after `solvers/refine.py`), \"proof phase\" what the proof phase "
    "needed of the memory rows it leaves out. \"variables\" and \"constraints\" are the whole model's. `ilp`'s plan "
    "space is one level of regions with per-op keep-sets; `dp`'s is nested regions without keeps, so neither "
    "contains the other."
)
ABOUT = {
    "": FIRST_TABLE,
    "proof_only": (
        "The proof phase alone (`ilp_lazy.proof_search`) from the block-by-block plan (or, where that is not one "
        "level, the refined warm plan `ilp`'s search starts from), given the whole limit: how long a proof takes "
        "when nothing runs first. It states the fullest memory row of its start plan up front and adds one per "
        "round; \"variables\" and \"constraints\" are the relaxation it ended with."
    ),
    "limits": "`ilp` at each time limit: the seconds it took against the limit asked, and its plan's overhead.",
    "limits_auto": "`auto` at each time limit: the seconds it took against the limit asked, and its plan's overhead.",
}


def variant(options: argparse.Namespace) -> str:
    """The results file a run writes: each mode, and the first table at a limit other than the
    default, keeps its own (``ilp_speed_proof_only.md``, ``ilp_speed_limits.md``,
    ``ilp_speed_limits_auto.md``, ``ilp_speed_6s.md``)."""
    if options.proof_only:
        return "proof_only"
    if options.limits:
        return "limits" if options.solver == "ilp" else f"limits_{options.solver}"
    return "" if options.time_limit == DEFAULT_LIMIT else f"{options.time_limit:g}s"


if __name__ == "__main__":
    options = arguments()
    mode = variant(options)
    with results_file.recorded(__file__, TITLE, ABOUT.get(mode, ABOUT[""]), variant=mode):
        main(options)
