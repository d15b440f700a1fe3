"""float64 without a float64 copy: :class:`Float64Run` gives bit for bit the outputs, loss and
gradients of ``model.double()`` on transformers models and the zoo, holds at most the running
module's parameters in float64, leaves the model as it was and reports its blocks; gradients
of a run in the model's own dtype stream out one by one."""

from __future__ import annotations

import copy

import pytest
import torch

from torchparity.golden.cases import golden_batch
from torchparity.reference import build_model, sequence_loss, zoo
from torchparity.subject.blockwise import Float64Run, repeated_blocks, stream_grads
from torchparity.subject.running import projection_loss, upcast
from torchparity.subject.trees import flatten_tensors

transformers = pytest.importorskip("transformers")
import tiny_transformers  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.transformers


def _hf_loss(output, inputs):
    return projection_loss({"logits": output.logits})


def _zoo_loss(output, inputs):
    return sequence_loss(output, upcast(inputs, torch.float64))


def _subjects():
    ids = torch.randint(0, tiny_transformers.VOCAB, (2, 8),
                        generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    torch.manual_seed(0)
    yield "gpt2", tiny_transformers.gpt2().eval(), inputs, _hf_loss
    yield "llama", tiny_transformers.llama().eval(), inputs, _hf_loss
    case = zoo.get("encdec-prenorm")  # tied embeddings, two stacks, cross-attention
    yield case.name, build_model(case.config, 0), golden_batch(case), _zoo_loss


SUBJECTS = {name: rest for name, *rest in _subjects()}


def _reference(model, inputs, loss_fn):
    """What a float64 copy computes."""
    double = copy.deepcopy(model).double()
    output = double(**upcast(inputs, torch.float64))
    loss = loss_fn(output, inputs)
    params = dict(double.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return flatten_tensors(output), loss, {
        n: torch.zeros_like(p) if g is None else g
        for (n, p), g in zip(params.items(), grads, strict=True)}


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_float64_run_equals_a_float64_copy_bit_for_bit(name):
    model, inputs, loss_fn = SUBJECTS[name]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    outputs, loss, grads = _reference(model, inputs, loss_fn)
    found, most_float64 = {}, []

    def count_float64(module, args, output):
        # While any module runs, only the modules that are running hold float64 weights (by
        # their storage: a parameter's dtype reads float64 all through the run).
        most_float64.append(sum(p.element_size() == 8 for p in model.parameters()))

    hooks = [m.register_forward_hook(count_float64) for m in model.modules()]
    with Float64Run(model, on_grad=found.__setitem__) as run:
        output = model(**upcast(inputs, torch.float64))
        run.backward(loss_fn(output, inputs))
    for hook in hooks:
        hook.remove()
    assert all(torch.equal(t, outputs[p]) for p, t in flatten_tensors(output).items())
    assert torch.equal(loss_fn(output, inputs), loss)
    assert found.keys() == grads.keys()
    assert all(torch.equal(found[n], g) for n, g in grads.items())
    assert max(most_float64) <= 2  # the weight and bias of the module that just ran
    assert all(torch.equal(v, state[k]) and v.dtype == state[k].dtype
               for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_decoding_under_no_grad_runs_in_float64():
    model, inputs, _ = SUBJECTS["llama"]
    double = copy.deepcopy(model).double()
    with torch.no_grad():
        expected = double(**upcast(inputs, torch.float64)).logits
        with Float64Run(model):
            logits = model(**upcast(inputs, torch.float64)).logits
    assert logits.dtype == torch.float64 and torch.equal(logits, expected)


class _FillsInTheDefaultDtype(torch.nn.Module):
    """Makes a mask in the default dtype with its input's minimum, as transformers 4.46's GPT-2
    makes its causal mask: in float32 that minimum of float64 overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        hidden = torch.full(h.shape, torch.finfo(h.dtype).min).triu(1)
        return (h + hidden).softmax(-1)


def test_tensors_made_in_the_default_dtype_are_float64_and_it_is_restored():
    torch.manual_seed(0)
    model, x = _FillsInTheDefaultDtype(), torch.randn(2, 4, 4, dtype=torch.float64)
    with Float64Run(model):
        probs = model(x)
    assert torch.get_default_dtype() == torch.float32
    assert probs.dtype == torch.float64
    # The row's first entry is all the softmax sees: the float64 minimum hides the others.
    torch.testing.assert_close(probs[..., 0, 0], torch.ones(2, dtype=torch.float64))


def test_progress_names_each_block_forward_and_backward():
    model, inputs, loss_fn = SUBJECTS["gpt2"]
    seen = []
    with Float64Run(model, on_grad=lambda n, g: None,
                    progress=lambda *report: seen.append(report)) as run:
        run.backward(loss_fn(model(**upcast(inputs, torch.float64)), inputs))
    blocks = len(repeated_blocks(model))
    assert blocks == tiny_transformers.LAYERS
    assert seen == [("forward", i, blocks) for i in range(1, blocks + 1)] + [
        ("backward", i, blocks) for i in range(1, blocks + 1)]


def test_an_exception_leaves_the_model_as_it_was():
    model, inputs, _ = SUBJECTS["gpt2"]
    with pytest.raises(RuntimeError, match="stop"), Float64Run(model, on_grad=lambda *a: None):
        model.transformer.h[1].register_forward_pre_hook(_stop)
        model(**upcast(inputs, torch.float64))
    model.transformer.h[1]._forward_pre_hooks.clear()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} <= {torch.float32}


def _stop(*args):
    raise RuntimeError("stop")


def test_streamed_gradients_equal_autograds_and_leave_grad_alone():
    model, inputs, loss_fn = SUBJECTS["llama"]
    params = dict(model.named_parameters())
    expected = torch.autograd.grad(loss_fn(model(**inputs), inputs), list(params.values()))
    marker = torch.ones_like(model.lm_head.weight)
    model.lm_head.weight.grad = marker
    found = {}
    stream_grads(model, loss_fn(model(**inputs), inputs), found.__setitem__)
    assert found.keys() == params.keys()
    assert all(torch.equal(found[n], g) for n, g in zip(params, expected, strict=True))
    assert model.lm_head.weight.grad is marker
    model.lm_head.weight.grad = None


def test_a_parameter_s_own_gradient_hooks_act_on_its_float64_gradient():
    # A sharding plan may reduce a gradient in a hook on its parameter; model.double() runs it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = torch.randn(5, 4, dtype=torch.float64)
    double = copy.deepcopy(model).double()
    expected = dict(zip(("0.weight", "0.bias", "1.weight", "1.bias"),
                        torch.autograd.grad(double(x).sum(), list(double.parameters())),
                        strict=True))
    model[0].weight.register_hook(lambda grad: 3 * grad)
    found = {}
    with Float64Run(model, on_grad=found.__setitem__) as run:
        run.backward(model(x).sum())
    assert torch.equal(found["0.weight"], 3 * expected["0.weight"])
    assert all(torch.equal(found[name], expected[name]) for name in ("0.bias", "1.weight",
                                                                     "1.bias"))


class _ReadsParametersOutside(torch.nn.Module):
    """Parameters used outside their module's forward: a tied head read directly, as
    Megatron's output layer reads the embedding, and a weight passed as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.emb(tokens)) * self.scale
        return x @ self.emb.weight.t() + torch.nn.functional.linear(x, self.proj.weight).sum()


def test_parameters_read_outside_their_module_run_in_float64_bit_for_bit():
    torch.manual_seed(0)
    model, tokens = _ReadsParametersOutside(), torch.randint(0, 10, (2, 5))
    outputs, loss, grads = _reference(model, {"tokens": tokens},
                                     lambda out, _: out.square().sum())
    found = {}
    with Float64Run(model, on_grad=found.__setitem__) as run:
        output = model(tokens)
        run.backward(output.square().sum())
        with torch.no_grad():
            decoded = model(tokens)
    assert output.dtype == torch.float64 and torch.equal(output, outputs["output"])
    assert torch.equal(decoded, outputs["output"])
    # The embedding's gradient sums its lookup's and the head's, delivered once.
    assert found.keys() == grads.keys()
    assert all(torch.equal(found[n], g) for n, g in grads.items())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


class _CastsToAnotherModulesDtype(torch.nn.Module):
    """Casts its input to the dtype of a module's weight before that module runs, as
    transformers' DeepSeek-V3.2 indexer does: a model cast to float64 reads float64 there."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


def test_a_parameter_s_dtype_read_outside_its_module_is_float64():
    torch.manual_seed(0)
    model, x = _CastsToAnotherModulesDtype(), torch.randn(2, 4)
    expected = copy.deepcopy(model).double()(x.double())
    with Float64Run(model):
        output = model(x.double())
    assert output.dtype == torch.float64 and torch.equal(output, expected)
    assert model.proj.weight.dtype == torch.float32


class _HoldsAPlainTable(torch.nn.Module):
    """Angles precomputed in float32 and held as a plain attribute, not a buffer: a model
    cast to float64 keeps them in float32, the golden run casts them with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.angles = torch.linspace(0.0, 1.0, 16).reshape(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ self.angles.cos()  # a float32 cos without the cast


def test_a_table_held_as_a_plain_attribute_is_cast_with_the_model():
    torch.manual_seed(0)
    model, x = _HoldsAPlainTable(), torch.randn(2, 4, dtype=torch.float64)
    angles = model.angles
    expected = torch.nn.functional.linear(x, model.proj.weight.double(),
                                          model.proj.bias.double()) @ angles.double().cos()
    with Float64Run(model):
        output = model(x)
    assert output.dtype == torch.float64 and torch.equal(output, expected)
    assert model.angles is angles
