"""A user's model trained by its factory's own recipe, one optimizer step at a time.

The factory gives ``batches(step)`` (the inputs of optimizer step ``step``, 1-based),
``optimizer(model)``, optionally ``scheduler(optimizer)`` (stepped after every optimizer step)
and ``train_step(model, batch, optimizer) -> loss``. Without ``train_step`` the step is
torchparity's: forward, the factory's ``loss_fn`` (or the default loss), backward,
``optimizer.step()``, ``optimizer.zero_grad()``.

Every step records the loss it returned, the gradient norm the optimizer received before any
clipping (the last value each parameter's gradient accumulated to), the norm of the parameter
update and, when the optimizer has several parameter groups, both norms per group: the
quantities a :class:`~torchparity.train.trainer.Trajectory` holds, judged by
:mod:`torchparity.train.trajectory` like the zoo's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from torchparity import backends
from torchparity.errors import UsageError, UserCodeError
from torchparity.subject.float64_ops import Float64Ops
from torchparity.subject.model import Subject
from torchparity.subject.rounding import perturb_weights
from torchparity.subject.running import call_model, cast_inputs
from torchparity.text import with_article
from torchparity.threads import single_thread
from torchparity.train import causal_lm
from torchparity.train.optimizer_groups import OptimizerGroups
from torchparity.train.trainer import (
    DTYPE_MODES,
    OWN_ATTENTION,
    Execution,
    StepDone,
    StepRecord,
    Trajectory,
    deterministic,
)

#: The hooks a factory needs to be trained, and what each must be.
HOOK_HINT = ("return batches(step) -> inputs and optimizer(model) -> torch.optim.Optimizer "
             "with the model (docs/training.md)")


@dataclass(frozen=True)
class UserRecipe:
    """A user's model trained ``steps`` optimizer steps by its factory's recipe. ``rounding``
    names the rounding-only change a member of the noise ensemble makes (None: the plain
    run); it never changes the mathematics, so every member shares the recipe."""

    entry: str
    steps: int
    rounding: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1; got {self.steps}")

    @property
    def case(self) -> str:
        return self.entry

    def same_recipe(self) -> UserRecipe:
        """The recipe without its rounding change: what two comparable runs share."""
        return dataclasses.replace(self, rounding=None, steps=1)

    def replace(self, **changes: Any) -> UserRecipe:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def training_subject(entry: str) -> Subject:
    """The model ``entry`` builds, with its training recipe: the factory's, or for a
    ``transformers`` causal LM that brings none the default one
    (:mod:`torchparity.train.causal_lm`)."""
    return causal_lm.with_recipe(Subject.load(entry))


def check_hooks(subject: Subject) -> None:
    """One line naming the training hook a factory lacks; nothing when it has them."""
    missing = [key for key in ("batches", "optimizer") if getattr(subject, key) is None]
    if missing:
        raise UsageError(f"factory {subject.entry} has no {' or '.join(missing)} to train "
                         f"with; {HOOK_HINT}")
    if subject.loss_fn is None and subject.train_step is None:
        raise UsageError(f"factory {subject.entry} has neither loss_fn nor train_step: the "
                         "default training step needs loss_fn(output, batch) -> loss")


class UserTrainer:
    """Trains a copy of ``subject``'s model under ``execution`` by the factory's recipe.

    ``perturb_seed`` moves the initial weights by one rounding of their dtype first
    (:func:`~torchparity.subject.rounding.perturb_weights`): a rounding-only member of the
    noise ensemble. The model is copied, so the factory's own model stays untouched.
    """

    def __init__(self, subject: Subject, recipe: UserRecipe, execution: Execution, *,
                 perturb_seed: int | None = None) -> None:
        check_hooks(subject)
        self.subject, self.recipe, self.execution = subject, recipe, execution
        self.mode = DTYPE_MODES[execution.dtype]
        self.device = torch.device(execution.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"device {execution.device!r} asked for, but no CUDA device is "
                             "available here; use --device cpu")
        self.model = self._build_model()
        if perturb_seed is not None:
            perturb_weights(self.model, seed=perturb_seed)
        self.optimizer = subject.guarded(lambda: subject.optimizer(self.model), "its optimizer")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise UsageError(f"optimizer of {subject.entry} returned "
                             f"{with_article(type(self.optimizer).__name__)}, not a "
                             "torch.optim.Optimizer")
        self.scheduler = (None if subject.scheduler is None else
                          subject.guarded(lambda: subject.scheduler(self.optimizer),
                                          "its scheduler"))
        self.groups = group_names(self.optimizer)
        self.optimizer_groups = OptimizerGroups.of(self.optimizer, self.model, self.groups)
        self._grad_norms: dict[int, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:  # a frozen parameter in a group never gets a gradient
                    p.register_post_accumulate_grad_hook(self._record_grad)
        self.records: list[StepRecord] = []
        self.started = time.perf_counter()

    def _build_model(self) -> torch.nn.Module:
        """A copy of the factory's model in the run's dtype, on its device."""
        return copy.deepcopy(self.subject.model).to(self.device, self.mode.param_dtype)

    def _group_norm(self, group: list[torch.Tensor], norms: list[torch.Tensor | None]) -> float:
        """The norm of a parameter group from each parameter's norm (None: no gradient):
        what a sharded trainer makes the whole model's."""
        return _norm(norms)

    def _record_grad(self, p: torch.Tensor) -> None:
        # The gradient as it stands after each accumulation: after the last backward of a step
        # it is what the optimizer gets before any clipping.
        self._grad_norms[id(p)] = torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64)

    def trajectory(self) -> Trajectory:
        first = self.records[0].seconds if self.records else math.nan
        return Trajectory(self.recipe, self.execution, list(self.records), first,
                          optimizer=self.optimizer_groups)

    def step(self, step: int) -> StepRecord:
        """Run optimizer step ``step`` (1-based) and record it."""
        subject = self.subject
        batch = subject.guarded(lambda: subject.batches(step), f"batches({step})")
        batch = cast_inputs(batch, self.device, self.mode.param_dtype)
        params = [[p for p in g["params"]] for g in self.optimizer.param_groups]
        before = [[p.detach().clone() for p in group] for group in params]
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer_groups.record(self.optimizer)
        self._grad_norms.clear()
        started = time.perf_counter()
        with deterministic(step, tf32=self.mode.tf32, warn_only=self.device.type == "cuda"), \
                self._attention(), self._autocast(), self._float64_ops():
            loss = self._train_step(batch, step)
        grads = [self._group_norm(group, [self._grad_norms.get(id(p)) for p in group])
                 for group in params]
        updates = [self._group_norm(group, [
            torch.linalg.vector_norm((p.detach() - b).to(torch.float64))
            for p, b in zip(group, old, strict=True)])
            for group, old in zip(params, before, strict=True)]
        if self.scheduler is not None:
            subject.guarded(self.scheduler.step, "its scheduler's step")
        record = StepRecord(step, loss, _norm(grads), _norm(updates), lr, 0, 0, 0,
                            time.perf_counter() - started)
        if len(self.groups) > 1:
            record.groups = {**{f"grad_norm[{name}]": g
                                for name, g in zip(self.groups, grads, strict=True)},
                             **{f"update_norm[{name}]": u
                                for name, u in zip(self.groups, updates, strict=True)}}
        self.records.append(record)
        return record

    def _train_step(self, batch: Any, step: int) -> float:
        subject = self.subject
        if subject.train_step is not None:
            loss = subject.guarded(lambda: subject.train_step(self.model, batch, self.optimizer),
                                   "its train_step")
            what = "train_step"
        else:
            loss = subject.guarded(lambda: self._default_step(batch), "its forward and loss")
            what = "loss_fn"
        value = _scalar(loss)
        if value is None:
            raise UsageError(f"{what} of {subject.entry} returned {_describe(loss)} at step "
                             f"{step}; it must return the step's loss (a scalar tensor or a "
                             "float)")
        if not math.isfinite(value):
            raise UserCodeError(f"the loss of {subject.entry} is {value} at step {step} "
                                f"({self.execution.dtype}); no golden is written from a run "
                                "that does not stay finite")
        return value

    def _default_step(self, batch: Any) -> torch.Tensor:
        loss = self.subject.loss_fn(call_model(self.model, batch), batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _attention(self) -> contextlib.AbstractContextManager:
        if self.execution.backend == OWN_ATTENTION:
            return contextlib.nullcontext()
        return backends.use(self.execution.backend)

    def _float64_ops(self) -> contextlib.AbstractContextManager:
        # A float64 run goes through kernels that have no float64 (a mixture of experts'
        # grouped matmul): their float64 fallbacks compute the same products.
        if self.mode.param_dtype != torch.float64:
            return contextlib.nullcontext()
        return Float64Ops()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.mode.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.mode.autocast_dtype)


def group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Each parameter group's ``name`` where the user gave one, else ``group0``, ``group1``...;
    a name given twice is told apart by its index (``decay#2``)."""
    names = [str(group.get("name", f"group{i}"))
             for i, group in enumerate(optimizer.param_groups)]
    return [name if names.index(name) == i else f"{name}#{i}" for i, name in enumerate(names)]


def train_user_model(subject: Subject, recipe: UserRecipe, execution: Execution, *,
                     perturb_seed: int | None = None,
                     advance: StepDone = lambda: None) -> Trajectory:
    """Train ``subject`` by ``recipe`` under ``execution`` in this process; its trajectory.

    Raises a one-line :class:`~torchparity.errors.UsageError` for a factory without the
    training hooks or a step that returns no loss, a
    :class:`~torchparity.errors.UserCodeError` when the user's code raises or the loss is not
    finite at a step (the step is named).
    """
    # One thread on the CPU, as the check runs: the results do not hang on the core count.
    on_cpu = torch.device(execution.device).type == "cpu"
    with single_thread() if on_cpu else contextlib.nullcontext():
        trainer = UserTrainer(subject, recipe, execution, perturb_seed=perturb_seed)
        for step in range(1, recipe.steps + 1):
            trainer.step(step)
            advance()
    return trainer.trajectory()


@dataclass(frozen=True)
class ModelRuns:
    """A user's model's recipe as the noise ensemble (:mod:`torchparity.train.ensemble`)
    trains it: the same protocol as a zoo case's :class:`~torchparity.train.trainer.CaseRuns`."""

    subject: Subject
    recipe: UserRecipe

    def train(self, execution: Execution, *, perturb_seed: int | None = None,
              rounding: str | None = None,
              advance: StepDone = lambda: None) -> Trajectory:
        """One run of the recipe under ``execution``, its rounding labelled ``rounding``."""
        return train_user_model(self.subject, self.recipe.replace(rounding=rounding),
                                execution, perturb_seed=perturb_seed, advance=advance)

    def spec(self) -> dict[str, Any]:
        """What a member process rebuilds these runs from: the entry, loaded again there."""
        entry = self.subject.entry
        if ":" not in entry or entry.startswith("<"):
            raise UsageError(f"the noise band reruns {entry} under another instruction set in "
                             "a process of its own: load it from an entry file.py:name")
        return {"entry": entry, "steps": self.recipe.steps}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ModelRuns:
        """The runs :meth:`spec` describes, the factory loaded in this process."""
        return cls(training_subject(spec["entry"]), UserRecipe(spec["entry"], spec["steps"]))


def _norm(parts: list[torch.Tensor | float | None]) -> float:
    values = [float(p) for p in parts if p is not None]
    return math.sqrt(sum(v * v for v in values))


def _scalar(loss: Any) -> float | None:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach().to(torch.float64).item()
    if isinstance(loss, float | int) and not isinstance(loss, bool):
        return float(loss)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "None" if value is None else with_article(type(value).__name__)
