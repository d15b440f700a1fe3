"""Running a model under test compiled by ``torch.compile``, and what compiling it cost.

Two forms, as users run them: ``dynamic`` (``torch.compile(model, dynamic=True)``: sizes are
symbols, so a new length need not recompile) and ``static`` (``dynamic=False``: every new
shape compiles anew). :func:`compiled` compiles a model in place (its parameters, buffers and
hooks stay where they are, so the rest of torchparity sees the same module) and keeps a
:class:`CompileLog` of the block: graphs, graph breaks, recompiles with dynamo's reasons, and
the seconds spent compiling against those spent running, per call of the model.

Compiling is costly on a CPU (tens of seconds for a tiny transformer's forward and backward),
so Inductor's caches stay on and live in one place across runs: ``$TORCHINDUCTOR_CACHE_DIR``
when set, else ``torchparity/inductor`` under the user's cache folder (``$XDG_CACHE_HOME`` or
``~/.cache``). A second run of the same graph then costs dynamo's tracing only.

The compiler is Inductor unless ``$TORCHPARITY_COMPILER`` names another ``torch.compile``
backend (``aot_eager``: dynamo and AOTAutograd without Inductor, which tells a departure that
tracing causes from one that Inductor's kernels cause).

A compiler that cannot compile a model raises :class:`CompileFailed`, a
:class:`~torchparity.errors.BackendUnavailable` with the compiler's own reason: a check cell
reports it as ``n/a``, never as a divergence. Hitting dynamo's recompile limit counts as
failing to compile (past it dynamo would run the model eagerly, and an eager run would be
judged as a compiled one); the limit is raised to :data:`RECOMPILE_LIMIT` first.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.errors import BackendUnavailable, UsageError
from torchparity.subject.trees import flatten_tensors

#: Compile form -> ``torch.compile``'s ``dynamic`` argument.
MODES = {"dynamic": True, "static": False}
#: Names the compiler backend of every compiled run (default ``inductor``); ``aot_eager``
#: runs dynamo and AOTAutograd without Inductor's code generation: a departure that stays
#: there comes from tracing, one that goes away from Inductor.
COMPILER_ENV = "TORCHPARITY_COMPILER"
#: A ``torch.compile`` backend: its registered name, or the backend function itself.
Compiler = str | Callable[..., Any]
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: Dynamo's recompile limit inside :func:`compiled` (its default, 8, is the default of each
#: function; a static model decoding step by step recompiles at every new length, and the
#: count is what is measured): never lowered, and reaching it is a failure.
RECOMPILE_LIMIT = 64


class CompileFailed(BackendUnavailable):
    """``torch.compile`` could not compile the model here; the message is the compiler's."""


def check_mode(mode: str) -> str:
    """``mode`` checked against :data:`MODES`, so a typo fails before any compile.

    Args:
        mode: the compile form a command or caller gave.

    Returns:
        ``mode`` unchanged.

    Raises:
        UsageError: ``mode`` is not a compile form.
    """
    if mode not in MODES:
        raise UsageError(f"unknown compile form {mode!r}; choose {' or '.join(MODES)}")
    return mode


def default_compiler() -> str:
    """The ``torch.compile`` backend used: ``$TORCHPARITY_COMPILER``, else ``inductor``.

    Returns:
        The backend's registered name.
    """
    return os.environ.get(COMPILER_ENV) or "inductor"


def cache_dir() -> Path:
    """Where Inductor's caches live: kept between runs, a graph compiled before costs less.

    Returns:
        ``$TORCHINDUCTOR_CACHE_DIR``, else ``torchparity/inductor`` under ``$XDG_CACHE_HOME``
        (default ``~/.cache``).
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "torchparity" / "inductor"


@dataclass
class CallRecord:
    """One call of the compiled model: what it compiled (the backward pass it started counts
    with it) and how long it took. ``grad`` says whether gradients were on (a training call)
    and ``shapes`` gives the input tensors' shapes by path; ``phase`` names the part of the
    run it belongs to (``cached step 3`` of a decoding; see :meth:`CompileLog.phase`)."""

    index: int
    grad: bool
    shapes: dict[str, list[int]]
    module: str = ""  # the module called, when modules are compiled on their own
    phase: str = ""
    seconds: float = 0.0
    compiles: int = 0
    recompiles: list[str] = field(default_factory=list)  # dynamo's reason for each
    compile_seconds: float = 0.0


@dataclass
class CompileLog:
    """What compiling cost in one :func:`compiled` block.

    ``graphs`` and ``graph_breaks`` are dynamo's counts, ``break_reasons`` the first line of
    each break's reason; ``calls`` one :class:`CallRecord` per call of the model, every
    compile and recompile counted with the call that caused it; ``seconds`` the block's wall
    time, ``compile_seconds`` the part of it spent compiling.
    """

    mode: str
    compiler: str = "inductor"
    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    seconds: float = 0.0
    failure: str | None = None
    current_phase: str = field(default="", repr=False)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the block's calls as part of ``name``: a report says what each part compiled.

        Args:
            name: the part of the run (``cached step 3`` of a decoding).

        Yields:
            Nothing; the outer phase is restored after the block.
        """
        outer, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = outer

    def in_phase(self, name: str) -> list[CallRecord]:
        """The calls recorded as part of ``name``, in order.

        Args:
            name: a phase given to :meth:`phase`.

        Returns:
            Their records.
        """
        return [call for call in self.calls if call.phase == name]

    @property
    def recompiles(self) -> int:
        """Dynamo's recompiles over every call of the block."""
        return sum(len(c.recompiles) for c in self.calls)

    @property
    def compile_seconds(self) -> float:
        """The part of the block's wall time spent compiling."""
        return sum(c.compile_seconds for c in self.calls)

    @property
    def recompiles_every_call(self) -> bool:
        """Whether every call after the first recompiled (at least two of them)."""
        later = self.calls[1:]
        return len(later) >= 2 and all(c.recompiles for c in later)

    def to_dict(self) -> dict[str, Any]:
        """The log as a report's JSON writes it.

        Returns:
            The counts, the seconds (compile and the rest), and every call's record.
        """
        return {"mode": self.mode, "compiler": self.compiler, "graphs": self.graphs,
                "graph_breaks": self.graph_breaks, "break_reasons": self.break_reasons,
                "recompiles": self.recompiles, "recompiles_every_call":
                self.recompiles_every_call, "seconds": self.seconds,
                "compile_seconds": self.compile_seconds,
                "run_seconds": max(self.seconds - self.compile_seconds, 0.0),
                "failure": self.failure, "calls": [asdict(c) for c in self.calls]}


class _Recorder:
    """Compiles functions for one block and moves dynamo's compilation metrics into its log as
    they appear, each to the call that was running (or last ran: the backward pass compiles
    after its forward call returned)."""

    def __init__(self, log: CompileLog, backend: Compiler) -> None:
        import torch._dynamo.utils as dynamo_utils

        self.log = log
        self.backend = backend
        self._utils = dynamo_utils
        dynamo_utils.clear_compilation_metrics()

    def collect(self) -> None:
        metrics = self._utils.get_compilation_metrics()
        self._utils.clear_compilation_metrics()
        if not metrics:
            return
        if not self.log.calls:  # compiled before any call was recorded: count it as the first
            self.log.calls.append(CallRecord(0, torch.is_grad_enabled(), {}))
        call = self.log.calls[-1]
        for metric in metrics:
            call.compiles += 1
            call.compile_seconds += (metric.duration_us or 0) / 1e6
            if metric.recompile_reason:
                call.recompiles.append(metric.recompile_reason.strip().splitlines()[0])

    def compile(self, fn: Callable[..., Any], forward: Callable[..., Any], module: str = ""
                ) -> Callable[..., Any]:
        """``fn``, which runs the module method ``forward``, compiled in the block's form, each
        call recorded (``module``: the module's name)."""
        from torch._dynamo import trace_rules
        from torch._dynamo.external_utils import wrap_inline

        # Dynamo starts tracing at the first frame outside torch: a torch.nn module's own
        # forward needs a frame of ours around it, as torch.compile(module) gives it.
        if trace_rules.check(forward):
            fn = wrap_inline(fn)
        compiled = torch.compile(fn, dynamic=MODES[self.log.mode], backend=self.backend)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.collect()
            inputs = {**flatten_tensors(args, "args"), **flatten_tensors(kwargs, "kwargs")}
            record = CallRecord(len(self.log.calls), torch.is_grad_enabled(),
                                {p: list(t.shape) for p, t in inputs.items()}, module,
                                self.log.current_phase)
            self.log.calls.append(record)
            started = time.perf_counter()
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:
                reason = failure_reason(exc)
                if reason is None:
                    raise
                self.log.failure = reason
                raise CompileFailed(reason) from exc
            finally:
                record.seconds = time.perf_counter() - started
                self.collect()

        return recorded


def failure_reason(exc: BaseException) -> str | None:
    """The compiler's one-line reason when ``exc`` is a failure to compile, else None.

    A compile failure is a cell the compiler cannot run here, not a numerical departure:
    the caller reports it as such.

    Args:
        exc: an exception raised in a compiled block, followed along its causes.

    Returns:
        ``torch.compile (backend) failed: Error: first line``, or None when the model's own
        code, or an unavailable backend, raised it.
    """
    import torch._dynamo.exc as dynamo_exc
    from torch._inductor.exc import InductorError

    compile_errors = (dynamo_exc.TorchDynamoException, dynamo_exc.FailOnRecompileLimitHit,
                      InductorError)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, CompileFailed):
            return str(seen)
        if isinstance(seen, BackendUnavailable):  # the backend's own reason, traced or not
            return None
        if isinstance(seen, compile_errors):
            innermost = seen
            while (inner := getattr(innermost, "inner_exception", None) or
                   innermost.__cause__) is not None:
                innermost = inner
            lines = [line.strip() for line in str(innermost).strip().splitlines()]
            text = next((line for line in lines if line), "") or type(innermost).__name__
            backend = getattr(seen, "backend_name", None)
            compiler = f"torch.compile ({backend})" if backend else "torch.compile"
            return f"{compiler} failed: {type(innermost).__name__}: {text}"
        seen = seen.__cause__
    return None


@contextlib.contextmanager
def compiled(model: nn.Module, mode: str | None, *, compiler: Compiler | None = None
             ) -> Iterator[CompileLog | None]:
    """Compile ``model`` in place for the block, and log what compiling cost.

    The whole call is compiled, hooks included, as ``model.compile()`` does. Every block starts
    from dynamo's empty caches, so its counts are its own (Inductor's caches on disk stay: a
    graph compiled before costs its tracing only). The model is eager again after the block.

    Args:
        model: the model compiled.
        mode: a compile form of :data:`MODES`, or None to leave it eager.
        compiler: the ``torch.compile`` backend (default :func:`default_compiler`).

    Yields:
        The block's :class:`CompileLog`, complete when the block ends; None when ``mode`` is.

    Raises:
        CompileFailed: compiling failed anywhere in the block, a backward pass included.
    """
    if mode is None:
        yield None
        return
    with _compiling(mode, compiler) as (log, recorder):
        model._compiled_call_impl = recorder.compile(model._call_impl, model.forward)
        try:
            yield log
        finally:
            model._compiled_call_impl = None


@contextlib.contextmanager
def compiled_modules(modules: Mapping[str, nn.Module], mode: str, *,
                     compiler: Compiler | None = None) -> Iterator[CompileLog]:
    """Compile the ``forward`` of each of ``modules`` on its own for the block.

    A module's hooks stay outside its compiled graph, so whoever hooks it sees its compiled
    output; everything it calls is inside. Otherwise as :func:`compiled`.

    Args:
        modules: the modules by name.
        mode: a compile form of :data:`MODES`.
        compiler: the ``torch.compile`` backend (default :func:`default_compiler`).

    Yields:
        One :class:`CompileLog` for all of them, each call's record naming its module.

    Raises:
        CompileFailed: compiling failed anywhere in the block.
    """
    with _compiling(mode, compiler) as (log, recorder):
        saved = {name: module.__dict__.get("forward") for name, module in modules.items()}
        for name, module in modules.items():
            module.forward = recorder.compile(module.forward, module.forward, name)
        try:
            yield log
        finally:
            for name, module in modules.items():
                if saved[name] is None:
                    del module.forward
                else:
                    module.forward = saved[name]


@contextlib.contextmanager
def _compiling(mode: str, compiler: Compiler | None
               ) -> Iterator[tuple[CompileLog, _Recorder]]:
    """A compiled block: dynamo reset, its counters cleared, the recompile limit raised and
    made a failure, compile failures turned into :class:`CompileFailed`, the log completed."""
    check_mode(mode)
    compiler = compiler or default_compiler()
    os.environ.setdefault(CACHE_ENV, str(cache_dir()))
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    log = CompileLog(mode, compiler if isinstance(compiler, str) else compiler.__name__)
    recorder = _Recorder(log, compiler)
    started = time.perf_counter()
    try:
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True,
                                        recompile_limit=limit):
            yield log, recorder
    except CompileFailed:
        raise
    except Exception as exc:
        reason = failure_reason(exc)
        if reason is None:
            raise
        log.failure = reason
        raise CompileFailed(reason) from exc
    finally:
        recorder.collect()
        log.seconds = time.perf_counter() - started
        counters = dynamo_utils.counters
        log.graphs = int(counters["stats"]["unique_graphs"])
        log.graph_breaks = int(sum(counters["graph_break"].values()))
        log.break_reasons = [reason.strip().splitlines()[0] for reason in counters["graph_break"]]
