"""One twin check: build both, run the golden, baselines, candidate and its rerun, and judge."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

import torch

from torchparity import backends
from torchparity.dtypes import dtype_name, torch_dtype
from torchparity.errors import UsageError
from torchparity.subject.rounding import perturb_weights
from torchparity.subject.running import cast_inputs
from torchparity.twins import building, reproducer, running
from torchparity.twins.building import Buildable, WeightMap
from torchparity.twins.judging import TwinVerdict, judge_twins
from torchparity.twins.running import Inputs, Steps

CacheFactory = Callable[[], object]


class TwinFailure(AssertionError):
    """A failed twin check, ending with the reproducer; ``verdict`` and ``example`` say what."""

    def __init__(self, verdict: TwinVerdict, example: dict[str, object],
                 reproduce: Callable[[], str]) -> None:
        super().__init__(verdict.explain())
        self.verdict, self.example = verdict, example
        self._reproduce, self._message = reproduce, None

    def __str__(self) -> str:
        # Made when first read: a search's shrinking raises many failures, reads one.
        if self._message is None:
            self._message = f"{self.verdict.explain()}\n\n{self._reproduce()}"
        return self._message


@dataclass(frozen=True)
class TwinOptions:
    """How two implementations are run and judged (see :func:`assert_twins` for each field)."""

    dtype: str | torch.dtype = "fp32"
    backend: str | None = None  # the new side's (torchparity.backends.names); None: as written
    init: Mapping[str, object] | None = None
    seed: int = 0
    weight_map: WeightMap | None = None
    grads: bool = True
    # bool, True at padded positions: out of the judgement and the backward
    padding: torch.Tensor | None = None
    # a factory, or a pair: the old side's and the new side's
    cache: CacheFactory | tuple[CacheFactory, CacheFactory] | None = None
    device: str | torch.device = "cpu"

    @classmethod
    def of(cls, options: TwinOptions | None, keywords: Mapping[str, object]) -> TwinOptions:
        """``options`` (the defaults when None) with ``keywords`` replacing its fields."""
        unknown = sorted(set(keywords) - {f.name for f in fields(cls)})
        if unknown:
            raise UsageError(f"unknown twin option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(f.name for f in fields(cls))}")
        return replace(options or cls(), **keywords)

    def for_reproducer(self) -> dict[str, object]:
        """The options as the reproducer script writes them."""
        return dict(dtype=dtype_name(self.dtype), backend=self.backend, init=self.init,
                    seed=self.seed, weight_map=self.weight_map, grads=self.grads,
                    padding=self.padding, cache=self.cache,
                    device=None if str(self.device) == "cpu" else str(self.device))


def check(old: Buildable, new: Buildable, inputs: Inputs, options: TwinOptions | None = None,
          **keywords: object) -> TwinVerdict:
    """The verdict on ``new`` against ``old`` on ``inputs``; see :func:`assert_twins`."""
    o = TwinOptions.of(options, keywords)
    backend, device, padding, weight_map = o.backend, o.device, o.padding, o.weight_map
    name, target = dtype_name(o.dtype), torch_dtype(o.dtype)
    if backend is not None and backend not in backends.names():
        raise UsageError(f"unknown backend {backend!r}; choose one of "
                         f"{', '.join(backends.names())}")
    if not isinstance(inputs, tuple | dict | Steps):
        raise UsageError(f"inputs must be a tuple of positional arguments, a dict of keyword "
                         f"arguments or Steps of them; got {type(inputs).__name__}")
    old_cache, new_cache = o.cache if isinstance(o.cache, tuple) else (o.cache, o.cache)
    old_module, new_module = building.build(old, new, init=o.init, seed=o.seed,
                                            weight_map=weight_map)
    old_module.eval()
    new_module.eval()
    rounded = cast_inputs(inputs, device, target)
    padding = None if padding is None else padding.to(device)
    grads = o.grads and not isinstance(inputs, Steps)
    old_in_dtype = building.copy_in(old_module, target, device)
    new_in_dtype = building.copy_in(new_module, target, device)
    sides = {  # name: (module, inputs, backend, cache)
        "golden": (building.copy_in(old_in_dtype, torch.float64, device),
                   cast_inputs(rounded, device, torch.float64), None, old_cache),
        "baseline": (old_in_dtype, rounded, None, old_cache),
        "candidate": (new_in_dtype, rounded, backend, new_cache),
        "rerun": (perturb_weights(building.copy_in(new_module, target, device)), rounded,
                  backend, new_cache),
    }
    if backend is not None:
        sides["baseline on the backend"] = (old_in_dtype, rounded, backend, old_cache)
    runs, leaves = {}, {}
    for side, (module, side_inputs, side_backend, side_cache) in sides.items():
        runs[side], leaves[side] = running.forward(module, side_inputs, side_backend,
                                                   grads=grads, cache=side_cache)
    if grads:
        old_state = old_module.state_dict()
        for side, run in runs.items():
            other = runs["golden" if side in ("candidate", "rerun") else "candidate"]
            running.backward(sides[side][0], run, leaves[side], other.outputs, padding, o.seed)
            if side in ("candidate", "rerun") and run.grads is not None:
                run.grads["params"] = building.old_layout(run.grads["params"], weight_map,
                                                          old_state)
    baselines = [run for side, run in runs.items() if side.startswith("baseline")]
    return judge_twins(runs["candidate"], runs["golden"], baselines, runs["rerun"],
                       padding=padding, dtype=name, backend=backend)


def assert_twins(old: Buildable, new: Buildable, inputs: Inputs,
                 options: TwinOptions | None = None, **keywords: object) -> TwinVerdict:
    """Check that ``new`` computes what ``old`` does on ``inputs``, within the rounding allowed.

    ``old`` and ``new`` are modules (weights taken as equal in meaning), or classes or factories
    built with ``**init`` and filled from ``seed``, the new one through ``weight_map``. The old
    one runs in float64 (the golden) and in ``dtype`` (the baseline), the new one in ``dtype`` on
    ``backend`` and again on weights moved by one rounding. With ``grads`` the gradients of a
    fixed projection of the shared outputs, by floating inputs and parameters, are judged too.

    Args:
        old, new: the two implementations (modules, classes or factories).
        inputs: a tuple of positional arguments, a dict of keyword arguments, or :class:`Steps`
            of them for a decoding twin, each side with its own ``cache`` keyword.
        options: a :class:`TwinOptions`; keywords (``dtype="bf16"``) replace its fields.

    Returns:
        The verdict, when it passes.

    Raises:
        TwinFailure: an ``AssertionError`` explaining it, with a reproducer where both rebuild.
    """
    o = TwinOptions.of(options, keywords)
    verdict = check(old, new, inputs, o)
    if not verdict.ok:
        written = o.for_reproducer()
        raise TwinFailure(verdict, dict(written, inputs=inputs),
                          lambda: reproducer.section(old, new, inputs, written))
    return verdict
