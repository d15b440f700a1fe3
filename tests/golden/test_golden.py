"""Tests of the golden store: round trips, reviewable JSON, checksums, atomic writes, the
zoo goldens, and every kind of damaged golden giving its own one-line error."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from torchparity import tolerance
from torchparity.cli import main
from torchparity.comparison import assert_parity
from torchparity.golden.cases import OUTPUT_KINDS, load_case
from torchparity.golden.store import (
    _STAT_DIGITS,
    EXACT_SCHEMA_VERSION,
    SCHEMA_VERSION,
    GoldenCorrupt,
    GoldenMissing,
    GoldenSchemaError,
    GoldenStore,
    checksum,
    default_golden_dir,
    machine_recorded,
    tensor_sha256,
)
from torchparity.reference import zoo

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "golden"
CASE = "llama-tiny"


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "weights": torch.randn(3, 5, generator=gen, dtype=torch.float64),
        "half": torch.randn(4, generator=gen).to(torch.bfloat16),
        "tokens": torch.arange(6).reshape(2, 3),
        "scalar": torch.tensor(2.5),
    }


# --- the store --------------------------------------------------------------------------------


def test_round_trip_keeps_every_value_and_dtype(tmp_path):
    store = GoldenStore(tmp_path)
    tensors = sample_tensors()
    store.write("group", "out", tensors, {"kind": "forward"})
    golden = store.read("group", "out")
    assert golden.tensors.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert golden.tensors[name].dtype == tensor.dtype
        assert torch.equal(golden.tensors[name], tensor)
    assert golden.summary["kind"] == "forward"
    assert golden.summary["schema_version"] == EXACT_SCHEMA_VERSION


def test_a_golden_reads_back_in_the_order_it_was_written(tmp_path):
    # The order decides which of two tensors with the same share of the budget a report
    # names; the file format itself keeps none, so each read must restore the written one.
    store = GoldenStore(tmp_path)
    written = {f"step.{i}": torch.full((2,), float(i)) for i in (3, 11, 0, 7, 5, 1, 9, 2)}
    store.write("group", "out", written, {"kind": "forward"})
    for _ in range(5):
        assert list(store.read("group", "out").tensors) == list(written)


def test_json_summary_states_numpy_statistics_one_line_per_tensor(tmp_path):
    store = GoldenStore(tmp_path)
    tensors = sample_tensors()
    _, json_path = store.write("group", "out", tensors)
    text = json_path.read_text()
    summary = json.loads(text)
    for name, tensor in tensors.items():
        values = tensor.to(torch.float64).numpy()
        listed = summary["tensors"][name]
        assert listed["shape"] == list(values.shape)
        # Shown to _STAT_DIGITS significant digits (half a unit of the last one, relative),
        # of statistics that torch and numpy sum in float64 in their own orders.
        summed = values.size * tolerance.unit_roundoff("fp64")
        shown = 0.5 * 10.0 ** (1 - _STAT_DIGITS) + summed
        assert math.isclose(listed["mean"], values.mean(), rel_tol=shown,
                            abs_tol=summed * np.abs(values).max())
        assert math.isclose(listed["std"], values.std(), rel_tol=shown,
                            abs_tol=summed * np.abs(values).max())
        assert math.isclose(listed["absmax"], np.abs(values).max(), rel_tol=shown)
        # A reviewer's diff shows one changed line per changed tensor.
        lines = [line for line in text.splitlines() if listed["sha256"] in line]
        assert len(lines) == 1 and f'"{name}"' in lines[0]


def test_hashes_are_sha256_of_little_endian_values():
    values = np.linspace(-1.0, 1.0, 7)
    expected = hashlib.sha256(values.astype("<f8").tobytes()).hexdigest()
    assert tensor_sha256(torch.from_numpy(values)) == expected
    header = b"x|float64|[7]|"
    assert checksum({"x": torch.from_numpy(values)}) == (
        "sha256:" + hashlib.sha256(header + values.astype("<f8").tobytes()).hexdigest())


def test_writes_leave_no_temporary_files(tmp_path):
    store = GoldenStore(tmp_path)
    store.write("group", "out", sample_tensors())
    store.write("group", "out", sample_tensors())
    assert sorted(p.name for p in (tmp_path / "group").iterdir()) == ["out.json",
                                                                      "out.safetensors"]


def test_missing_golden_names_the_command_that_creates_it(tmp_path):
    store = GoldenStore(tmp_path, update_command="make golden CASE={case}")
    with pytest.raises(GoldenMissing, match="make golden CASE=group"):
        store.read("group", "out")


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "x.obtained"])
def test_unsafe_names_are_refused(tmp_path, name):
    with pytest.raises(Exception, match="invalid"):
        GoldenStore(tmp_path).write(name, "out", sample_tensors())


def test_default_dir_is_the_source_trees_golden_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHPARITY_GOLDEN_DIR", raising=False)
    monkeypatch.chdir(REPO / "src")
    assert default_golden_dir() == SHIPPED
    monkeypatch.setenv("TORCHPARITY_GOLDEN_DIR", str(tmp_path))
    assert default_golden_dir() == tmp_path
    assert default_golden_dir(tmp_path / "x") == tmp_path / "x"


# --- the shipped goldens ----------------------------------------------------------------------


def test_shipped_goldens_are_complete_valid_and_small():
    store = GoldenStore(SHIPPED)
    for name in zoo.names():
        goldens = load_case(store, zoo.get(name))
        assert set(goldens) == set(OUTPUT_KINDS)
        assert all(machine_recorded(golden.summary) for golden in goldens.values())
    zoo_files = [p for name in zoo.names() for output in OUTPUT_KINDS
                 for p in store.paths(name, output)]
    assert sum(p.stat().st_size for p in zoo_files) <= 5 * 2**20


def test_update_writes_goldens_that_verify_and_leaves_unchanged_files_alone(tmp_path, capsys):
    assert main(["golden", "update", "mqa", "--golden-dir", str(tmp_path)]) == 0
    files = sorted((tmp_path / "mqa").iterdir())
    assert [p.name for p in files] == sorted(f"{o}.{ext}" for o in OUTPUT_KINDS
                                             for ext in ("json", "safetensors"))
    # The values of the shipped goldens, up to float64 rounding (another torch may reorder).
    fresh, shipped = GoldenStore(tmp_path), GoldenStore(SHIPPED)
    for output, kind in OUTPUT_KINDS.items():
        assert_parity(fresh.read("mqa", output).tensors, shipped.read("mqa", output).tensors,
                      kind=kind)
    stamps = {p: p.stat().st_mtime_ns for p in files}
    assert main(["golden", "update", "mqa", "--golden-dir", str(tmp_path)]) == 0
    assert "logits unchanged" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in files} == stamps
    assert main(["golden", "verify", "mqa", "--golden-dir", str(tmp_path)]) == 0


def test_update_records_the_machine_of_goldens_made_before_they_did(tmp_path, capsys):
    assert main(["golden", "update", "mqa", "--golden-dir", str(tmp_path)]) == 0
    summary_path = tmp_path / "mqa" / "loss.json"
    summary = json.loads(summary_path.read_text())
    here = summary["produced_by"].pop("cpu_capability")  # as goldens were once written
    summary_path.write_text(json.dumps(summary))
    assert main(["golden", "update", "mqa", "--golden-dir", str(tmp_path)]) == 0
    assert "logits unchanged, hidden unchanged, loss machine recorded" in capsys.readouterr().out
    rewritten = json.loads(summary_path.read_text())
    assert rewritten["produced_by"]["cpu_capability"] == here
    assert rewritten["tensors"] == summary["tensors"]  # the values' digests: the same values


def test_show_prints_a_readable_summary(capsys):
    assert main(["golden", "show", CASE, "--golden-dir", str(SHIPPED)]) == 0
    out = capsys.readouterr().out
    assert zoo.get(CASE).description.split(":")[0] in out
    assert "decoder.layers.1.mlp.down_proj.weight" in out
    assert "weights checksum: sha256:" in out


# --- damaged goldens: each its own one-line error, exit 2, nothing overwritten ----------------


@pytest.fixture
def golden_copy(tmp_path):
    """A copy of the shipped goldens of one case, in a fresh golden folder."""
    shutil.copytree(SHIPPED / CASE, tmp_path / CASE)
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def edit_json(folder: Path, output: str, change) -> None:
    path = folder / CASE / f"{output}.json"
    summary = json.loads(path.read_text())
    change(summary)
    path.write_text(json.dumps(summary, indent=1))


def truncate(folder: Path) -> None:
    path = folder / CASE / "logits.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def scramble(folder: Path) -> None:
    path = folder / CASE / "grads.safetensors"
    path.write_bytes(b"\xff" * 16 + path.read_bytes()[16:])


def zero_bytes(folder: Path) -> None:
    """Bytes of the data zeroed, as a bad disk or copy leaves them: the file still parses."""
    path = folder / CASE / "logits.safetensors"
    data = bytearray(path.read_bytes())
    data[-64:-32] = bytes(32)
    path.write_bytes(bytes(data))


def edit_statistic(folder: Path) -> None:
    edit_json(folder, "hidden", lambda s: s["tensors"]["decoder.layers.0"].update(absmax=9.5))


def newer_schema(folder: Path) -> None:
    edit_json(folder, "loss", lambda s: s.update(schema_version=SCHEMA_VERSION + 1))


def other_config(folder: Path) -> None:
    edit_json(folder, "decode", lambda s: s["config"].update(norm_eps=1e-5))


def broken_json(folder: Path) -> None:
    path = folder / CASE / "logits.json"
    path.write_text(path.read_text()[:-20])


@pytest.mark.parametrize("damage, message", [
    (truncate, "logits.safetensors is truncated or corrupt"),
    (scramble, "grads.safetensors is truncated or corrupt"),
    (zero_bytes, "logits.safetensors is damaged: its bytes no longer match the checksum "
                 "logits.json records"),
    (edit_statistic, "hidden.json no longer matches its tensors (decoder.layers.0: absmax"),
    (newer_schema, f"schema version {SCHEMA_VERSION + 1}, newer than"),
    (other_config, "different config (norm_eps: 1e-05 in the golden, 1e-06 now)"),
    (broken_json, "logits.json is not valid JSON"),
])
@pytest.mark.parametrize("command", ["check", "verify"])
def test_damaged_golden_gives_one_line_and_exit_2(golden_copy, capsys, damage, message,
                                                  command):
    damage(golden_copy)
    before = snapshot(golden_copy)
    argv = (["check", "--case", CASE, "--backend", "manual", "--jobs", "1"] if command == "check"
            else ["golden", "verify", CASE])
    assert main([*argv, "--golden-dir", str(golden_copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert snapshot(golden_copy) == before


def test_missing_golden_dir_says_how_to_create_it(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["check", "--golden-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"golden directory {missing} does not exist" in err
    assert "torchparity golden update" in err
    assert not missing.exists()


def test_missing_case_golden_names_the_update_command(golden_copy, capsys):
    assert main(["check", "--case", "mqa", "--golden-dir", str(golden_copy)]) == 2
    assert "create it with `torchparity golden update mqa`" in capsys.readouterr().err


def test_store_errors_are_typed(golden_copy):
    store = GoldenStore(golden_copy)
    truncate(golden_copy)
    with pytest.raises(GoldenCorrupt):
        store.read(CASE, "logits")
    newer_schema(golden_copy)
    with pytest.raises(GoldenSchemaError):
        store.read(CASE, "loss")
    (golden_copy / CASE / "grads.json").unlink()
    with pytest.raises(GoldenCorrupt, match="has no grads.json beside it"):
        store.read(CASE, "grads")
