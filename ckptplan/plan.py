"""Plans: which regions run under checkpoint, what each keeps, and what that is predicted to cost.

A ``Plan`` is a pydantic model whose only serial form is JSON (schema ``ckptplan.plan/v1``);
loading validates and never executes anything. Its regions are ``ckptplan.region.Region``, the
plain type the algorithms work with, checked here by the same rules (``region_problem``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckptplan.errors import PlanFormatError
from ckptplan.region import Region, region_problem
from ckptplan.timeline import Timeline

SCHEMA_VERSION = "ckptplan.plan/v1"
# Deeper nesting than any solver makes (dp nests about log2(n) levels) is refused before
# validation, which recurses once per level.
MAX_REGION_DEPTH = 64
SolverStatus = Literal["optimal", "feasible", "infeasible", "timeout"]
Decision = Literal["store", "recompute", "keep", "remat"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_Schema = TypeVar("_Schema", bound=_Frozen)


class InputInfo(_Frozen):
    shape: tuple[int, ...]
    dtype: str


class ShardingInfo(_Frozen):
    """The data-parallel sharding the plan was made for (``ckptplan.sharding``): the budget and
    the prediction are one rank's. ``stage``: ZeRO stage, 0 for DDP. ``units``: module paths
    sharded one by one (FSDP units)."""

    degree: int = Field(ge=1)
    stage: int = Field(ge=0, le=3)
    master_dtype: str | None = None
    units: tuple[str, ...] = ()


class ModelInfo(_Frozen):
    """The profiled step the plan is for. ``autocast``: the dtype its forward ran under
    ``torch.autocast`` with (None: no autocast); ``target``: the device kind whose kernels its
    bytes follow (``profiler.profile``). Plans written before either existed have None, and were
    fingerprinted as ``"cpu"`` ones. ``spell_out``: its composite kernels ran as their parts
    (``profile(..., spell_out=True)``). ``outputs_live``: the step it plans keeps the model's
    outputs through backward (``profile(..., outputs_live=True)``); written only when it does."""

    name: str
    fingerprint: str
    inputs: tuple[InputInfo, ...] = ()
    node_count: int = Field(ge=0)
    sharding: ShardingInfo | None = None
    autocast: Literal["bfloat16", "float16"] | None = None
    target: Literal["cpu", "cuda"] | None = None
    spell_out: bool = False
    outputs_live: bool = False


class BudgetInfo(_Frozen):
    requested: str
    bytes: int = Field(ge=0)


class SolverInfo(_Frozen):
    """Which solver made the plan and how: ``origin`` names the phase that made its regions when
    that is not the solver itself (``ilp``'s ``"block by block"``, or the warm-start solver whose
    plan it returns); plans without one leave the key out of their JSON."""

    name: str
    status: SolverStatus
    seconds: float = Field(ge=0.0)
    gap: float | None = None
    note: str = ""
    origin: str | None = None


class Prediction(_Frozen):
    """What ``planner.simulate`` says of the plan. ``checkpoint_seconds``: what the regions'
    machinery adds besides recomputation (0 under the default A100 cost model, and in plans
    written before it existed); ``overhead`` = (recompute + checkpoint seconds) / step cost.
    ``priced_in``: what those costs count (``Roofline.priced_in``): ``"seconds"``, or ``"flops"``
    for a graph priced in FLOPs (``--costs flops``), whose overhead is a share of the step's FLOPs.

    ``priced_on``: where the costs come from (``Roofline.source``): an A100's datasheet, times
    measured on the machine that profiled it, FLOPs, or a roofline the caller gave; written only
    when known.

    ``timeline``: the step's live bytes, downsampled (``ckptplan.timeline``); plans written
    before it existed have none."""

    peak_bytes: int = Field(ge=0)
    baseline_peak_bytes: int = Field(ge=0)
    activation_bytes: int = Field(ge=0)
    recompute_flops: int = Field(ge=0)
    recompute_seconds: float = Field(ge=0.0)
    checkpoint_seconds: float = Field(default=0.0, ge=0.0)
    overhead: float = Field(ge=0.0)
    priced_in: Literal["seconds", "flops"] = "seconds"
    priced_on: Literal["a100", "measured", "flops", "custom"] | None = None
    timeline: Timeline | None = None

    @property
    def cost_seconds(self) -> float:
        """What the plan adds to a step, the quantity solvers minimise."""
        return self.recompute_seconds + self.checkpoint_seconds


class NodeDecision(_Frozen):
    """One node's fate under the plan. ``region_input_bytes``: bytes of its output storages
    that a top-level region reads from before it, which the region stores as its input until
    its backward (0 in plans written before the field existed)."""

    name: str
    op: str
    module: str
    decision: Decision
    output_bytes: int = Field(ge=0)
    saved_bytes: int = Field(ge=0)
    fwd_flops: int = Field(ge=0)
    region_input_bytes: int = Field(default=0, ge=0)


class Plan(_Frozen):
    """What to do with one graph: regions, provenance, and the simulator's prediction."""

    schema_version: Literal["ckptplan.plan/v1"] = SCHEMA_VERSION
    model: ModelInfo
    budget: BudgetInfo
    solver: SolverInfo
    prediction: Prediction
    regions: tuple[Region, ...] = ()
    nodes: tuple[NodeDecision, ...] = ()
    # Nodes whose outputs are dropped after forward and recomputed in the backward of each op
    # that saved them (``ckptplan.remat``); written only when there are any.
    remat: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check_regions(self) -> Plan:
        names = {n.name for n in self.nodes} if self.nodes else None
        if len(set(self.remat)) != len(self.remat):
            raise ValueError("remat names a node twice")
        unknown = [name for name in self.remat if names is not None and name not in names]
        if unknown:
            raise ValueError(f"remat names unknown node {unknown[0]!r}")
        problem = region_problem(self.regions, node_count=len(self.nodes) if self.nodes else None, names=names)
        if problem is not None:
            raise ValueError(problem)
        return self

    def to_json(self) -> str:
        """Deterministic JSON text: same plan, same bytes."""
        raw = self.model_dump(mode="json")
        if not raw["remat"]:
            del raw["remat"]  # plans without it read as before, by earlier versions too
        if raw["solver"]["origin"] is None:
            del raw["solver"]["origin"]  # likewise
        if raw["prediction"]["priced_on"] is None:
            del raw["prediction"]["priced_on"]  # likewise
        if not raw["model"]["outputs_live"]:
            del raw["model"]["outputs_live"]  # likewise
        return json.dumps(raw, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """Parse and validate; any problem is a ``PlanFormatError`` naming the first bad field."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanFormatError(f"Plan is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc}).") from None
        except RecursionError:
            raise PlanFormatError("Plan JSON is nested too deeply to be a plan.") from None
        if not isinstance(raw, dict):
            raise PlanFormatError("Plan JSON must be an object with 'schema_version', 'model', 'regions', ...")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanFormatError(
                f"Not a ckptplan plan: schema_version is {version!r}, expected {SCHEMA_VERSION!r}."
            )
        if _region_depth(raw.get("regions")) > MAX_REGION_DEPTH:
            raise PlanFormatError(f"Plan regions are nested more than {MAX_REGION_DEPTH} levels deep, which no plan needs.")
        return _validated(cls, raw)

    def all_regions(self) -> list[Region]:
        return [r for top in self.regions for r in top.walk()]


PARTITION_SCHEMA_VERSION = "ckptplan.partition/v1"
# Inductor settings a compiled step's plan may record (``planner.compiled.MODELLED_INDUCTOR``).
InductorOption = Literal["reorder_for_peak_memory", "layout_optimization"]


class PartitionPrediction(_Frozen):
    """What ``ckptplan.partition`` says of a compiled step's partition: its peak (and each
    graph's), the peak saving everything the backward reads, and the work the backward repeats,
    priced on ``priced_on`` (the joint graph's roofline); ``replayed_masks``: how many times
    the backward draws a dropout mask again from the generator state the forward saved (for the
    mask, or for the dropout's output; ``ckptplan.joint``)."""

    peak_bytes: int = Field(ge=0)
    forward_peak_bytes: int = Field(ge=0)
    backward_peak_bytes: int = Field(ge=0)
    baseline_peak_bytes: int = Field(ge=0)
    recompute_flops: int = Field(ge=0)
    recompute_seconds: float = Field(ge=0.0)
    priced_on: str | None = None
    replayed_masks: int = Field(default=0, ge=0)


class PartitionPlan(_Frozen):
    """A compiled step's plan (``ckptplan.compile``): which forward values of AOTAutograd's joint
    graph the forward saves for the backward; the backward computes the others it needs again.
    Values are named as in the joint graph; ``model.fingerprint`` is the joint graph's
    (``JointGraph.fingerprint``) and ``model.node_count`` its values. ``solver.name`` is the
    search asked for and ``solver.origin`` the one that found the saved set. ``inductor_options``:
    the inductor settings the step was compiled with besides inductor's defaults (``compile``
    sets them where inductor's default step measured over the budget), which ``compile(plan=...)``
    compiles with again."""

    schema_version: Literal["ckptplan.partition/v1"] = PARTITION_SCHEMA_VERSION
    kind: Literal["joint-graph partition"] = "joint-graph partition"
    model: ModelInfo
    budget: BudgetInfo
    solver: SolverInfo
    prediction: PartitionPrediction
    saved: tuple[str, ...]
    recomputed: tuple[str, ...] = ()
    inductor_options: dict[InductorOption, bool] = Field(default_factory=dict)

    @field_validator("inductor_options", mode="after")
    @classmethod
    def _sort_options(cls, options: dict[str, bool]) -> dict[str, bool]:
        return dict(sorted(options.items()))  # same settings, same bytes

    @model_validator(mode="after")
    def _check_names(self) -> PartitionPlan:
        for field in ("saved", "recomputed"):
            names = getattr(self, field)
            if len(set(names)) != len(names):
                raise ValueError(f"{field} names a value twice")
        both = set(self.saved) & set(self.recomputed)
        if both:
            raise ValueError(f"{min(both)!r} is both saved and recomputed")
        return self

    def to_json(self) -> str:
        """Deterministic JSON text: same plan, same bytes."""
        raw = self.model_dump(mode="json")
        if not raw["inductor_options"]:
            del raw["inductor_options"]  # plans without it read as before, by earlier versions too
        return json.dumps(raw, indent=2, sort_keys=False) + "\n"


def read_plan(text: str | bytes) -> Plan | PartitionPlan:
    """A plan file's text as the plan its ``schema_version`` names: an eager step's ``Plan`` or a
    compiled step's ``PartitionPlan``; any problem is a ``PlanFormatError``."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return Plan.from_json(text)  # which says what is wrong
    if isinstance(raw, dict) and raw.get("schema_version") == PARTITION_SCHEMA_VERSION:
        return _validated(PartitionPlan, raw)
    return Plan.from_json(text)


def _validated(schema: type[_Schema], raw: dict[str, Any]) -> _Schema:
    """``raw`` validated as ``schema``; the first problem is a ``PlanFormatError`` naming its field."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "plan"
        raise PlanFormatError(f"Plan field '{where}' is invalid: {first['msg']}.") from None


def _region_depth(regions: Any) -> int:
    """How deeply raw (unvalidated) region lists nest through ``children``, found without recursion."""
    deepest, stack = 0, [(regions, 1)]
    while stack:
        items, depth = stack.pop()
        if not isinstance(items, list):
            continue
        deepest = max(deepest, depth if items else depth - 1)
        stack.extend((item.get("children"), depth + 1) for item in items if isinstance(item, dict))
    return deepest


def load_plan(path: str | Path) -> Plan:
    """Read an eager step's plan file; a missing, unreadable or malformed file, or a compiled
    step's plan (``load_any_plan`` reads those), is a ``PlanFormatError``."""
    plan = load_any_plan(path)
    if isinstance(plan, PartitionPlan):
        raise PlanFormatError(
            f"{str(path)!r} is a compiled step's plan (a joint-graph partition); apply it with "
            "ckptplan.compile(model, args, plan=...), or verify it with 'ckptplan verify'."
        )
    return plan


def load_any_plan(path: str | Path) -> Plan | PartitionPlan:
    """Read a plan file of either kind (``read_plan``); a missing, unreadable or malformed file
    is a ``PlanFormatError``."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise PlanFormatError(f"Plan file {str(path)!r} does not exist.") from None
    except OSError as exc:
        raise PlanFormatError(f"Plan file {str(path)!r} could not be read: {exc.strerror}.") from None
    try:
        return read_plan(text)
    except PlanFormatError as exc:
        raise PlanFormatError(f"{str(path)!r}: {exc}") from None


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of plan files, as ``ckptplan schema`` prints it."""
    schema = Plan.model_json_schema()
    schema["$id"] = SCHEMA_VERSION
    bounds = schema["$defs"]["Region"]["properties"]
    bounds["start"]["minimum"], bounds["end"]["minimum"] = 0, 1  # ``ckptplan.region``'s rules
    return schema


def partition_json_schema() -> dict[str, Any]:
    """The JSON Schema of a compiled step's plan files, as ``ckptplan schema --compile`` prints it."""
    schema = PartitionPlan.model_json_schema()
    schema["$id"] = PARTITION_SCHEMA_VERSION
    return schema
