"""Factories of sharded models, each with its own plan, for ``--nproc`` runs: a small
transformer written here and a tiny ``transformers`` Llama, each with an FSDP2 plan, a
tensor-parallel plan and both on a 2-D mesh; a GPT-2 (a tied embedding and head) and a BART
(an encoder-decoder) with FSDP2; the classic sharding bugs planted in a plan; and
faulty runs (a plan that does not divide the model's shapes, a rank 1 that dies, hangs,
raises, stops or computes a NaN alone); FSDP2 over a vocabulary of 101 rows, correct and with
a bug in the rows of its last, shorter shard.
The ranks import this file by its path."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import torchparity as tp

VOCAB, WIDTH, HEADS, LAYERS = 64, 32, 4, 2
#: A vocabulary no number of ranks above 1 divides (GPT-2's, 50257, is odd too).
ODD_VOCAB = 101


class Attention(nn.Module):
    """Multi-head self-attention whose head count comes from its projections' width: a
    tensor-parallel rank holds whole heads and runs them as its own."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                           is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attn = Attention(width, heads)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS,
                 hidden: int = 2 * WIDTH, layers: int = LAYERS,
                 block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(block(width, heads, hidden) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tokens(length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(0))


# --- plans ----------------------------------------------------------------------------------


def fsdp_plan(*stacks: str):
    """FSDP2: one unit per layer of each of ``model.<stacks>``, the rest in the root's, over
    the mesh's ``dp`` dimension."""
    def parallelize(model: nn.Module, mesh) -> None:
        for stack in stacks:
            for layer in model.get_submodule(stack):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])

    return parallelize


def tp_plan(layers: str, columns: tuple[str, ...], rows: tuple[str, ...]):
    """Tensor parallel over the mesh's ``tp`` dimension: ``columns`` of each layer split by
    output (heads, hidden units), ``rows`` by input, their partial sums reduced."""
    def parallelize(model: nn.Module, mesh) -> None:
        for layer in model.get_submodule(layers):
            parallelize_module(layer, mesh["tp"], {
                **{name: ColwiseParallel() for name in columns},
                **{name: RowwiseParallel() for name in rows}})

    return parallelize


def both(tensor_parallel, fsdp):
    """Tensor parallel inside each ``tp`` group, then FSDP2 across ``dp``: the 2-D plan."""
    def parallelize(model: nn.Module, mesh) -> None:
        tensor_parallel(model, mesh)
        fsdp(model, mesh)

    return parallelize


MINE_TP = tp_plan("layers", ("attn.q", "attn.k", "attn.v", "up"), ("attn.o", "down"))
MINE_FSDP = fsdp_plan("layers")
LLAMA_COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj")
LLAMA_TP = tp_plan("model.layers", LLAMA_COLUMNS, ("self_attn.o_proj", "mlp.down_proj"))
LLAMA_FSDP = fsdp_plan("model.layers")


# --- factories ------------------------------------------------------------------------------


def _mine(plan, mesh: dict[str, int], **sizes: int) -> dict:
    model = TinyLM(**sizes)
    tp.init_weights(model, seed=0)
    return {"model": model, "inputs": (tokens(),), "parallelize": plan, "mesh": mesh}


def _mine_on_meta(plan, mesh: dict[str, int], **sizes: int) -> dict:
    """The model built on the meta device, its weights filled by ``init``: under torchrun each
    rank materialises and fills only its part."""
    with torch.device("meta"):
        model = TinyLM(**sizes)
    return {"model": model, "inputs": (tokens(),), "parallelize": plan, "mesh": mesh,
            "init": lambda model: tp.init_weights(model, seed=0)}


def mine_tp_on_meta() -> dict:
    return _mine_on_meta(MINE_TP, {"tp": -1})


def mine_fsdp_on_meta() -> dict:
    return _mine_on_meta(MINE_FSDP, {"dp": -1})


def mine_fsdp() -> dict:
    return _mine(MINE_FSDP, {"dp": -1})


def mine_tp() -> dict:
    return _mine(MINE_TP, {"tp": -1})


def mine_fsdp_tp() -> dict:
    return _mine(both(MINE_TP, MINE_FSDP), {"dp": -1, "tp": 2})


def mine_uneven() -> dict:
    """Tensor parallel over an MLP of 33 hidden units, which 2 ranks cannot split."""
    return _mine(MINE_TP, {"tp": -1}, hidden=33)


def mine_odd_heads() -> dict:
    """Tensor parallel over attention of 3 heads of 16: 2 ranks would split one."""
    return _mine(MINE_TP, {"tp": -1}, width=48, heads=3)


def _dies_in_rank_one(model: nn.Module, mesh) -> None:
    MINE_FSDP(model, mesh)
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def mine_rank_one_dies() -> dict:
    return _mine(_dies_in_rank_one, {"dp": -1})


def _hangs_in_rank_one(model: nn.Module, mesh) -> None:
    MINE_FSDP(model, mesh)
    if int(os.environ["RANK"]) == 1:
        time.sleep(3600)


def mine_rank_one_hangs() -> dict:
    return _mine(_hangs_in_rank_one, {"dp": -1})


def _rank_one(hook):
    """A correct tensor-parallel plan, and ``hook(module, args, output)`` on rank 1's last
    layer: in the middle of its forward, between two collectives."""
    def parallelize(model: nn.Module, mesh) -> None:
        MINE_TP(model, mesh)
        if int(os.environ["RANK"]) == 1:
            model.layers[-1].register_forward_hook(hook)

    return parallelize


def _raise(module: nn.Module, args, output) -> None:
    raise ValueError("rank 1's own bug")


def _nan(module: nn.Module, args, output) -> torch.Tensor:
    return output.index_fill(-1, torch.tensor([0]), float("nan"))


def mine_rank_one_raises() -> dict:
    """The user's code raises on rank 1 only, inside its forward."""
    return _mine(_rank_one(_raise), {"tp": -1})


def mine_rank_one_stops() -> dict:
    """Rank 1 is stopped (SIGSTOP) inside its forward: alive, but it never answers."""
    return _mine(_rank_one(lambda *hooked: os.kill(os.getpid(), signal.SIGSTOP)), {"tp": -1})


def mine_rank_one_nan() -> dict:
    """Rank 1's last layer puts a NaN in its output, which every rank should hold alike."""
    return _mine(_rank_one(_nan), {"tp": -1})


def mine_fsdp_odd_vocab() -> dict:
    """FSDP2 over an embedding and head of 101 rows: the ranks hold 51 and 50 of them."""
    return _mine(MINE_FSDP, {"dp": -1}, vocab=ODD_VOCAB)


def _last_rows_scaled(model: nn.Module, mesh) -> None:
    """FSDP2, but the rows of the embedding that the last rank holds come out scaled."""
    MINE_FSDP(model, mesh)
    first = -(-ODD_VOCAB // mesh["dp"].size()) * (mesh["dp"].size() - 1)

    def scaled(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return torch.where((args[0] >= first)[..., None], output * (1 + 2**-8), output)

    model.embed.register_forward_hook(scaled)


def mine_fsdp_odd_vocab_last_rows_scaled() -> dict:
    return _mine(_last_rows_scaled, {"dp": -1}, vocab=ODD_VOCAB)


def _llama(plan, mesh: dict[str, int]) -> dict:
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    tp.init_weights(model, seed=0)
    return {"model": model, "inputs": {"input_ids": tokens()}, "parallelize": plan,
            "mesh": mesh}


def llama_fsdp() -> dict:
    return _llama(LLAMA_FSDP, {"dp": -1})


def llama_tp() -> dict:
    return _llama(LLAMA_TP, {"tp": -1})


def llama_fsdp_tp() -> dict:
    return _llama(both(LLAMA_TP, LLAMA_FSDP), {"dp": -1, "tp": 2})


def gpt2_fsdp() -> dict:
    """A transformers GPT-2, whose embedding and head share one weight (FSDP2's root unit
    holds it), sharded by FSDP2 on every block."""
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=64,
        bos_token_id=1, eos_token_id=2))
    tp.init_weights(model, seed=0)
    return {"model": model, "inputs": {"input_ids": tokens()},
            "parallelize": fsdp_plan("transformer.h"), "mesh": {"dp": -1}}


def bart_fsdp() -> dict:
    """A transformers BART sharded by FSDP2 on every layer of both sides: its decoding step
    runs the encoder by itself, not through the whole model's forward."""
    import transformers

    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, max_position_embeddings=64,
        decoder_start_token_id=2, forced_eos_token_id=None, pad_token_id=0,
        eos_token_id=None))
    tp.init_weights(model, seed=0)
    return {"model": model, "inputs": {"input_ids": tokens()},
            "parallelize": fsdp_plan("model.encoder.layers", "model.decoder.layers"),
            "mesh": {"dp": -1}}


def llama_tp_beams() -> dict:
    """Decoded by a beam search of 2 beams: each rank reorders its heads' cache rows."""
    return {**llama_tp(), "search": {"beams": 2}}


# --- the classic sharding bugs, each planted in an otherwise correct tensor-parallel plan -------


class _Unreduced(RowwiseParallel):
    """A row-parallel linear whose partial sums are never reduced: each rank goes on with its
    own share of the sum."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()


class _GatheredOutOfOrder(ColwiseParallel):
    """A column-parallel linear whose output is gathered with the ranks' columns in the
    wrong order."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        whole = outputs.redistribute(placements=[Replicate()]).to_local()
        return torch.cat(list(reversed(whole.chunk(device_mesh.size(), dim=-1))), dim=-1)


def _unreduced_rows(model: nn.Module, mesh) -> None:
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {
            **{name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "up")},
            "attn.o": _Unreduced(), "down": RowwiseParallel()})


def _columns_out_of_order(model: nn.Module, mesh) -> None:
    """The MLP's up projection split by columns and gathered back (down stays whole)."""
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {
            **{name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v")},
            "attn.o": RowwiseParallel(), "up": _GatheredOutOfOrder()})


def _up_as_dtensor(model: nn.Module, mesh) -> None:
    """A correct plan whose MLP up projection hands its columns on as a DTensor (the next
    module takes them as one): an output that each rank holds a part of."""
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {
            **{name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v")},
            "up": ColwiseParallel(use_local_output=False),
            "attn.o": RowwiseParallel(), "down": RowwiseParallel()})


def _norm_drifts(model: nn.Module, mesh) -> None:
    """A correct plan, but rank 1's copy of the replicated norm weights has drifted."""
    MINE_TP(model, mesh)
    if mesh["tp"].get_local_rank() == 1:
        with torch.no_grad():
            for layer in model.layers:
                layer.attn_norm.weight.mul_(1 + 2**-10)


def _heads_swapped(model: nn.Module, mesh) -> None:
    """Keys and values split by heads, but each rank gets another rank's heads: the query
    heads of one rank attend with the keys of another's."""
    with torch.no_grad():
        for layer in model.layers:
            for projection in (layer.attn.k, layer.attn.v):
                for tensor in (projection.weight, projection.bias):
                    tensor.copy_(torch.cat(list(reversed(tensor.chunk(2, dim=0)))))
    MINE_TP(model, mesh)


def _norm_grads_reduced_twice(model: nn.Module, mesh) -> None:
    """A correct plan, but the replicated norms' weight gradients, complete on every rank
    already, are summed across the ranks once more: every rank ends with twice the gradient.
    The forward is untouched."""
    MINE_TP(model, mesh)
    group = mesh["tp"].get_group()

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    for layer in model.layers:
        layer.mlp_norm.weight.register_hook(summed)


def mine_unreduced_rows() -> dict:
    return _mine(_unreduced_rows, {"tp": -1})


def _llama_unreduced_rows(model: nn.Module, mesh) -> None:
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], {
            **{name: ColwiseParallel() for name in LLAMA_COLUMNS},
            "self_attn.o_proj": _Unreduced(), "mlp.down_proj": RowwiseParallel()})


def llama_unreduced_rows() -> dict:
    return _llama(_llama_unreduced_rows, {"tp": -1})


def mine_up_as_dtensor() -> dict:
    return _mine(_up_as_dtensor, {"tp": -1})


def mine_columns_out_of_order() -> dict:
    return _mine(_columns_out_of_order, {"tp": -1})


def mine_norm_drifts() -> dict:
    return _mine(_norm_drifts, {"tp": -1})


def mine_heads_swapped() -> dict:
    return _mine(_heads_swapped, {"tp": -1})


def mine_norm_grads_reduced_twice() -> dict:
    return _mine(_norm_grads_reduced_twice, {"tp": -1})


# --- a wider model whose weights outweigh the interpreter: what BENCHMARKS.md measures ---------

WIDE = {"width": 1536, "heads": 16, "hidden": 3072, "layers": 8}


def wide_fsdp() -> dict:
    """151M parameters (604 MB in fp32): 8 layers of width 1536, sharded by FSDP2, built on
    the meta device: under torchrun each rank materialises only its part."""
    return _mine_on_meta(MINE_FSDP, {"dp": -1}, **WIDE)


def wide_tp() -> dict:
    return _mine_on_meta(MINE_TP, {"tp": -1}, **WIDE)


def wide_tp_long() -> dict:
    """The same on 2 x 128 tokens: its module outputs (110 MB a run in fp32) outweigh what
    judging one call at a time holds."""
    return {**wide_tp(), "inputs": (tokens(128),)}


def wide_tp_whole() -> dict:
    """The same model and plan, built whole by every rank before the plan shards it."""
    return _mine(MINE_TP, {"tp": -1}, **WIDE)


#: Five times as deep: 755M parameters (3.0 GB in fp32), where a rank's weights, not the
#: interpreter every process holds, make its peak.
DEEP = {**WIDE, "layers": 40}


def deep_fsdp() -> dict:
    return _mine_on_meta(MINE_FSDP, {"dp": -1}, **DEEP)


def deep_tp() -> dict:
    return _mine_on_meta(MINE_TP, {"tp": -1}, **DEEP)
