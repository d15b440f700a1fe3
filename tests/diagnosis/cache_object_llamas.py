"""One transformers Llama returning its cache in two forms: as the tuples of (keys, values)
per layer that releases up to 4.46 returned, and as the cache object later ones return; and
the cache object with its last layer's keys scaled (a change only the cache shows)."""
import torch
import transformers
from torch import nn

import torchparity as tp


def _llama():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)
    model = tp.init_weights(transformers.LlamaForCausalLM(config), seed=0).eval()
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}


class AsTuples(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=True)
        cache = out.past_key_values
        legacy = tuple((layer.keys, layer.values) for layer in cache.layers)
        return {"logits": out.logits, "past_key_values": legacy}


class AsObject(AsTuples):
    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=True)
        return {"logits": out.logits, "past_key_values": out.past_key_values}


def tuples():
    model, inputs = _llama()
    return AsTuples(model), inputs


def cache_object():
    model, inputs = _llama()
    return AsObject(model), inputs


class ScaledKeys(AsTuples):
    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=True)
        layer = out.past_key_values.layers[-1]
        layer.keys = layer.keys * 1.5  # out of place: the backward still reads the original
        return {"logits": out.logits, "past_key_values": out.past_key_values}


def cache_object_scaled_keys():
    model, inputs = _llama()
    return ScaledKeys(model), inputs
