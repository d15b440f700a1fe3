"""One twin check at a time: correct twins pass, the smallest examples the search finds for
each planted bug fail (and pass with the correct twin on the same input), a failure's
reproducer runs on its own and fails the same way, and mistakes get one clear line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import user_twins as ut

import torchparity as tp
from torchparity.errors import UsageError
from torchparity.twins import Steps, TwinFailure

SRC = Path(tp.__file__).resolve().parents[1]
HIDDEN = tp.random_tensor((2, 5, 16), seed=0)
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])  # a left-padded row
PADDED = {"hidden_states": HIDDEN, "attention_mask": MASK}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


@pytest.mark.parametrize(("dtype", "backend"), [("fp32", None), ("bf16", "sdpa-math")])
def test_fused_projections_pass_on_a_padded_batch(dtype, backend):
    verdict = tp.assert_twins(ut.ThreeProjectionAttention, ut.FusedQKVAttention, PADDED,
                              init=dict(d_model=16, n_heads=4, n_kv_heads=2),
                              weight_map=ut.FUSED_QKV, padding=MASK == 0, dtype=dtype,
                              backend=backend)
    assert verdict.forward.ok and verdict.grads.ok
    # The fused weight's gradient is judged split back into the old projections'.
    assert {"q.weight", "k.weight", "v.weight", "o.weight"} <= {
        t.path.split('"')[-2] for t in verdict.grads.tensors if "params" in t.path}


def _single(length: int, d_model: int = 8) -> torch.Tensor:
    return tp.random_tensor((1, length, d_model), seed=3)


# The smallest examples the searches of test_twins_search.py shrink to, each with the correct
# twin that passes on the same input: the planted bug is the only difference.
FOUND = {
    "gqa-tiled-heads": (ut.ThreeProjectionAttention, ut.TiledKVAttention,
                        ut.ThreeProjectionAttention, {"hidden_states": _single(1, 32)},
                        dict(init=dict(d_model=32, n_heads=4, n_kv_heads=2))),
    "mask-flipped-in-padded-rows": (
        ut.ThreeProjectionAttention, ut.PaddedRowsFlippedAttention, ut.FusedQKVAttention,
        {"hidden_states": _single(2), "attention_mask": torch.tensor([[0, 1]])},
        dict(init=dict(d_model=8, n_heads=1), padding=torch.tensor([[True, False]]))),
    "cache-one-slot-off": (
        ut.CachedAttention, ut.CachedAttention, ut.CachedAttention,
        Steps({"hidden_states": x} for x in _single(2).split(1, dim=1)),
        dict(init=dict(d_model=8, n_heads=1))),
    "rotary-scaled-after-a-bf16-cast": (
        ut.ThreeProjectionAttention, ut.EarlyCastRotaryAttention, ut.ThreeProjectionAttention,
        {"hidden_states": _single(2), "position_ids": torch.tensor([[256, 257]])},
        dict(init=dict(d_model=8, n_heads=1, rotary=True), dtype="bf16")),
}
CACHES = {"cache-one-slot-off": ((ut.ConcatCache, ut.OffByOneCache),
                                 (ut.ConcatCache, ut.PreallocatedCache))}


@pytest.mark.parametrize("name", list(FOUND))
def test_the_smallest_example_of_a_planted_bug_fails_and_its_correct_twin_passes(name):
    old, buggy, correct, inputs, options = FOUND[name]
    weight_map = ut.FUSED_QKV if correct is ut.FusedQKVAttention else None
    bad_cache, good_cache = CACHES.get(name, (None, None))
    with pytest.raises(TwinFailure, match="FAIL"):
        tp.assert_twins(old, buggy, inputs, cache=bad_cache, **options)
    tp.assert_twins(old, correct, inputs, cache=good_cache, weight_map=weight_map, **options)


def test_the_rotary_bug_is_invisible_below_257_and_in_fp32():
    # Positions up to 256 are integers in bf16, and fp32 rounds none of these: the example
    # the search found is where bf16 starts rounding positions (257 to 256, so that two
    # neighbours look like one position: rotary attention sees only their distance).
    old, buggy, _, inputs, options = FOUND["rotary-scaled-after-a-bf16-cast"]
    tp.assert_twins(old, buggy, {**inputs, "position_ids": torch.tensor([[255, 256]])},
                    **options)
    tp.assert_twins(old, buggy, inputs, **{**options, "dtype": "fp32"})


def _verdict_lines(text: str) -> list[str]:
    """The verdict's lines up to the values, which the thread count may move in the last
    bit."""
    return [re.split(r" \(candidate", line)[0] for line in text.splitlines()[:3]]


def test_the_reproducer_runs_on_its_own_and_fails_the_same_way(tmp_path):
    old, buggy, _, inputs, options = FOUND["mask-flipped-in-padded-rows"]
    with pytest.raises(TwinFailure) as failure:
        tp.assert_twins(old, buggy, inputs, **options)
    message = str(failure.value)
    script = message.split("# --- reproducer ---\n")[1].split("# --- end of reproducer")[0]
    path = tmp_path / "reproduce.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    ran = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode != 0
    assert "TwinFailure: twins in fp32: FAIL" in ran.stderr
    reproduced = ran.stderr.split("TwinFailure: ")[1]
    assert _verdict_lines(reproduced) == _verdict_lines(message)


def test_modules_given_as_instances_are_saved_beside_a_reproducer_that_fails_the_same_way():
    for n_kv_heads in (4, 2):  # with MHA tiling is repeating; with groups of 2 it is not
        old, new = (cls(16, 4, n_kv_heads) for cls in (ut.ThreeProjectionAttention,
                                                        ut.TiledKVAttention))
        new.load_state_dict(old.state_dict())
        if n_kv_heads == 4:
            tp.assert_twins(old, new, PADDED, padding=MASK == 0)
    with pytest.raises(TwinFailure) as failure:
        tp.assert_twins(old, new, PADDED, padding=MASK == 0)
    message = str(failure.value)
    assert all(len(line) <= 80 for line in message.splitlines()), message
    path = Path(re.search(r"saved beside it\):\n  python (\S+)\n", message).group(1))
    assert (path.parent / "twins.pt").is_file()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    ran = subprocess.run([sys.executable, str(path)], cwd=path.anchor, env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode != 0
    reproduced = ran.stderr.split("TwinFailure: ")[1]
    assert _verdict_lines(reproduced) == _verdict_lines(message)


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(), "the old module's weights do not fit the new one \\(missing: qkv.weight; "
             "unexpected: k.weight, q.weight, v.weight\\): give weight_map="),
    (dict(weight_map={"qkv.weight": ["q.weight", "key.weight"]}),
     "weight_map\\['qkv.weight'\\] names key.weight, which the old module does not have"),
    (dict(weight_map=ut.FUSED_QKV, backend="fast"), "unknown backend 'fast'"),
    (dict(weight_map=ut.FUSED_QKV, dtype="fp12"), "unknown dtype 'fp12'"),
])
def test_mistakes_are_named_in_one_line(arguments, message):
    with pytest.raises((UsageError, ValueError), match=message) as error:
        tp.assert_twins(ut.ThreeProjectionAttention, ut.FusedQKVAttention, PADDED,
                        init=dict(d_model=16, n_heads=2), **arguments)
    assert "\n" not in str(error.value)
