"""Plans as JSON (``ckptplan.plan``): round trips, determinism, and rejection of bad files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ckptplan.build import make_plan
from ckptplan.errors import PlanFormatError
from ckptplan.plan import SCHEMA_VERSION, BudgetInfo, Plan, Region, SolverInfo, load_plan, plan_json_schema
from ckptplan.simulation import simulate
from tests.ilp_oracles import model_peak
from tests.synthetic import chain_graph, skip_graph

TOP_LEVEL_KEYS = ["schema_version", "model", "budget", "solver", "prediction", "regions", "nodes"]


def _chain():
    return chain_graph([100, 100, 200, 200, 100, 100, 300, 300])


def _nested_plan() -> Plan:
    graph = _chain()
    regions = [
        Region(0, 4, keep=("linear_0",), children=(Region(2, 4, keep=("relu_3",)),)),
        Region(5, 8, children=(Region(5, 6), Region(6, 8, children=(Region(7, 8),)))),
    ]
    return make_plan(graph, regions)


def _plan_dict(plan: Plan | None = None) -> dict[str, Any]:
    return json.loads((plan or _nested_plan()).to_json())


def test_region_positional_and_keyword_construction_agree() -> None:
    region = Region(0, 5, keep=("a",))
    assert (region.start, region.end, region.keep, region.children) == (0, 5, ("a",), ())
    assert region == Region(start=0, end=5, keep=("a",))
    assert region != Region(0, 5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start": 3, "end": 3},
        {"start": 4, "end": 2},
        {"start": -1, "end": 2},
        {"start": 0, "end": 4, "keep": ("a", "a")},
        {"start": 0, "end": 4, "children": (Region(0, 2), Region(1, 3))},
        {"start": 0, "end": 4, "children": (Region(2, 5),)},
        {"start": 2, "end": 4, "children": (Region(0, 3),)},
    ],
)
def test_region_rejects_bad_shapes(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Region(**kwargs)


def test_make_plan_records_what_the_simulator_says() -> None:
    """The prediction is checked against what does not run the simulator: the ilp model's peak
    for the fixed plan, and the FLOPs of the nodes it recomputes (all but the kept one)."""
    graph = _chain()
    regions = [Region(0, 4), Region(4, 8, keep=("linear_6",))]
    plan = make_plan(graph, regions)
    report = simulate(graph, regions)
    assert plan.prediction.peak_bytes == model_peak(graph, tuple(regions))
    assert plan.prediction.recompute_flops == sum(n.fwd_flops for n in graph.nodes if n.name != "linear_6") == 1500
    assert plan.prediction.baseline_peak_bytes == model_peak(graph, ())
    assert plan.budget.bytes == report.peak_bytes  # no budget given: its own peak
    assert plan.solver.name == "manual"
    assert plan.model.node_count == len(graph) and plan.model.fingerprint == graph.fingerprint
    decisions = [n.decision for n in plan.nodes]
    assert decisions == ["recompute"] * 6 + ["keep", "recompute"]
    assert [n.name for n in plan.nodes] == [n.name for n in graph.nodes]


def test_make_plan_rejects_regions_the_graph_cannot_have() -> None:
    graph = _chain()
    with pytest.raises(PlanFormatError):
        make_plan(graph, [Region(4, 9)])
    with pytest.raises(PlanFormatError):
        make_plan(graph, [Region(0, 4, keep=("nonexistent",))])


@pytest.mark.parametrize(
    "regions",
    [
        [],
        [Region(0, 8)],
        [Region(1, 3, keep=("relu_1",)), Region(3, 7)],
        [Region(0, 4, keep=("linear_0",), children=(Region(2, 4, keep=("relu_3",)),))],
        [Region(5, 8, children=(Region(5, 6), Region(6, 8, children=(Region(7, 8),))))],
    ],
)
def test_round_trip_is_lossless(regions: list[Region]) -> None:
    plan = make_plan(_chain(), regions)
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.regions == tuple(regions)
    assert again.to_json() == text
    assert Plan.from_json(text.encode()) == plan


def test_round_trip_keeps_solver_and_budget_fields() -> None:
    graph = skip_graph()
    plan = make_plan(
        graph,
        [Region(2, 6, keep=("mid",))],
        budget=BudgetInfo(requested="60%", bytes=123_456),
        solver=SolverInfo(name="dp", status="optimal", seconds=0.125, gap=0.0, note="exact"),
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.solver.gap == 0.0 and again.solver.status == "optimal"
    assert again.budget == BudgetInfo(requested="60%", bytes=123_456)


def test_to_json_is_deterministic() -> None:
    plan = _nested_plan()
    # Two plans made independently from equal inputs serialise to the same bytes.
    assert _nested_plan().to_json() == plan.to_json()
    assert plan.to_json().endswith("}\n")


def test_top_level_keys_are_exactly_the_schema() -> None:
    assert list(_plan_dict()) == TOP_LEVEL_KEYS
    assert _plan_dict()["schema_version"] == SCHEMA_VERSION == "ckptplan.plan/v1"


def test_nested_regions_and_keep_sets_appear_in_the_json() -> None:
    regions = _plan_dict()["regions"]
    assert regions[0]["keep"] == ["linear_0"]
    assert regions[0]["children"][0] == {"start": 2, "end": 4, "keep": ["relu_3"], "children": []}
    assert regions[1]["children"][1]["children"][0]["start"] == 7


def _mutated(edit) -> str:
    raw = _plan_dict()
    edit(raw)
    return json.dumps(raw)


def _set(path: list[Any], value: Any):
    def edit(raw: dict[str, Any]) -> None:
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


BAD_PLANS: dict[str, str | bytes] = {
    "not json": "{this is not json",
    "empty": "",
    "not utf-8": b"\xff\xfe\x00",
    "a json list": "[1, 2, 3]",
    "a json string": '"ckptplan.plan/v1"',
    "null": "null",
    "wrong schema_version": _mutated(_set(["schema_version"], "ckptplan.plan/v0")),
    "no schema_version": _mutated(lambda raw: raw.pop("schema_version")),
    "missing model": _mutated(lambda raw: raw.pop("model")),
    "negative budget bytes": _mutated(_set(["budget", "bytes"], -1)),
    "negative peak bytes": _mutated(_set(["prediction", "peak_bytes"], -5)),
    "string bytes": _mutated(_set(["budget", "bytes"], "lots")),
    "fractional bytes": _mutated(_set(["budget", "bytes"], 1.5)),
    "unknown status": _mutated(_set(["solver", "status"], "great")),
    "overlapping regions": _mutated(_set(["regions"], [{"start": 0, "end": 4}, {"start": 3, "end": 6}])),
    "unordered regions": _mutated(_set(["regions"], [{"start": 4, "end": 6}, {"start": 0, "end": 2}])),
    "empty region": _mutated(_set(["regions"], [{"start": 3, "end": 3}])),
    "reversed region": _mutated(_set(["regions"], [{"start": 5, "end": 2}])),
    "region past the nodes": _mutated(_set(["regions"], [{"start": 4, "end": 9}])),
    "overlapping children": _mutated(
        _set(["regions"], [{"start": 0, "end": 6, "children": [{"start": 0, "end": 3}, {"start": 2, "end": 5}]}])
    ),
    "keep of an unknown node": _mutated(_set(["regions"], [{"start": 0, "end": 4, "keep": ["ghost"]}])),
    "extra top-level key": _mutated(_set(["extra"], 1)),
    "extra region key": _mutated(_set(["regions"], [{"start": 0, "end": 4, "policy": "all"}])),
    "extra nested key": _mutated(_set(["model", "owner"], "me")),
    "unknown autocast dtype": _mutated(_set(["model", "autocast"], "int8")),
    "unknown target": _mutated(_set(["model", "target"], "tpu")),
}


@pytest.mark.parametrize("text", list(BAD_PLANS.values()), ids=list(BAD_PLANS))
def test_bad_plans_raise_plan_format_error(text: str | bytes) -> None:
    with pytest.raises(PlanFormatError) as info:
        Plan.from_json(text)
    assert not isinstance(info.value, ValidationError | json.JSONDecodeError)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    assert info.value.__cause__ is None  # raised `from None`: no pydantic or json traceback attached


def test_bad_field_is_named_in_the_message() -> None:
    with pytest.raises(PlanFormatError, match=r"'budget\.bytes'"):
        Plan.from_json(BAD_PLANS["negative budget bytes"])
    with pytest.raises(PlanFormatError, match="schema_version"):
        Plan.from_json(BAD_PLANS["wrong schema_version"])


def _deep_regions_text(depth: int) -> str:
    raw = _plan_dict()
    raw["regions"] = ["@"]
    opening = '{"start": 0, "end": 4, "children": [' * depth
    closing = "]}" * depth
    return json.dumps(raw).replace('"@"', opening + '{"start": 0, "end": 4}' + closing)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, _deep_regions_text(300)], ids=["arrays", "regions"])
def test_deeply_nested_input_is_a_plan_format_error(text: str) -> None:
    with pytest.raises(PlanFormatError):
        Plan.from_json(text)


def test_moderately_nested_regions_still_load() -> None:
    plan = Plan.from_json(_deep_regions_text(40))
    depth, region = 0, plan.regions[0]
    while region.children:
        depth, region = depth + 1, region.children[0]
    assert depth == 40


def test_model_records_the_graphs_autocast_and_target_and_old_plans_load_without_them() -> None:
    graph = dataclasses.replace(_chain(), autocast="bfloat16", target="cuda")
    plan = make_plan(graph, [Region(0, 4)])
    assert (plan.model.autocast, plan.model.target) == ("bfloat16", "cuda")
    assert plan.model.fingerprint == graph.fingerprint != _chain().fingerprint
    assert Plan.from_json(plan.to_json()) == plan
    raw = _plan_dict(plan)
    del raw["model"]["autocast"], raw["model"]["target"]  # a plan written before the fields existed
    old = Plan.from_json(json.dumps(raw))
    assert (old.model.autocast, old.model.target) == (None, None)


def test_only_a_cuda_target_enters_the_fingerprint() -> None:
    graph = _chain()
    assert graph.target is None
    assert dataclasses.replace(graph, target="cpu").fingerprint == graph.fingerprint
    assert dataclasses.replace(graph, target="cuda").fingerprint != graph.fingerprint


def test_load_plan_reads_a_saved_plan(tmp_path: Path) -> None:
    plan = _nested_plan()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert load_plan(path) == plan
    assert load_plan(str(path)) == plan


def test_load_plan_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="does not exist"):
        load_plan(tmp_path / "nope.json")


def test_load_plan_directory(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="could not be read"):
        load_plan(tmp_path)


def test_load_plan_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[]")
    with pytest.raises(PlanFormatError):
        load_plan(path)


def test_json_schema_describes_the_plan() -> None:
    schema = plan_json_schema()
    assert schema["$id"] == "ckptplan.plan/v1"
    assert schema["type"] == "object"
    # "remat" is written only by plans that rematerialise something (tests/test_remat.py).
    assert set(schema["properties"]) == {*TOP_LEVEL_KEYS, "remat"}
    assert set(schema["required"]) >= {"model", "budget", "solver", "prediction"}
    dumped = _plan_dict()
    assert {*dumped, "remat"} == set(schema["properties"])
    # Every nested model's fields are in the schema's definitions.
    defs = schema["$defs"]
    assert set(dumped["budget"]) == set(defs["BudgetInfo"]["properties"])
    # "outputs_live" is written only by plans of loops that keep the outputs (test_measured.py).
    assert {*dumped["model"], "outputs_live"} == set(defs["ModelInfo"]["properties"])
    # "priced_on" is written only for graphs that say what priced them (profiled ones).
    assert {*dumped["prediction"], "priced_on"} == set(defs["Prediction"]["properties"])
    assert set(dumped["regions"][0]) == set(defs["Region"]["properties"])
    schema["$id"] = "changed by a caller"  # each call gives a fresh dict: a caller's change stays its own
    assert plan_json_schema()["$id"] == "ckptplan.plan/v1"


def test_json_schema_validates_dumped_plans_and_rejects_bad_ones() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = plan_json_schema()
    jsonschema.validate(_plan_dict(), schema)
    for name in ("missing model", "extra top-level key", "negative budget bytes", "unknown status"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(BAD_PLANS[name]), schema)
