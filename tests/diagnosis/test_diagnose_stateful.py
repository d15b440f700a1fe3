"""Replays of modules that keep state across calls, and of modules whose signature changed.

The toy decoder of ``toy_decoders.py`` is unrolled inside one forward (the prompt, then each
teacher-forced token), as a hand-written factory might check a generation: its attention
modules are called once per step and keep their cache on themselves. A replay of one of those
calls must run on the cache as it was when that call started, never on what the whole forward
left behind.
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.subject.factory import resolve_entry

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

TOYS = Path(__file__).with_name("toy_decoders.py")
toys = resolve_entry(f"{TOYS}:make").__globals__  # the module's classes, as loaded for entries


class Unrolled(nn.Module):
    """The prompt and ``tokens`` (batch, steps) fed one by one through a toy decoder."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logits, state = toys["generate_step"](self.decoder, {"ids": ids}, None)
        steps = [logits[:, -1]]
        for token in tokens.unbind(1):
            logits, state = toys["generate_step"](self.decoder, token[:, None], state)
            steps.append(logits[:, -1])
        return torch.stack(steps, 1)


class TupleCacheAttention(toys["SelfAttention"]):
    """Keeps its keys and values in one attribute: the same math, another layout of state."""

    def __init__(self) -> None:
        super().__init__()
        del self.k_cache, self.v_cache
        self.cache = None

    def cached(self, k, v, step):
        if step:
            k, v = torch.cat((self.cache[0], k), -2), torch.cat((self.cache[1], v), -2)
        self.cache = (k, v)
        return k, v


class RenamedStepAttention(toys["SelfAttention"]):
    """Takes the step counter as ``position`` (by keyword from its layer)."""

    def forward(self, x, position=None):
        return super().forward(x, position)


class KeywordLayer(toys["Layer"]):
    def forward(self, x, step=None):
        x = x + self.self_attn(self.attn_norm(x), position=step)[0]
        return x + self.mlp(self.mlp_norm(x))


def unrolled(attention: type, layer: type | None = None) -> tuple[nn.Module, tuple]:
    made = toys["make"](attention)
    decoder = made["model"]
    if layer is not None:
        for index, old in enumerate(decoder.layers):
            new = layer(attention)
            new.load_state_dict(old.state_dict())
            decoder.layers[index] = new
    tokens = torch.randint(0, 32, (8, 4), generator=torch.Generator().manual_seed(3))
    return Unrolled(decoder).eval(), (made["inputs"]["ids"], tokens)


def test_replays_of_a_module_keeping_a_cache_run_on_the_state_of_their_call() -> None:
    a, inputs = unrolled(toys["SelfAttention"])
    b, _ = unrolled(toys["SelfAttention"])
    report = tp.diagnose(a, b, inputs, backward=False, local="all")
    calls = [r for r in report.rows if r.module.startswith("decoder.layers.0.self_attn")]
    assert len(calls) > 5  # the prompt and each step: call #0 ... #4 with its submodules
    assert all(r.local is not None and r.local.verdict == "identical" for r in report.rows), \
        report.render()


def test_a_cache_slot_left_unwritten_is_found_at_the_first_decoding_call() -> None:
    a, inputs = unrolled(toys["SelfAttention"])
    b, _ = unrolled(toys["PreallocatedSelfAttention"])
    report = tp.diagnose(a, b, inputs, backward=False)
    assert report.first_divergence.module == "decoder.layers.0.self_attn#1", report.render()
    first = report.first_divergence
    # A number on A's state, not a note that the replay failed; the op drill-down replays the
    # call on the cache as it was when the call started and names B's read of the buffer,
    # whose slot 10 the counter (one too far) skipped.
    assert first.shapes and not first.notes, report.render()
    assert first.ops is not None and first.ops.answer is not None, report.render()
    assert source_lines(toys["PreallocatedSelfAttention"].cached, "return self.k_cache[") & \
        {str(frame) for frame in first.ops.answer.pair.b.stack[:1]}, report.render()


class ShiftedWriteAttention(toys["PreallocatedSelfAttention"]):
    """The preallocated cache with each new key written one slot further than it is read."""

    def cached(self, k, v, step):
        stop = step + k.shape[-2]
        if step == 0:
            self.k_cache = self.v_cache = None
        if self.k_cache is None or stop + 1 > self.k_cache.shape[-2]:
            size = math.ceil((stop + 1) / self.chunk) * self.chunk
            grown = [k.new_zeros(*k.shape[:-2], size, k.shape[-1]) for _ in range(2)]
            if self.k_cache is not None:
                for new, old in zip(grown, (self.k_cache, self.v_cache), strict=True):
                    new[..., :old.shape[-2], :] = old
            self.k_cache, self.v_cache = grown
        self.k_cache[..., step + 1:stop + 1, :] = k  # planted
        self.v_cache[..., step:stop, :] = v
        if step == 0:
            return k, v
        return self.k_cache[..., :stop, :], self.v_cache[..., :stop, :]


def source_lines(function: object, text: str) -> set[str]:
    """``path:line`` of each line of ``function``'s source that holds ``text``."""
    lines, start = inspect.getsourcelines(function)
    path = os.path.relpath(inspect.getsourcefile(function))
    return {f"{path}:{start + i}" for i, line in enumerate(lines) if text in line}


def names_the_shifted_write(report: DiagnosisReport) -> None:
    """The first divergence is the first decoding call of the attention, its op B's write
    (paired with A's) at the planted line."""
    first = report.first_divergence
    assert first.module == "decoder.layers.0.self_attn#1", report.render()
    assert first.ops is not None and first.ops.answer is not None, report.render()
    answer = first.ops.answer
    assert answer.pair.kind == "paired", first.ops.sentence()
    assert source_lines(ShiftedWriteAttention.cached, "# planted") == \
        {str(frame) for frame in answer.pair.b.stack[:1]}, first.ops.sentence()


def test_a_cache_written_one_slot_off_is_named_at_the_write() -> None:
    """A and B both keep a preallocated cache on the attention module; B writes each key one
    slot further. The replays of the first divergent call start from A's cache as it was then
    (the prompt's keys), so B's write is the op whose output, the buffer, leaves its budget
    while what it writes agrees."""
    a, inputs = unrolled(toys["PreallocatedSelfAttention"])
    b, _ = unrolled(ShiftedWriteAttention)
    report = tp.diagnose(a, b, inputs, backward=False)
    names_the_shifted_write(report)


def test_state_kept_in_another_layout_is_not_replayable_and_says_so() -> None:
    a, inputs = unrolled(toys["SelfAttention"])
    b, _ = unrolled(TupleCacheAttention)
    report = tp.diagnose(a, b, inputs, backward=False, local="all")
    row = report.row("decoder.layers.0.self_attn#1")
    assert row.local is None
    assert any("not replayable: the module keeps state across calls, in k_cache, v_cache in A "
               "and cache in B" in note for note in row.notes), row.notes
    assert report.first_divergence is None or report.first_divergence.local is not None


def test_a_renamed_parameter_is_bound_as_the_recorded_call_was() -> None:
    a, inputs = unrolled(toys["SelfAttention"])
    b, _ = unrolled(RenamedStepAttention, KeywordLayer)
    report = tp.diagnose(a, b, inputs, backward=False, local="all")
    assert report.first_divergence is None, report.render()
    attention = [r for r in report.rows if r.module.startswith("decoder.layers.1.self_attn#")]
    assert attention and all(r.local.verdict == "identical" for r in attention)


def test_a_trace_keeps_the_state_replays_need(tmp_path: Path) -> None:
    a, inputs = unrolled(toys["SelfAttention"])
    path = tp.record(a, inputs, tmp_path / "base.tptrace", backward=False)
    b, _ = unrolled(toys["SelfAttention"])
    same = tp.diagnose_against(path, b, inputs, local="all")
    assert all(r.local.verdict == "identical" for r in same.rows), same.render()
    changed, _ = unrolled(toys["PreallocatedSelfAttention"])
    report = tp.diagnose_against(path, changed, inputs)
    assert report.first_divergence.module == "decoder.layers.0.self_attn#1", report.render()


def test_a_cache_written_one_slot_off_is_named_at_the_write_against_a_trace(
        tmp_path: Path) -> None:
    """As in-process: A's ops of the call, kept by ``record --ops`` from A's cache as it was
    when the call started, and B replayed on that cache, name B's write at its line."""
    a, inputs = unrolled(toys["PreallocatedSelfAttention"])
    path = tp.record(a, inputs, tmp_path / "base.tptrace", backward=False,
                     ops="decoder.layers.0.self_attn")
    b, _ = unrolled(ShiftedWriteAttention)
    report = tp.diagnose_against(path, b, inputs)
    names_the_shifted_write(report)
