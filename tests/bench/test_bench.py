"""`torchparity bench`: the result's schema and invariants, the measuring helpers, bad input.

No test asserts a speed: speed goals are checked by the benchmark itself (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from torchparity import cli
from torchparity.bench.models import model_config, timing_model
from torchparity.bench.rounds import paired_ratio, rotated
from torchparity.bench.runner import SCHEMA
from torchparity.bench.settings import PARTS, QUICK_SIZES, default_settings
from torchparity.bench.stages import stage_seconds
from torchparity.bench.timing import peak_bytes
from torchparity.bench.twins_time import QUICK_EXAMPLES
from torchparity.errors import UsageError

POSITIVE = {"tok_per_s", "step_s", "first_step_s", "ratio_vs_manual", "peak_bytes",
            "peak_vs_manual", "tokens_per_step", "wall_s", "cpu_s", "plain_s", "diagnose_s",
            "stream_s",
            "plain_peak_bytes", "diagnose_peak_bytes", "stream_peak_bytes",
            "diagnose_time_ratio", "stream_time_ratio", "diagnose_peak_ratio",
            "stream_peak_ratio"}


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    markdown = tmp_path / "bench.md"
    code = cli.main(["bench", "--quick", "--threads", "1", "--json", str(out),
                     "--markdown", str(markdown), *args])
    assert code == 0
    result = json.loads(out.read_text())
    result["_markdown"] = markdown.read_text()
    return result


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # One decoder, the baseline, an SDPA kernel, flex (forward only on the CPU) and a
    # CUDA-only backend: every kind of row, in a few seconds.
    return run_bench(tmp_path_factory.mktemp("bench"), "--skip", "diagnose",
                     "--case", "llama-tiny", "--backend", "manual", "--backend", "sdpa-math",
                     "--backend", "flex", "--backend", "sdpa-efficient")


def numbers(tree: Any, path: str = "") -> list[tuple[str, float]]:
    """Every number in a JSON tree with its dotted path (booleans are not numbers)."""
    if isinstance(tree, dict):
        return [item for key, value in tree.items() for item in numbers(value, f"{path}.{key}")]
    if isinstance(tree, list):
        return [item for i, value in enumerate(tree) for item in numbers(value, f"{path}.{i}")]
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return [(path, tree)]
    return []


def check_rows(rows: list[dict[str, Any]]) -> None:
    assert rows, "every part reports at least one row"
    for row in rows:
        assert row["status"] in ("ok", "n/a"), row
        if row["status"] == "n/a":
            assert isinstance(row.get("reason"), str) and row["reason"].strip(), row
        for path, value in numbers(row):
            assert math.isfinite(value), (path, row)
            key = path.split(".")[1]
            if key in POSITIVE or key == "times_s":
                assert value > 0, (path, row)


def test_quick_result_schema(quick: dict[str, Any]) -> None:
    assert quick["schema"] == SCHEMA
    assert {"cpu", "logical_cores", "torch", "load_average_start"} <= set(quick["machine"])
    for part in PARTS:
        check_rows(quick[part])
    for target in quick["targets"]:
        assert target["met"] in (True, False, None)
        if target["met"] is None:
            assert target["note"], target


@pytest.mark.parametrize("model", ["decoder", "attention"])
def test_quick_throughput_rows(quick: dict[str, Any], model: str) -> None:
    rows = {row["backend"]: row for row in quick["throughput"] if row["model"] == model}
    assert list(rows) == ["manual", "sdpa-math", "flex", "sdpa-efficient"]
    size = QUICK_SIZES[0]
    for name in ("manual", "sdpa-math"):
        row = rows[name]
        assert row["status"] == "ok" and row["mode"] == "forward+backward"
        assert len(row["times_s"]) == quick["settings"]["rounds"]
        assert row["step_s"] == sorted(row["times_s"])[len(row["times_s"]) // 2]
        assert row["tokens_per_step"] == size.batch_size * size.seq_len
        assert row["tok_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
    assert rows["manual"]["ratio_vs_manual"] == 1.0  # the baseline against itself, per round
    assert "ratio_vs_manual" in rows["sdpa-math"]
    # Flex has no backward on the CPU: measured forward only, said so, and not ratioed.
    assert rows["flex"]["status"] == "ok" and rows["flex"]["mode"] == "forward"
    assert "forward only" in rows["flex"]["note"] and "ratio_vs_manual" not in rows["flex"]
    assert rows["sdpa-efficient"]["status"] == "n/a"
    assert "CUDA" in rows["sdpa-efficient"]["reason"]


def test_quick_skipped_parts_say_why(quick: dict[str, Any]) -> None:
    assert "--skip diagnose" in quick["diagnose"][0]["reason"]
    assert "--quick" in quick["check"][0]["reason"]
    skipped = [t for t in quick["targets"] if t["target"] in ("diagnose_time", "check_wall")]
    assert skipped and all(t["met"] is None for t in skipped)


def test_markdown_has_a_line_per_row(quick: dict[str, Any]) -> None:
    lines = quick["_markdown"].splitlines()
    assert lines[0].startswith("Machine: ")
    table_rows = [line for line in lines if line.startswith(("| decoder |", "| attention |"))]
    assert len(table_rows) == len(quick["throughput"])
    assert any(quick["throughput"][-1]["reason"] in line for line in table_rows)


def test_quick_twins_search_passes_and_reports_its_figures(quick: dict[str, Any]) -> None:
    # The fused-QKV refactor is correct, so the search passes every example it draws; the
    # figures are a search's own, in its Markdown table, and only a 100-example run is judged.
    [row] = quick["twins"]
    assert row["status"] == "ok" and row["examples"] == QUICK_EXAMPLES
    assert row["result"].startswith(f"twins: pass ({QUICK_EXAMPLES} examples")
    assert row["command"].endswith(f"--examples {QUICK_EXAMPLES}")
    assert row["wall_s"] > 0 and row["cpu_s"] > 0
    assert len(row["load_before"]) == len(row["load_after"]) == 3
    assert row["command"] in quick["_markdown"] and row["result"] in quick["_markdown"]
    [target] = [t for t in quick["targets"] if t["target"] == "twins_wall"]
    assert target["met"] is None and "100 examples" in target["note"]


@pytest.mark.slow
def test_quick_diagnose_rows(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--skip", "throughput", "--case", "llama-tiny",
                       "--rounds", "1", "--warmup", "0")
    check_rows(result["diagnose"])
    row = result["diagnose"][0]
    assert row["status"] == "ok", row
    for name in ("diagnose", "stream"):
        assert row[f"{name}_time_ratio"] > 0 and row[f"{name}_peak_ratio"] > 0


def test_peak_bytes_counts_what_lives_together() -> None:
    n = 1 << 18
    size = n * torch.tensor([], dtype=torch.float32).element_size()

    def together() -> None:
        a, b = torch.empty(n), torch.empty(n)
        del a, b

    def one_after_the_other() -> None:
        a = torch.empty(n)
        del a
        b = torch.empty(n)
        del b

    cpu = torch.device("cpu")
    assert peak_bytes(together, cpu) == 2 * size
    assert peak_bytes(one_after_the_other, cpu) == size


def test_rotated_rounds_put_each_contender_first_once() -> None:
    names = ["manual", "sdpa", "flex"]
    orders = [rotated(names, r) for r in range(len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert sorted(order[0] for order in orders) == sorted(names)


def test_paired_ratio_cancels_drift() -> None:
    # The machine slows down 8x over the run; B is always exactly twice as fast as A.
    a = [0.5 * 2.0**r for r in range(4)]
    b = [t / 2 for t in a]
    assert paired_ratio(a, b) == 2.0


class PhasedReport:
    """A report with the phases a diagnosis times; rendering it costs nothing."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.meta = types.SimpleNamespace(seconds=seconds)

    def render(self, width: int) -> str:
        return ""

    def to_json(self) -> str:
        return ""

    def to_html(self) -> str:
        return ""


def test_every_phase_of_a_diagnosis_is_in_one_stage() -> None:
    phases = {"A: forward and backward": 1.0, "golden (float64): forward and backward": 2.0,
              "B: forward and backward": 4.0, "judging while B runs": 3.0,
              "A, golden and B: module replays": 0.5, "where the first divergence enters": 0.25,
              "B in float64: forward": 8.0}
    stages = stage_seconds(PhasedReport(phases), call_s=64.0, before=16.0)
    # Judging happens inside B's run: counted once, as judging.
    assert stages["runs"] == 16.0 + 1.0 + 2.0 + 4.0 - 3.0 and stages["judging"] == 3.0
    assert stages["replays"] == 0.75 and stages["float64 check"] == 8.0
    assert stages["other"] == 64.0 - 16.0 - (sum(phases.values()) - 3.0)
    assert sum(stages.values()) - stages["report"] == 64.0


@pytest.mark.parametrize("args, named", [
    (["--case", "no-such-case"], "--case"),
    (["--rounds", "0"], "--rounds"),
    (["--threads", "0"], "--threads"),
    (["--backend", "no-such-backend"], "--backend"),
    (["--size", "xl"], "--size"),
    (["--json", "/no/such/dir/out.json"], "/no/such/dir"),
])
def test_bad_input_is_one_line(args: list[str], named: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--quick", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


def test_dtypes_by_any_name_are_recorded_by_torchs() -> None:
    settings = default_settings("cpu", quick=True, dtypes=("fp32", "torch.bfloat16", "half"))
    assert settings.dtypes == tuple(str(d).removeprefix("torch.") for d in (
        torch.float32, torch.bfloat16, torch.float16))
    with pytest.raises(UsageError, match="--dtype float64: choose from fp32, bf16, fp16"):
        default_settings("cpu", quick=True, dtypes=("float64",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_timing_models_of_two_backends_hold_the_same_weights() -> None:
    # diagnose is timed on two such models and must find nothing: every parameter, linear
    # biases included, comes from the seeded generator rather than the global RNG.
    config = model_config("encdec-prenorm", QUICK_SIZES[0])
    first = timing_model(config, torch.device("cpu"), torch.float32)
    torch.manual_seed(123)  # what the constructors draw from
    second = timing_model(config.replace(attention_backend="sdpa"), torch.device("cpu"),
                          torch.float32)
    a, b = first.state_dict(), second.state_dict()
    assert any(name.endswith("q_proj.bias") for name in a)
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


SMALL_FACTORY = '''
import torch


def mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    return model, (torch.randn(4, 64, generator=torch.Generator().manual_seed(1)),)
'''


@pytest.mark.slow  # three fresh interpreters
def test_bench_model_times_golden_update_and_check_beside_a_plain_step(tmp_path):
    """Each in its own process: seconds, peak memory, golden bytes and the check's verdict."""
    (tmp_path / "small.py").write_text(SMALL_FACTORY)
    report = tmp_path / "bench.json"
    entry = f"{tmp_path / 'small.py'}:mlp"
    assert cli.main(["bench", "--model", entry, "--skip", "throughput", "--skip", "check",
                     "--backend", "manual", "--json", str(report)]) == 0
    (cost,) = json.loads(report.read_text())["size"]
    assert cost["parameters"] == 64 * 256 + 256 + 256 * 64 + 64
    assert cost["plain"]["step_s"] > 0 and cost["plain"]["peak_bytes"] > 2**20
    golden, check = cost["golden"], cost["check"]
    assert golden["exit"] == 0 and golden["bytes"] > 8 * cost["parameters"]  # exact float64
    assert check["exit"] == 0 and check["failed"] == [] and check["cells"] == 2
    assert check["steps"] > 0 and check["peak_bytes"] >= cost["plain"]["peak_bytes"] / 2
