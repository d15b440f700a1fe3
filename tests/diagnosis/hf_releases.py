"""A tiny random Llama and GPT-2 with the same weights under any transformers release (4.46 and
5.x alike), plain factories: torchparity decodes them with its built-in step.

Weights are drawn per parameter from a generator seeded by the parameter's name, so two
releases that initialise in another order still hold the same numbers. ``TP_PLANT=1`` plants a
bug in the cached decoding path of the attention (the query of a single new token scaled by
1.05, inside the attention's own code) of the release it runs under.

``llama_cached`` and ``mistral_cached`` run with ``use_cache=True``, so that every layer and
attention is handed the cache object (a ``DynamicCache`` in both releases); ``TP_PLANT=mask``
makes their layer 1 hand its attention a mask on which the last query no longer sees key 0,
a change that enters through an argument (the layer's own code is otherwise A's).
"""

import functools
import os
import zlib

import torch
import transformers

VOCAB = 64


def prompt() -> dict:
    ids = torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _same_weights(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            drawn = torch.randn(parameter.shape,
                                generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            norm = parameter.dim() == 1 and "bias" not in name
            parameter.copy_(1 + 0.1 * drawn if norm else 0.3 * drawn)
    return model.eval()


def _eager(config):
    config._attn_implementation = "eager"
    return config


def _scaled_when_cached(attention):
    """``attention(module, query, ...)`` with the query of a single new token scaled."""
    def planted(module, query, *args, **kwargs):
        return attention(module, query * 1.05 if query.shape[-2] == 1 else query, *args,
                         **kwargs)

    return planted


def llama():
    if os.environ.get("TP_PLANT"):
        from transformers.models.llama import modeling_llama

        original = modeling_llama.apply_rotary_pos_emb

        def rotated(q, k, *args, **kwargs):
            q, k = original(q, k, *args, **kwargs)
            return (q * 1.05 if q.shape[-2] == 1 else q), k

        modeling_llama.apply_rotary_pos_emb = rotated
    config = _eager(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB))
    return _same_weights(transformers.LlamaForCausalLM(config)), prompt()


def gpt2():
    if os.environ.get("TP_PLANT"):
        from transformers.models.gpt2 import modeling_gpt2

        modeling_gpt2.eager_attention_forward = _scaled_when_cached(
            modeling_gpt2.eager_attention_forward)
    config = _eager(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            vocab_size=VOCAB, bos_token_id=1, eos_token_id=2))
    return _same_weights(transformers.GPT2LMHeadModel(config)), prompt()


def _blocks_first_key(layer):
    """``layer`` handing its attention a mask on which the last query cannot see key 0."""
    forward = layer.forward

    @functools.wraps(forward)
    def planted(*args, **kwargs):
        mask = kwargs["attention_mask"].clone()
        mask[..., -1, 0] = torch.finfo(mask.dtype).min
        return forward(*args, **{**kwargs, "attention_mask": mask})

    layer.forward = planted


def _cached(model):
    if os.environ.get("TP_PLANT") == "mask":
        _blocks_first_key(model.model.layers[1])
    return _same_weights(model), {**prompt(), "use_cache": True}


def llama_cached():
    return _cached(transformers.LlamaForCausalLM(_eager(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB))))


def mistral_cached():
    return _cached(transformers.MistralForCausalLM(_eager(transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB,
        sliding_window=None))))
