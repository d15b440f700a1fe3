"""Users' models sharded over the ranks of torchrun (``--nproc N``), on the CPU with gloo: the
goldens made by the sharded model in float64 check with any number of ranks, with the verdicts
one process gives, FSDP2's uneven shards included; a rank that dies or stops, a collective that
times out and a tensor-parallel plan that does not divide the model end the run with one line,
exit status 2 and no golden written; a replicated weight or output that differs between ranks
fails the check (1), the user's code raising on one rank names it (3), every rank ended.

Each ``--nproc`` run starts torchrun and its ranks (seconds of imports each), so the default
suite runs a few of them with 2 ranks; the other plans and 4 ranks are ``slow``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from processes import leftover
from torchparity.cli import main

pytest.importorskip("transformers")

pytestmark = pytest.mark.transformers

MODELS = Path(__file__).resolve().parents[1] / "sharded_models.py"
#: Factories that shard their models themselves under torchrun, handing no plan.
SELF_SHARDED = MODELS.with_name("self_sharded_models.py")
#: The outputs a sharded run judges: a transformers Llama decodes too (greedily in the
#: reference cell, along the golden's tokens elsewhere; ``decode-cache``: its cache against
#: recomputing the whole sequence).
JUDGED = ("outputs", "loss", "grads", "decode", "decode-cache")
WITHOUT_DECODING = {"outputs", "loss", "grads"}
#: Cells enough to meet each kind of row: the baseline backend, and one that differs from it.
CELLS = ["--backend", "manual", "--backend", "sdpa-math", "--dtype", "fp32"]


def entry(name: str) -> str:
    """A factory of tests/sharded_models.py, or ``self:NAME`` of tests/self_sharded_models.py."""
    if name.startswith("self:"):
        return f"{SELF_SHARDED}:{name.removeprefix('self:')}"
    return f"{MODELS}:{name}"


def verdicts(path: Path) -> dict[tuple[str, str, str], str]:
    """(backend, dtype, output) -> verdict of a ``check --json`` (a compiled cell's dtype as
    its row shows it: ``fp32 static``); a bit-identical output is within its budget as well
    (which it is depends on how many ranks made the golden)."""
    rows = json.loads(path.read_text())["results"]
    return {(r["backend"], " ".join(filter(None, (r["dtype"], r.get("compile")))), r["output"]):
            "within" if r["verdict"] == "identical" else r["verdict"]
            for r in rows if r["output"] in JUDGED}


def update_then_check(tmp_path: Path, name: str, nproc: list[int], capsys,
                      cells: list[str] = CELLS) -> dict[int, dict]:
    """Goldens made by 2 ranks, then checked in ``cells`` with each of ``nproc`` (1: one
    process); the verdicts of each check."""
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry(name), "--nproc", "2", *golden]) == 0
    found = {}
    for n in nproc:
        report = tmp_path / f"check{n}.json"
        status = main(["check", "--model", entry(name), "--nproc", str(n), *cells, *golden,
                       "--json", str(report)])
        assert status == 0, capsys.readouterr()
        found[n] = verdicts(report)
    return found


def test_a_llama_tensor_parallel_golden_checks_on_2_ranks_and_in_one_process(tmp_path, capsys):
    found = update_then_check(tmp_path, "llama_tp", [2, 1], capsys)
    assert found[2] == found[1]
    assert set(found[1].values()) <= {"within", "n/a"}
    assert any(verdict == "within" for verdict in found[1].values())
    assert {output for (_, _, output) in found[1]} == set(JUDGED)


def test_a_model_built_on_meta_is_made_rank_by_rank_with_the_weights_of_one_process(
        tmp_path, capsys):
    # Each rank fills only its part of the weights; the one-process check recomputes the
    # weights' checksum from a whole model, so any part filled wrongly reads "init changed".
    found = update_then_check(tmp_path, "mine_tp_on_meta", [1], capsys)
    assert set(found[1].values()) <= {"within", "n/a"}
    assert {output for (_, _, output) in found[1]} == WITHOUT_DECODING


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mine_fsdp", "mine_tp", "mine_fsdp_on_meta", "mine_fsdp_tp",
                                  "llama_fsdp", "llama_fsdp_tp", "llama_tp_beams",
                                  "gpt2_fsdp", "bart_fsdp", "self:manual_tp",
                                  "self:manual_tp_inferred"])
def test_each_plan_checks_on_2_ranks_and_in_one_process(tmp_path, capsys, name):
    found = update_then_check(tmp_path, name, [2, 1], capsys)
    assert found[2] == found[1]
    assert set(found[1].values()) <= {"within", "n/a"}


def test_a_model_that_shards_itself_checks_on_2_ranks_against_goldens_of_one_process(
        tmp_path, capsys):
    # The factory applies tensor parallel and FSDP2 itself when it finds itself under
    # torchrun: its DTensor parameters are weighed and kept through their placements, and the
    # verdicts are those of the same model whose factory hands its plan.
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry("self:fsdp_tp"), *golden]) == 0
    report = tmp_path / "check.json"
    assert main(["check", "--model", entry("self:fsdp_tp"), "--nproc", "2", *CELLS, *golden,
                 "--json", str(report)]) == 0, capsys.readouterr()
    found = verdicts(report)
    assert set(found.values()) <= {"within"}
    assert {output for (_, _, output) in found} == WITHOUT_DECODING


def test_a_model_sharded_by_hand_checks_on_2_ranks_against_goldens_of_one_process(
        tmp_path, capsys):
    # Megatron-style: each rank holds plain slices of the column- and row-parallel weights,
    # which torchparity finds in the weights the factory builds as one process; the ranks'
    # slices of each gradient joined are judged against the one-process gradient.
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry("self:manual_tp_inferred"), *golden]) == 0
    report = tmp_path / "check.json"
    assert main(["check", "--model", entry("self:manual_tp_inferred"), "--nproc", "2", *CELLS,
                 *golden, "--json", str(report)]) == 0, capsys.readouterr()
    found = verdicts(report)
    assert set(found.values()) <= {"within"}
    assert {output for (_, _, output) in found} == WITHOUT_DECODING


@pytest.mark.slow
def test_slices_found_nowhere_leave_the_gradients_not_compared_and_say_how_to_declare_them(
        tmp_path, capsys):
    # The MLP's hidden units dealt to the ranks in turn: the outputs are the one-process
    # model's, its slices are no stretch of the one-process weights.
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry("self:manual_tp_mlp_dealt"),
                 *golden]) == 0
    capsys.readouterr()
    report = tmp_path / "check.json"
    assert main(["check", "--model", entry("self:manual_tp_mlp_dealt"), "--nproc", "2",
                 *CELLS, *golden, "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["results"]
    grads = [r for r in rows if r["output"] == "grads"]
    assert grads and {r["verdict"] for r in grads} == {"n/a"}
    assert all("layers.0.up.weight and 5 more are found nowhere" in r["reason"]
               and 'returning shards={"layers.0.attn.q.weight": 0' in r["reason"]
               for r in grads)
    assert {r["verdict"] for r in rows if r["output"] != "grads"} <= {"identical", "within"}
    # no golden is made across ranks of weights no one process holds
    other = tmp_path / "other"
    assert main(["golden", "update", "--model", entry("self:manual_tp_mlp_dealt"), "--nproc",
                 "2", "--golden-dir", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no golden can be made of it across ranks" in err
    assert not other.exists() or not any(other.rglob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "planned"), [("self:dtensor_tp", "mine_tp"),
                                               ("self:fsdp", "mine_fsdp"),
                                               ("self:fsdp_tp", "mine_fsdp_tp")])
def test_a_model_that_shards_itself_checks_as_the_model_whose_plan_is_handed_in(
        tmp_path, capsys, name, planned):
    # In a dtype of its own too (bf16): each run's copy is built and sharded by the factory.
    cells = [*CELLS, "--dtype", "bf16"]
    itself = update_then_check(tmp_path / "itself", name, [2, 1], capsys, cells=cells)
    handed = update_then_check(tmp_path / "handed", planned, [2], capsys, cells=cells)
    assert itself[2] == itself[1] == handed[2]
    assert set(itself[2].values()) <= {"within"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mine_fsdp_tp", "llama_fsdp_tp", "self:fsdp_tp"])
def test_a_golden_of_2_ranks_checks_on_4(tmp_path, capsys, name):
    found = update_then_check(tmp_path, name, [4, 1], capsys)
    assert found[4] == found[1]


@pytest.mark.slow
def test_a_compiled_cell_runs_on_the_ranks_as_in_one_process(tmp_path, capsys):
    # Each rank compiles its sharded copy (FSDP2's hooks and collectives in the graph or
    # around it) and judges it against the same eager baseline as one process does.
    found = update_then_check(tmp_path, "mine_fsdp", [2, 1], capsys,
                              cells=["--backend", "manual", "--dtype", "fp32",
                                     "--compile", "static"])
    assert found[2] == found[1]
    assert {dtype for (_, dtype, _), verdict in found[2].items() if verdict == "within"} >= {
        "fp32 static"}


def refused(tmp_path: Path, name: str, capsys, **env: str) -> str:
    """The one line a failed ``golden update --nproc 2`` prints; nothing may be written."""
    golden = tmp_path / "golden"
    status = main(["golden", "update", "--model", entry(name), "--nproc", "2",
                   "--golden-dir", str(golden)])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1, err
    assert not golden.exists() or not any(golden.rglob("*.safetensors"))
    return err


@pytest.mark.parametrize("argv", [
    ["check", "--nproc", "2"],
    ["check", "--case", "llama-tiny", "--model", entry("mine_tp"), "--nproc", "2"],
    ["golden", "update", "--nproc", "2"],
    ["golden", "update", "llama-tiny", "--nproc", "2"],
])
def test_the_zoo_s_cases_across_ranks_are_refused_not_run_on_every_rank(tmp_path, capsys,
                                                                         argv):
    # The zoo is not sharded: every rank would run the same cases; refused before any rank
    # starts or any golden is touched.
    assert main([*argv, "--golden-dir", str(tmp_path / "golden")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "the zoo's cases run in one process: leave --nproc out for them" in err
    assert not (tmp_path / "golden").exists()


def test_a_rank_that_dies_is_named_and_nothing_is_written(tmp_path, capsys):
    assert "rank 1 died (Signal 9 (SIGKILL)" in refused(tmp_path, "mine_rank_one_dies", capsys)
    assert not leftover(f"{entry('mine_rank_one_dies')} ")


def failed_check(tmp_path: Path, name: str, capsys) -> tuple[int, str]:
    """``check --nproc 2`` of ``name`` against goldens made in one process: its exit status
    and its one line, once no process of it is left."""
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry(name), *golden]) == 0
    capsys.readouterr()
    status = main(["check", "--model", entry(name), "--nproc", "2", *CELLS, *golden])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not leftover(f"{entry(name)} ")
    return status, err


def test_a_replicated_weight_that_drifted_on_one_rank_fails_the_check_naming_it(
        tmp_path, capsys):
    # Every rank gathers the digests of its replicated copies, then all decide alike: a
    # finding at once, not a rank left waiting for another in the collective timeout.
    status, err = failed_check(tmp_path, "mine_norm_drifts", capsys)
    assert status == 1
    assert ("FAILED: the replicated weight layers.0.attn_norm.weight differs between ranks: "
            "rank 1 differs from rank 0's copy by up to ") in err
    assert "1 more weight(s) differ too" in err  # layers.1's norm


@pytest.mark.slow
@pytest.mark.parametrize("name", ["self:manual_tp_norm_drifts", "self:dtensor_tp_norm_drifts"])
def test_a_drifted_weight_of_a_model_that_shards_itself_fails_the_check(tmp_path, capsys,
                                                                         name):
    status, err = failed_check(tmp_path, name, capsys)
    assert status == 1
    assert "the replicated weight layers.0.attn_norm.weight differs between ranks" in err


def test_the_user_s_code_raising_on_one_rank_is_named_and_ends_every_rank(tmp_path, capsys):
    # Rank 1 raises in its forward while rank 0 waits in the next collective: rank 1 leaves
    # at once and torchrun stops rank 0, long before the collective timeout.
    status, err = failed_check(tmp_path, "mine_rank_one_raises", capsys)
    assert status == 3
    assert "rank 1: error: the model's forward" in err
    assert "raised ValueError: rank 1's own bug" in err


@pytest.mark.slow
def test_a_nan_on_one_rank_fails_the_check_naming_the_output_and_the_rank(tmp_path, capsys):
    status, err = failed_check(tmp_path, "mine_rank_one_nan", capsys)
    assert status == 1
    assert ("outputs.output of the reference fp64 cpu run differs between ranks: rank 1 "
            "differs from rank 0's copy: NaN where rank 0's is a number") in err


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_the_collective_timeout(tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("TORCHPARITY_COLLECTIVE_TIMEOUT", "10")
    status, err = failed_check(tmp_path, "mine_rank_one_stops", capsys)
    assert status == 2
    # named by rank 0's watch on its heartbeat after 5 s (half the timeout), not by a
    # collective that timed out
    assert "error: rank 1 has not answered for" in err
    assert err.endswith("(stopped, or frozen) at the forward and backward of the reference "
                        "fp64 cpu run; every rank was stopped")


def test_fsdp2_over_an_odd_vocabulary_checks_against_goldens_of_one_process(tmp_path, capsys):
    # 101 rows over 2 ranks: FSDP2 pads the last shard in its collectives; each rank's part
    # is read through its real size (51 and 50 rows).
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry("mine_fsdp_odd_vocab"), *golden]) == 0
    report = tmp_path / "check.json"
    assert main(["check", "--model", entry("mine_fsdp_odd_vocab"), "--nproc", "2", *CELLS,
                 *golden, "--json", str(report)]) == 0, capsys.readouterr()
    found = verdicts(report)
    assert set(found.values()) == {"within"}
    assert {output for (_, _, output) in found} == WITHOUT_DECODING


def test_a_plan_that_does_not_divide_a_parameter_is_refused(tmp_path, capsys):
    err = refused(tmp_path, "mine_uneven", capsys)
    assert "splits layers.0.up.weight (shape (33, 32)) along dimension 0 over 2 ranks" in err


def test_a_plan_that_splits_a_head_is_refused(tmp_path, capsys):
    err = refused(tmp_path, "mine_odd_heads", capsys)
    assert ("splits the 3 heads of layers.0.attn (16 wide, in layers.0.attn.q.weight of shape "
            "(48, 48)) over 2 ranks") in err


@pytest.mark.slow
def test_a_rank_that_hangs_is_named_within_the_collective_timeout(tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.setenv("TORCHPARITY_COLLECTIVE_TIMEOUT", "10")
    err = refused(tmp_path, "mine_rank_one_hangs", capsys)
    assert "rank 0: error: a collective failed" in err
    assert "rank 1 is at the sharding of" in err


@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_the_run_in_one_line_and_leaves_the_goldens_whole(
        tmp_path, capsys):
    # Rank 1 of a model sharded by hand is killed inside its forward, between collectives:
    # rank 0 waits in the next one until torchrun stops it.
    err = refused(tmp_path / "update", "self:manual_tp_rank_one_dies", capsys)
    assert "rank 1 died (Signal 9 (SIGKILL)" in err
    golden = tmp_path / "golden"
    assert main(["golden", "update", "--model", entry("self:manual_tp_rank_one_dies"),
                 "--golden-dir", str(golden)]) == 0  # one process: no rank to kill
    before = {path: path.read_bytes() for path in golden.rglob("*") if path.is_file()}
    capsys.readouterr()
    assert main(["check", "--model", entry("self:manual_tp_rank_one_dies"), "--nproc", "2",
                 *CELLS, "--golden-dir", str(golden)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank 1 died" in err
    assert {path: path.read_bytes() for path in golden.rglob("*") if path.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize(("name", "diverged"), [
    *((name, WITHOUT_DECODING) for name in (
        "mine_unreduced_rows", "mine_columns_out_of_order", "mine_heads_swapped",
        "mine_fsdp_odd_vocab_last_rows_scaled")),
    # the plan sums the norms' gradients again in a hook on their parameters: every run's
    # copy, planned on the meta device, must keep the hook for the check to see it
    ("mine_norm_grads_reduced_twice", {"grads"}),
    # a Llama decodes with the bug too: its tokens or logits leave the golden's (its cache
    # and its recompute agree, both being wrong alike)
    ("llama_unreduced_rows", {*WITHOUT_DECODING, "decode"}),
    # the same bugs written by hand, Megatron-style, in a model that shards itself; and a
    # row-parallel linear that reduces its partial sums twice
    *((f"self:manual_tp_{bug}", WITHOUT_DECODING) for bug in (
        "unreduced_rows", "reduced_twice", "columns_out_of_order", "heads_swapped")),
])
def test_each_classic_sharding_bug_fails_the_check(tmp_path, capsys, name, diverged):
    # The goldens are made in one process, where no plan runs: the model's own mathematics.
    # Every cell's baseline runs the same buggy plan, so the reference cell is the one that
    # sees it: the sharded float64 run against the one-process golden.
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry(name), *golden]) == 0
    report = tmp_path / "check.json"
    assert main(["check", "--model", entry(name), "--nproc", "2", *CELLS, *golden,
                 "--json", str(report)]) == 1
    failed = {output for (backend, dtype, output), verdict in verdicts(report).items()
              if verdict == "diverged" and (backend, dtype) == ("manual", "fp64")}
    assert failed == diverged


@pytest.mark.gpu
def test_nccl_ranks_check_like_one_process(tmp_path, capsys, device):
    import torch

    if torch.device(device).type != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("nccl needs a GPU per rank: 2 GPUs; the CPU path (gloo) is tested above")
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", entry("llama_fsdp_tp"), "--nproc", "2",
                 *golden]) == 0
    found = {}
    for n in (2, 1):
        report = tmp_path / f"check{n}.json"
        assert main(["check", "--model", entry("llama_fsdp_tp"), "--nproc", str(n),
                     "--device", "cuda", "--backend", "manual", "--backend", "sdpa",
                     "--dtype", "fp32", "--dtype", "bf16", *golden, "--json", str(report)]
                    ) == 0, capsys.readouterr()
        found[n] = verdicts(report)
    assert found[2] == found[1]
