"""``torchparity twins`` from the shell and the ``twins`` pytest fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchparity.cli import main

HERE = Path(__file__).parent
OLD = f"{HERE / 'user_twins.py'}:ThreeProjectionAttention"


def test_fused_projections_pass_a_search_from_the_shell(capsys):
    status = main(["twins", OLD, f"{HERE / 'user_twins.py'}:FusedQKVAttention",
                   "--inputs", "attention", "--init", "n_heads=1,2", "--init", "d_model=16",
                   "--weight-map", f"{HERE / 'user_twins.py'}:fuse_qkv", "--dtype", "bf16",
                   "--backend", "sdpa-math", "--examples", "5"])
    assert (status, capsys.readouterr().out) == (
        0, "twins: pass (5 examples, bf16, backends sdpa-math)\n")


def test_a_planted_bug_fails_one_check_with_its_explanation_and_reproducer(capsys):
    status = main(["twins", OLD, f"{HERE / 'user_twins.py'}:TiledKVAttention", "--inputs",
                   f"{HERE / 'user_twins.py'}:padded_batch", "--init", "n_heads=4",
                   "--init", "n_kv_heads=2", "--init", "d_model=16"])
    out = capsys.readouterr().out
    assert status == 1
    assert out.startswith("twins in fp32: FAIL\noutputs: diverged")
    assert "tp.assert_twins(old, new, inputs, dtype=dtype, init=init" in out


@pytest.mark.parametrize(("arguments", "message"), [
    (["--init", "heads"], "--init 'heads': write NAME=VALUE"),
    (["--init", "d_model=x"], "--init 'd_model=x': 'x' is not a Python literal"),
    ([], "--inputs attention needs the width: --init d_model=N"),
    (["--init", "d_model=8", "--positions", "5"], "--positions '5': write LO,HI"),
])
def test_a_mistake_is_one_line_and_status_2(capsys, arguments, message):
    status = main(["twins", OLD, OLD, "--inputs", "attention", "--init", "n_heads=1",
                   *arguments])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and message in err


FIXTURE_TEST = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import user_twins as ut
from torchparity.twins import strategies as tpt

calls = 0
forward = ut.TiledKVAttention.forward

def counted(self, *args, **kwargs):
    global calls
    calls += 1
    return forward(self, *args, **kwargs)

ut.TiledKVAttention.forward = counted

def test_refactor(twins):
    try:
        twins(ut.ThreeProjectionAttention, ut.TiledKVAttention,
              init=dict(n_heads=[1, 2, 4], n_kv_heads=lambda a: tpt.divisors(a["n_heads"]),
                        d_model=16),
              inputs=lambda a: tpt.attention_inputs(a["d_model"]))
    finally:
        print("calls:", calls)
"""


@pytest.mark.slow
def test_the_fixture_shrinks_and_its_database_replays_the_failure_first(pytester, monkeypatch):
    # A project of its own, without this suite's derandomized profile: the database is on.
    monkeypatch.setenv("PYTHONPATH", str(HERE.parents[1] / "src"))
    pytester.makepyfile(test_refactor=FIXTURE_TEST)
    calls = []
    for _ in range(2):
        result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
        result.assert_outcomes(failed=1)
        output = result.stdout.str()
        assert "twins in fp32: FAIL" in output and "# --- reproducer ---" in output
        assert "init = {'n_heads': 4, 'n_kv_heads': 2, 'd_model': 16}" in output
        calls.append(int(output.split("calls: ")[1].split()[0]))
    # The second run starts from the shrunk example the first one kept: no search, no shrink.
    assert calls[1] < calls[0] / 4, calls
