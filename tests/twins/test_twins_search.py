"""The search finds planted bugs within its default budget and shrinks each to a small
example; correct twins pass it. Each search runs up to 100 examples (and shrinks): slow."""

from __future__ import annotations

import pytest
import user_twins as ut

from torchparity.backends import available
from torchparity.dtypes import torch_dtype
from torchparity.twins import TwinFailure
from torchparity.twins import strategies as tpt
from torchparity.twins.search import check_twins

pytestmark = pytest.mark.slow

#: Head counts with every GQA grouping: MHA, MQA and groups in between.
HEADS = dict(n_heads=[1, 2, 4], n_kv_heads=lambda a: tpt.divisors(a["n_heads"]),
             d_model=lambda a: [8 * a["n_heads"], 12 * a["n_heads"]])
ROTARY = dict(n_heads=[1, 2, 4], d_model=lambda a: ut.ROTARY_HEAD_DIM * a["n_heads"],
              rotary=True)


def attention_inputs(**options):
    return lambda arguments: tpt.attention_inputs(arguments["d_model"], **options)


def found(old, new, **options) -> TwinFailure:
    with pytest.raises(TwinFailure) as failure:
        check_twins(old, new, **options)
    return failure.value


def test_a_gqa_repeat_that_tiles_heads_is_found_at_two_groups_of_two():
    failure = found(ut.ThreeProjectionAttention, ut.TiledKVAttention, init=HEADS,
                    inputs=attention_inputs())
    example = failure.example
    assert (example["init"]["n_heads"], example["init"]["n_kv_heads"]) == (4, 2)
    assert example["inputs"]["hidden_states"].shape[:2] == (1, 1)


def test_a_mask_read_the_other_way_in_padded_rows_is_found_on_one_short_row():
    failure = found(ut.ThreeProjectionAttention, ut.PaddedRowsFlippedAttention, init=HEADS,
                    inputs=attention_inputs())
    example = failure.example
    hidden = example["inputs"]["hidden_states"]
    assert hidden.shape[:2] == (1, 2)  # one real token and one padded: the smallest such row
    assert example["padding"].sum() == 1


def test_a_cache_written_one_slot_off_after_the_first_chunk_is_found_at_the_second_step():
    failure = found(ut.CachedAttention, ut.CachedAttention, init=HEADS,
                    inputs=lambda a: tpt.decoding_inputs(a["d_model"]),
                    cache=(ut.ConcatCache, ut.OffByOneCache))
    steps = failure.example["inputs"]
    assert [step["hidden_states"].shape[:2] for step in steps] == [(1, 1), (1, 1)]


def test_a_rotary_scale_after_a_bf16_cast_is_found_at_position_257():
    failure = found(ut.ThreeProjectionAttention, ut.EarlyCastRotaryAttention, init=ROTARY,
                    inputs=attention_inputs(positions=(0, 4096)), dtypes=["fp32", "bf16"])
    example = failure.example
    assert example["dtype"] == "bf16"
    # Two neighbours, the second at 257: the first integer bf16 rounds (to 256, the first's).
    assert example["inputs"]["position_ids"].tolist() == [[256, 257]]


@pytest.mark.parametrize(("old", "new", "init", "weight_map"), [
    pytest.param(ut.ThreeProjectionAttention, ut.FusedQKVAttention, HEADS, ut.FUSED_QKV,
                 id="fused-projections"),
    pytest.param(ut.ThreeProjectionAttention, ut.InterleavedRotaryAttention, ROTARY,
                 ut.interleave_rotary_rows, id="interleaved-rotary"),
])
def test_correct_twins_pass(old, new, init, weight_map):
    check_twins(old, new, init=init, weight_map=weight_map,
                inputs=attention_inputs(positions=(0, 4096), mask=tpt.MASKS[1:3]),
                dtypes=["fp32", "bf16"], backends=[None, "manual", "sdpa-math", "sdpa"])


def test_a_preallocated_cache_passes():
    check_twins(ut.CachedAttention, ut.CachedAttention, init=HEADS,
                inputs=lambda a: tpt.decoding_inputs(a["d_model"]),
                cache=(ut.ConcatCache, ut.PreallocatedCache), dtypes=["fp32", "bf16"])


@pytest.mark.transformers
def test_transformers_llama_attention_eager_and_sdpa_are_twins_under_an_additive_mask():
    hf = pytest.importorskip("hf_twins")
    check_twins(hf.LlamaSelfAttention, hf.LlamaSdpaSelfAttention, init=HEADS,
                inputs=attention_inputs(mask="additive", positions=(0, 4096)),
                dtypes=["fp32", "bf16"], backends=[None, "sdpa-math"])


@pytest.mark.transformers
def test_transformers_llama_attention_without_a_mask_is_causal_on_sdpa_only():
    # What the search found: called without a mask, the sdpa implementation is causal (it
    # passes is_causal for more than one query) and the eager one attends to every key.
    hf = pytest.importorskip("hf_twins")
    failure = found(hf.LlamaSelfAttention, hf.LlamaSdpaSelfAttention, init=HEADS,
                    inputs=attention_inputs(mask="causal"))
    assert failure.example["init"] == {"n_heads": 1, "n_kv_heads": 1, "d_model": 8}
    assert failure.example["inputs"]["hidden_states"].shape[:2] == (1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_correct_twins_pass_on_the_device_on_every_backend_it_offers(device, dtype):
    # flex compiles for every new shape (and has no backward on the CPU): tests/test_gpu.py's.
    offered = [name for name, why in available(device, torch_dtype(dtype)).items()
               if why is None and name != "flex"]
    check_twins(ut.ThreeProjectionAttention, ut.FusedQKVAttention, init=HEADS,
                weight_map=ut.FUSED_QKV, inputs=attention_inputs(positions=(0, 4096)),
                dtypes=[dtype], backends=[None, *offered], device=device)
