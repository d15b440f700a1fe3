"""``diagnose ENTRY --nproc 2 --against TRACE``: a sharded model run by 2 ranks of torchrun
(gloo, CPU) against a trace of the same model recorded in one process, where no plan runs (the
model's own mathematics); and ``diagnose A B --nproc 2``: against the correct plan's model,
sharded too. Each classic sharding bug planted in a tensor-parallel plan
(tests/sharded_models.py) is named at the module it is planted in, with the ranks where it
shows; a correct plan passes.

Each run starts torchrun and its ranks (seconds of imports each): the default suite runs one
bug; the others and the correct plans are ``slow``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity.cli import main

MODELS = Path(__file__).resolve().parents[1] / "sharded_models.py"


#: Each planted bug (B), where it is named, on which ranks, with which verdict.
BUGS = {
    # each rank goes on with its own share of the sum: both ranks' outputs leave A's budget
    "mine_unreduced_rows": ("layers.0.attn.o", [0, 1], "diverged"),
    # gathered in the wrong order: every rank gets the same wrong whole
    "mine_columns_out_of_order": ("layers.0.up", [0, 1], "diverged"),
    # rank 1's copy of the replicated norm drifted: its output is not rank 0's
    "mine_norm_drifts": ("layers.0.attn_norm", [1], "differs between ranks"),
    # keys split by heads but each rank holds the other's: the ranks' keys joined are not A's
    "mine_heads_swapped": ("layers.0.attn.k", [0, 1], "diverged"),
}


#: The same bugs written by hand, Megatron-style, in a model that shards itself
#: (tests/self_sharded_models.py), with a row-parallel linear that reduces twice.
BY_HAND = {
    "self:manual_tp_unreduced_rows": ("layers.0.attn.o", [0, 1], "diverged"),
    "self:manual_tp_reduced_twice": ("layers.0.attn.o", [0, 1], "diverged"),
    "self:manual_tp_columns_out_of_order": ("layers.0.up", [0, 1], "diverged"),
    "self:manual_tp_norm_drifts": ("layers.0.attn_norm", [1], "differs between ranks"),
    # its slices are found where they lie in the one-process weights, but the ranks' keys
    # joined in rank order, as a gather joins them, are not A's
    "self:manual_tp_heads_swapped": ("layers.0.attn.k", [0, 1], "diverged"),
}
SELF_SHARDED = MODELS.with_name("self_sharded_models.py")


def assert_named(status: int, report: dict, name: str) -> None:
    first = report["first_divergence"]
    assert status == 1
    assert (first["module"], first["ranks"], first["result"]["verdict"]) == {
        **BUGS, **BY_HAND}[name]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """The correct model (the plans change how it runs, not what it computes) in one
    process."""
    path = tmp_path_factory.mktemp("ranks") / "mine.tptrace"
    assert main(["record", f"{MODELS}:mine_tp", "-o", str(path)]) == 0
    return path


def entry(name: str) -> str:
    """A factory of tests/sharded_models.py, or ``self:NAME`` of tests/self_sharded_models.py."""
    if name.startswith("self:"):
        return f"{SELF_SHARDED}:{name.removeprefix('self:')}"
    return f"{MODELS}:{name}"


@pytest.fixture(scope="module")
def by_hand_trace(tmp_path_factory) -> Path:
    """The Megatron-style model in one process, where its factory does not shard it."""
    path = tmp_path_factory.mktemp("ranks") / "manual.tptrace"
    assert main(["record", entry("self:manual_tp"), "-o", str(path)]) == 0
    return path


def diagnosed(trace: Path, name: str, tmp_path: Path) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    status = main(["diagnose", entry(name), "--nproc", "2", "--against", str(trace),
                   "--json", str(report)])
    return status, json.loads(report.read_text())


def test_a_row_parallel_linear_whose_partial_sums_are_not_reduced_is_named(
        trace, tmp_path, capsys):
    assert_named(*diagnosed(trace, "mine_unreduced_rows", tmp_path), "mine_unreduced_rows")
    out = capsys.readouterr().out
    assert out.count("First divergence: layers.0.attn.o (Linear) on ranks 0, 1 of 2") == 1
    assert "Local errors are not computed across ranks" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in BUGS if name != "mine_unreduced_rows"])
def test_each_other_sharding_bug_is_named_at_its_module(trace, tmp_path, name):
    assert_named(*diagnosed(trace, name, tmp_path), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mine_tp", "mine_fsdp", "mine_fsdp_tp", "mine_up_as_dtensor",
                                  # the same model sharded by its factory itself
                                  "self:dtensor_tp", "self:fsdp", "self:fsdp_tp"])
def test_a_correct_plan_passes(trace, tmp_path, name):
    status, report = diagnosed(trace, name, tmp_path)
    assert status == 0
    # gradients too: each rank's shards against its cut of the one-process gradients
    assert report["first_divergence"] is None and report["first_grad_divergence"] is None
    assert report["judged_modules"] > 0 and report["judged_gradients"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BY_HAND))
def test_each_bug_of_tensor_parallel_written_by_hand_is_named_at_its_module(
        by_hand_trace, tmp_path, name):
    assert_named(*diagnosed(by_hand_trace, name, tmp_path), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["self:manual_tp", "self:manual_tp_inferred"])
def test_tensor_parallel_written_by_hand_passes_with_its_gradients_judged_slice_by_slice(
        by_hand_trace, tmp_path, name):
    status, report = diagnosed(by_hand_trace, name, tmp_path)
    assert status == 0
    assert report["first_divergence"] is None and report["first_grad_divergence"] is None
    # every module with parameters: 2 layers of 8, the embedding, the final norm and head
    assert (report["judged_modules"], report["judged_gradients"]) == (24, 19)


def against_a(a: str, b: str, tmp_path: Path, *options: str) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    status = main(["diagnose", f"{MODELS}:{a}", f"{MODELS}:{b}", "--nproc", "2",
                   "--json", str(report), *options])
    return status, json.loads(report.read_text())


def test_against_a_correct_plan_a_column_output_gathered_out_of_order_is_named(tmp_path):
    # B gathers up's output (in the wrong order) where A keeps each rank's columns: A's
    # columns joined in rank order are what B's whole output is judged against.
    status, report = against_a("mine_tp", "mine_columns_out_of_order", tmp_path)
    assert_named(status, report, "mine_columns_out_of_order")
    assert report["against"] == f"{MODELS}:mine_tp run sharded alike"
    # past a forward divergence every gradient differs: none is named
    assert report["first_grad_divergence"] is None
    assert report["gradients"].startswith("Gradients are not judged past a forward divergence")


@pytest.mark.slow
def test_a_gradient_summed_twice_across_ranks_is_named_where_backward_reaches_it(trace,
                                                                                 tmp_path):
    for status, report in (against_a("mine_tp", "mine_norm_grads_reduced_twice", tmp_path),
                           diagnosed(trace, "mine_norm_grads_reduced_twice", tmp_path)):
        assert status == 1
        assert report["first_divergence"] is None  # the forward is untouched
        grad = report["first_grad_divergence"]
        # both layers' norms carry the bug; a backward reaches layer 1's first
        assert (grad["module"], grad["ranks"], grad["result"]["verdict"]) == (
            "layers.1.mlp_norm", [0, 1], "diverged")
    status, report = against_a("mine_tp", "mine_norm_grads_reduced_twice", tmp_path,
                               "--no-backward")
    assert (status, report["judged_gradients"]) == (0, None)
    assert report["gradients"] == "Gradients are not judged (--no-backward)."


@pytest.mark.slow
def test_an_output_each_rank_holds_a_part_of_is_made_whole_and_judged_against_a_s_columns(
        tmp_path):
    # B's up hands on a DTensor, each rank keeping its part until the call is judged; A's up
    # keeps each rank's columns, joined to be judged against B's whole
    status, report = against_a("mine_tp", "mine_up_as_dtensor", tmp_path, "--no-backward")
    # every module call is judged: TinyLM's 24 (its ModuleList is never called)
    assert (status, report["first_divergence"], report["judged_modules"]) == (0, None, 24)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in BUGS if name != "mine_columns_out_of_order"])
def test_against_a_correct_plan_each_other_bug_is_named(tmp_path, name):
    assert_named(*against_a("mine_tp", name, tmp_path), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mine_tp", "mine_fsdp", "mine_fsdp_tp"])
def test_a_correct_plan_against_itself_passes(tmp_path, name):
    status, report = against_a(name, name, tmp_path)
    assert status == 0
    assert report["first_divergence"] is None and report["first_grad_divergence"] is None
    assert report["judged_modules"] > 0 and report["judged_gradients"] > 0


def test_one_entry_without_a_trace_is_refused_with_both_forms(capsys):
    assert main(["diagnose", f"{MODELS}:mine_tp", "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "one entry point (B) with --against TRACE (recorded in one process: " \
        "`torchparity record ENTRY -o TRACE`), or two (A and B" in err


def test_an_option_a_diagnosis_across_ranks_does_not_take_is_refused_not_ignored(capsys):
    assert main(["diagnose", f"{MODELS}:mine_tp", "--nproc", "2", "--against", "T",
                 "--backend-b", "sdpa", "--local", "all"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "does not take --backend-b, --local" in err
