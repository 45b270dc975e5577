"""Human views of plans and profiles, drawn with rich on the stderr console.

Machine output (``--json``) never passes through here: it goes to stdout unstyled.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptplan.cli.summary import GroupRow, ProfileSummary, RecomputeRow, recomputed_by_module
from ckptplan.plan import PartitionPlan, Plan, SolverInfo
from ckptplan.planner.sweep import SweepPoint
from ckptplan.planner.verify import Verification
from ckptplan.solvers.context import Progress
from ckptplan.timeline import Timeline, max_pool
from ckptplan.units import describe_bytes, format_bytes, format_flops


def stderr_console() -> Console:
    """A console bound to whatever ``sys.stderr`` is when it writes (so test runners capture it)."""
    return Console(stderr=True, highlight=False)


def render_error(console: Console, message: str) -> None:
    """``Error: <message>`` on one line: no wrapping, no markup, so paths and brackets survive."""
    line = Text("Error: ", style="bold red")
    line.append(" ".join(message.split()))
    console.print(line, soft_wrap=True)


def progress_line(title: str, progress: Progress, step_cost: float, elapsed_seconds: float) -> str:
    """The status line a terminal shows while a solve runs: what runs, the cheapest plan so far
    (its overhead on a step of ``step_cost`` and its peak) and the best bound proven on that
    overhead, and the seconds spent."""
    parts = [title, progress.phase]
    if progress.best_cost_seconds is not None and step_cost > 0:
        best = f"best +{progress.best_cost_seconds / step_cost:.1%} step time"
        if progress.best_peak_bytes is not None:
            best += f" at {format_bytes(progress.best_peak_bytes)}"
        parts.append(best)
        bound = progress.bound_cost_seconds
        if bound is not None and bound <= progress.best_cost_seconds:
            parts.append(f"bound +{bound / step_cost:.1%}")
    parts.append(f"{elapsed_seconds:.0f} s")
    return " · ".join(parts)


def render_plan(console: Console, plan: Plan, *, costs: str | None = None, verbose: bool = False) -> None:
    """What a PyTorch user asks of a plan: the budget, the predicted peak against it and against
    no checkpointing, the step-time overhead and what prices it, the memory timeline (when the
    plan has one), and what is recomputed, by module path. ``costs``: the ``--costs`` the graph
    was priced with (``"a100"``, ``"here"``, ``"flops"``); None for a saved plan, whose
    prediction tells it (``pricing``). ``verbose`` adds the solver's internals (status, gap and
    note), the fingerprint, exact bytes, the regions by node index and the per-module counts."""
    prediction = plan.prediction
    solver = plan.solver
    model = f"{plan.model.name} ({plan.model.node_count} nodes, fingerprint {plan.model.fingerprint})" if verbose \
        else f"{plan.model.name} ({plan.model.node_count} ops)"
    size = describe_bytes if verbose else format_bytes
    rows = [
        ("model", model),
        *_step_rows(plan.model.autocast, plan.model.target, plan.model.outputs_live),
        ("budget", f"{plan.budget.requested} = {size(plan.budget.bytes)}" + _per_rank(plan)),
        ("peak", _peak_line(prediction.peak_bytes, prediction.baseline_peak_bytes, plan.budget.bytes)),
        ("overhead", _overhead_line(plan)),
    ]
    basis = pricing(plan, costs)
    if basis:
        rows.append(("", basis))
    if verbose:
        gap = "" if solver.gap is None else f", gap {solver.gap:.2%}"
        rows.append(("solver", f"{solver.name}: {solver.status} in {solver.seconds:.2f} s{gap}"))
        if solver.note:
            rows.append(("", solver.note))
    else:
        rows.append(("solver", _solver_line(solver)))
    timeline = prediction.timeline
    if timeline is not None and timeline.bytes:
        label_width = max(len(label) for label, _ in rows) + FACTS_PADDING
        width = max(min(SPARKLINE_MAX_WIDTH, console.width) - label_width, SPARKLINE_MIN_WIDTH)
        rows.append(("memory", sparkline(timeline, width)))
        rows.append(("", _sparkline_scale(timeline)))
    if plan.remat:
        count = f"{len(plan.remat)} op" + ("s" if len(plan.remat) > 1 else "")
        line = f"{count} recomputed without a region, in each backward that needs it"
        if verbose:
            shown = ", ".join(plan.remat[:REMAT_SHOWN]) + (", …" if len(plan.remat) > REMAT_SHOWN else "")
            line += f": {shown}"
        rows.append(("remat", line))
    console.print(_facts(rows))
    recomputed = recomputed_by_module(plan)
    if recomputed:
        console.print(_recomputed_table(plan, recomputed))
    if verbose or not recomputed:
        console.print(_regions_table(plan))
    if verbose and recomputed:
        console.print(_modules_table(plan))
    elif recomputed:
        console.print(Text("(-v: solver details, regions by node index, bytes by module)", style="dim"))


PARTITION_NAMES_SHOWN = 12  # recomputed values a compiled step's plan lists by name


def render_partition(console: Console, plan: PartitionPlan) -> None:
    """A compiled step's plan: the budget, the predicted peak against it and against saving
    everything the backward reads, the work the backward repeats and what prices it, the search
    and what it proved, and the values recomputed (joint-graph names)."""
    prediction, solver = plan.prediction, plan.solver
    verdict = {"optimal": "least recomputation proved", "infeasible": "nothing fits the budget (proved)"}.get(
        solver.status, "not proven least")
    found = f", found by the {solver.origin} search" if solver.origin and solver.origin != solver.name else ""
    rows = [
        ("model", f"{plan.model.name} (joint graph of {plan.model.node_count} nodes, compiled step)"),
        *_step_rows(plan.model.autocast, plan.model.target, plan.model.outputs_live),
        ("budget", f"{plan.budget.requested} = {format_bytes(plan.budget.bytes)}"),
        ("peak", f"{format_bytes(prediction.peak_bytes)} predicted"
                 + (f" ({prediction.peak_bytes / plan.budget.bytes:.0%} of budget)" if plan.budget.bytes else "")
                 + f", {format_bytes(prediction.baseline_peak_bytes)} recomputing nothing"),
        ("recomputed", f"{len(plan.recomputed)} values, {format_flops(prediction.recompute_flops)} again"
                       + (f", priced on {_PRICED_ON.get(prediction.priced_on, prediction.priced_on)}"
                          if plan.recomputed and prediction.priced_on else "")
                       + (f"; {prediction.replayed_masks} dropout mask(s) drawn again from the generator state "
                          "the forward saved" if prediction.replayed_masks else "")),
        ("saved", f"{len(plan.saved)} forward values handed to the backward"),
        ("solver", f"{solver.name} in {solver.seconds:.1f} s{found}: {verdict}"),
    ]
    if plan.inductor_options:
        settings = ", ".join(f"{name}={value}" for name, value in plan.inductor_options.items())
        rows.append(("inductor", f"compiled with {settings}"))
    if plan.recomputed:
        shown = ", ".join(plan.recomputed[:PARTITION_NAMES_SHOWN])
        rows.append(("", shown + (", …" if len(plan.recomputed) > PARTITION_NAMES_SHOWN else "")))
    console.print(_facts(rows))


_PRICED_ON = {"a100": "an A100 datasheet roofline", "flops": "FLOPs alone", "measured": "this machine's timings",
              "custom": "the roofline given to compile()"}


def pricing(plan: Plan, costs: str | None) -> str:
    """What the overhead is priced on, in words, with the option that changes it: ``costs`` as
    given to ``solve``, or, for a saved plan (None), as its prediction records it
    (``priced_on``), or for a plan that predates the record, infers it: priced in FLOPs; with a
    cost for checkpointing's own machinery, which only times measured on a machine have;
    otherwise the default, an A100's datasheet. Empty when nothing is recomputed."""
    if not plan.regions and not plan.remat:
        return ""
    recorded = plan.prediction.priced_on
    if costs is None and recorded is not None:
        return {
            "a100": "priced on an A100 datasheet roofline; --costs here times this machine",
            "measured": "timed on the machine that profiled it (--costs here)",
            "flops": "priced in recomputed FLOPs alone (--costs flops)",
            "custom": "priced on the roofline given to profile()",
        }[recorded]
    if costs is None:
        if plan.prediction.priced_in == "flops":
            costs = "flops"
        elif plan.prediction.checkpoint_seconds > 0:
            return "timed on the machine that solved it (--costs here)"
        else:
            costs = "a100"
    return {
        "a100": "priced on an A100 datasheet roofline; --costs here times this machine",
        "here": "timed on this machine (--costs here)",
        "flops": "priced in recomputed FLOPs alone (--costs flops)",
    }[costs]


def _solver_line(solver: SolverInfo) -> str:
    if solver.name == "manual":
        return "none: a hand-made plan"
    verdict = {
        "optimal": "optimal",
        "timeout": "stopped at its time limit, not proven optimal",
    }.get(solver.status, "not proven optimal")
    return f"{solver.name} in {solver.seconds:.1f} s: {verdict}"


def _overhead_line(plan: Plan) -> str:
    prediction = plan.prediction
    if not plan.regions and not plan.remat:
        return "none: nothing is recomputed"
    recomputed = f"{format_flops(prediction.recompute_flops)} recomputed"
    if prediction.priced_in == "flops":
        return f"{prediction.overhead:+.1%} of the step's FLOPs ({recomputed})"
    return f"{prediction.overhead:+.1%} step time ({recomputed})"


def _recomputed_table(plan: Plan, rows: Sequence[RecomputeRow]) -> Table:
    """What is recomputed in backward, one row per module path (``recomputed_by_module``)."""
    regions = sum(row.count for row in rows if row.how == "checkpoint")
    title = "recomputed in backward"
    if regions:
        title += f" ({regions} checkpoint region" + ("s" if regions > 1 else "") + ")"
    table = Table(title=title, title_justify="left")
    table.add_column("module", overflow="fold")
    table.add_column("recomputed")
    table.add_column("kept in memory")
    if plan.remat:
        table.add_column("how")
    for row in rows:
        cells = [Text(row.module), Text(row.recomputed), Text(row.kept)]
        if plan.remat:
            cells.append(Text("region" if row.how == "checkpoint" else "remat"))
        table.add_row(*cells)
    return table


def _step_rows(
    autocast: str | None, target: str | None, outputs_live: bool | None = None
) -> list[tuple[str, str]]:
    """Facts rows for the step a graph or plan models, where it says: its autocast dtype, whose
    kernels its bytes follow, and whether the loop keeps the model's outputs through backward."""
    rows = []
    if outputs_live is not None:
        rows.append(("outputs", "kept by the loop through backward" if outputs_live
                     else "dropped by the loop once the loss is made (--outputs-dropped)"))
    if autocast is not None:
        rows.append(("autocast", f"{autocast}: forward and loss under torch.autocast, backward outside it"))
    if target is not None:
        rows.append(("target", f"{target} kernels"))
    return rows


SPARKLINE_BLOCKS = "▁▂▃▄▅▆▇█"
SPARKLINE_MAX_WIDTH = 100  # columns, label included
SPARKLINE_MIN_WIDTH = 16  # columns for the sparkline even on a narrower console
FACTS_PADDING = 2  # columns between a facts label and its value (see ``_facts``)
SPARKLINE_SEPARATOR = " | "


def sparkline(timeline: Timeline, width: int) -> str:
    """``fwd ▁▂▅█ | bwd █▅▂▁`` in at most ``width`` columns (labels included): each block the
    most bytes live over its stretch of the step, from the timeline's least (▁) to its peak
    (█). Forward and backward (recomputation included) get columns in proportion to their
    buckets; a part with no buckets is left out."""
    forward_bytes = timeline.bytes[: timeline.backward_start]
    backward_bytes = timeline.bytes[timeline.backward_start:]
    parts = [(label, values) for label, values in (("fwd ", forward_bytes), ("bwd ", backward_bytes)) if values]
    labels_width = sum(len(label) for label, _ in parts) + len(SPARKLINE_SEPARATOR) * (len(parts) - 1)
    columns = max(width - labels_width, len(parts))
    if len(timeline.bytes) > columns:
        forward_columns = round(columns * len(forward_bytes) / len(timeline.bytes))
        if forward_bytes and backward_bytes:
            forward_columns = min(max(forward_columns, 1), columns - 1)
        part_columns = [c for c in (forward_columns, columns - forward_columns) if c > 0]
        parts = [(label, max_pool(values, c)) for (label, values), c in zip(parts, part_columns, strict=True)]
    low_bytes, high_bytes = min(timeline.bytes), max(timeline.bytes)
    return SPARKLINE_SEPARATOR.join(
        label + "".join(_block(v, low_bytes, high_bytes) for v in values) for label, values in parts
    )


def _block(value_bytes: int, low_bytes: int, high_bytes: int) -> str:
    """The block for ``value_bytes`` on a scale from ``low_bytes`` (▁) to ``high_bytes`` (█),
    rounded to the nearest of the eight heights."""
    top = len(SPARKLINE_BLOCKS) - 1
    if high_bytes <= low_bytes:
        return SPARKLINE_BLOCKS[top]
    span = high_bytes - low_bytes
    return SPARKLINE_BLOCKS[(2 * (value_bytes - low_bytes) * top + span) // (2 * span)]


def _sparkline_scale(timeline: Timeline) -> str:
    """What the sparkline's lowest and highest blocks stand for."""
    return f"▁ {format_bytes(min(timeline.bytes))} to █ {format_bytes(timeline.peak_bytes)} peak"


MODULE_DEPTH = 2  # group "blocks.3.attn.proj" under "blocks.3"
REMAT_SHOWN = 6  # rematerialised node names listed in the facts before "…"


def _modules_table(plan: Plan) -> Table:
    """Per module (paths cut to ``MODULE_DEPTH`` parts), in execution order: how many of its ops
    are stored, recomputed or kept (and rematerialised, when the plan does that), the bytes they
    would save for backward without checkpointing, and the bytes of their outputs that checkpoint
    regions hold as inputs until their backward."""
    rows: dict[str, dict[str, int]] = {}
    for node in plan.nodes:
        module = ".".join(node.module.split(".")[:MODULE_DEPTH]) or "(top level)"
        row = rows.setdefault(
            module, {"store": 0, "recompute": 0, "keep": 0, "remat": 0, "saved": 0, "region_input": 0}
        )
        row[node.decision] += 1
        row["saved"] += node.saved_bytes
        row["region_input"] += node.region_input_bytes
    counts = ["store", "recompute", "keep", *(["remat"] if plan.remat else [])]
    headers = {"store": "stored", "recompute": "recomputed", "keep": "kept", "remat": "remat"}
    remat = "remat: ops outside regions whose outputs are dropped and recomputed by their readers' backward; " \
        if plan.remat else ""
    table = Table(
        title="ops by module", title_justify="left", caption_justify="left",
        caption="stored: ops outside every region, whose saved tensors stay; recomputed: ops in a region, run "
                "again in backward; kept: ops in a region whose outputs it caches; " + remat + "saved: bytes "
                "its ops keep for backward without checkpointing; region inputs: bytes of its outputs held as a "
                "checkpoint region's inputs",
    )
    table.add_column("module", overflow="fold")
    for header in (*(headers[c] for c in counts), "saved", "region inputs"):
        table.add_column(header, justify="right")
    for module, row in rows.items():
        table.add_row(Text(module), *(str(row[c]) for c in counts),
                      format_bytes(row["saved"]), format_bytes(row["region_input"]))
    return table


def _facts(rows: Sequence[tuple[str, str]]) -> Table:
    """Label/value lines. Values become ``Text`` so names with brackets are not read as markup."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for label, value in rows:
        grid.add_row(label, Text(value))
    return grid


def _per_rank(plan: Plan) -> str:
    sharding = plan.model.sharding
    if sharding is None:
        return ""
    if sharding.stage == 0:
        return f" per rank (DDP over {sharding.degree} ranks, gradient buckets included)"
    master = f", {sharding.master_dtype} masters" if sharding.master_dtype else ""
    return f" per rank (ZeRO-{sharding.stage} over {sharding.degree} ranks{master}, {len(sharding.units)} units)"


def _peak_line(peak_bytes: int, baseline_peak_bytes: int, budget_bytes: int) -> str:
    line = f"{format_bytes(peak_bytes)} predicted"
    if budget_bytes > 0:
        line += f" ({peak_bytes / budget_bytes:.0%} of budget)"
    return line + f", {format_bytes(baseline_peak_bytes)} without checkpointing"


def _regions_table(plan: Plan) -> Table | Text:
    if not plan.regions:
        stored = "every activation but the rematerialised ops' is stored" if plan.remat else "every activation is stored"
        return Text(f"No checkpoint regions: {stored}.")
    names = [node.name for node in plan.nodes]
    table = Table(title="checkpoint regions", title_justify="left", caption_justify="left",
                  caption="start, end: the region runs nodes start to end - 1, in execution order; kept: its "
                          "nodes whose outputs it caches (selective checkpointing); children: regions nested in it")
    for header in ("start", "end", "first node", "last node", "kept", "children"):
        if header in ("first node", "last node"):
            table.add_column(header, overflow="fold")
        else:
            table.add_column(header, justify="right")
    for region in plan.regions:
        table.add_row(
            str(region.start),
            str(region.end),
            Text(_name(names, region.start)),
            Text(_name(names, region.end - 1)),
            str(len(region.keep)),
            str(len(region.children)),
        )
    return table


def _name(names: Sequence[str], index: int) -> str:
    # Plans may omit per-node records; the indices alone are still meaningful.
    return names[index] if index < len(names) else "-"


def render_profile(console: Console, summary: ProfileSummary) -> None:
    """Totals, then the per-module and per-op tables."""
    static = summary.static
    static_line = (
        f"params {format_bytes(static['param_bytes'])}, buffers {format_bytes(static['buffer_bytes'])}, "
        f"inputs {format_bytes(static['input_bytes'])}, grads {format_bytes(static['grad_bytes'])}, "
        f"optimizer {format_bytes(static['optimizer_bytes'])} ({static['optimizer'] or 'none'})"
    )
    console.print(
        _facts(
            [
                ("model", f"{summary.model} ({summary.node_count} nodes, fingerprint {summary.fingerprint})"),
                *_step_rows(summary.autocast, summary.target),
                ("static", static_line),
                ("activations", format_bytes(summary.activation_bytes)),
                ("baseline peak", format_bytes(summary.baseline_peak_bytes)),
            ]
        )
    )
    console.print(_group_table("by module", "module", summary.by_module))
    console.print(_group_table("by op", "op", summary.by_op))


def _group_table(title: str, key_header: str, rows: Sequence[GroupRow]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(key_header, overflow="fold")  # op and module names have no spaces to wrap at
    for header in ("nodes", "output", "saved", "fwd", "bwd"):
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(
            Text(row.key or "(top level)"),
            str(row.nodes),
            format_bytes(row.output_bytes),
            format_bytes(row.saved_bytes),
            format_flops(row.fwd_flops),
            format_flops(row.bwd_flops),
        )
    return table


def render_verification(console: Console, result: Verification) -> None:
    """Predicted against measured peak, the gradient check and the step-time overhead with its
    spread over the timed steps."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    verdict = "within budget" if result.within_budget else "OVER BUDGET"
    table.add_row("budget", describe_bytes(result.budget_bytes))
    table.add_row("predicted", describe_bytes(result.predicted_peak_bytes))
    table.add_row(
        "measured",
        f"{describe_bytes(result.measured_peak_bytes)} on {result.device} "
        f"({result.prediction_error:+.2%} predicted vs measured), {verdict}",
    )
    table.add_row("original", f"{describe_bytes(result.original_peak_bytes)} without the plan")
    grads = "equal" if result.gradients_equal else f"DIFFER (max abs error {result.max_grad_error:.3g})"
    table.add_row("gradients", grads)
    table.add_row("step time", _overhead_spread(result))
    table.add_row(
        "", f"{result.emitted_step_seconds * 1e3:.1f} ms vs {result.original_step_seconds * 1e3:.1f} ms "
            "median, with and without the plan",
    )
    console.print(table)


def _overhead_spread(result: Verification) -> str:
    """``+9.1% (+4.0% to +12.5% over 5 steps)``: the medians' overhead, and the least and most
    overhead of one step over its paired original step; "within noise" when that range reaches
    both sides of 0."""
    line = f"{result.step_overhead:+.1%}"
    spread = result.step_overhead_range
    steps = len(result.emitted_step_times)
    if spread is None or steps < 2:
        return line + " (1 step: no spread)" if steps == 1 else line
    low, high = spread
    line += f" ({low:+.1%} to {high:+.1%} over {steps} steps)"
    return line + ", within noise" if low < 0 < high else line


def render_sweep(console: Console, baseline_peak_bytes: int, points: Sequence[SweepPoint]) -> None:
    """One row per budget: what the plan reaches and what it costs."""
    table = Table(title=f"trade-off (no checkpointing: {format_bytes(baseline_peak_bytes)})")
    for column in ("budget", "bytes", "solver", "predicted peak", "recompute", "overhead"):
        table.add_column(column, justify="right" if column not in ("budget", "solver") else "left")
    for p in points:
        if p.peak_bytes is None:
            least = f"least {format_bytes(p.least_peak_bytes)}" if p.least_peak_bytes else ""
            table.add_row(p.requested, format_bytes(p.budget_bytes), p.solver, "infeasible", least, "")
        else:
            table.add_row(
                p.requested, format_bytes(p.budget_bytes), p.solver, format_bytes(p.peak_bytes),
                format_flops(p.recompute_flops), f"{100 * p.overhead:.1f}%",
            )
    console.print(table)
