"""The op drill-down: a planted one-line change is named at its line of B.

Each plant (tests/diagnosis/op_plants.py) changes one line of one module of a zoo model, and
marks it ``# planted``; the expected line is read from the plant's source, independently of the
diagnosis. Changes that compute the same thing (a reordered sum, a fused projection, sdpa for
eager attention) must yield no divergent op.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shlex
from pathlib import Path

import op_plants as plants
import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.diagnosis.stages.ops.align import align_steps
from torchparity.diagnosis.stages.ops.capture import capture_steps
from torchparity.errors import UsageError
from torchparity.reference import build_model, sequence_loss, zoo

pytestmark = pytest.mark.usefixtures("single_thread")


def planted_line(cls: object) -> str:
    """``path:line`` of the line marked ``# planted`` in the source of ``cls`` (a class or a
    function)."""
    lines, start = inspect.getsourcelines(cls)
    offset = next(i for i, line in enumerate(lines) if "# planted" in line)
    return f"{os.path.relpath(inspect.getsourcefile(cls))}:{start + offset}"


def model_and_batch(case: str) -> tuple[nn.Module, dict]:
    config = zoo.get(case).config
    return build_model(config, seed=0), zoo.make_batch(config, batch_size=2, seq_len=12, seed=0)


PLANTS = [
    (plants.RMSNormEps, "llama-tiny", "decoder.layers.1.attn_norm", "differs"),
    (plants.RMSNormNoWeight, "llama-tiny", "decoder.layers.0.mlp_norm", "only in B"),
    (plants.LayerNormEps, "rotary-interleaved", "decoder.layers.0.attn_norm", "differs"),
    (plants.MLPActivation, "llama-tiny", "decoder.layers.0.mlp", "only in B"),
    (plants.MLPSwapped, "llama-tiny", "decoder.layers.1.mlp", "differs"),
    (plants.AttentionScale, "llama-tiny", "decoder.layers.0.attn", "only in B"),
    (plants.AttentionMergeHeads, "llama-tiny", "decoder.layers.1.attn", "only in B"),
    (plants.AttentionValuesFromKeys, "llama-tiny", "decoder.layers.0.attn", "only in B"),
    (plants.AttentionPartialRotary, "llama-tiny", "decoder.layers.0.attn", "differs"),
    (plants.AttentionFutureKeys, "nope-postnorm", "decoder.layers.0.attn", "only in B"),
    (plants.LayerResidual, "llama-tiny", "decoder.layers.1", "only in B"),
]
#: Every plant runs in the slow suite; these three kinds (a norm's argument, an activation,
#: an op inserted in attention) in the default one.
FAST = {plants.LayerNormEps, plants.MLPActivation, plants.AttentionScale}


@pytest.mark.parametrize("plant, case, module, kind", [
    pytest.param(*p, id=p[0].__name__,
                 marks=() if p[0] in FAST else pytest.mark.slow) for p in PLANTS])
def test_planted_line_is_named(plant: type, case: str, module: str, kind: str) -> None:
    model_a, batch = model_and_batch(case)
    model_b = copy.deepcopy(model_a)
    model_b.get_submodule(module).__class__ = plant
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, backward=False)
    op = report.to_dict()["first_divergence"]["op"]
    assert op is not None and op["found"], report.render()
    assert planted_line(plant) in op["b_stack"], report.render()
    assert op["kind"] == kind, report.render()
    summary = report.summary()
    assert summary.count("It enters") == 1, summary  # the module, then the op, then the line
    sentence = summary[summary.index("It enters at "):]
    assert re.match(rf"It enters at {re.escape(module)}\b[^;]*, in {re.escape(op['name'])}[ ,]",
                    sentence), summary


def test_changed_argument_is_named() -> None:
    model_a, batch = model_and_batch("rotary-interleaved")
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[0].attn_norm.__class__ = plants.LayerNormEps
    eps = model_a.decoder.layers[0].attn_norm.eps
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, backward=False)
    op = report.to_dict()["first_divergence"]["op"]
    assert op["name"] == "aten::native_layer_norm"
    assert op["arguments"] == [f"eps {eps!r} (A) vs 0.001 (B)"], op["arguments"]
    assert f"eps {eps!r} (A) vs 0.001 (B)" in report.summary()


@pytest.mark.parametrize("twin, module", [
    (plants.ResidualReordered, "decoder.layers.0"),
    (plants.FusedProjection, "decoder.layers.0.attn"),
])
def test_legitimate_change_has_no_divergent_op(twin: type, module: str) -> None:
    model_a, batch = model_and_batch("llama-tiny")
    model_b = copy.deepcopy(model_a)
    model_b.get_submodule(module).__class__ = twin
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, backward=False,
                         ops=module)
    assert report.first_divergence is None, report.render()
    ops = report.row(module).ops
    assert ops is not None and ops.answer is None, report.render()
    assert "No op of" not in report.summary()  # no divergence: nothing to explain
    one_sided = [line.pair.kind for line in ops.lines if line.pair.kind != "paired"]
    if twin is plants.FusedProjection:  # the fused matmul and its split are B's alone
        assert "only in B" in one_sided and "only in A" in one_sided


@pytest.mark.parametrize("plant, module", [
    (plants.LayerNormEps, "decoder.layers.0.attn_norm"),
    (plants.FusedProjection, "decoder.layers.0.attn")])
def test_big_op_outputs_are_kept_as_sketches_and_judged_from_them(monkeypatch, plant: type,
                                                                  module: str) -> None:
    """Op outputs as large as a layer's hidden states are kept as sketches (here from the
    first byte kept): the planted eps is still named at its line, from the sketch of its
    output, and a fused projection still yields no divergent op."""
    from torchparity.diagnosis.stages.ops import capture
    from torchparity.sketching import Sketch

    model_a, batch = model_and_batch("rotary-interleaved")
    hidden = model_a.decoder.layers[0].attn_norm.weight.numel() * batch["input_ids"].numel()
    monkeypatch.setattr(capture, "wants_sketch",
                        lambda t: t.is_floating_point() and t.numel() >= hidden)
    monkeypatch.setattr(capture, "KEPT_WHOLE_BYTES", 0)
    model_b = copy.deepcopy(model_a)
    model_b.get_submodule(module).__class__ = plant
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, backward=False,
                         ops=module)
    ops = report.row(module).ops
    sketched = [line for line in ops.lines if line.pair.b is not None and
                any(isinstance(t, Sketch) for t in line.pair.b.outputs.values())]
    assert sketched, report.render()
    if plant is plants.FusedProjection:
        assert ops.answer is None, ops.sentence()
        return
    answer = ops.answer
    assert answer is not None and answer in sketched, report.render()
    assert planted_line(plant) in [str(frame) for frame in answer.pair.b.stack]
    notes = [note for t in answer.local.tensors for note in t.notes]
    assert not answer.local.ok and any(note.startswith("sketched") for note in notes), notes


def test_nothing_diverges_nothing_drilled() -> None:
    model_a, batch = model_and_batch("llama-tiny")
    report = tp.diagnose(model_a, copy.deepcopy(model_a), batch, loss_fn=sequence_loss,
                         backward=False)
    assert all(r.ops is None for r in report.rows)
    assert report.to_dict()["first_divergence"] is None


def test_ops_of_an_unknown_module_is_one_clear_error() -> None:
    model_a, batch = model_and_batch("llama-tiny")
    with pytest.raises(UsageError, match="--ops decoder.nowhere: B has no recorded call"):
        tp.diagnose(model_a, copy.deepcopy(model_a), batch, backward=False,
                    ops="decoder.nowhere")


# --- alignment: streams of any length, order and fusion -------------------------------------


class Reordered(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(x)
        b = torch.sigmoid(x)
        return a * b


class Swapped(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = torch.sigmoid(x)
        a = torch.tanh(x)
        return a * b


class Fused(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x, approximate="tanh")


class Unfused(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = 0.7978845608 * (x + 0.044715 * x.pow(3))
        return 0.5 * x * (1 + torch.tanh(inner))


class Empty(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def steps(module: nn.Module) -> list:
    return capture_steps(module, (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),),
                         {})


@pytest.mark.parametrize("left, right", [(Reordered, Swapped), (Fused, Unfused),
                                         (Unfused, Fused), (Empty, Unfused), (Unfused, Empty)])
def test_alignment_never_raises_and_accounts_for_every_step(left: type, right: type) -> None:
    a, b = steps(left()), steps(right())
    pairs = align_steps(a, b)
    assert sorted(p.a.index for p in pairs if p.a is not None) == list(range(len(a)))
    assert sorted(p.b.index for p in pairs if p.b is not None) == list(range(len(b)))
    if left is Reordered:  # the same ops in another order: every one paired, one moved
        assert all(p.kind == "paired" for p in pairs) and sum(p.moved for p in pairs) == 1
    longer = "only in A" if len(a) > len(b) else "only in B"
    assert sum(p.kind == longer for p in pairs) >= abs(len(a) - len(b))


def test_gelu_approximation_is_named_as_an_argument() -> None:
    class Exact(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(x)

    pairs = align_steps(steps(Exact()), steps(Fused()))
    assert [p.differences for p in pairs] == [["approximate default (A) vs 'tanh' (B)"]]


def test_op_stack_names_the_line_and_its_text() -> None:
    (step,) = steps(Fused())
    frame = step.stack[0]
    lines, start = inspect.getsourcelines(Fused.forward)
    assert frame.line == start + 1 and frame.text == lines[1].strip()
    assert frame.path == os.path.relpath(__file__)


# --- tiny transformers models ----------------------------------------------------------------


def hf_inputs() -> dict:
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the mask reaches every attention path
    return {"input_ids": ids, "attention_mask": mask, "use_cache": False}


@pytest.mark.transformers
@pytest.mark.parametrize("plant", [
    "scores", pytest.param("activation", marks=pytest.mark.slow)])
def test_planted_line_in_transformers_llama_is_named(plant: str) -> None:
    import hf_op_plants

    import tiny_transformers
    from torchparity.subject import hf

    torch.manual_seed(0)
    model_a = tiny_transformers.llama().eval()
    hf.set_attention(model_a, "eager")
    model_b = copy.deepcopy(model_a)
    if plant == "scores":
        hf.set_attention(model_b, hf_op_plants.SCALED_SCORES)
        where, kind = hf_op_plants.scaled_scores_attention, "differs"
    else:
        model_b.model.layers[1].mlp.__class__ = hf_op_plants.GeluMLP
        where, kind = hf_op_plants.GeluMLP, "only in B"
    report = tp.diagnose(model_a, model_b, hf_inputs())
    op = report.to_dict()["first_divergence"]["op"]
    assert op is not None and op["found"], report.render()
    assert planted_line(where) in op["b_stack"] and op["kind"] == kind, report.render()


def planted_lines(function: object) -> list[str]:
    """``path:line`` of every line marked ``# planted`` in ``function``'s source."""
    lines, start = inspect.getsourcelines(function)
    path = os.path.relpath(inspect.getsourcefile(function))
    return [f"{path}:{start + i}" for i, line in enumerate(lines) if "# planted" in line]


@pytest.mark.transformers
@pytest.mark.parametrize("capped", ["A", "B"])
def test_ops_one_side_alone_applies_are_the_answer_with_their_lines(capped: str) -> None:
    """Scores soft-capped on one side only (three ops the other has no counterpart of): the
    answer names that run, its ops and lines, not the paired op that reads it."""
    import hf_op_plants

    import tiny_transformers
    from torchparity.subject import hf

    torch.manual_seed(0)
    plain = tiny_transformers.llama(initializer_range=0.2).eval()  # scores the cap bends
    hf.set_attention(plain, "eager")
    capping = copy.deepcopy(plain)
    hf.set_attention(capping, hf_op_plants.SOFTCAPPED_SCORES)
    model_a, model_b = (capping, plain) if capped == "A" else (plain, capping)
    report = tp.diagnose(model_a, model_b, hf_inputs(), backward=False)
    found = report.to_dict()["first_divergence"]
    assert found["module"] == "model.layers.0.self_attn", report.render()
    op = found["op"]
    assert op["kind"] == f"only in {capped}", report.render()
    lines = planted_lines(hf_op_plants.softcapped_scores_attention)
    assert [d["line"] for d in op["dropped"]] == lines, report.render()
    assert [d["name"] for d in op["dropped"]] == ["aten::div.Tensor", "aten::tanh",
                                                  "aten::mul.Tensor"], report.render()
    other = "B" if capped == "A" else "A"
    span = f"{lines[0]}..{lines[-1].rpartition(':')[2]}"
    assert f"3 ops only in {capped}" in report.summary(), report.render()
    assert span in report.summary() and f"{other} has no counterpart" in report.summary()


@pytest.mark.transformers
def test_scores_soft_capped_by_eager_and_not_by_sdpa_diverge_in_the_attention() -> None:
    """Eager hands its attention an additive float mask, sdpa a bool one: B's attention is
    replayed on A's mask in B's form, so the attention itself is the first divergence (as in
    a release whose sdpa path had no argument for the soft-cap), not the model around it."""
    import hf_op_plants

    import tiny_transformers
    from torchparity.subject import hf

    torch.manual_seed(0)
    capping = tiny_transformers.llama(initializer_range=0.2).eval()
    hf.set_attention(capping, hf_op_plants.SOFTCAPPED_SCORES)
    sdpa = copy.deepcopy(capping)
    hf.set_attention(sdpa, "sdpa")
    report = tp.diagnose(capping, sdpa, hf_inputs(), backward=False)
    assert report.first_divergence.module == "model.layers.0.self_attn", report.render()
    notes = " ".join(report.row("model.layers.0.self_attn").notes)
    assert "attention_mask in B's form (boolean attend)" in notes, notes


class StaticCacheDecoding(nn.Module):
    """A prompt, then one token, through a ``transformers`` ``StaticCache`` made per call."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        from transformers import StaticCache

        cache = StaticCache(config=self.lm.config, max_cache_len=16)
        prompt = self.lm(input_ids=ids, past_key_values=cache, use_cache=True).logits
        step = self.lm(input_ids=token, past_key_values=cache, use_cache=True).logits
        return torch.cat((prompt, step), 1)


@pytest.mark.transformers
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_the_float64_golden_writes_into_its_own_float64_static_cache() -> None:
    """The decoding step's attention gets the float32 StaticCache; its float64 golden, in the
    module replays and in the drill-down, gets a float64 copy to write into, so the planted
    line is named at the step and every module of it has a local error."""
    import hf_op_plants

    import tiny_transformers
    from torchparity.subject import hf

    torch.manual_seed(0)
    lm = tiny_transformers.llama().eval()
    hf.set_attention(lm, "eager")
    model_a = StaticCacheDecoding(lm)
    model_b = copy.deepcopy(model_a)
    hf.set_attention(model_b.lm, hf_op_plants.SCALED_SCORES)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    token = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(1))
    step_attention = "lm.model.layers.0.self_attn#1"
    report = tp.diagnose(model_a, model_b, (ids, token), backward=False, local="all",
                         ops=step_attention)
    row = report.row(step_attention)
    assert row.local is not None and not row.local.ok, row.notes
    assert row.ops is not None and row.ops.answer is not None and not row.ops.notes, row.notes
    assert planted_line(hf_op_plants.scaled_scores_attention) in \
        [str(frame) for frame in row.ops.answer.pair.b.stack], row.ops.sentence()


@pytest.mark.transformers
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_eager_vs_sdpa_at_a_static_cache_step_has_no_divergent_op() -> None:
    """At the decoding step, eager reshapes its keys to (batch * heads, keys, dim) for its
    matmuls and sdpa views them per key-value group: layouts of other ranks are not one
    computation, so they are not paired (which would read as a shape that diverges)."""
    import tiny_transformers
    from torchparity.subject import hf

    torch.manual_seed(0)
    lm = tiny_transformers.llama().eval()
    hf.set_attention(lm, "eager")
    model_a = StaticCacheDecoding(lm)
    model_b = copy.deepcopy(model_a)
    hf.set_attention(model_b.lm, "sdpa")
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    token = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(1))
    step_attention = "lm.model.layers.0.self_attn#1"
    report = tp.diagnose(model_a, model_b, (ids, token), backward=False, ops=step_attention)
    ops = report.row(step_attention).ops
    assert ops is not None and ops.answer is None, ops.sentence()


@pytest.mark.transformers
@pytest.mark.parametrize("family, attention", [
    ("llama", "model.layers.0.self_attn"),
    pytest.param("gpt2", "transformer.h.0.attn", marks=pytest.mark.slow)])
def test_transformers_eager_vs_sdpa_has_no_divergent_op(family: str, attention: str) -> None:
    import tiny_transformers
    from torchparity.subject import hf

    torch.manual_seed(0)
    eager = getattr(tiny_transformers, family)().eval()
    hf.set_attention(eager, "eager")
    sdpa = copy.deepcopy(eager)
    hf.set_attention(sdpa, "sdpa")
    report = tp.diagnose(eager, sdpa, hf_inputs(), ops=attention)
    ops = report.row(attention).ops
    assert ops is not None and ops.answer is None, report.render()
    kinds = {line.pair.kind for line in ops.lines}
    assert {"only in A", "only in B"} <= kinds  # eager's matmuls and softmax, sdpa's kernel


# --- the command line ------------------------------------------------------------------------


def test_command_line_names_the_planted_line_in_80_columns(tmp_path, capsys) -> None:
    from torchparity import cli

    plants_file = inspect.getsourcefile(plants)
    entries = [f"{plants_file}:make_a", f"{plants_file}:make_b_scale"]
    assert cli.main(["diagnose", *entries, "--no-backward",
                     "--json", str(tmp_path / "d.json")]) == 1
    out = capsys.readouterr().out
    op = json.loads((tmp_path / "d.json").read_text())["first_divergence"]["op"]
    assert planted_line(plants.AttentionScale) in op["b_stack"]
    table = out[out.index("op of decoder.layers.1.attn"):].splitlines()
    assert any(planted_line(plants.AttentionScale) in line for line in table)  # never cut
    assert all(len(line) <= 80 for line in table), out
    # under the module's row, closed by the one sentence, which is said there only
    above = out[:out.index("op of decoder.layers.1.attn")].splitlines()
    assert above[-2].endswith(" decoder.layers.1.attn"), out
    assert out.count("It enters") == 1
    sentence = next(i for i, line in enumerate(table) if "It enters at" in line)
    assert table[sentence].startswith(" It enters at decoder.layers.1.attn, in aten::"), out
    assert any(line.endswith(" decoder.layers.1.mlp_norm") for line in table[sentence:])


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    """A's trace of ``make_a``, without and with its ops of the planted attention."""
    from torchparity import cli

    folder = tmp_path_factory.mktemp("traces")
    entry = f"{inspect.getsourcefile(plants)}:make_a"
    for name, ops in (("plain", []), ("ops", ["--ops", "decoder.layers.1.attn"])):
        assert cli.main(["record", entry, "--no-backward", "-o", str(folder / name), *ops]) == 0
    return {"plain": folder / "plain", "ops": folder / "ops"}


def test_against_a_trace_with_ops_names_the_planted_line_as_in_process(traces, tmp_path,
                                                                        capsys) -> None:
    from torchparity import cli

    plants_file = inspect.getsourcefile(plants)
    assert cli.main(["diagnose", f"{plants_file}:make_b_scale", "--against",
                     str(traces["ops"]), "--json", str(tmp_path / "d.json")]) == 1
    op = json.loads((tmp_path / "d.json").read_text())["first_divergence"]["op"]
    assert planted_line(plants.AttentionScale) in op["b_stack"]
    model_a, batch, loss = plants.make_a()
    in_process = tp.diagnose(model_a, plants.make_b_scale()[0], batch, loss_fn=loss,
                             backward=False).to_dict()["first_divergence"]["op"]
    same = ("name", "kind", "a_stack", "b_stack", "code", "arguments")
    assert {k: op[k] for k in same} == {k: in_process[k] for k in same}
    assert len(op["steps"]) == len(in_process["steps"])
    capsys.readouterr()


def test_against_a_trace_with_sketched_op_outputs_names_the_planted_line(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHPARITY_SKETCH_ABOVE", "64")  # every op output past it is sketched
    model_a, batch, loss = plants.make_a()
    trace = tp.record(model_a, batch, tmp_path / "t", loss_fn=loss, backward=False,
                      ops="decoder.layers.1.attn")
    report = tp.diagnose_against(trace, plants.make_b_scale()[0], batch, loss_fn=loss)
    op = report.to_dict()["first_divergence"]["op"]
    assert op is not None and planted_line(plants.AttentionScale) in op["b_stack"], \
        report.render()


class _NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.up(x)) * 2  # a library module's call: its caller has the line


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head = _NormBlock(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.block(x))


class _RootNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(self.up(x)) * 2)  # the root's own call of a library module


@pytest.mark.parametrize("net, norm, caller, source", [
    (_NormNet, "block.norm", "block", _NormBlock), (_RootNorm, "norm", "(model)", _RootNorm)])
def test_more_ops_records_a_library_modules_caller_and_answers_as_in_process(
        tmp_path, net: type, norm: str, caller: str, source: type) -> None:
    """A library module's own ops have no line of ours: its caller's call is recorded too,
    the model's root (named as reports name it) as any other, and names the caller's line."""
    model_a, x = net(), torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    model_b = copy.deepcopy(model_a)
    model_b.get_submodule(norm).eps = 1e-2  # nn.LayerNorm's own code has no line of ours
    trace = tp.record(model_a, (x,), tmp_path / "plain", backward=False)
    asked = []

    def more_ops(modules: list[str]) -> Path:
        asked.append(modules)
        return tp.record(model_a, (x,), tmp_path / "ops", backward=False,
                         ops=",".join(modules), ops_only=True)

    op = tp.diagnose_against(trace, model_b, (x,), more_ops=more_ops
                             ).to_dict()["first_divergence"]["op"]
    in_process = tp.diagnose(model_a, model_b, (x,), backward=False
                             ).to_dict()["first_divergence"]["op"]
    assert asked == [[norm, caller]]
    same = ("module", "name", "kind", "a_stack", "b_stack", "code", "arguments")
    assert {k: op[k] for k in same} == {k: in_process[k] for k in same}
    lines, start = inspect.getsourcelines(source.forward)
    line = next(start + i for i, text in enumerate(lines) if "self.norm(" in text)
    assert op["b_stack"][0] == f"{os.path.relpath(__file__)}:{line}", op


def test_against_a_trace_without_ops_prints_the_command_that_adds_them(tmp_path,
                                                                       capsys) -> None:
    """The note names the trace's own record command with --ops: run as printed, the next
    diagnosis drills down to the op."""
    from torchparity import cli

    plants_file = inspect.getsourcefile(plants)
    trace = tmp_path / "plain"
    assert cli.main(["record", f"{plants_file}:make_a", "--no-backward", "-o", str(trace)]) == 0
    diagnose = ["diagnose", f"{plants_file}:make_b_scale", "--against", str(trace),
                "--json", str(tmp_path / "d.json")]
    assert cli.main(diagnose) == 1
    assert json.loads((tmp_path / "d.json").read_text())["first_divergence"]["op"] is None
    out = "".join(capsys.readouterr().out.split())  # a path longer than a line is folded
    command = shlex.join(["torchparity", "record", f"{plants_file}:make_a", "--no-backward",
                          "-o", str(trace), "--ops", "decoder.layers.1.attn"])
    assert "".join(f"`{command}` on A's code adds them".split()) in out
    assert cli.main(shlex.split(command)[1:]) == 0
    assert cli.main(diagnose) == 1
    op = json.loads((tmp_path / "d.json").read_text())["first_divergence"]["op"]
    assert op["found"] and planted_line(plants.AttentionScale) in op["b_stack"]


def test_a_module_diverging_forward_and_backward_says_its_missing_ops_once(tmp_path) -> None:
    """Against a trace with gradients and no ops, the first divergence and the first gradient
    divergence are one module: the reason it is not drilled down is one note, not two."""
    model_a, batch, _ = plants.make_a()
    trace = tp.record(model_a, batch, tmp_path / "t", loss_fn=sequence_loss)
    model_b, _, _ = plants.make_b_scale()
    report = tp.diagnose_against(trace, model_b, batch, loss_fn=sequence_loss)
    row = report.first_divergence
    assert row is not None and row is report.first_grad_divergence, report.render()
    missing = [note for note in row.notes if "no op drill-down" in note]
    assert len(missing) == 1, row.notes


def test_record_ops_of_a_module_the_model_lacks_is_one_line(tmp_path, capsys) -> None:
    from torchparity import cli

    entry = f"{inspect.getsourcefile(plants)}:make_a"
    assert cli.main(["record", entry, "--no-backward", "-o", str(tmp_path / "t"),
                     "--ops", "decoder.layers.9.attn"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the model has no module decoder.layers.9.attn" in err
    assert "\n" not in err and not (tmp_path / "t").exists()


def test_html_shows_both_sides_lines() -> None:
    model_a, batch = model_and_batch("rotary-interleaved")
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[0].attn_norm.__class__ = plants.LayerNormEps
    page = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss,
                       backward=False).to_html()
    ops = page[page.index("<h2>Ops of decoder.layers.0.attn_norm</h2>"):]
    answer = ops[ops.index("<tr class='entry'>"):]
    answer = answer[:answer.index("</tr>")]
    assert planted_line(plants.LayerNormEps) in answer
    assert "src/torchparity/reference/norms.py:" in answer and "eps 1e-05 (A)" in answer


# --- the determinism probe -------------------------------------------------------------------


def test_determinism_probe_names_a_seedless_dropout_at_its_line(tmp_path, capsys) -> None:
    from torchparity import cli

    entry = f"{inspect.getsourcefile(plants)}:make_seedless"
    assert cli.main(["diagnose", "--determinism", entry, "--json",
                     str(tmp_path / "d.json")]) == 1
    found = json.loads((tmp_path / "d.json").read_text())
    (op,) = found["between_runs"]
    assert op["name"].startswith("aten::bernoulli")
    assert planted_line(plants.SeedlessDropout) in op["stack"]
    assert planted_line(plants.SeedlessDropout) in capsys.readouterr().out


@pytest.mark.parametrize("scale", [2.0, 2.01])
def test_run_to_run_noise_joins_the_budget_of_the_ops_it_reaches(scale: float) -> None:
    """B perturbs a projection by one part in 1e4 drawn anew at every call: the module's
    output leaves its budget, but between two runs of B the ops it reaches differ as much as
    from the golden, so no op is called the change; a scale changed by 0.5% still is."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    model_b = plants.GeneratorNoise(noisy=True, scale=scale)
    report = tp.diagnose(plants.GeneratorNoise(), model_b, (x,), backward=False)
    first = report.first_divergence
    assert first is not None and first.module == "" and first.ops is not None, report.render()
    if scale == 2.0:
        assert first.ops.answer is None, first.ops.sentence()
    else:
        assert first.ops.answer is not None, report.render()
        assert first.ops.answer.pair.kind == "paired", first.ops.sentence()
        assert planted_line(plants.GeneratorNoise) in \
            [str(f) for f in first.ops.answer.pair.b.stack], first.ops.sentence()


def test_determinism_probe_finds_the_zoo_deterministic() -> None:
    from torchparity.diagnosis.stages.ops.determinism import probe_determinism

    model, batch = model_and_batch("llama-tiny")
    found = probe_determinism(model.eval(), batch)
    assert found.deterministic and not found.between_runs, found.lines()
    assert found.steps > 100


# --- a decoding ------------------------------------------------------------------------------


def test_decoding_names_the_op_and_line_of_the_unwritten_cache_slot() -> None:
    """The toy decoder's preallocated cache written one slot off (toy_decoders.py): at the
    first divergent step, the op is B's write into the buffer or its read of the slot never
    written, at its line."""
    from toy_decoders import PreallocatedSelfAttention

    from torchparity.subject.factory import resolve_entry

    toys = inspect.getsourcefile(PreallocatedSelfAttention)
    clean, changed = (resolve_entry(f"{toys}:{name}")() for name in ("clean", "off_by_one"))
    report = tp.diagnose_decode(clean["model"], changed["model"], clean["inputs"],
                                step=clean["step"], steps=4)
    op = report.to_dict()["decode"]["first_op"]
    assert report.first_step == 1 and op is not None and op["found"], report.render(100)
    lines, start = inspect.getsourcelines(PreallocatedSelfAttention.cached)
    cache_lines = {f"{os.path.relpath(toys)}:{start + i}" for i, line in enumerate(lines)
                   if "self.k_cache[..., " in line}  # the write and the read of the buffer
    assert cache_lines & set(op["b_stack"][:1]), op
    assert report.summary().count("It enters") == 1
    assert "It enters at layers.0.self_attn @ step 1 through its state k_cache (" in \
        report.summary()


def test_long_streams_align_by_signature_and_still_account_for_every_step(monkeypatch) -> None:
    from torchparity.diagnosis.stages.ops import align

    monkeypatch.setattr(align, "_LARGEST_TABLE", 0)  # the fallback of very long streams
    a, b = steps(Unfused()), steps(Fused())
    pairs = align_steps(a, b)
    assert sorted(p.a.index for p in pairs if p.a is not None) == list(range(len(a)))
    assert sorted(p.b.index for p in pairs if p.b is not None) == list(range(len(b)))


def test_a_failing_drill_down_leaves_the_diagnosis_whole(monkeypatch) -> None:
    from torchparity.diagnosis.stages.ops import calls

    def broken(*args, **kwargs):
        raise RuntimeError("a tensor subclass the capture cannot copy")

    monkeypatch.setattr(calls, "capture_steps", broken)
    model_a, batch = model_and_batch("rotary-interleaved")
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[0].attn_norm.__class__ = plants.LayerNormEps
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, backward=False)
    assert report.first_divergence.module == "decoder.layers.0.attn_norm"
    assert report.first_divergence.ops is None
    assert "op drill-down failed: RuntimeError: a tensor subclass the capture cannot copy" in \
        report.first_divergence.notes


@pytest.mark.slow
def test_decoding_names_the_write_or_read_of_the_preallocated_cache_one_off() -> None:
    import functools

    model_a, _ = model_and_batch("llama-tiny")
    config = zoo.get("llama-tiny").config
    prompt = zoo.make_batch(config, batch_size=2, seq_len=6, seed=0, padding="none")
    model_b = copy.deepcopy(model_a.eval())
    model_b.new_cache = functools.partial(plants.CacheWrittenOneOff, chunk=4)
    report = tp.diagnose_decode(model_a, model_b, prompt, steps=2)
    op = report.to_dict()["decode"]["first_op"]
    assert op is not None and op["found"], report.render(100)
    lines, start = inspect.getsourcelines(plants.CacheWrittenOneOff)
    write_or_read = {f"{os.path.relpath(inspect.getsourcefile(plants))}:{start + i}"
                     for i, line in enumerate(lines) if "# planted" in line or "# read" in line}
    assert write_or_read & set(op["b_stack"][:1]), op


def test_a_gradient_only_change_is_drilled_in_its_backward_pass() -> None:
    """The same forward, the gradient of the norm's statistics halved: found by default (its
    output gradient agrees, the gradient it hands back does not), and the backward ops of the
    first gradient divergence name the changed statement (B's line, or A's of it)."""
    from torchparity.reference.norms import RMSNorm

    model_a, batch = model_and_batch("llama-tiny")
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[1].mlp_norm.__class__ = plants.RMSNormHalfGradient
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss)
    assert report.first_divergence is None and report.first_grad_divergence is not None
    op = report.to_dict()["first_grad_divergence"]["op"]
    assert op is not None and op["found"], report.render()
    lines, start = inspect.getsourcelines(RMSNorm.forward)
    a_line = next(f"{os.path.relpath(inspect.getsourcefile(RMSNorm))}:{start + i}"
                  for i, line in enumerate(lines) if "h.pow(2)" in line)
    assert planted_line(plants.RMSNormHalfGradient) in op["b_stack"] or a_line in op["a_stack"]
    # an op, or the run of ops one side's backward alone applies (A's of the square)
    assert re.search(r"In its backward pass: It enters at decoder\.layers\.1\.mlp_norm "
                     r"\(backward\), in (aten::|\d+ ops only in [AB] \(aten::)",
                     report.summary()), report.summary()


def test_against_a_trace_with_ops_names_the_backward_op_as_in_process(tmp_path) -> None:
    """The gradient-only change drilled against A's trace: the backward ops kept by
    ``record --ops`` give the same answer as the in-process drill-down."""
    model_a, batch = model_and_batch("llama-tiny")
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[1].mlp_norm.__class__ = plants.RMSNormHalfGradient
    trace = tp.record(model_a, batch, tmp_path / "t", loss_fn=sequence_loss,
                      ops="decoder.layers.1.mlp_norm")
    against = tp.diagnose_against(trace, model_b, batch, loss_fn=sequence_loss, local="all")
    in_process = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, local="all")
    op, expected = (r.to_dict()["first_grad_divergence"]["op"] for r in (against, in_process))
    assert op is not None and op["found"], against.render()
    same = ("module", "name", "kind", "a_stack", "b_stack", "code", "arguments")
    assert {k: op[k] for k in same} == {k: expected[k] for k in same}, against.render()


def test_an_ops_lines_are_the_models_own_never_torchparitys_machinery() -> None:
    # the zoo's attention calls the backend switch (torchparity/backends.py): the ops of a
    # changed attention are named at the model's lines, never inside the switch
    model_a, batch = model_and_batch("llama-tiny")
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[0].attn.scale *= 1.5
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, backward=False)
    steps = report.to_dict()["first_divergence"]["op"]["steps"]
    paths = {frame for step in steps for frame in step["a_stack"] + step["b_stack"]}
    assert any("reference/attention.py" in p for p in paths), paths
    assert all("torchparity/reference/" in p for p in paths), paths
