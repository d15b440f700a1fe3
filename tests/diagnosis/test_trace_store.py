"""How a trace being written keeps its tensors: big exact ones go to a file at once, sketches
and small exact ones wait (copied) and go to disk together, a few megabytes at a time; a
reader gets back exactly what was put, whenever it asks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

import torchparity as tp
from torchparity import sketching
from torchparity.cli import main
from torchparity.diagnosis.core import trace
from torchparity.diagnosis.core.trace import DiskStore, TraceWriter, open_trace
from torchparity.diagnosis.core.trace_meta import DecodeTraceMeta, ForwardTraceMeta, meta_from_json


def _files(directory: Path) -> list[Path]:
    return sorted((directory / "tensors").iterdir())


def _small() -> torch.Tensor:
    return torch.arange(12.0).reshape(3, 4)


def test_small_tensors_wait_and_are_read_back_whenever_asked(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, writable=True)
    store.put("a#0", "out", {"output": _small()})
    store.put("b#0", "out", {"output": _small() + 1})
    assert _files(tmp_path) == []  # both wait
    assert torch.equal(store.get("b#0", "out")["output"], _small() + 1)
    assert len(_files(tmp_path)) == 1  # the read wrote them, together
    assert torch.equal(store.get("a#0", "out")["output"], _small())


def test_a_waiting_tensor_is_a_copy_taken_when_it_was_put(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, writable=True)
    live = _small()
    store.put("a#0", "grad_out", {"output": live})
    live.mul_(-1)  # the run goes on and reuses the memory
    assert torch.equal(store.get("a#0", "grad_out")["output"], _small())


def test_one_memory_put_twice_is_stored_once_unless_changed_between(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.tptrace") as writer:
        hidden = _small()
        writer.store.put("a#0", "out", {"output": hidden})
        writer.store.put("b#0", "in", {"0": hidden})  # the next call's input
        writer.store.put("c#0", "in", {"0": hidden.view(3, 4)})  # another view of it
        hidden.add_(1)
        writer.store.put("d#0", "in", {"0": hidden})  # changed since: a tensor of its own
        path = writer.commit({"schema": trace.SCHEMA})
    meta, store = open_trace(path)
    (stored,) = _files(path)
    with safe_open(stored, framework="pt") as handle:  # small: laid end to end, 24 values
        assert json.loads(handle.metadata()["packed"]).keys() == {"a#0|out/output",
                                                                  "d#0|in/0"}
        assert [handle.get_slice(name).get_shape() for name in handle.keys()] == [[24]]
    assert sum(len(names) for names in meta["aliases"].values()) == 2
    for key, expected in (("a#0", _small()), ("b#0", _small()), ("c#0", _small()),
                          ("d#0", _small() + 1)):
        (got,) = (store.get(key, "out") or store.get(key, "in")).values()
        assert torch.equal(got, expected)


def test_big_exact_tensors_are_written_at_once_and_sketches_wait(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, writable=True)
    big = torch.randn(sketching.threshold())  # sketched when not fed to replays
    store.put("a#0", "grad_out", {"output": big})  # kept exact: replays are fed it
    assert len(_files(tmp_path)) == 1
    store.put("a#0", "out", {"output": big})
    assert len(_files(tmp_path)) == 1  # its sketch waits
    sketch = store.get("a#0", "out")["output"]
    assert isinstance(sketch, sketching.Sketch)
    assert torch.equal(sketch.projection, sketching.sketch(big, "output").projection)
    assert torch.equal(store.get("a#0", "grad_out")["output"], big)


def test_what_waits_is_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(trace, "PENDING_BYTES", 4 * _small().nbytes)
    store = DiskStore(tmp_path, writable=True)
    for call in range(20):
        store.put(f"m#{call}", "out", {"output": _small() + call})
    # Five tensors' worth at most waits: a file every five puts.
    assert len(_files(tmp_path)) == 20 // 5
    store.finish({"schema": trace.SCHEMA})
    meta = json.loads((tmp_path / trace.TRACE_JSON).read_text())
    assert all(store.get(f"m#{call}", "out")["output"][0, 0] == call for call in range(20))
    assert len(meta["files"]) == 20


def test_a_group_reads_back_in_the_order_it_was_put(tmp_path: Path) -> None:
    # As a store in memory gives it back: the order the model returned its outputs in, which
    # a report lists them by; neither the name's order nor which of them are sketched.
    store = DiskStore(tmp_path, writable=True)
    big = torch.randn(sketching.threshold())
    hidden = _small()
    store.put("a#0", "out", {"output.10": hidden, "output.2": big, "output.1": hidden + 1})
    store.put("b#0", "in", {"0": hidden})  # the same memory: stored once, read as put
    # One gradient at a time, as backward hands them on: a small one waits, a big exact one
    # is written at once, and one put again keeps its place with its new value.
    store.put("a#0", "grad_out", {"output.1": hidden})
    store.put("a#0", "grad_out", {"output.0": big})
    store.put("a#0", "grad_out", {"output.1": hidden + 1})
    store.finish({"schema": trace.SCHEMA})
    _, reader = open_trace(tmp_path)
    assert list(reader.get("a#0", "out")) == ["output.10", "output.2", "output.1"]
    assert torch.equal(reader.get("b#0", "in")["0"], hidden)
    grads = reader.get("a#0", "grad_out")
    assert list(grads) == ["output.1", "output.0"]
    assert torch.equal(grads["output.1"], hidden + 1) and torch.equal(grads["output.0"], big)


def test_small_tensors_of_every_kind_read_back_bit_for_bit(tmp_path: Path) -> None:
    kinds = {"scalar": torch.tensor(-1e4), "flag": torch.tensor([True, False]),
             "count": torch.tensor([3, 4]), "phase": torch.tensor([2 + 1j]),
             "half": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
             "empty": torch.zeros(0, 3), "expanded": torch.ones(1, 3).expand(4, 3)}
    store = DiskStore(tmp_path, writable=True)
    store.put("a#0", "in", kinds)
    store.finish({"schema": trace.SCHEMA})
    _, reader = open_trace(tmp_path)
    got = reader.get("a#0", "in")
    assert list(got) == list(kinds)
    for name, expected in kinds.items():
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape
        assert torch.equal(_bits(got[name]), _bits(expected))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_a_small_tensor_read_back_is_a_copy_of_its_own(tmp_path: Path) -> None:
    # Packed tensors are read from one tensor of the file: a replay that changes its input in
    # place must not change what the next read gives, nor the tensor laid beside it.
    with TraceWriter(tmp_path / "t.tptrace") as writer:
        writer.store.put("a#0", "in", {"0": _small(), "1": _small() + 1})
        writer.store.put("b#0", "in", {"0": _small() + 2})
        path = writer.commit({"schema": trace.SCHEMA})
    _, store = open_trace(path)
    store.get("a#0", "in")["0"].fill_(-1)
    store.get("b#0", "in")  # the store keeps the last call's tensors: read another's between
    again = store.get("a#0", "in")
    assert torch.equal(again["0"], _small()) and torch.equal(again["1"], _small() + 1)


def _written_back(path: Path) -> None:
    """The typed metadata read from ``path`` writes back its trace.json: every key, in order
    (the storage keys are the store's)."""
    data = json.loads((path / trace.TRACE_JSON).read_text())
    stored = {k: v for k, v in data.items() if k not in ("files", "aliases", "input_specs")}
    written = meta_from_json(data).to_json()
    assert list(written) == list(stored) and written == stored


def test_a_traces_metadata_is_read_back_whole(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4)
    forward = tp.record(model, (x,), tmp_path / "f.tptrace", ops="0")
    assert isinstance(meta_from_json(open_trace(forward)[0]), ForwardTraceMeta)
    _written_back(forward)
    toys = Path(__file__).with_name("toy_decoders.py")
    assert main(["record", f"{toys}:clean", "--decode", "--steps", "2", "-o",
                 str(tmp_path / "d.tptrace")]) == 0
    assert isinstance(meta_from_json(open_trace(tmp_path / "d.tptrace")[0]), DecodeTraceMeta)
    _written_back(tmp_path / "d.tptrace")
