"""A model under test: what a user's factory returned, checked, and how to run it."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from torchparity.errors import BackendUnavailable, UsageError, UserCodeError
from torchparity.subject import hf
from torchparity.subject.beams import BeamSettings, builtin_reorder, search_settings
from torchparity.subject.decoding import STEP_HINT, ReorderFn, StepFn, builtin_step
from torchparity.subject.factory import call_factory, entry_name, first_line, resolve_entry
from torchparity.subject.padding import Padding, padding_of
from torchparity.subject.running import (
    Inputs,
    LossFn,
    call_model,
    cast_inputs,
    converted,
    default_loss_paths,
    left_unfilled,
    mark_unfilled,
    on_meta,
    projection_loss,
)
from torchparity.subject.slices import Slices, under_torchrun
from torchparity.subject.trees import PyTree
from torchparity.text import with_article

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

_Result = TypeVar("_Result")

#: ``decode(model, inputs, use_cache)``: a model's incremental decoding, its outputs a pytree.
DecodeFn = Callable[[nn.Module, Inputs, bool], PyTree]


@dataclass
class Subject:
    """A user's model under test, named by its ``entry`` and its golden folder's ``name``.

    Every command that takes a user's model loads it here. ``padding`` (the factory's, else what
    the inputs' masks say) is left out of every comparison and of the default loss.
    """

    name: str
    entry: str
    model: nn.Module
    inputs: Inputs
    loss_fn: LossFn | None = None
    step: StepFn | None = None
    decode: DecodeFn | None = None
    padding: Padding = field(default_factory=Padding)
    reorder: ReorderFn | None = None  # reorders its decoding state between beam steps
    # the factory's search key: its decode golden is a beam search
    search: BeamSettings | None = None
    #: ``parallelize(model, mesh)``: the factory's plan to shard the model over ``mesh``, a
    #: ``{dimension name: size}`` (see :mod:`torchparity.distributed.sharding`).
    parallelize: Callable[[nn.Module, DeviceMesh], nn.Module | None] | None = None
    #: The factory's ``mesh``, as it gave it: ``mesh_sizes`` checks it once under torchrun.
    mesh: object = None
    #: Under torchrun, once :func:`~torchparity.distributed.sharding.hold` sharded the factory's
    #: model by its plan (its own dtype, each rank its part): that model, ``model`` being then
    #: its structure on the meta device.
    shards: nn.Module | None = None
    #: The factory's ``shards``: parameter name -> the dimension its ranks' plain slices
    #: split it along, for a model it sharded by hand (:mod:`~torchparity.subject.slices`).
    split: Mapping[str, int] | None = None
    #: Under torchrun, a model sharded by hand: where each rank's slices lie (set by
    #: :func:`~torchparity.distributed.sharding.hold`).
    slices: Slices | None = None
    #: ``init(model)``: fills the weights of a model the factory built on the meta device.
    init: Callable[[nn.Module], object] | None = None
    #: Training (:mod:`torchparity.train.user_model`): ``batches(step)`` the inputs of optimizer
    #: step ``step``, ``optimizer(model)`` its optimizer, ``scheduler(optimizer)`` its learning
    #: rate schedule, ``train_step(model, batch, optimizer) -> loss`` the user's own step.
    batches: Callable[[int], Inputs] | None = None
    optimizer: Callable[[nn.Module], Optimizer] | None = None
    scheduler: Callable[[Optimizer], LRScheduler] | None = None
    train_step: Callable[[nn.Module, Inputs, Optimizer], torch.Tensor | float] | None = None
    #: False where it is checked against goldens made without decoding: it does not decode.
    decoding: bool = True
    #: A ``transformers`` model's attention implementation as built: its goldens run it, the
    #: other implementations are alternatives judged against it.
    attention: str | None = None

    @classmethod
    def load(cls, entry: str | Callable[[], object]) -> Subject:
        """Load a user's model the one way every command does: factory called, keys checked.

        Raises:
            UsageError: the entry or what the factory returns is wrong (one line saying which).
            UserCodeError: the factory, or its ``init``, raised.
        """
        if isinstance(entry, str):
            factory, spec = resolve_entry(entry), entry
        else:
            factory, spec = entry, f"{entry.__module__}:{entry.__qualname__}"
        fields = call_factory(factory, spec)
        fields["padding"] = padding_of(fields["padding"], fields["inputs"], fields["model"],
                                       f"the padding of factory {spec}", "the factory's padding")
        fields["search"] = search_settings(fields["search"], f"the search of factory {spec}")
        fields["split"] = fields.pop("shards")
        if fields["split"] is not None and not isinstance(fields["split"], Mapping):
            raise UsageError(f"factory {spec} returned shards={fields['split']!r}; give each "
                             'sliced parameter\'s dimension by name, such as '
                             '{"layers.0.attn.q.weight": 0}')
        subject = cls(name=entry_name(spec), entry=spec, **fields,
                      attention=hf.attention_of(fields["model"]))
        # under torchrun with a plan, each rank fills its own part once sharded
        if on_meta(subject.model) and not (under_torchrun() and subject.parallelize):
            subject.materialise(subject.model, "cpu")
        return subject

    def materialise(self, model: nn.Module, device: str | torch.device) -> None:
        """Give ``model`` (on meta) memory on ``device``, filled by the factory's ``init``."""
        if self.init is None:
            raise UsageError(f"factory {self.entry} built its model on the meta device; return "
                             "init(model), which fills its weights, with it")
        model.to_empty(device=device)
        # NaN first, so a weight init forgot is named rather than read as whatever memory held
        mark_unfilled(model)
        self.guarded(lambda: self.init(model), "its init")
        unfilled = left_unfilled(model)
        if unfilled:
            raise UsageError(f"factory {self.entry}: its init left {unfilled} unfilled (NaN) "
                             "after the model was built on the meta device; fill it in init "
                             "(a buffer the model computes when built, such as rotary "
                             "frequencies, must be computed again there)")

    @property
    def is_transformers(self) -> bool:
        """Whether the model is a ``transformers`` model."""
        return hf.is_transformers(self.model)

    @property
    def steps(self) -> bool:
        """Whether it decodes step by step: a ``step`` (the factory's or built-in) only."""
        return self.decoding and self.decode is None and self.has_step

    @property
    def has_step(self) -> bool:
        """Whether :meth:`stepper` has a step to give: the factory's, or a built-in one."""
        return self.step is not None or builtin_step(self.model) is not None

    @property
    def generates(self) -> bool:
        """Whether it decodes: with its own ``decode``, or step by step."""
        return self.decoding and (self.decode is not None or self.steps)

    def stepper(self, model: nn.Module | None = None) -> StepFn:
        """The factory's ``step``, else the built-in one, for ``model``; its exceptions one line.

        Raises:
            UsageError: the model has neither, naming the ``step`` key it needs.
        """
        model = self.model if model is None else model
        step = self.step or builtin_step(model)
        if step is None:
            raise UsageError(f"factory {self.entry}: torchparity cannot decode "
                             f"{with_article(type(model).__name__)} by itself; {STEP_HINT}")
        what = "its step" if self.step is not None else "the built-in decoding step"

        def guarded(m: nn.Module, tokens: PyTree, state: PyTree) -> tuple[torch.Tensor, PyTree]:
            return self.guarded(lambda: step(m, tokens, state), what)

        guarded.label = (f"the step of {self.entry}" if self.step is not None
                         else f"the built-in decoding step of {self.entry}")  # in its messages
        return guarded

    def reorderer(self, model: nn.Module | None = None) -> ReorderFn | None:
        """The ``reorder(state, index)`` of a beam search (the factory's, else built-in) or None."""
        model = self.model if model is None else model
        reorder = self.reorder or builtin_reorder(model)
        if reorder is None:
            return None
        what = "its reorder" if self.reorder is not None else "the built-in reorder"
        return lambda state, index: self.guarded(lambda: reorder(state, index), what)

    def placed(self, device: str | torch.device, dtype: torch.dtype,
               attention: str | None = None, *, share: bool = False
               ) -> tuple[nn.Module, Inputs]:
        """The model (a copy unless ``share``) and inputs in ``dtype`` on ``device``, eval mode."""
        model = converted(self.model, device, dtype)
        if model is self.model and not share:
            model = copy.deepcopy(model)
        # dropout, modules' or F.dropout(training=self.training), would make runs differ
        model.eval()
        if self.is_transformers:
            hf.set_attention(model, attention or self.attention)
        return model, cast_inputs(self.inputs, device, dtype)

    def forward(self, model: nn.Module, inputs: Inputs) -> PyTree:
        """``model`` called on ``inputs``, the model's own exception as one line."""
        return self.guarded(lambda: call_model(model, inputs), "the model's forward")

    def loss(self, output: PyTree, inputs: Inputs, flat: Mapping[str, torch.Tensor],
             loss_paths: list[str] | None = None) -> torch.Tensor | str:
        """The scalar loss a cell compares: ``loss_fn``, else the projection of ``loss_paths``.

        Returns a sentence saying why instead when ``flat`` lacks one of ``loss_paths``: the
        gradients are then not compared.
        """
        if self.loss_fn is not None:
            loss = self.guarded(lambda: self.loss_fn(output, inputs), "its loss_fn")
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise UsageError(f"loss_fn of {self.entry} must return a scalar tensor; got "
                                 f"{type(loss).__name__}")
            return loss.reshape(())
        # default: the floating outputs no cache holds, the goldens' choice
        paths = loss_paths if loss_paths is not None else default_loss_paths(flat)
        absent = [p for p in paths if p not in flat]
        if absent:
            more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
            return (f"the model returned no tensor at {absent[0]}{more}, which the golden's "
                    f"default loss projects; the loss and gradients cannot be compared")
        if not paths:
            raise UsageError(f"the output of {self.entry} has no floating tensor to take "
                             "gradients of; return a loss_fn from the factory")
        return projection_loss({p: flat[p] for p in paths}, self.padding)

    def decoded(self, model: nn.Module, inputs: Inputs, use_cache: bool) -> PyTree:
        """The factory's ``decode(model, inputs, use_cache)``, its exception as one line."""
        return self.guarded(lambda: self.decode(model, inputs, use_cache), "its decode")

    def guarded(self, fn: Callable[[], _Result], what: str) -> _Result:
        """``fn()``, with an exception of the user's code as a one-line :class:`UserCodeError`."""
        try:
            return fn()
        # torchparity's own errors pass through
        except (BackendUnavailable, UsageError):
            raise
        except Exception as exc:
            raise UserCodeError(f"{what} of {self.entry} raised {type(exc).__name__}: "
                                f"{first_line(exc)}") from exc
