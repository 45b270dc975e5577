"""The ``ckptplan`` command through typer's CliRunner: outputs, files, and every error's exit code.

Models are tiny files written to tmp_path; one test runs examples/gpt.py end to end.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Import torch here, not first inside a CliRunner run: torch's log handlers keep the sys.stderr
# of their import, and the runner closes its stream after each run.
import torch  # noqa: F401
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner, Result

import ckptplan
from ckptplan.cli.loader import load_model, parse_spec
from ckptplan.cli.main import app
from ckptplan.cli.summary import recomputed_by_module

EXAMPLES = Path(__file__).parents[1] / "examples"

# Activations dominate (batch 256 x width 16), so a 0.9 budget is reachable by checkpointing.
TINY = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(16, 16), nn.ReLU())])
    return model, torch.randn(256, 16)

def make_small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU()), (torch.randn(8, 16),), {}
"""

GLOBALS = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
example_inputs = {"args": (torch.randn(8, 16),)}
"""

DATA_DEPENDENT = """
import torch
from torch import nn

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)

def build():
    return Branchy(), (torch.randn(8, 16),)
"""

runner = CliRunner()


def invoke(*args: object) -> Result:
    """Run the CLI in-process. Unexpected exceptions propagate (they are bugs); user errors must
    never show a traceback."""
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert "Traceback" not in result.output
    return result


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def tiny(workdir: Path) -> Path:
    return write(workdir, "tiny.py", TINY)


@pytest.fixture(scope="module")
def plan_file(workdir: Path, tiny: Path) -> Path:
    out = workdir / "plan.json"
    result = invoke("solve", tiny, "--budget", "0.9", "--out", out)
    assert result.exit_code == 0, result.output
    return out


# --- solve -----------------------------------------------------------------------------------


def test_solve_json_is_the_only_stdout(tiny: Path) -> None:
    result = invoke("solve", tiny, "--budget", "0.9", "--solver", "sqrt", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["schema_version"] == "ckptplan.plan/v1"
    assert plan["budget"]["requested"] == "0.9"
    assert plan["prediction"]["peak_bytes"] <= plan["budget"]["bytes"]
    assert plan["prediction"]["peak_bytes"] < plan["prediction"]["baseline_peak_bytes"]
    assert plan["solver"]["name"] == "sqrt"


def test_solve_prints_summary_on_stderr(tiny: Path) -> None:
    """By default: the budget, the peak against it and against no checkpointing, the overhead
    and the cost model pricing it, and what is recomputed by module and op; the solver's
    status and note, the regions' node indices and bytes per module with ``-v``."""
    result = invoke("solve", tiny, "--budget", "0.9", "--optimizer", "adamw", "--time-limit", "5")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    for expected in ("Sequential", "8 ops", "0.9 =", "without checkpointing", "of budget", "step time",
                     "priced on an A100 datasheet", "recomputed in backward", "module", "linear"):
        assert expected in result.stderr, expected
    assert all(len(line) <= 80 for line in result.stderr.splitlines())
    for internal in ("auto chose", "gap", "fingerprint", "first node"):
        assert internal not in result.stderr, internal
    verbose = invoke("solve", tiny, "--budget", "0.9", "--optimizer", "adamw", "--time-limit", "5", "-v")
    assert verbose.exit_code == 0, verbose.output
    for internal in ("auto chose", "fingerprint", "checkpoint regions", "first node", "ops by module"):
        assert internal in verbose.stderr, internal
    assert ": optimal in" in verbose.stderr or ": feasible in" in verbose.stderr


@pytest.mark.parametrize(("costs", "basis"), [("flops", "priced in recomputed FLOPs"), ("here", "timed on this machine")])
def test_solve_states_what_prices_the_overhead(tiny: Path, costs: str, basis: str) -> None:
    result = invoke("solve", tiny, "--budget", "0.9", "--solver", "dp", "--costs", costs)
    assert result.exit_code == 0, result.output
    assert basis in result.stderr and "A100" not in result.stderr


def test_solve_out_writes_a_loadable_plan(plan_file: Path) -> None:
    plan = ckptplan.load_plan(plan_file)
    assert plan.regions
    assert plan.prediction.peak_bytes <= plan.budget.bytes


def test_solve_out_refuses_existing_file_without_force(workdir: Path, tiny: Path) -> None:
    out = write(workdir, "taken.json", "keep me")
    result = invoke("solve", tiny, "--budget", "0.9", "--out", out)
    assert result.exit_code == 1
    assert "--force" in result.stderr
    assert out.read_text() == "keep me"


def test_solve_out_with_force_overwrites(workdir: Path, tiny: Path) -> None:
    out = write(workdir, "old.json", "stale")
    result = invoke("solve", tiny, "--budget", "0.9", "--out", out, "--force")
    assert result.exit_code == 0, result.output
    assert ckptplan.load_plan(out).schema_version == "ckptplan.plan/v1"


def test_solve_out_into_missing_folder_fails(workdir: Path, tiny: Path) -> None:
    result = invoke("solve", tiny, "--budget", "0.9", "--out", workdir / "no_such_dir" / "plan.json")
    assert result.exit_code == 1
    assert "does not exist" in result.stderr


def test_solve_gpt_example_end_to_end() -> None:
    result = invoke("solve", EXAMPLES / "gpt.py", "--budget", "0.6", "--solver", "sqrt", "--json")
    assert result.exit_code == 0, result.output
    plan = ckptplan.Plan.from_json(result.stdout)
    assert plan.model.name == "GPT"
    assert plan.prediction.peak_bytes <= plan.budget.bytes < plan.prediction.baseline_peak_bytes


# --- model files -----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "nodes"), [("tiny.py:make_small", 2), ("globals_model.py", 4)])
def test_named_function_and_module_globals_are_loaded(workdir: Path, tiny: Path, spec: str, nodes: int) -> None:
    write(workdir, "globals_model.py", GLOBALS)
    result = invoke("profile", f"{workdir}/{spec}", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["nodes"] == nodes


def test_loaded_module_does_not_linger(tiny: Path) -> None:
    modules_before, path_before = set(sys.modules), list(sys.path)
    with load_model(str(tiny)) as loaded:
        assert loaded.args[0].shape == (256, 16)
    assert set(sys.modules) == modules_before
    assert sys.path == path_before


def test_spec_colon_splits_only_a_trailing_identifier() -> None:
    assert parse_spec("models/a.py:build_big").func == "build_big"
    assert parse_spec(r"C:\models\a.py").func is None
    assert parse_spec("models/a.py").path == Path("models/a.py")


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("raises.py", "x = 1 / 0\n", "raised ZeroDivisionError: division by zero"),
        ("empty.py", "import torch\n", "defines neither build() nor 'model'"),
        ("no_inputs.py", "from torch import nn\nmodel = nn.ReLU()\n", "example_inputs"),
        ("garbage.py", "def build():\n    return 42\n", "must return a tuple (model, args)"),
        ("not_module.py", "def build():\n    return 'model', ()\n", "torch.nn.Module"),
        ("build_raises.py", "def build():\n    raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    ],
)
def test_bad_model_file_is_one_line_error(workdir: Path, name: str, text: str, expected: str) -> None:
    path = write(workdir, name, text)
    result = invoke("profile", path)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert expected in result.stderr


def test_missing_model_file(workdir: Path) -> None:
    missing = workdir / "nowhere" / "model.py"
    result = invoke("solve", missing, "--budget", "1GB")
    assert result.exit_code == 1
    assert str(missing) in result.stderr


def test_model_file_must_be_python(workdir: Path) -> None:
    result = invoke("profile", write(workdir, "model.txt", ""))
    assert result.exit_code == 1
    assert "not a .py file" in result.stderr


def test_missing_named_function(tiny: Path) -> None:
    result = invoke("profile", f"{tiny}:make_huge")
    assert result.exit_code == 1
    assert "no function 'make_huge'" in result.stderr


def test_untraceable_model_names_the_branch_and_how_to_rewrite_it(workdir: Path) -> None:
    """A branch on tensor values stops both tracers: one line naming it and its place in the
    model file, and the rewrite, not the other tracer."""
    result = invoke("profile", write(workdir, "branchy.py", DATA_DEPENDENT))
    assert result.exit_code == 1
    # torch.export itself prints the partial graph to stderr before raising; ours is the last line.
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("Error: ")
    assert "data-dependent control flow" in last_line and "branchy.py:" in last_line
    assert "torch.where" in last_line and "try trace" not in last_line


# --- budgets, solvers, options -----------------------------------------------------------------


def test_unparseable_budget_is_a_usage_error(tiny: Path) -> None:
    result = invoke("solve", tiny, "--budget", "lots")
    assert result.exit_code == 2
    assert "'lots'" in result.stderr


def test_budget_and_solver_are_checked_before_the_model_is_loaded(workdir: Path) -> None:
    missing = workdir / "absent_model.py"
    assert invoke("solve", missing, "--budget", "lots").exit_code == 2
    assert invoke("solve", missing, "--budget", "1GB", "--solver", "magic").exit_code == 2


def test_infeasible_budget_names_least_peak(tiny: Path) -> None:
    """Below what the model's state and gradients hold: refused at once, saying so. Above that
    but below every plan: the least peak a plan reaches."""
    result = invoke("solve", tiny, "--budget", "1B")
    assert result.exit_code == 3
    assert "every plan holds before any activation" in result.stderr and "least peak" in result.stderr
    assert result.stdout == ""
    result = invoke("solve", tiny, "--budget", "26KB", "--time-limit", "2")
    assert result.exit_code == 3
    assert "least peak" in result.stderr
    assert result.stdout == ""


def test_unknown_solver_is_a_usage_error(tiny: Path) -> None:
    result = invoke("solve", tiny, "--budget", "1GB", "--solver", "magic")
    assert result.exit_code == 2
    assert "magic" in result.stderr and "sqrt" in result.stderr


def test_unknown_trace_mode_is_a_usage_error(tiny: Path) -> None:
    result = invoke("solve", tiny, "--budget", "1GB", "--trace", "jit")
    assert result.exit_code == 2


# --- show, schema, profile ---------------------------------------------------------------------


def test_show_renders_saved_plan(plan_file: Path) -> None:
    result = invoke("show", plan_file)
    assert result.exit_code == 0, result.output
    assert "Sequential" in result.stderr
    plan = ckptplan.load_plan(plan_file)
    assert sum(n.decision == "recompute" for n in plan.nodes) > 0
    assert "recomputed in backward" in result.stderr and "A100 datasheet" in result.stderr
    rows = recomputed_by_module(plan)
    lines = result.stderr.splitlines()
    assert rows and all(any(r.module in line and r.recomputed in line for line in lines) for r in rows)
    verbose = invoke("show", plan_file, "-v")
    assert verbose.exit_code == 0, verbose.output
    assert "checkpoint regions" in verbose.stderr and "by module" in verbose.stderr


def test_show_json_round_trips(plan_file: Path) -> None:
    result = invoke("show", plan_file, "--json")
    assert result.exit_code == 0, result.output
    assert result.stdout == plan_file.read_text()
    assert ckptplan.Plan.from_json(result.stdout) == ckptplan.load_plan(plan_file)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "not valid JSON"),
        ('{"schema_version": "someone.else/v3", "regions": []}', "Not a ckptplan plan"),
    ],
)
def test_show_rejects_bad_plan_files(workdir: Path, text: str, expected: str) -> None:
    result = invoke("show", write(workdir, "bad_plan.json", text))
    assert result.exit_code == 1
    assert expected in result.stderr


def test_show_missing_plan_file(workdir: Path) -> None:
    result = invoke("show", workdir / "absent.json")
    assert result.exit_code == 1
    assert "absent.json" in result.stderr


def test_schema_is_json_with_id() -> None:
    result = invoke("schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert schema["$id"] == "ckptplan.plan/v1"
    assert "regions" in schema["properties"]


def test_verbose_logs_progress_to_stderr(tiny: Path) -> None:
    logger = logging.getLogger("ckptplan")
    level, handlers = logger.level, list(logger.handlers)
    try:
        result = invoke("-v", "profile", tiny, "--json")
    finally:  # -v configures the process's logging; undo it for the other tests
        logger.setLevel(level)
        logger.handlers[:] = handlers
    assert result.exit_code == 0, result.output
    assert "profiling" in result.stderr
    assert json.loads(result.stdout)["nodes"] == 8


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == ckptplan.__version__


def test_module_entry_point_runs_the_app() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "ckptplan.cli", "schema"], capture_output=True, text=True, check=False, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["$id"] == "ckptplan.plan/v1"


def test_profile_tables(tiny: Path) -> None:
    result = invoke("profile", tiny)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    for expected in ("by module", "by op", "baseline peak", "aten.linear"):
        assert expected in result.stderr


def test_profile_json(tiny: Path) -> None:
    result = invoke("profile", tiny, "--json", "--optimizer", "sgd")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {
        "model",
        "fingerprint",
        "nodes",
        "autocast",
        "target",
        "static",
        "activation_bytes",
        "baseline_peak_bytes",
        "by_module",
        "by_op",
    }
    assert report["nodes"] == 8
    assert report["autocast"] is None and report["target"] == "cpu"
    assert report["static"]["optimizer"] == "sgd"
    assert report["static"]["optimizer_bytes"] > 0
    assert [row["module"] for row in report["by_module"]] == [str(i) for i in range(8)]
    assert sum(row["nodes"] for row in report["by_op"]) == 8
    saved = [(-row["saved_bytes"], row["op"]) for row in report["by_op"]]
    assert saved == sorted(saved)
    assert report["baseline_peak_bytes"] > report["activation_bytes"] > 0


def test_ctrl_c_during_an_ilp_solve_returns_the_best_plan_so_far() -> None:
    """``ilp`` announces at its start that Ctrl-C keeps the best plan; pressed then, before any
    search has returned (here it would run for minutes), it answers at once with a plan that fits."""
    example = Path(__file__).resolve().parents[1] / "examples" / "unet.py"
    command = [sys.executable, "-m", "ckptplan.cli", "-v", "solve", str(example), "--budget", "0.5",
               "--solver", "ilp", "--time-limit", "300", "--json"]
    # SIGINT as in a terminal: started from a background job (CI), this process would pass it on
    # ignored, and the search would run on. A handler (unlike "ignore") is not inherited.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        for line in process.stderr:  # progress is logged to stderr; wait until the ilp solve has begun
            if "Ctrl-C stops early" in line:
                break
        else:
            pytest.fail("the solve ended without announcing its search")
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    plan = json.loads(stdout)
    # Stopped during its search, it returns the cheapest plan made so far, and says why it stopped.
    assert plan["solver"]["name"] == "ilp"
    assert plan["solver"]["note"].count("Ctrl-C") == 1, "the solve ran on after Ctrl-C, or says so twice"
    assert plan["prediction"]["peak_bytes"] <= plan["budget"]["bytes"]


def test_ctrl_c_outside_a_search_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tiny: Path, tmp_path: Path
) -> None:
    # Stands in for the user pressing Ctrl-C while the model is being profiled.
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptplan, "profile", interrupted)
    out = tmp_path / "plan.json"
    result = invoke("solve", tiny, "--budget", "0.5", "--out", out)
    assert result.exit_code == 130
    assert "Interrupted" in result.output and "Traceback" not in result.output
    assert not out.exists()


# --- sharding and TRAINING defaults --------------------------------------------------------------

GPT3_SMALL = """
import importlib.util, pathlib
spec = importlib.util.spec_from_file_location("gpt3", pathlib.Path({example!r}))
gpt3 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpt3)
TRAINING = gpt3.TRAINING

def build():
    return gpt3.build(layers=4)
"""


def test_gpt3_example_plans_one_rank_with_its_training_defaults(workdir: Path) -> None:
    model = write(workdir, "gpt3_small.py", GPT3_SMALL.format(example=str(EXAMPLES / "gpt3_175b.py")))
    result = invoke("solve", model, "--budget", "0.95", "--shard-degree", "8", "--solver", "sqrt", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["model"]["sharding"] == {
        "degree": 8, "stage": 3, "master_dtype": "float32", "units": [f"transformer.h.{i}" for i in range(4)],
    }
    assert plan["prediction"]["peak_bytes"] <= plan["budget"]["bytes"]
    unsharded = json.loads(invoke("solve", model, "--budget", "1.0", "--solver", "sqrt", "--json").stdout)
    assert unsharded["model"]["sharding"] is None
    assert unsharded["model"]["fingerprint"] == plan["model"]["fingerprint"]
    assert plan["prediction"]["baseline_peak_bytes"] < unsharded["prediction"]["baseline_peak_bytes"]


def test_costs_here_times_the_model_and_refuses_a_meta_one(workdir: Path, tiny: Path) -> None:
    result = invoke("solve", tiny, "--budget", "0.9", "--solver", "dp", "--costs", "here", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prediction"]["peak_bytes"] > 0
    model = write(workdir, "gpt3_small.py", GPT3_SMALL.format(example=str(EXAMPLES / "gpt3_175b.py")))
    result = invoke("solve", model, "--budget", "0.95", "--costs", "here")
    assert result.exit_code == 1 and "meta device" in result.output


def test_costs_flops_prices_a_plan_by_the_flops_it_recomputes(tiny: Path) -> None:
    """``--costs flops``: the overhead is recompute FLOPs over the step's FlopCounterMode count
    (bytes moved break ties at a thousandth of a FLOP each, hence the tolerance)."""
    result = invoke("solve", tiny, "--budget", "0.8", "--solver", "dp", "--costs", "flops", "--json")
    assert result.exit_code == 0, result.output
    prediction = json.loads(result.stdout)["prediction"]
    counter = FlopCounterMode(display=False)
    with load_model(str(tiny)) as loaded, counter:
        loaded.model(*loaded.args).sum().backward()
    assert prediction["recompute_flops"] > 0 and prediction["priced_in"] == "flops"
    assert prediction["overhead"] == pytest.approx(prediction["recompute_flops"] / counter.get_total_flops(), rel=0.01)
    shown = invoke("solve", tiny, "--budget", "0.8", "--solver", "dp", "--costs", "flops")
    assert shown.exit_code == 0 and "of the step's FLOPs" in shown.output


def test_zero_stage_needs_values_it_knows(tiny: Path) -> None:
    result = invoke("solve", tiny, "--budget", "0.9", "--shard-degree", "2", "--zero-stage", "4")
    assert result.exit_code == 2


def test_training_defaults_with_unknown_keys_are_one_clear_error(workdir: Path) -> None:
    model = write(workdir, "bad_training.py", TINY + "\nTRAINING = {'optimiser': 'adamw'}\n")
    result = invoke("solve", model, "--budget", "0.9")
    assert result.exit_code == 1
    assert "TRAINING" in result.output and "'optimiser'" in result.output


# Dropout between the linears, so the target's kernels change what backward keeps.
TINY_DROPOUT = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.1))])
    return model, torch.randn(256, 16)
"""


def test_training_autocast_and_target_are_the_files_defaults(workdir: Path) -> None:
    plain = write(workdir, "plain_dropout.py", TINY_DROPOUT)
    mixed = write(workdir, "mixed.py", TINY_DROPOUT + "\nTRAINING = {'autocast': 'bf16', 'target': 'cuda'}\n")
    default = json.loads(invoke("profile", plain, "--json").stdout)
    report = json.loads(invoke("profile", mixed, "--json").stdout)
    assert (report["autocast"], report["target"]) == ("bfloat16", "cuda")
    assert report["fingerprint"] != default["fingerprint"]
    given = json.loads(invoke("profile", plain, "--json", "--autocast", "bf16", "--target", "cuda").stdout)
    assert given == report  # the options and the file's TRAINING describe the same step
    solved = invoke("solve", mixed, "--budget", "0.9", "--solver", "sqrt", "--json")
    assert solved.exit_code == 0, solved.output
    plan = json.loads(solved.stdout)
    assert (plan["model"]["autocast"], plan["model"]["target"]) == ("bfloat16", "cuda")
    assert plan["model"]["fingerprint"] == report["fingerprint"]
    # the command line wins over TRAINING
    overridden = json.loads(invoke("profile", mixed, "--json", "--autocast", "fp16", "--target", "cpu").stdout)
    assert (overridden["autocast"], overridden["target"]) == ("float16", "cpu")


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        ("{'autocast': 'int8'}", "TRAINING in {path!r} has autocast 'int8'; use 'bf16' or 'fp16'."),
        ("{'target': 'tpu'}", "TRAINING in {path!r} has target 'tpu'; use 'cpu' or 'cuda'."),
        ("{'outputs': 'lost'}", "TRAINING in {path!r} has outputs 'lost'; use 'kept' or 'dropped'."),
    ],
)
def test_training_with_a_bad_autocast_or_target_is_one_sentence_and_exit_1(
    workdir: Path, training: str, expected: str
) -> None:
    model = write(workdir, "bad_step.py", TINY + f"\nTRAINING = {training}\n")
    result = invoke("profile", model)
    assert result.exit_code == 1  # an error in the model file, as README's exit codes have it
    message = " ".join(result.stderr.replace("│", " ").split())
    assert expected.format(path=str(model)) in message


def test_bad_target_option_is_a_usage_error(tiny: Path) -> None:
    result = invoke("profile", tiny, "--target", "tpu")
    assert result.exit_code == 2


# Layer norms and GELUs whose outputs the next Linear saves: rematerialisation candidates.
NORMED = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))]
    return nn.Sequential(*layers), torch.randn(512, 32)
"""


def test_remat_flag_turns_rematerialisation_on_and_off(workdir: Path) -> None:
    """``--remat`` lets dp's plan give way to rematerialisation alone (cheaper here at 95%);
    dp without the flag, and auto with ``--no-remat``, rematerialise nothing. ``show`` lists
    the rematerialised ops."""
    normed = write(workdir, "normed.py", NORMED)
    result = invoke("solve", normed, "--budget", "0.95", "--json", "--solver", "dp", "--remat")
    assert result.exit_code == 0, result.output
    plan = ckptplan.Plan.from_json(result.stdout)
    assert plan.remat and plan.prediction.peak_bytes <= plan.budget.bytes
    assert {n.decision for n in plan.nodes if n.name in plan.remat} == {"remat"}
    shown = invoke("show", write(workdir, "normed_plan.json", result.stdout))
    assert shown.exit_code == 0, shown.output
    assert "1 op recomputed without a region" in shown.stderr and "│ remat │" in shown.stderr.replace("┃", "│")
    for options in (["--solver", "dp"], ["--no-remat", "--time-limit", "3"]):
        plain = invoke("solve", normed, "--budget", "0.95", "--json", *options)
        assert plain.exit_code == 0, plain.output
        assert not ckptplan.Plan.from_json(plain.stdout).remat


def test_the_status_line_reads_in_step_time_and_leaves_out_what_is_not_known() -> None:
    from ckptplan.cli.render import progress_line
    from ckptplan.solvers.context import Progress

    title = "solving GPT (160 ops) with auto"
    assert progress_line(title, Progress(phase="sqrt"), 2.0, 0.4) == f"{title} · sqrt · 0 s"
    line = progress_line(title, Progress("ilp: search", best_cost_seconds=0.05, best_peak_bytes=3 * 2**20,
                                         bound_cost_seconds=0.04), 2.0, 7.2)
    assert line == f"{title} · ilp: search · best +2.5% step time at 3.0 MiB · bound +2.0% · 7 s"
    # A bound above the best plan (over ilp's one-level plans, when a nested plan is cheaper) is not shown.
    assert "bound" not in progress_line(title, Progress("ilp", best_cost_seconds=0.01, bound_cost_seconds=0.02),
                                        2.0, 1.0)


def test_the_step_keeps_the_outputs_unless_the_file_or_the_command_line_says_otherwise(workdir: Path) -> None:
    """The plain loop keeps the outputs through backward (the default); TRAINING's "outputs" says
    how the file's model is trained, and ``--outputs-live/--outputs-dropped`` wins over both."""
    plain = write(workdir, "plain.py", TINY)
    trainer = write(workdir, "trainer.py", TINY + "\nTRAINING = {'outputs': 'dropped'}\n")

    def kept(*args: object) -> bool:
        result = invoke("solve", *args, "--budget", "1.0", "--solver", "sqrt", "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["model"].get("outputs_live", False)

    assert kept(plain) and not kept(trainer)
    assert not kept(plain, "--outputs-dropped") and kept(trainer, "--outputs-live")
