"""DecoderLM imported from tiny Hugging Face Llama models gives HF's logits."""

from __future__ import annotations

import pytest
import torch

import torchparity as tp
from torchparity.reference import zoo
from torchparity.reference.convert import from_hf_llama, to_hf_llama

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.transformers

VARIANTS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "bias": dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
}


def _hf_llama(dtype: torch.dtype, **overrides) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=64, rms_norm_eps=1e-6, rope_theta=500.0, attn_implementation="sdpa",
        **overrides,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():  # HF's init leaves biases at zero and norms at one: perturb them
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    return model.to(dtype)


def _hf_logits(hf_model, batch) -> torch.Tensor:
    mask = batch.get("attention_mask")
    kwargs = {}
    if mask is not None:  # HF takes positions explicitly; ours follow the mask
        kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        return hf_model(batch["input_ids"], **kwargs).logits


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_imported_llama_matches_hf_logits(variant: str, padding: str) -> None:
    hf32 = _hf_llama(torch.float32, **VARIANTS[variant])
    hf64 = _hf_llama(torch.float64, **VARIANTS[variant])
    ours = from_hf_llama(hf32)
    batch = zoo.make_batch(ours.config, batch_size=3, seq_len=12, seed=2, padding=padding)
    with torch.no_grad():
        candidate = ours(**batch)
    golden, baseline = _hf_logits(hf64, batch), _hf_logits(hf32, batch)
    real = batch["attention_mask"].bool() if padding != "none" else slice(None)
    # Padded query positions have no defined output (HF and we fill them differently).
    tp.assert_parity(candidate[real], golden[real], baseline=baseline[real], kind="forward")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_then_import_round_trips_bit_exactly(variant: str) -> None:
    hf_model = _hf_llama(torch.float32, **VARIANTS[variant])
    ours = from_hf_llama(hf_model)
    again = from_hf_llama(to_hf_llama(ours))
    assert ours.config == again.config
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_export_rejects_a_config_llama_cannot_express() -> None:
    model = tp.reference.build_model(zoo.get("alibi").config)
    with pytest.raises(ValueError, match="not Llama-compatible in field"):
        to_hf_llama(model)
