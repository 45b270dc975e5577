"""``ckptplan show``: the memory timeline a plan carries, its sparkline and PNG, and the bytes
each module's outputs contribute as checkpoint-region inputs. Synthetic graphs keep it fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Import torch before the first CliRunner run (see test_cli.py: torch's log handlers keep the
# sys.stderr of their import).
import torch
from typer.testing import CliRunner, Result

from ckptplan.build import make_plan
from ckptplan.cli.main import app
from ckptplan.cli.render import SPARKLINE_BLOCKS, pricing, sparkline
from ckptplan.cli.summary import recomputed_by_module
from ckptplan.plan import Plan, Region
from ckptplan.simulation import Event, simulate
from ckptplan.solvers import available_solvers, solve
from ckptplan.timeline import TIMELINE_BUCKETS, Timeline, bucket_bounds, max_pool, timeline_of
from tests.synthetic import chain_graph

runner = CliRunner()

ACT_BYTES = [100, 100, 400, 400, 100, 100, 300, 300]


def _uniform_graph():
    return chain_graph([1000] * 24, param_bytes=16, saves_output=True)


def invoke(*args: object) -> Result:
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


def _solved_plan(solver: str = "dp") -> Plan:
    plan = solve(_uniform_graph(), "80%", solver=solver)
    assert plan.regions, "the budget should force checkpointing"
    return plan


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("show") / "plan.json"
    path.write_text(_solved_plan().to_json())
    return path


@pytest.fixture(scope="module")
def old_plan_file(plan_file: Path) -> Path:
    """The same plan as written before timelines and region-input bytes existed."""
    raw = json.loads(plan_file.read_text())
    del raw["prediction"]["timeline"]
    for node in raw["nodes"]:
        del node["region_input_bytes"]
    path = plan_file.with_name("old_plan.json")
    path.write_text(json.dumps(raw, indent=2))
    return path


# ----------------------------------------------------------------------------- the timeline field
@pytest.mark.parametrize("solver", [s for s in available_solvers() if s != "auto"])
def test_every_solvers_plan_carries_a_timeline_peaking_at_the_prediction(solver: str) -> None:
    graph = _uniform_graph()
    plan = _solved_plan(solver)
    timeline = plan.prediction.timeline
    assert timeline is not None
    events = simulate(graph, plan).timeline
    assert max(timeline.bytes) == timeline.peak_bytes == plan.prediction.peak_bytes
    assert len(timeline.bytes) == min(len(events), TIMELINE_BUCKETS) and timeline.events == len(events)
    first_backward = next(i for i, e in enumerate(events) if e.phase != "forward")
    assert timeline.bytes[: timeline.backward_start] == tuple(e.live_bytes for e in events[:first_backward])


def test_long_steps_are_downsampled_to_at_most_the_bucket_count_and_keep_the_peak() -> None:
    graph = chain_graph([(37 * i) % 500 + 100 for i in range(150)])
    plan = make_plan(graph, [Region(10, 60), Region(80, 140)])
    timeline = plan.prediction.timeline
    assert timeline is not None and len(timeline.bytes) == TIMELINE_BUCKETS < timeline.events
    assert max(timeline.bytes) == plan.prediction.peak_bytes == simulate(graph, plan).peak_bytes
    assert 0 < timeline.backward_start < TIMELINE_BUCKETS
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.to_json() == make_plan(graph, [Region(10, 60), Region(80, 140)]).to_json()


def test_buckets_are_consecutive_nearly_equal_and_cover_everything() -> None:
    bounds = bucket_bounds(10, 4)
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert bucket_bounds(3, 120) == [(0, 1), (1, 2), (2, 3)]
    assert max_pool([1, 9, 2, 3, 8, 4, 5, 6, 7, 0], 4) == (9, 8, 5, 7)
    with pytest.raises(ValueError):
        bucket_bounds(5, 0)


def test_backward_starts_at_the_bucket_holding_the_first_backward_event() -> None:
    events = [Event("forward", i, 10 * i) for i in range(5)] + [Event("recompute", 2, 7), Event("backward", 1, 3)]
    # Buckets of events [0, 2), [2, 4), [4, 7); the first backward event (index 5) is in the last.
    assert timeline_of(events, buckets=3) == Timeline(bytes=(10, 30, 40), backward_start=2, events=7)
    assert timeline_of(events[:5], buckets=3).backward_start == 3  # no backward: past the end
    assert timeline_of([]) is None


@pytest.mark.parametrize(
    "fields", [{"bytes": (1, 2), "backward_start": 3, "events": 2}, {"bytes": (1, 2), "backward_start": 1, "events": 1}]
)
def test_inconsistent_timelines_are_rejected(fields: dict) -> None:
    with pytest.raises(ValueError):
        Timeline(**fields)


def test_plans_without_timeline_or_region_inputs_still_load(old_plan_file: Path, plan_file: Path) -> None:
    old = Plan.from_json(old_plan_file.read_text())
    assert old.prediction.timeline is None
    assert all(node.region_input_bytes == 0 for node in old.nodes)
    assert old.regions == Plan.from_json(plan_file.read_text()).regions


# ----------------------------------------------------------------------------- region inputs
def test_region_input_bytes_are_the_outputs_entering_a_region_from_before_it() -> None:
    graph = chain_graph(ACT_BYTES)
    # [2, 4) reads relu_1's output; [5, 8) reads linear_4's; linear_4 runs outside any region.
    plan = make_plan(graph, [Region(2, 4), Region(5, 8)])
    by_name = {node.name: node.region_input_bytes for node in plan.nodes}
    assert by_name == {n.name: 0 for n in plan.nodes} | {"relu_1": ACT_BYTES[1], "linear_4": ACT_BYTES[4]}
    assert all(node.region_input_bytes == 0 for node in make_plan(graph, []).nodes)


def test_solved_plans_have_region_inputs(plan_file: Path) -> None:
    plan = Plan.from_json(plan_file.read_text())
    assert sum(node.region_input_bytes for node in plan.nodes) > 0


# ----------------------------------------------------------------------------- rendering
def test_sparkline_fits_its_width_and_separates_forward_from_backward() -> None:
    timeline = Timeline(bytes=tuple(range(60)) + tuple(range(59, -1, -1)), backward_start=60, events=120)
    for width in (20, 50, 89, 200):
        line = sparkline(timeline, width)
        assert len(line) <= width
        forward, backward = line.split(" | ")
        assert forward.startswith("fwd ") and backward.startswith("bwd ")
        assert forward[-1] == backward[4] == SPARKLINE_BLOCKS[-1]  # the peak survives pooling
    unpooled = sparkline(timeline, 200)
    assert unpooled.count(SPARKLINE_BLOCKS[0]) >= 2 and unpooled[4] == unpooled[-1] == SPARKLINE_BLOCKS[0]
    assert sparkline(Timeline(bytes=(5, 5), backward_start=2, events=2), 40) == "fwd ██"


def test_show_prints_the_sparkline_and_region_inputs(plan_file: Path) -> None:
    result = invoke("show", plan_file)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stderr.splitlines() if "fwd " in line)
    assert "| bwd " in line and SPARKLINE_BLOCKS[-1] in line and len(line.rstrip()) <= 100
    assert "peak" in result.stderr and "budget" in result.stderr
    verbose = invoke("show", plan_file, "-v")
    assert verbose.exit_code == 0, verbose.output
    assert "region inputs" in verbose.stderr


def test_show_renders_a_plan_without_timeline(old_plan_file: Path) -> None:
    result = invoke("show", old_plan_file, "-v")
    assert result.exit_code == 0, result.output
    assert "checkpoint regions" in result.stderr and "region inputs" in result.stderr
    assert "fwd " not in result.stderr


def test_show_plot_writes_a_png(plan_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    result = invoke("show", plan_file, "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Wrote the plot" in result.stderr


def test_show_plot_refuses_bad_targets_and_plans_without_timeline(
    plan_file: Path, old_plan_file: Path, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    missing_folder = invoke("show", plan_file, "--plot", tmp_path / "nowhere" / "t.png")
    assert missing_folder.exit_code == 1 and "does not exist" in missing_folder.stderr
    old = invoke("show", old_plan_file, "--plot", tmp_path / "old.png")
    assert old.exit_code == 1 and "no memory timeline" in old.stderr
    assert not (tmp_path / "old.png").exists()


# ----------------------------------------------------------------------------- plain words
def _blocks_plan() -> Plan:
    """A plan over a 24-node chain renamed as three transformer blocks of eight ops (layer
    norm, attention's projections and core, an MLP): regions recompute each block's attention
    core, and block 2's whole MLP but its first linear, which it keeps."""
    modules = ["ln", "attn.qkv", "attn", "attn", "attn.proj", "mlp.0", "mlp.1", "mlp.2"]
    ops = ["layer_norm", "linear", "scaled_dot_product_attention", "view", "linear", "linear", "gelu", "linear"]
    plan = make_plan(_uniform_graph(), [Region(2, 3), Region(10, 11), Region(18, 19), Region(21, 24, keep=("relu_21",))])
    nodes = [
        node.model_copy(update={"module": f"blocks.{i // 8}.{modules[i % 8]}", "op": f"aten.{ops[i % 8]}.default"})
        for i, node in enumerate(plan.nodes)
    ]
    return plan.model_copy(update={"nodes": tuple(nodes)})


def test_what_is_recomputed_is_named_by_module_with_repeated_blocks_merged() -> None:
    rows = recomputed_by_module(_blocks_plan())
    assert [(r.module, r.recomputed, r.kept, r.how, r.count) for r in rows] == [
        ("blocks.0..2.attn", "scaled_dot_product_attention", "-", "checkpoint", 3),
        ("blocks.2.mlp.0..2", "gelu, linear", "linear", "checkpoint", 1),
    ]
    assert recomputed_by_module(make_plan(_uniform_graph(), [])) == []


def test_regions_across_blocks_name_their_span_and_skipped_indices_are_listed() -> None:
    plan = _blocks_plan()
    across = plan.model_copy(update={"regions": (Region(4, 12), Region(20, 23))})
    assert [r.module for r in recomputed_by_module(across)] == ["blocks.0..1", "blocks.2"]
    skipping = plan.model_copy(update={"regions": (Region(2, 3), Region(18, 19))})
    assert [r.module for r in recomputed_by_module(skipping)] == ["blocks.{0,2}.attn"]


def test_show_says_what_is_recomputed_by_module_and_what_prices_it(tmp_path: Path) -> None:
    """The default output names modules and ops in words, states the cost model, and stays
    within 80 columns; node indices, node names and the solver's status are for ``-v``."""
    plan = _blocks_plan()
    plan = plan.model_copy(update={"solver": plan.solver.model_copy(update={"note": "1234 variables, 2 round(s)"})})
    path = tmp_path / "blocks.json"
    path.write_text(plan.to_json())
    result = invoke("show", path)
    assert result.exit_code == 0, result.output
    text = result.stderr
    assert "blocks.0..2.attn" in text and "scaled_dot_product_attention" in text and "kept in memory" in text
    assert "step time" in text and "A100 datasheet" in text and "--costs here" in text
    assert "without checkpointing" in text and "of budget" in text
    assert all(len(line) <= 80 for line in text.splitlines())
    for internal in ("variables", "round(s)", "manual:", "first node", "relu_21", "fingerprint"):
        assert internal not in text, internal
    verbose = invoke("show", path, "-v")
    assert verbose.exit_code == 0, verbose.output
    for internal in ("1234 variables", "round(s)", "manual: feasible", "first node", "fingerprint", "ops by module"):
        assert internal in verbose.stderr, internal
    assert "blocks.0..2.attn" in verbose.stderr
    before_the_command = invoke("-v", "show", path)
    assert "1234 variables" in before_the_command.stderr


def test_pricing_names_the_cost_model() -> None:
    plan = _blocks_plan()
    assert "A100 datasheet" in pricing(plan, "a100") and "this machine" in pricing(plan, "here")
    assert "FLOPs" in pricing(plan, "flops")
    # A saved plan's prediction tells: checkpointing's own costs are only timed on a machine.
    timed = plan.model_copy(update={"prediction": plan.prediction.model_copy(update={"checkpoint_seconds": 1e-3})})
    assert "timed on the machine that solved it" in pricing(timed, None)
    assert "A100 datasheet" in pricing(plan, None)
    flops = plan.model_copy(update={"prediction": plan.prediction.model_copy(update={"priced_in": "flops"})})
    assert "FLOPs" in pricing(flops, None)
    assert pricing(make_plan(_uniform_graph(), []), "a100") == ""
    # A plan that records what priced it says so, whatever its numbers suggest.
    for source, words in (("measured", "timed on the machine that profiled it"), ("a100", "A100 datasheet"),
                          ("flops", "FLOPs"), ("custom", "roofline given to profile()")):
        recorded = timed.model_copy(update={"prediction": timed.prediction.model_copy(update={"priced_on": source})})
        assert words in pricing(recorded, None), source


def test_profiled_plans_record_what_priced_them() -> None:
    import ckptplan
    from ckptplan.profiler import FLOPS

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    args = (torch.randn(8, 16),)
    assert make_plan(ckptplan.profile(model, args), [ckptplan.Region(0, 2)]).prediction.priced_on == "a100"
    assert make_plan(ckptplan.profile(model, args, roofline=FLOPS), []).prediction.priced_on == "flops"
    assert '"priced_on"' not in make_plan(_uniform_graph(), []).to_json()  # a graph that does not say
