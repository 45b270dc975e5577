"""The ``ckptplan`` command: solve, profile, show, schema.

Each command parses, calls one library function, and renders: tables and progress go to stderr
through rich, ``--json`` output goes to stdout alone, so ``ckptplan solve ... --json > plan.json``
works. Library errors become exit codes in ``ckptplan.cli.exits`` and nowhere else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

import ckptplan
from ckptplan.cli.exits import EXIT_ERROR, exits_on_error
from ckptplan.cli.loader import AUTOCAST_DTYPES, LoadedModel, load_model
from ckptplan.cli.render import (
    progress_line,
    render_partition,
    render_plan,
    render_profile,
    render_sweep,
    render_verification,
    stderr_console,
)
from ckptplan.cli.summary import summarize
from ckptplan.errors import BudgetError
from ckptplan.graph import ComputeGraph, ShardSpec
from ckptplan.joint import JointGraph
from ckptplan.partition import simulate_partition
from ckptplan.plan import PartitionPlan, Plan, load_any_plan, partition_json_schema, plan_json_schema
from ckptplan.planner.io import check_plan_target, save_plan
from ckptplan.planner.sweep import SweepPoint, check_plotting, plot_pareto, sweep_partitions
from ckptplan.planner.sweep import sweep as run_sweep
from ckptplan.planner.timeline_plot import plot_timeline
from ckptplan.simulation import baseline_peak_bytes
from ckptplan.solvers import available_solvers
from ckptplan.solvers.context import Progress
from ckptplan.solvers.partition import no_recompute
from ckptplan.solvers.registry import get_solver
from ckptplan.units import check_budget

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

app = typer.Typer(
    name="ckptplan",
    help="Plan activation checkpointing for a PyTorch training step within a memory budget.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class TraceMode(str, Enum):
    export = "export"
    symbolic = "symbolic"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Optimizer(str, Enum):
    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"


ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL.py[:FUNC]",
        help="Python file defining build() -> (model, args[, kwargs]), or FUNC, or 'model' and 'example_inputs'.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout only.")]
TraceOpt = Annotated[TraceMode, typer.Option(help="How to capture the graph: torch.export or torch.fx.symbolic_trace.")]
OptimizerOpt = Annotated[
    Optimizer | None,
    typer.Option(case_sensitive=False, help="Count this optimizer's state in resident memory.", show_default=False),
]


ShardDegreeOpt = Annotated[
    int | None,
    typer.Option(
        "--shard-degree", min=1, metavar="N", show_default=False,
        help="Plan one rank of N data-parallel ranks that shard the training state (FSDP2 / ZeRO); the budget is per rank.",
    ),
]
ZeroStageOpt = Annotated[
    int,
    typer.Option("--zero-stage", min=0, max=3, help="With --shard-degree: 0 is DDP (nothing sharded; its gradient buckets counted), 1 shards optimizer state, 2 also gradients, 3 also parameters (FSDP2)."),
]
MasterDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--master-dtype", metavar="DTYPE", show_default=False,
        help="With --shard-degree: dtype of the sharded parameters, gradients and optimizer state when the model computes in a lower one (FSDP2 mixed precision), e.g. float32.",
    ),
]


def _autocast_name(value: str | None) -> str | None:
    """``--autocast`` as a torch dtype name; any other spelling is a usage error (exit code 2)."""
    if value is None:
        return None
    name = AUTOCAST_DTYPES.get(value.strip().lower())
    if name is None:
        raise typer.BadParameter(f"{value!r} is not an autocast dtype; use bf16 or fp16.")
    return name


AutocastOpt = Annotated[
    str | None,
    typer.Option(
        "--autocast", metavar="bf16|fp16", callback=_autocast_name, show_default=False,
        help="Plan a mixed-precision step: forward and loss under torch.autocast with this dtype, backward outside it.",
    ),
]
class Costs(str, Enum):
    a100 = "a100"
    here = "here"
    flops = "flops"


CostsOpt = Annotated[
    Costs,
    typer.Option(
        "--costs", case_sensitive=False,
        help="What prices recomputation: an A100's datasheet (roofline); this machine (op times measured on the model's real tensors, and the fixed costs of checkpoint regions; a few seconds more); or FLOPs alone, as FlopCounterMode counts them (matmul-like ops; the rest nearly free).",
    ),
]
SpellOutOpt = Annotated[
    bool,
    typer.Option(
        "--spell-out",
        help="Run composite kernels as their parts, each a node plans can keep or recompute: attention that takes PyTorch's math kernel (softmax, dropout, matmuls) and, for cpu, dropout as a one-byte mask (a quarter of fp32 noise's bytes) and its product. More choices; ilp needs more time for them.",
    ),
]
OutputsLiveOpt = Annotated[
    bool | None,
    typer.Option(
        "--outputs-live/--outputs-dropped", show_default=False,
        help="Whether the training loop keeps the model's outputs through backward: a plain loop does (out = model(x); loss(out).backward() with out still bound: a causal LM's logits, say); Trainer, Lightning and torchtitan drop them once the loss is made (--outputs-dropped). Default: the file's TRAINING 'outputs', else kept, the assumption whose mistake is not an out-of-memory error.",
    ),
]
RematOpt = Annotated[
    bool | None,
    typer.Option(
        "--remat/--no-remat", show_default=False,
        help="Whether to also consider rematerialising cheap ops outside regions (layer norms, GELUs): their outputs are dropped after forward and recomputed in the backward of each op that saved them, from tensors kept anyway; the cheapest plan wins. Default: on for the auto solver, off for the others.",
    ),
]
TargetOpt = Annotated[
    Device | None,
    typer.Option(
        "--target", case_sensitive=False, show_default=False,
        help="Whose kernels the step runs on, where they save different bytes (dropout masks: 1 B/element on cuda; attention: the fused kernel on cuda); default: the model's device, cpu for a meta model.",
    ),
]


def _print_version(value: bool) -> None:
    # An eager option callback: it must act before click insists on a command.
    if value:
        typer.echo(ckptplan.__version__)
        raise typer.Exit()


VERBOSE_HELP = "Log progress to stderr; solve and show also print the solver's details (status, gap, model size), the regions by node index and bytes by module."
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help=VERBOSE_HELP)]


@app.callback()
def configure(
    ctx: typer.Context,
    verbose: VerboseOpt = False,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version)
    ] = False,
) -> None:
    """Plan activation checkpointing for a PyTorch training step within a memory budget."""
    ctx.obj = {"verbose": verbose}
    _configure_logging(verbose)


@app.command()
@exits_on_error
def solve(
    ctx: typer.Context,
    model: ModelArg,
    budget: Annotated[
        str,
        typer.Option(
            help="Peak memory allowed: '80GB', '80GiB', bytes, '60%' or a fraction like 0.6.", show_default=False
        ),
    ],
    solver: Annotated[
        str, typer.Option(help=f"Solver name: {', '.join(available_solvers())}; with --compile: auto, exact, greedy.")
    ] = "auto",
    out: Annotated[Path | None, typer.Option(help="Write the plan JSON to this file.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    json_output: JsonOpt = False,
    trace: TraceOpt = TraceMode.export,
    optimizer: OptimizerOpt = None,
    shard_degree: ShardDegreeOpt = None,
    zero_stage: ZeroStageOpt = 3,
    master_dtype: MasterDtypeOpt = None,
    autocast: AutocastOpt = None,
    target: TargetOpt = None,
    spell_out: SpellOutOpt = False,
    outputs_live: OutputsLiveOpt = None,
    costs: CostsOpt = Costs.a100,
    remat: RematOpt = None,
    time_limit: Annotated[
        float | None,
        typer.Option(min=0.0, metavar="SECONDS", show_default=False,
                     help="Stop the solver after this long (auto: 10 s by default, 30 s above 600 graph nodes; "
                          "ilp: 60 s; --compile: auto 30 s, exact 120 s)."),
    ] = None,
    compile_step: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Plan the step torch.compile runs: which forward values of AOTAutograd's joint graph the backward keeps (ckptplan.compile); the plan file is a joint-graph partition.",
        ),
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Find which activations to keep and which to recompute so one step fits BUDGET.

    Prints the predicted peak against the budget, the step-time overhead and what prices it, and
    what is recomputed, by module; -v adds the solver's details."""
    verbose = _verbose(ctx, verbose)
    # Cheap checks first: a typo should not cost a minutes-long profile.
    if compile_step:
        _check_compile_options(solver, costs, trace, optimizer, shard_degree, target, spell_out, remat)
    else:
        get_solver(solver)
    check_budget(budget)
    if out is not None:
        check_plan_target(out, overwrite=force)
    if compile_step:
        _solve_compiled(model, budget, solver, time_limit, costs, outputs_live, autocast, out, force, json_output)
        return
    with load_model(model) as loaded, _progress(f"profiling {loaded.source}"):
        log.info("profiling %s", loaded.source)
        graph = _profile(
            loaded, trace, optimizer, shard_degree, zero_stage, master_dtype, autocast, target, costs, spell_out,
            outputs_live,
        )
    log.info("solving %s (%d nodes) with %s", graph.name, len(graph.nodes), solver)
    with _solving(graph, solver) as on_progress:
        plan = ckptplan.solve(graph, budget, solver=solver, time_limit=time_limit, remat=remat, progress=on_progress)
    _deliver(plan, out, force, json_output, lambda console: render_plan(console, plan, costs=costs.value, verbose=verbose))


@app.command()
@exits_on_error
def profile(
    model: ModelArg,
    json_output: JsonOpt = False,
    trace: TraceOpt = TraceMode.export,
    optimizer: OptimizerOpt = None,
    shard_degree: ShardDegreeOpt = None,
    zero_stage: ZeroStageOpt = 3,
    master_dtype: MasterDtypeOpt = None,
    autocast: AutocastOpt = None,
    target: TargetOpt = None,
    spell_out: SpellOutOpt = False,
    outputs_live: OutputsLiveOpt = None,
    costs: CostsOpt = Costs.a100,
) -> None:
    """Show where one training step's memory and FLOPs go, per module and per op."""
    with load_model(model) as loaded:
        log.info("profiling %s", loaded.source)
        graph = _profile(
            loaded, trace, optimizer, shard_degree, zero_stage, master_dtype, autocast, target, costs, spell_out,
            outputs_live,
        )
    summary = summarize(graph)
    if json_output:
        _write_stdout(json.dumps(summary.to_dict(), indent=2) + "\n")
        return
    render_profile(stderr_console(), summary)


@app.command()
@exits_on_error
def show(
    ctx: typer.Context,
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN.json", help="A plan written by 'ckptplan solve --out'.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print the validated plan JSON on stdout.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Draw the predicted memory timeline as a PNG here.", show_default=False)
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Summarise a saved plan: predicted peak, overhead, memory timeline, what is recomputed by module."""
    verbose = _verbose(ctx, verbose)
    if plot is not None:
        check_plotting()
        check_plan_target(plot, overwrite=True)
    plan = load_any_plan(plan_file)
    if isinstance(plan, PartitionPlan):
        if plot is not None:
            raise ckptplan.CkptPlanError("A compiled step's plan has no timeline to plot; drop --plot.")
        if json_output:
            _write_stdout(plan.to_json())
            return
        render_partition(stderr_console(), plan)
        return
    if plot is not None:
        plot_timeline(plan, plot)
    if json_output:
        _write_stdout(plan.to_json())
        return
    render_plan(stderr_console(), plan, verbose=verbose)
    if plot is not None:
        stderr_console().print(f"Wrote the plot to {plot}", markup=False, soft_wrap=True)


@app.command()
@exits_on_error
def verify(
    model: ModelArg,
    plan_file: Annotated[Path, typer.Option("--plan", metavar="PLAN.json", help="The plan to check.")],
    steps: Annotated[
        int, typer.Option(min=1, help="Training steps to time each module over, in pairs; the spread of the pairs' overheads is reported.")
    ] = 5,
    device: Annotated[Device, typer.Option(help="Where to run the steps.")] = Device.cpu,
    json_output: JsonOpt = False,
) -> None:
    """Run real steps with and without PLAN.json: measured vs predicted peak, gradients, step time
    (median overhead, with the least and most of its paired steps).

    A compiled step's plan (solve --compile) runs compiled with its partition (aot_eager).
    Exits 1 when the measured peak is over the plan's budget or the gradients differ."""
    plan = load_any_plan(plan_file)
    with load_model(model) as loaded:
        result = ckptplan.verify(loaded.model, loaded.args, plan, loaded.kwargs, steps=steps, device=device.value)
    if json_output:
        _write_stdout(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        render_verification(stderr_console(), result)
    if not result.within_budget or not result.gradients_equal:
        raise typer.Exit(EXIT_ERROR)


@app.command()
@exits_on_error
def sweep(
    model: ModelArg,
    budgets: Annotated[
        str, typer.Option(help="Comma-separated budgets, e.g. '0.9,0.7,0.5,0.3' or '8GB,6GB'.")
    ] = "0.9,0.7,0.5,0.3",
    solver: Annotated[str, typer.Option(help=f"Solver name: {', '.join(available_solvers())}.")] = "auto",
    plot: Annotated[Path | None, typer.Option(help="Draw the trade-off as a PNG here.", show_default=False)] = None,
    json_output: JsonOpt = False,
    trace: TraceOpt = TraceMode.export,
    optimizer: OptimizerOpt = None,
    shard_degree: ShardDegreeOpt = None,
    zero_stage: ZeroStageOpt = 3,
    master_dtype: MasterDtypeOpt = None,
    autocast: AutocastOpt = None,
    target: TargetOpt = None,
    spell_out: SpellOutOpt = False,
    outputs_live: OutputsLiveOpt = None,
    costs: CostsOpt = Costs.a100,
    remat: RematOpt = None,
    compile_step: Annotated[
        bool, typer.Option("--compile", help="The trade-off of the step torch.compile runs (see solve --compile).")
    ] = False,
    time_limit: Annotated[
        float | None,
        typer.Option(min=0.0, metavar="SECONDS", help="Stop the solver after this long, at each budget.",
                     show_default=False),
    ] = None,
) -> None:
    """Solve at several budgets and show the memory/recompute trade-off."""
    if compile_step:
        _check_compile_options(solver, costs, trace, optimizer, shard_degree, target, spell_out, remat)
    else:
        get_solver(solver)
    requested = [b.strip() for b in budgets.split(",") if b.strip()]
    if not requested:
        raise BudgetError("--budgets lists no budget; write e.g. '0.9,0.7,0.5'.")
    for budget in requested:
        check_budget(budget)
    if plot is not None:
        check_plotting()
        check_plan_target(plot, overwrite=True)
    if compile_step:
        joint = _joint_graph(model, costs, outputs_live, autocast)
        with _progress(f"partitioning {joint.name} at {len(requested)} budgets"):
            points = sweep_partitions(joint, requested, solver=solver, time_limit=time_limit)
        baseline = simulate_partition(joint, no_recompute(joint)).peak_bytes
        _show_sweep(points, plot, f"{joint.name} (compiled): peak memory vs recompute", baseline, json_output)
        return
    with load_model(model) as loaded, _progress(f"profiling {loaded.source}"):
        graph = _profile(
            loaded, trace, optimizer, shard_degree, zero_stage, master_dtype, autocast, target, costs, spell_out,
            outputs_live,
        )
    with _progress(f"solving {graph.name} at {len(requested)} budgets"):
        points = run_sweep(graph, requested, solver=solver, time_limit=time_limit, remat=remat)
    _show_sweep(points, plot, f"{graph.name}: peak memory vs recompute", baseline_peak_bytes(graph), json_output)


def _show_sweep(points: list[SweepPoint], plot: Path | None, title: str, baseline: int, json_output: bool) -> None:
    """The sweep's points: plotted, as JSON on stdout, or as a table."""
    if plot is not None:
        plot_pareto(points, plot, title)
    if json_output:
        _write_stdout(json.dumps([p.to_dict() for p in points], indent=2) + "\n")
        return
    render_sweep(stderr_console(), baseline, points)
    if plot is not None:
        stderr_console().print(f"Wrote the plot to {plot}", markup=False, soft_wrap=True)


@app.command()
def schema(
    compile_step: Annotated[
        bool, typer.Option("--compile", help="The schema of a compiled step's plan files (solve --compile).")
    ] = False,
) -> None:
    """Print the JSON Schema of plan files."""
    _write_stdout(json.dumps(partition_json_schema() if compile_step else plan_json_schema(), indent=2) + "\n")


def _verbose(ctx: typer.Context, verbose: bool) -> bool:
    """``-v`` given before the command or after it; after it, it also logs progress."""
    if verbose:
        _configure_logging(True)
    return verbose or bool((ctx.obj or {}).get("verbose"))


def _configure_logging(verbose: bool) -> None:
    """With ``-v``, show ckptplan's INFO records on the stderr console (its handler looks
    ``sys.stderr`` up when it writes). Without it logging is left alone: Python's last-resort
    handler already prints warnings, and in-process callers (tests) keep their own setup."""
    if not verbose:
        return
    logger = logging.getLogger("ckptplan")
    logger.setLevel(logging.INFO)
    if not any(isinstance(handler, RichHandler) for handler in logger.handlers):
        logger.addHandler(RichHandler(console=stderr_console(), show_time=False, show_path=False))


def _progress(message: str) -> contextlib.AbstractContextManager:
    """A spinner on stderr while ``message`` runs, when stderr is a terminal."""
    console = stderr_console()
    return console.status(message) if console.is_terminal else contextlib.nullcontext()


@contextlib.contextmanager
def _solving(graph: ComputeGraph, solver: str) -> Iterator[Callable[[Progress], None] | None]:
    """A status line on stderr while ``graph`` is solved, when stderr is a terminal: the phase,
    the cheapest plan and the bound so far (``render.progress_line``); yields what hears them."""
    console = stderr_console()
    title = f"solving {graph.name} ({len(graph.nodes)} ops) with {solver}"
    if not console.is_terminal:
        yield None
        return
    started = time.perf_counter()
    with console.status(title) as status:
        yield lambda progress: status.update(progress_line(title, progress, graph.step_cost,
                                                           time.perf_counter() - started))


def _profile(
    loaded: LoadedModel,
    trace: TraceMode,
    optimizer: Optimizer | None,
    shard_degree: int | None,
    zero_stage: int,
    master_dtype: str | None,
    autocast: str | None,
    target: Device | None,
    costs: Costs,
    spell_out: bool,
    outputs_live: bool | None,
) -> ComputeGraph:
    """Profile the loaded model as the options (or, where they are silent, its file's
    ``TRAINING`` defaults, which the loader has checked) describe its training step."""
    from ckptplan.profiler.cost import A100, FLOPS
    from ckptplan.profiler.trace import model_device_type

    optimizer_name = optimizer.value if optimizer is not None else loaded.training.get("optimizer")
    master_dtype = master_dtype or loaded.training.get("master_dtype")
    target_name = target.value if target is not None else loaded.training.get("target")
    if outputs_live is None:
        outputs_live = loaded.training.get("outputs", "kept") == "kept"
    shard = None
    if shard_degree is not None:
        shard = ShardSpec(shard_degree, stage=zero_stage, master_dtype=master_dtype if zero_stage == 3 else None)
    roofline = FLOPS if costs == Costs.flops else A100
    if costs == Costs.here:
        device = model_device_type(loaded.model, [])
        if device == "meta":
            raise ckptplan.CkptPlanError("--costs here times the model's ops, but its tensors are on the meta device; use --costs a100.")
        roofline = ckptplan.measure_roofline(device)
    return ckptplan.profile(
        loaded.model, loaded.args, loaded.kwargs, trace=trace.value, optimizer=optimizer_name, shard=shard,
        autocast=_autocast_dtype(autocast, loaded.training), target=target_name,
        roofline=roofline, measure_times=costs == Costs.here, spell_out=spell_out, outputs_live=outputs_live,
    )


def _check_compile_options(
    solver: str, costs: Costs, trace: TraceMode, optimizer: Optimizer | None, shard_degree: int | None,
    target: Device | None, spell_out: bool, remat: bool | None,
) -> None:
    """``--compile``'s refusals, before anything is loaded: its solvers, and options of the eager
    step's profile that a compiled step does not take."""
    from ckptplan.solvers import tuning

    if solver not in tuning.PARTITION_SECONDS:
        raise ckptplan.UnknownSolverError(
            f"Unknown solver {solver!r} for --compile; choose one of: {', '.join(tuning.PARTITION_SECONDS)}."
        )
    if costs == Costs.here:
        raise ckptplan.CkptPlanError("--costs here is not available with --compile; use --costs a100 or flops.")
    unsupported = [name for name, given in (
        ("--trace", trace != TraceMode.export), ("--optimizer", optimizer is not None),
        ("--shard-degree", shard_degree is not None), ("--target", target is not None),
        ("--spell-out", spell_out), ("--remat/--no-remat", remat is not None),
    ) if given]
    if unsupported:
        raise ckptplan.CkptPlanError(f"{unsupported[0]} does not apply to a compiled step (--compile); drop it.")


def _solve_compiled(
    model: str, budget: str, solver: str, time_limit: float | None, costs: Costs, outputs_live: bool | None,
    autocast: str | None, out: Path | None, force: bool, json_output: bool,
) -> None:
    """``solve --compile``: compile the model once with ckptplan's partitioner (aot_eager, whose
    joint graph is inductor's) and write or print its partition."""
    from ckptplan.profiler.cost import A100, FLOPS

    with load_model(model) as loaded, _progress(f"compiling and partitioning {loaded.source}"):
        if outputs_live is None:
            outputs_live = loaded.training.get("outputs", "kept") == "kept"
        module = ckptplan.compile(
            loaded.model, loaded.args, loaded.kwargs, budget=budget, solver=solver, backend="aot_eager",
            time_limit=time_limit, outputs_live=outputs_live, roofline=FLOPS if costs == Costs.flops else A100,
            autocast=_autocast_dtype(autocast, loaded.training),
        )
    plan = module.ckptplan_plan.to_plan()
    _deliver(plan, out, force, json_output, lambda console: render_partition(console, plan))


def _deliver(
    plan: Plan | PartitionPlan, out: Path | None, force: bool, json_output: bool, render: Callable[[Console], None]
) -> None:
    """What ``solve`` ends with: ``plan`` written to ``out`` (if given), then printed as JSON on
    stdout (``--json``) or rendered on stderr."""
    if out is not None:
        save_plan(plan, out, overwrite=force)
    if json_output:
        _write_stdout(plan.to_json())
        return
    console = stderr_console()
    render(console)
    if out is not None:
        console.print(f"Wrote the plan to {out}", markup=False, soft_wrap=True)


def _joint_graph(model: str, costs: Costs, outputs_live: bool | None, autocast: str | None) -> JointGraph:
    """The model's compiled step's joint graph, as ``ckptplan.compile`` reads it (compiled once,
    with nothing recomputed)."""
    from ckptplan.profiler.cost import A100, FLOPS

    with load_model(model) as loaded, _progress(f"compiling {loaded.source}"):
        if outputs_live is None:
            outputs_live = loaded.training.get("outputs", "kept") == "kept"
        module = ckptplan.compile(
            loaded.model, loaded.args, loaded.kwargs, budget=1.0, solver="greedy", backend="aot_eager",
            outputs_live=outputs_live, roofline=FLOPS if costs == Costs.flops else A100,
            autocast=_autocast_dtype(autocast, loaded.training),
        )
    return module.ckptplan_plan.graph


def _autocast_dtype(autocast: str | None, training: dict[str, str]) -> torch.dtype | None:
    """``--autocast``, else the model file's TRAINING "autocast", as a torch dtype (None: neither)."""
    import torch  # here, not at the top: `show` and `schema` never need torch

    name = autocast or training.get("autocast")
    return getattr(torch, name) if name is not None else None


def _write_stdout(text: str) -> None:
    typer.echo(text, nl=False)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="ckptplan")


if __name__ == "__main__":
    main()
