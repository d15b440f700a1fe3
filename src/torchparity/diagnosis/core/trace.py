"""Where the reference side of a diagnosis keeps its tensors: in memory or in a trace directory.

Per call of model A, each under a *group*: ``out`` / ``golden_out`` (A's and the float64
golden's outputs in their full runs); ``local_golden`` (the golden's module on A's inputs);
``grad_out`` / ``golden_grad_out`` (d loss / d output; A's is fed to local backward replays,
so kept exact, ``judged_grad_out`` as judging reads it); ``param_grad`` /
``golden_param_grad`` (the module's direct parameters); ``local_grad`` /
``local_golden_grad`` (A's and the golden's module replayed backward); ``in`` (the inputs'
tensors, on disk only).

On disk (``tp.record``)::

    base.tptrace/
      trace.json              schema, versions, settings, module tree, checksums, the calls
                              in execution order with their input structure and files
      tensors/000123.safetensors  a file per write of big tensors, and one per batch of
                              sketches and small tensors laid end to end in one tensor per
                              dtype ("<call>|<group>/<path>" or ``__packed__/<dtype>``)

Written incrementally (bounded memory, nothing rewritten) into a temporary sibling that
replaces the target when complete. Tensors of :func:`torchparity.sketching.threshold`
elements or more are kept as sketches (``::sketch``, ``::slices``, ``::stats``), except
``in`` and ``grad_out``, which replays are fed; one path's sketches share their buckets
across groups, so A's, the golden's and B's compare."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from torchparity import digests, sketching
from torchparity.comparison.structure import cache_layers, is_cache
from torchparity.diagnosis.core.capture import (
    CallArgs,
    ModuleCall,
    PatternSpec,
    Uncopyable,
    snapshot,
    uncopyable_leaves,
)
from torchparity.errors import TorchParityError, UsageError
from torchparity.memory import SharedCopies, memory_key
from torchparity.sketching import Sketch
from torchparity.subject.padding import Padding
from torchparity.subject.trees import PyTree, field_names, flatten_tensors, rebuilt_from_fields

SCHEMA = "torchparity.trace/6"
TRACE_JSON = "trace.json"
FINAL = "__final__"  # pseudo-call key of the model's own output and loss
DECODE = "decode"  # the kind of a decoding trace (trace_meta.DecodeTraceMeta)
_CACHE_HINT = " (run without a cache to replay it, e.g. use_cache=False for Hugging Face models)"
#: Groups kept exact whatever their size: replays are fed them.
EXACT_GROUPS = ("in", "grad_out")
_PART = "::"
#: Bytes of sketches and small exact tensors a trace being written holds before it writes them.
PENDING_BYTES = 4 << 20
#: Exact tensors of at most this many bytes wait with the sketches (copied: cheap at this size).
SMALL_BYTES = 64 << 10
#: Trace files a reader keeps open.
OPEN_FILES = 16
#: The names of a file's small tensors laid end to end, one per dtype (``__packed__/float32``).
_PACKED = "__packed__/"


def stored_form(group: str, path: str, tensor: torch.Tensor | Sketch,
         left_out: torch.Tensor | None = None, *, copy: bool = False) -> torch.Tensor | Sketch:
    """How a store keeps one tensor of ``group``: a sketch when big and not fed to replays
    (its ``left_out`` positions at 0, :func:`~torchparity.sketching.masked`), else on the CPU,
    copied with ``copy`` (the run may still change it in place)."""
    if isinstance(tensor, Sketch):
        return tensor
    if sketched_in(group, tensor):
        return sketching.sketch(sketching.masked(tensor, left_out), path)
    return tensor.detach().to("cpu", copy=copy)


def sketched_in(group: str, tensor: torch.Tensor) -> bool:
    """Whether a store keeps ``tensor`` of ``group`` as a sketch (:func:`stored_form`)."""
    return group not in EXACT_GROUPS and sketching.wants_sketch(tensor)


def padded(padding: Padding | None, key: str, group: str, path: str, tensor: torch.Tensor
           ) -> torch.Tensor | None:
    """The padded positions of a call's tensor as its judgement reads them (None without
    padding, and for parameter gradients)."""
    if not padding or "param" in group:
        return None
    left_out = padding.within("" if key == FINAL else key.partition("#")[0])(path, tensor)
    return None if left_out is None else left_out.mask


class ReplayUnavailable(TorchParityError):
    """A call's inputs cannot be replayed (an input object that could not be recorded)."""


# --------------------------------------------------------------------------------------------
# Stores


Stored = tuple[str, str, Mapping[str, torch.Tensor]]  # (call key, group, tensors by path)


class Store(Protocol):
    """A's tensors by call key and group, and each call's inputs for replays: in memory or
    in a trace."""

    padding: Padding | None  # the batch's, which sketches leave out

    def put(self, key: str, group: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Add tensors to ``group`` of call ``key``, merging with what is there."""

    def put_all(self, entries: list[Stored], *, owned: bool = False) -> None:
        """:meth:`put` of each ``(key, group, tensors)``; ``owned``: the caller's own copies."""

    def get(self, key: str, group: str) -> dict[str, torch.Tensor]:
        """The group's tensors ({} when none were stored)."""

    def put_inputs(self, key: str, args: tuple, kwargs: dict) -> None:
        """Keep a call's inputs for replays."""

    def inputs_entry(self, key: str, args: tuple, kwargs: dict) -> Stored:
        """Keep a call's inputs; the :meth:`put_all` entry of their tensors."""

    def get_inputs(self, key: str, placeholders: bool = False) -> CallArgs:
        """A fresh copy of a call's inputs; :class:`ReplayUnavailable` when not recorded or
        not copied (with ``placeholders`` an uncopied object stays its ``Uncopyable``)."""

    def finish(self, meta: dict[str, Any]) -> None:
        """Write what is pending, with ``meta`` (a trace's JSON)."""


class MemoryStore:
    """Tensors and replayable inputs in memory, as detached CPU copies."""

    def __init__(self) -> None:
        self._tensors: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self._inputs: dict[str, CallArgs] = {}
        self.padding: Padding | None = None  # the batch's, which sketches leave out

    def put(self, key: str, group: str, tensors: Mapping[str, torch.Tensor], *,
            owned: bool = False) -> None:
        """Add tensors to ``group`` of call ``key``, copied unless ``owned``."""
        slot = self._tensors.setdefault((key, group), {})
        slot.update({path: stored_form(group, path, t, padded(self.padding, key, group, path, t),
                                copy=not owned)
                     for path, t in tensors.items()})

    def get(self, key: str, group: str) -> dict[str, torch.Tensor]:
        """The group's tensors ({} when none were stored)."""
        return dict(self._tensors.get((key, group), {}))

    def put_inputs(self, key: str, args: tuple, kwargs: dict) -> None:
        self._inputs[key] = (args, kwargs)

    def inputs_entry(self, key: str, args: tuple, kwargs: dict
                     ) -> tuple[str, str, dict[str, torch.Tensor]]:
        """Keep the call's inputs; an empty :meth:`put_all` entry."""
        self.put_inputs(key, args, kwargs)
        return key, "in", {}

    def get_inputs(self, key: str, placeholders: bool = False) -> CallArgs:
        """A fresh copy of the call's inputs (replays may append to a cache); see
        :meth:`Store.get_inputs`."""
        if key not in self._inputs:
            raise ReplayUnavailable("its inputs were not recorded")
        uncopyable = uncopyable_leaves(self._inputs[key])
        if uncopyable and not placeholders:
            raise ReplayUnavailable(f"an input of type {uncopyable[0]} could not be copied"
                                    f"{_CACHE_HINT if 'Cache' in uncopyable[0] else ''}")
        return CallArgs(*snapshot(self._inputs[key]))

    def put_all(self, entries: list[tuple[str, str, Mapping[str, torch.Tensor]]], *,
                owned: bool = False) -> None:
        """:meth:`put` of each ``(key, group, tensors)``."""
        for key, group, tensors in entries:
            self.put(key, group, tensors, owned=owned)

    def finish(self, meta: dict[str, Any]) -> None:
        """Nothing to write; memory traces live as long as their report needs them."""


class DiskStore:
    """Tensors in safetensors files under ``directory/tensors``, inputs' structure in the JSON.

    Big exact tensors are written at once, a file per write (the run may change them in place
    afterwards); sketches and small tensors wait in memory up to :data:`PENDING_BYTES` and go
    to disk together, so a reader opens a few files. Up to :data:`OPEN_FILES` stay open."""

    def __init__(self, directory: Path, *, writable: bool) -> None:
        self.directory = Path(directory)
        self.input_specs: dict[str, Any] = {}
        self.files: dict[str, dict[str, list[str]]] = {}  # call -> group -> its files
        self.padding: Padding | None = None  # the batch's, which sketches leave out
        self.aliases: dict[str, dict[str, str]] = {}  # file -> name -> the name stored for it
        self._n_files = 0
        self._n_put = 0  # tensors put so far: a tensor's rank in the order of putting
        self._pending = _Batch()
        self._open: OrderedDict[str, _OpenFile] = OrderedDict()
        self._cache_key: str | None = None
        self._cache: dict[str, dict[str, torch.Tensor | Sketch]] = {}  # group -> path -> tensor
        if writable:
            (self.directory / "tensors").mkdir(parents=True, exist_ok=True)

    def _load(self, key: str, group: str) -> dict[str, torch.Tensor]:
        """The call's tensors of one group by path, in the order put (a tensor put again keeps
        its place); the last call's are kept, as calls are read group after group."""
        if (key, group) in self._pending.groups:
            self._flush()
        if self._cache_key != key:
            self._cache, self._cache_key = {}, key
        if group not in self._cache:
            prefix = _prefix(key, group)
            read = []
            for index, name in enumerate(self.files.get(key, {}).get(group, [])):
                opened = self._opened(name)
                read += [(opened.ranks.get(k, 0), index, position, k[len(prefix):], t)
                         for position, (k, t) in enumerate(opened.read(prefix).items())]
            found: dict[str, torch.Tensor | Sketch] = {}
            for *_, path, tensor in sorted(read, key=lambda entry: entry[:3]):
                found[path] = tensor
            self._cache[group] = found
        return self._cache[group]

    def _opened(self, name: str) -> _OpenFile:
        if name in self._open:
            self._open.move_to_end(name)
        else:
            self._open[name] = _OpenFile(self.directory / name, self.aliases.get(name, {}))
            while len(self._open) > OPEN_FILES:
                self._open.popitem(last=False)[1].close()
        return self._open[name]

    def put(self, key: str, group: str, tensors: Mapping[str, torch.Tensor]) -> None:
        self.put_all([(key, group, tensors)])

    def put_all(self, entries: list[tuple[str, str, Mapping[str, torch.Tensor]]], *,
                owned: bool = False) -> None:
        """Write several calls' groups into one file (a decoding step's calls); small tensors
        are copied unless ``owned``."""
        now = _Batch()
        for key, group, tensors in entries:
            for path, tensor in tensors.items():
                left_out = padded(self.padding, key, group, path, tensor)
                value = stored_form(group, path, tensor, left_out)
                self._n_put += 1
                if isinstance(value, Sketch):
                    self._pending.add(key, group, path, value, self._n_put)
                elif value.numel() * value.element_size() <= SMALL_BYTES:
                    self._pending.add(key, group, path,
                                      value if owned else self._pending.copies.copy(value),
                                      self._n_put)
                else:
                    now.add(key, group, path, value, self._n_put)
        self._write(now)
        if self._pending.bytes > PENDING_BYTES:
            self._flush()

    def _flush(self) -> None:
        batch, self._pending = self._pending, _Batch()
        self._write(batch)

    def _write(self, batch: _Batch) -> None:
        if not batch.flat:
            return
        name = f"tensors/{self._n_files:06d}.safetensors"
        self._n_files += 1
        aliases = _aliased(batch.flat)
        if aliases:
            self.aliases[name] = aliases
        flat, packed = _packed(batch.flat)
        save_file(flat, str(self.directory / name),
                  metadata={"sketches": json.dumps(batch.described),
                            "ranks": json.dumps(batch.ranks), "packed": json.dumps(packed)})
        for key, group in batch.groups:
            self.files.setdefault(key, {}).setdefault(group, []).append(name)
            if self._cache_key == key:
                self._cache.pop(group, None)  # read again, with the new file

    def get(self, key: str, group: str) -> dict[str, torch.Tensor]:
        return dict(self._load(key, group))

    def put_inputs(self, key: str, args: tuple, kwargs: dict) -> None:
        self.put_all([self.inputs_entry(key, args, kwargs)])

    def get_inputs(self, key: str, placeholders: bool = False) -> CallArgs:
        if key not in self.input_specs:
            raise ReplayUnavailable("its inputs were not recorded")
        # A fresh copy, as from memory: a replay may write into a tensor it is handed (a
        # StaticCache's keys), and the next replay of this call reads the same file.
        fresh = {path: tensor.clone() for path, tensor in self.get(key, "in").items()}
        args, kwargs = decode_tree(self.input_specs[key], fresh, placeholders)
        return CallArgs(tuple(args), dict(kwargs))

    def inputs_entry(self, key: str, args: tuple, kwargs: dict
                     ) -> tuple[str, str, dict[str, torch.Tensor]]:
        """The ``(key, "in", tensors)`` entry of a call's inputs (their structure: the JSON)."""
        tensors: dict[str, torch.Tensor] = {}
        self.input_specs[key] = encode_tree((args, kwargs), tensors)
        return key, "in", tensors

    def finish(self, meta: dict[str, Any]) -> None:
        self._flush()
        self.close()
        meta = {**meta, "files": self.files, "aliases": self.aliases,
                "input_specs": self.input_specs}
        (self.directory / TRACE_JSON).write_text(json.dumps(meta, default=str))

    def close(self) -> None:
        """Close the files open for reading."""
        while self._open:
            self._open.popitem()[1].close()


class _Batch:
    """Tensors on their way to one file: by name with their order, sketches' descriptions, calls."""

    def __init__(self) -> None:
        self.flat: dict[str, torch.Tensor] = {}
        self.ranks: dict[str, int] = {}  # full name (a sketch's own) -> rank
        self.described: dict[str, Any] = {}
        self.groups: dict[tuple[str, str], None] = {}  # in order of arrival
        self.bytes = 0
        #: Copies of the small exact tensors that wait (the run may change them in place
        #: meanwhile), one per memory, so that a call's output and the next call's input stay
        #: one tensor in the file.
        self.copies = SharedCopies()

    def add(self, key: str, group: str, path: str, value: torch.Tensor | Sketch,
            rank: int) -> None:
        full = f"{_prefix(key, group)}{path}"
        self.ranks.setdefault(full, rank)
        stored = ({f"{full}{_PART}{part}": t for part, t in sketching.parts(value).items()}
                  if isinstance(value, Sketch) else {full: value})
        if isinstance(value, Sketch):
            self.described[full] = sketching.describe_sketch(value)
        for name, tensor in stored.items():
            self.flat[name] = tensor.contiguous()
            self.bytes += tensor.numel() * tensor.element_size()
        self.groups[(key, group)] = None


def _packed(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``named``'s small tensors laid end to end, one per dtype (a file costs per tensor at
    this size), and where each lies: name -> [tensor, offset, shape]."""
    flat, by_dtype = {}, {}
    for name, tensor in named.items():
        if tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        else:
            flat[name] = tensor
    where: dict[str, Any] = {}
    for dtype, members in by_dtype.items():
        pack, offset = f"{_PACKED}{str(dtype).removeprefix('torch.')}", 0
        for name, tensor in members:
            where[name] = [pack, offset, list(tensor.shape)]
            offset += tensor.numel()
        flat[pack] = torch.cat([tensor.reshape(-1) for _, tensor in members])
    return flat, where


class _OpenFile:
    """A trace file open for reading: names by call-and-group prefix, order, sketches."""

    def __init__(self, path: Path, aliases: dict[str, str]) -> None:
        self._handle = safe_open(path, framework="pt")
        self._aliases = aliases
        self._names: dict[str, list[str]] = {}
        metadata = self._handle.metadata() or {}
        self._packed = json.loads(metadata.get("packed", "{}"))
        #: Each full name's rank in the order of putting (none in a file of an older writer).
        self.ranks: dict[str, int] = json.loads(metadata.get("ranks", "{}"))
        for name in [*(n for n in self._handle.keys() if not n.startswith(_PACKED)),
                     *self._packed, *aliases]:
            self._names.setdefault(name[:name.index("/", name.index("|")) + 1], []).append(name)
        self._described = json.loads(metadata.get("sketches", "{}"))
        self._packs: dict[str, torch.Tensor] = {}  # read whole, once: a few MiB at most

    def read(self, prefix: str) -> dict[str, torch.Tensor | Sketch]:
        stored = {name: self._tensor(self._aliases.get(name, name))
                  for name in self._names.get(prefix, [])}
        return _with_sketches(stored, self._described)

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self._packed:
            return self._handle.get_tensor(name)
        pack, offset, shape = self._packed[name]
        if pack not in self._packs:
            self._packs[pack] = self._handle.get_tensor(pack)
        # A copy of its own, as a tensor read from the file is: a replay may change it in place.
        return self._packs[pack][offset:offset + math.prod(shape)].reshape(shape).clone()

    def close(self) -> None:
        self._handle.__exit__(None, None, None)


def _with_sketches(tensors: dict[str, torch.Tensor], described: dict[str, Any]
                   ) -> dict[str, torch.Tensor | Sketch]:
    """A file's tensors with each sketch's parts put back together, in order."""
    if not described:
        return dict(tensors)
    found: dict[str, Any] = {}
    for name, tensor in tensors.items():
        full, separator, part = name.partition(_PART)
        if separator:
            found.setdefault(full, {})[part] = tensor
        else:
            found[name] = tensor
    for full in [name for name in found if name in described]:
        try:
            found[full] = sketching.from_parts(described[full], found[full])
        except (KeyError, ValueError) as exc:
            raise TorchParityError(f"a trace file's sketch {full} is damaged ({exc}); record "
                                   "the trace again") from None
    return found


# --------------------------------------------------------------------------------------------
# Inputs as JSON + tensors


def encode_tree(tree: PyTree, tensors: dict[str, torch.Tensor], depth: int = 0) -> PyTree:
    """A JSON-able description of ``tree``; its tensors are added to ``tensors`` by name.

    Plain data, containers, dataclasses (by import path), dtypes, devices and objects holding
    their state in attributes (``transformers`` caches) are kept; anything else becomes
    ``{"opaque": type name}``, which :func:`decode_tree` cannot replay."""
    if isinstance(tree, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = tree
        return {"tensor": name}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, torch.dtype):
        return {"dtype": str(tree).removeprefix("torch.")}
    if isinstance(tree, torch.device):
        return {"device": str(tree)}
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return {"tuple": [encode_tree(v, tensors, depth) for v in tree]}
    if isinstance(tree, list):
        return [encode_tree(v, tensors, depth) for v in tree]
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"dict": {k: encode_tree(v, tensors, depth) for k, v in tree.items()}}
    if isinstance(tree, Uncopyable):
        return {"opaque": tree.type_name}
    if rebuilt_from_fields(tree):
        cls = type(tree)
        fields = {name: encode_tree(getattr(tree, name), tensors, depth + 1)
                  for name in field_names(tree, init=True)}
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(tree, type) and _importable(tree):
        return {"class": _import_path(tree)}
    if is_cache(tree) and _importable(type(tree)):
        described = {"cache": _import_path(type(tree)),
                     "layers": {name: encode_tree(t, tensors)
                                for name, t in (cache_layers(tree) or {}).items()}}
        if _rebuilt_from_attributes(tree, depth):
            described["attributes"] = encode_tree(vars(tree), tensors, depth + 1)["dict"]
        return described
    if _rebuilt_from_attributes(tree, depth):
        return {"object": _import_path(type(tree)),
                "attributes": {name: encode_tree(value, tensors, depth + 1)
                               for name, value in vars(tree).items()}}
    return {"opaque": type(tree).__name__}


#: How deep objects nest inside one another in an input that is recorded (a cache, its layers).
_OBJECT_DEPTH = 4


def _rebuilt_from_attributes(obj: object, depth: int) -> bool:
    """Whether ``obj`` is rebuilt by its importable class and attributes (a plain object, not
    nested too deep)."""
    return depth < _OBJECT_DEPTH and hasattr(obj, "__dict__") and not callable(obj) and \
        not isinstance(obj, (nn.Module, type)) and _importable(type(obj))


def _importable(cls: type) -> bool:
    return "<locals>" not in cls.__qualname__ and cls.__module__ not in ("__main__", "builtins")


def _import_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def decode_tree(spec: Any, tensors: Mapping[str, torch.Tensor], placeholders: bool = False
                ) -> Any:
    """Rebuild what :func:`encode_tree` described; an object it could not record raises
    :class:`ReplayUnavailable`, or with ``placeholders`` is an :class:`Uncopyable`."""
    if isinstance(spec, list):
        return [decode_tree(v, tensors, placeholders) for v in spec]
    if not isinstance(spec, dict):
        return spec
    if "tensor" in spec:
        return tensors[spec["tensor"]]
    if "dtype" in spec:
        return getattr(torch, spec["dtype"])
    if "device" in spec:
        return torch.device(spec["device"])
    if "tuple" in spec:
        return tuple(decode_tree(v, tensors, placeholders) for v in spec["tuple"])
    if "dict" in spec:
        return {k: decode_tree(v, tensors, placeholders) for k, v in spec["dict"].items()}
    if "dataclass" in spec:
        cls = _import(spec["dataclass"])
        return cls(**{k: decode_tree(v, tensors, placeholders) for k, v in spec["fields"].items()})
    if "class" in spec:
        return _import(spec["class"])
    if "object" in spec:
        return _with_attributes(_import(spec["object"]), spec["attributes"], tensors,
                                placeholders)
    if "cache" in spec:
        return _rebuilt_cache(spec, tensors, placeholders)
    if placeholders:
        return Uncopyable(spec["opaque"])
    raise ReplayUnavailable(f"an input of type {spec['opaque']} could not be recorded"
                            f"{_CACHE_HINT if 'Cache' in spec['opaque'] else ''}")


def _with_attributes(cls: type, attributes: dict[str, Any], tensors: Mapping[str, torch.Tensor],
                     placeholders: bool) -> Any:
    rebuilt = cls.__new__(cls)  # its state is its attributes: no constructor runs
    vars(rebuilt).update({k: decode_tree(v, tensors, placeholders)
                          for k, v in attributes.items()})
    return rebuilt


def _rebuilt_cache(spec: dict[str, Any], tensors: Mapping[str, torch.Tensor],
                   placeholders: bool) -> Any:
    """A ``transformers`` cache in this release's class: from its recorded attributes where
    they match, else rebuilt by ``update`` layer by layer (4.x kept ``key_cache``, 5.x
    ``layers``)."""
    cls = _import(spec["cache"])
    attributes = spec.get("attributes")
    try:
        empty = cls()
    except Exception:  # noqa: BLE001 - it needs its settings (a StaticCache's length)
        empty = None
    if attributes is not None and (empty is None or set(vars(empty)) == set(attributes)):
        return _with_attributes(cls, attributes, tensors, placeholders)
    if empty is None:
        raise ReplayUnavailable(f"an input of type {cls.__name__} could not be rebuilt: it was "
                                "recorded by another release, and this one's needs settings "
                                "to make a new one")
    layers = {name: decode_tree(t, tensors) for name, t in spec["layers"].items()}
    for index in sorted({int(name.split(".")[0]) for name in layers}):
        empty.update(layers[f"{index}.keys"], layers[f"{index}.values"], index)
    return empty


def _aliased(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """Drop from ``named`` the tensors that are another one, returning their aliases; copy
    those that only share memory (safetensors refuses them)."""
    kept: dict[tuple, str] = {}
    aliases, pointers = {}, set()
    for name, tensor in list(named.items()):
        pointer, same = tensor.untyped_storage().data_ptr(), memory_key(tensor)
        if same in kept:
            aliases[name] = kept[same]
            del named[name]
        elif pointer in pointers:
            named[name] = tensor.clone()
        else:
            kept[same] = name
            pointers.add(pointer)
    return aliases


def _prefix(key: str, group: str) -> str:
    """How a call's tensors of one group are named in a file: ``<call>|<group>/<path>``."""
    return f"{key}|{group}/"


def _import(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ReplayUnavailable(f"input class {path} is gone on this revision ({exc})") from None
    return obj


# --------------------------------------------------------------------------------------------
# Checksums and module trees


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 (first 16 hex digits) of a tensor's dtype, shape and values."""
    return digests.sha256(tensor, header=f"{tensor.dtype}{tuple(tensor.shape)}")[:16]


def inputs_digest(inputs: PyTree) -> str:
    """Digest of every tensor in the model inputs and of their structure."""
    digest = hashlib.sha256()
    for path, tensor in flatten_tensors(inputs, "inputs").items():
        digest.update(f"{path}={tensor_digest(tensor)};".encode())
    return digest.hexdigest()[:16]


def weight_digests(model: nn.Module) -> dict[str, str]:
    """Digest of every parameter and buffer by qualified name."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    return {name: tensor_digest(t) for name, t in named.items()}


def module_tree(model: nn.Module) -> list[dict[str, Any]]:
    """Every module's name, class and direct parameters' shapes."""
    return [
        {"name": name, "type": type(module).__name__,
         "params": {p: list(t.shape) for p, t in module.named_parameters(recurse=False)}}
        for name, module in model.named_modules()
    ]


# --------------------------------------------------------------------------------------------
# Trace directories


def call_to_json(call: ModuleCall) -> dict[str, Any]:
    return {
        "name": call.name, "call": call.call, "type": call.module_type, "start": call.start,
        "order": call.order, "clock": call.clock,
        "output_shapes": {p: list(s) for p, s in call.output_shapes.items()},
        "inputs_requiring_grad": sorted(call.inputs_requiring_grad),
    }


def call_from_json(data: dict[str, Any]) -> ModuleCall:
    return ModuleCall(
        name=data["name"], call=data["call"], module_type=data["type"], start=data["start"],
        order=data["order"], clock=data["clock"],
        output_shapes={p: tuple(s) for p, s in data["output_shapes"].items()},
        inputs_requiring_grad=frozenset(data["inputs_requiring_grad"]),
    )


class TraceWriter:
    """A trace directory being written; ``commit`` moves it into place atomically, and leaving the
    block uncommitted (an error, Ctrl-C) removes it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and not (self.path / TRACE_JSON).exists():
            raise UsageError(f"{self.path} exists and is not a torchparity trace; choose another "
                             "path or remove it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.path.parent))
        self.store = DiskStore(self._tmp, writable=True)

    def commit(self, meta: dict[str, Any]) -> Path:
        self.store.finish(meta)
        old = None
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
            self.path.rename(old)
        self._tmp.rename(self.path)
        if old is not None:
            shutil.rmtree(old)  # the trace this one replaces, as the caller asked
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abort()  # nothing left to remove once committed: the directory moved into place


def check_recorded_inputs(path: str | os.PathLike, inputs: PyTree, recorded: str,
                          what: str) -> None:
    """A one-line error unless ``inputs`` match the trace's ``recorded`` checksum."""
    digest = inputs_digest(inputs)
    if digest != recorded:
        raise UsageError(f"inputs differ from the ones recorded in {path} (checksum {digest} vs "
                         f"{recorded}); pass the same {what} to both revisions")


def open_trace(path: str | os.PathLike) -> tuple[dict[str, Any], DiskStore]:
    """Read a trace directory's metadata; errors say what is wrong and how to make one."""
    path = Path(path)
    meta_file = path / TRACE_JSON
    if not meta_file.exists():
        what = "is not a torchparity trace" if path.exists() else "does not exist"
        raise TorchParityError(f"trace {path} {what}; create it on the base revision with "
                               "`torchparity record` or tp.record(model, inputs, path)")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as exc:
        raise TorchParityError(f"trace {path} is corrupted ({meta_file.name}: {exc}); "
                               "record it again") from None
    if meta.get("schema") != SCHEMA:
        raise TorchParityError(f"trace {path} has schema {meta.get('schema')!r}, this torchparity "
                               f"reads {SCHEMA!r}; record it again with this version")
    store = DiskStore(path, writable=False)
    store.files = meta["files"]
    store.aliases = meta["aliases"]
    store.input_specs = meta["input_specs"]
    return meta, store


def changed_weights(recorded: Mapping[str, str], model: nn.Module) -> dict[str, list[str]]:
    """Parameters and buffers whose digests differ, and those present on one side only."""
    current = weight_digests(model)
    return {
        "changed": sorted(n for n in recorded.keys() & current.keys()
                          if recorded[n] != current[n]),
        "only_recorded": sorted(recorded.keys() - current.keys()),
        "only_current": sorted(current.keys() - recorded.keys()),
    }


def pattern_json(spec: PatternSpec) -> Any:
    """A module selection as a trace stores it (globs and ``re:`` strings only)."""
    if spec is None or isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)) and all(isinstance(p, str) for p in spec):
        return list(spec)
    raise UsageError("record() stores the module selection in the trace: pass include/exclude "
                     "as glob or 're:' strings, not compiled patterns or callables")
