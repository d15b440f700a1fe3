"""``check --model`` of a refactor that renamed, fused or split weights, against the goldens
of the version before: the goldens' weights are found in the model by name, order and shape,
or by a name map, checked by meaning and their gradients judged through the map part by part,
in both directions; a name that pairs with nothing is one line saying how to hand a map, and
each cause of other weights gets its own hint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import torchparity as tp
from renamed_models import source
from torchparity.cli import main
from torchparity.golden.renamed import renaming
from torchparity.sketching import SKETCH_ABOVE_ENV

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

CELLS = ("--backend", "manual", "--backend", "sdpa", "--dtype", "fp32")
FUSED = "attn.qkv <- attn.q+attn.k+attn.v [fused]"


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """The base's goldens."""
    root = tmp_path_factory.mktemp("renamed")
    assert main(["golden", "update", "--model", f"{_write(root, 'base')}:make",
                 "--golden-dir", str(root / "golden")]) == 0
    return root / "golden"


def _write(root: Path, version: str) -> Path:
    path = root / version / "models.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source(version))
    return path


def check(golden: Path, version: str, *args: str) -> tuple[int, list[dict]]:
    report = golden.parent / f"{version}.json"
    status = main(["check", "--model", f"{_write(golden.parent, version)}:make",
                   "--golden-dir", str(golden), "--json", str(report), *CELLS, *args])
    return status, json.loads(report.read_text())["results"]


def _out(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())  # the lines wrapped at 80, joined


def test_the_goldens_record_the_layout_of_the_state_dict(golden):
    layout = json.loads((golden / "models.make" / "grads.json").read_text())["layout"]
    assert layout["attn.q.weight"] == [16, 16] and layout["mlp.up.bias"] == [64]
    assert layout["head.weight"] == "embed.weight"  # tied: the name it ties to


@pytest.mark.parametrize("version", ["tied", "fused", "gelu"])
def test_refactors_equal_in_meaning_pass_against_the_base(golden, capsys, version):
    status, rows = check(golden, version)
    assert status == 0, [r["explain"] or r["reason"] for r in rows if not r["ok"]]
    assert {r["output"] for r in rows} == {"outputs", "loss", "grads"}
    assert {r["verdict"] for r in rows} <= {"identical", "within"}
    renamed = {r["renamed"] for r in rows if r["output"] == "grads"}
    assert renamed == ({FUSED} if version == "fused" else {None})
    out = _out(capsys)
    assert (f"models.make: {FUSED}" in out) == (version == "fused")


def test_a_fused_gradient_is_judged_part_by_part(golden):
    # The forward is the fused model's; the k part's gradient is doubled.
    status, rows = check(golden, "fused-k-grad-doubled")
    assert status == 1
    failed = {(r["backend"], r["dtype"], r["output"]) for r in rows if not r["ok"]}
    assert failed == {("manual", "fp64", "grads")}  # the baseline carries it in fp32
    grads = next(r for r in rows if (r["backend"], r["dtype"], r["output"])
                 == ("manual", "fp64", "grads"))
    assert grads["worst"] == 'outputs["attn.k.weight"]'  # the doubled part, by its name


def test_a_value_change_in_one_fused_part_fails_with_the_values_hint(golden, capsys):
    status, rows = check(golden, "fused-k-changed")
    assert status == 1 and {r["verdict"] for r in rows} == {"init changed"}
    out = _out(capsys)
    assert f"compared by meaning: {FUSED}" in out
    assert "their values changed, not the machine" in out
    assert "tp.init_weights" not in out and "--name-map" not in out
    assert out.count("FAIL models.") == 1
    # The fused model's 13 tensors; k is rows 16-31 of its qkv (DIM 16).
    assert ("differ from the goldens' in 1 of 13 tensors: attn.qkv.weight rows 16-31 (the "
            "goldens' attn.k.weight), on a machine") in out


def test_a_value_change_without_a_rename_names_the_tensor(golden, capsys):
    status, rows = check(golden, "k-changed")
    assert status == 1 and {r["verdict"] for r in rows} == {"init changed"}
    out = _out(capsys)
    assert "differ from the goldens' in 1 of 17 tensors: attn.k.weight, on a machine" in out
    assert "compared by meaning" not in out


def test_goldens_with_one_checksum_of_the_weights_still_say_they_changed(golden, capsys,
                                                                       tmp_path):
    older = tmp_path / "golden" / "models.make"
    older.mkdir(parents=True)
    for path in (golden / "models.make").iterdir():
        text = path.read_bytes()
        if path.suffix == ".json":  # as goldens made before they kept each tensor's
            summary = json.loads(text)
            del summary["checksums"]["weight_blocks"]
            text = json.dumps(summary).encode()
        (older / path.name).write_bytes(text)
    status, rows = check(older.parent, "k-changed")
    assert status == 1 and {r["verdict"] for r in rows} == {"init changed"}
    out = _out(capsys)
    assert "differ from those its golden was made from (sha256:" in out
    assert ("; these goldens keep one checksum of all the weights: made anew, they name the "
            "tensors that differ), on a machine") in out
    assert "attn.k.weight" not in out


@pytest.fixture(scope="module")
def fused_golden(tmp_path_factory) -> Path:
    """The goldens of ``fused`` (one qkv projection) and of ``gated-fused`` (one gate_up)."""
    root = tmp_path_factory.mktemp("fused")
    for version in ("fused", "gated-fused"):
        assert main(["golden", "update", "--model", f"{_write(root, version)}:make",
                     "--golden-dir", str(root / version / "golden")]) == 0
    return root


@pytest.mark.parametrize(("fused", "split", "summary"), [
    ("fused", "base", "attn.q+attn.k+attn.v <- attn.qkv [split]"),
    ("gated-fused", "gated", "mlp.gate+mlp.up <- mlp.gate_up [split]"),
])
def test_a_fused_projection_undone_passes_against_the_fused_goldens(fused_golden, capsys,
                                                                     fused, split, summary):
    status, rows = check(fused_golden / fused / "golden", split)
    assert status == 0, [r["explain"] or r["reason"] for r in rows if not r["ok"]]
    assert {r["verdict"] for r in rows} <= {"identical", "within"}
    assert {r["renamed"] for r in rows if r["output"] == "grads"} == {summary}
    assert f"models.make: {summary}" in _out(capsys)


@pytest.mark.parametrize(("fused", "changed", "part"), [
    ("fused", "k-grad-scaled", "attn.k.weight"),
    ("gated-fused", "gated-up-grad-scaled", "mlp.up.weight"),
])
def test_a_gradient_one_percent_off_in_a_split_part_fails_naming_it(fused_golden, fused,
                                                                    changed, part):
    # The golden's fused gradient is cut into the model's parts, so the part is named.
    status, rows = check(fused_golden / fused / "golden", changed)
    assert status == 1
    failed = [r for r in rows if not r["ok"]]
    assert {(r["backend"], r["dtype"], r["output"]) for r in failed} == {
        ("manual", "fp64", "grads")}  # the fp32 baseline carries it
    assert failed[0]["worst"] == f'outputs["{part}"]'


@pytest.mark.parametrize(("fused", "changed", "named", "kept"), [
    # DIM 16: q is rows 0-15 of qkv; gate rows 0-63 of gate_up, up rows 64-127.
    ("fused", "q-changed", "1 of 17 tensors: attn.q.weight (the goldens' attn.qkv.weight "
     "rows 0-15)", ("attn.k.weight", "attn.v.weight")),
    ("gated-fused", "gated-up-changed", "1 of 19 tensors: mlp.up.weight (the goldens' "
     "mlp.gate_up.weight rows 64-127)", ("mlp.gate.weight",)),
])
def test_a_value_change_in_one_split_part_names_the_part(fused_golden, capsys, fused, changed,
                                                        named, kept):
    status, rows = check(fused_golden / fused / "golden", changed)
    assert status == 1 and {r["verdict"] for r in rows} == {"init changed"}
    out = _out(capsys)
    assert f"differ from the goldens' in {named}, on a machine" in out
    assert "their values changed, not the machine" in out and "--name-map" not in out
    assert not any(part in out for part in kept)


def test_a_split_golden_kept_as_a_sketch_is_judged_joined():
    layout = {"qkv.weight": [6, 2], "out.weight": [2, 2]}
    model = {"q.weight": [2, 2], "k.weight": [2, 2], "v.weight": [2, 2], "out.weight": [2, 2]}
    grads = {name: torch.full(shape, float(i)) for i, (name, shape) in enumerate(model.items())}
    for sketched, judged in ((frozenset(), {"q.weight", "k.weight", "v.weight"}),
                             (frozenset({"qkv.weight"}), {"qkv.weight"})):
        paired = renaming(layout, model, sketched=sketched)
        kept: dict[str, torch.Tensor] = {}
        keep = paired.gradient_keeper(kept.__setitem__)
        for name in ("v.weight", "out.weight", "q.weight", "k.weight"):  # any order
            keep(name, grads[name])
        assert set(kept) == judged | {"out.weight"}
        golden = torch.cat([grads[n] for n in ("q.weight", "k.weight", "v.weight")])
        goldens = paired.judged_goldens({"qkv.weight": golden, "out.weight": grads["out.weight"]})
        assert set(goldens) == set(kept)
        assert all(torch.equal(kept[name], goldens[name]) for name in kept)
        state = paired.golden_state(grads, model)
        assert torch.equal(state["qkv.weight"], golden)
        assert torch.equal(paired.model_tensor("k.weight", state), grads["k.weight"])


@pytest.mark.slow
def test_a_split_golden_kept_as_a_sketch_is_checked_joined(tmp_path, monkeypatch):
    # Every tensor of 512 elements or more sketched: qkv.weight (48 x 16) cannot be cut into
    # the model's parts, which are joined into it and judged whole, by its name.
    monkeypatch.setenv(SKETCH_ABOVE_ENV, "512")
    golden = tmp_path / "golden"
    assert main(["golden", "update", "--model", f"{_write(tmp_path, 'fused')}:make",
                 "--golden-dir", str(golden)]) == 0
    status, rows = check(golden, "base")
    assert status == 0 and {r["verdict"] for r in rows} <= {"identical", "within"}
    status, rows = check(golden, "k-grad-scaled")
    failed = [r for r in rows if not r["ok"]]
    assert status == 1 and [r["worst"] for r in failed] == ['outputs["attn.qkv.weight"]']


def test_goldens_of_another_instruction_set_point_at_torchs_draws(golden, capsys, tmp_path):
    here = torch.backends.cpu.get_cpu_capability().lower()
    elsewhere = "avx2" if here == "default" else "default"
    other = tmp_path / "golden"
    (other / "models.make").mkdir(parents=True)
    for path in (golden / "models.make").iterdir():
        text = path.read_bytes()
        if path.name == "grads.json":
            summary = json.loads(text)
            summary["produced_by"]["cpu_capability"] = elsewhere
            text = json.dumps(summary).encode()
        (other / "models.make" / path.name).write_bytes(text)
    status, _ = check(other, "fused-k-changed")
    out = _out(capsys)
    assert status == 1
    assert f"the goldens were made on cpu {elsewhere}, this run is on cpu {here}" in out
    assert "tp.init_weights(model, seed)" in out and "their values changed" not in out


def test_an_unmappable_rename_says_how_to_hand_a_map_in_one_line(golden, capsys):
    status, rows = check(golden, "swapped")
    assert status == 1 and {r["verdict"] for r in rows} == {"init changed"}
    out = _out(capsys)
    assert out.count("FAIL models.") == 1
    fail = out.split("FAIL", 1)[1]
    assert "mlp.up.weight (64, 16)" in fail and "mlp.fc1.weight (64, 16)" in fail
    assert "--name-map REGEX=REPLACEMENT" in fail

    status, rows = check(golden, "swapped", "--name-map", r"mlp\.up=mlp.fc1",
                         "--name-map", r"mlp\.down=mlp.fc2")
    assert status == 0 and {r["verdict"] for r in rows} <= {"identical", "within"}
    assert "mlp.fc1 <- mlp.up [renamed]" in _out(capsys)


def test_the_python_api_takes_a_name_map(golden):
    entry = f"{_write(golden.parent, 'swapped')}:make"
    report = tp.check_model(entry, backends=["manual"], dtypes=["fp32"], golden_dir=golden,
                            name_map={"mlp.up": "mlp.fc1", "mlp.down": "mlp.fc2"})
    assert report.ok, report.explain()


def test_diagnose_runs_a_head_read_outside_its_module_in_float64(golden, capsys):
    # A's float64 golden runs the tied head, x @ embed.weight.t(), outside any module.
    tied, base = (f"{_write(golden.parent / v, v)}:make" for v in ("tied", "base"))
    assert main(["diagnose", tied, base]) == 0
    out = _out(capsys)
    assert "against A's float64 golden" in out and "Verdict: pass" in out


def test_a_name_map_without_a_model_is_refused_in_one_line(capsys):
    assert main(["check", "--case", "mqa", "--name-map", "a=b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--name-map" in err and "--model ENTRY" in err
