"""Running a model under test compiled by ``torch.compile``, and what compiling it cost.

Two forms, as users run them: ``dynamic`` (sizes are symbols: a new length need not recompile)
and ``static`` (every new shape compiles anew). A compiler that cannot compile a model raises
:class:`CompileFailed`: a check cell reports it as ``n/a``, never as a divergence.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
Compiler = str | Callable[..., object]
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: Dynamo's recompile limit inside :func:`compiled` (its default, 8, is the default of each
#: function; a static model decoding step by step recompiles at every new length, and the
#: count is what is measured): never lowered, and reaching it is a failure.
RECOMPILE_LIMIT = 64


class CompileFailed(BackendUnavailable):
    """``torch.compile`` could not compile the model here; the message is the compiler's."""


def check_mode(mode: str) -> str:
    """``mode`` checked against :data:`MODES`, so a typo fails before any compile."""
    if mode not in MODES:
        raise UsageError(f"unknown compile form {mode!r}; choose {' or '.join(MODES)}")
    return mode


def default_compiler() -> str:
    """The ``torch.compile`` backend used: ``$TORCHPARITY_COMPILER``, else ``inductor``."""
    return os.environ.get(COMPILER_ENV) or "inductor"


def cache_dir() -> Path:
    """Where Inductor's caches live: ``$TORCHINDUCTOR_CACHE_DIR``, else the user's cache."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    # compiling a tiny transformer costs tens of seconds on a CPU; a cached graph costs tracing only
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "torchparity" / "inductor"


@dataclass
class CallRecord:
    """One call of the compiled model: what it compiled (its backward included) and how long."""

    index: int
    grad: bool
    shapes: dict[str, list[int]]  # the input tensors' shapes by path
    module: str = ""  # the module called, when modules are compiled on their own
    phase: str = ""  # the part of the run (cached step 3 of a decoding)
    seconds: float = 0.0
    compiles: int = 0
    recompiles: list[str] = field(default_factory=list)  # dynamo's reason for each
    compile_seconds: float = 0.0


@dataclass
class CompileLog:
    """What compiling cost in one :func:`compiled` block: dynamo's counts, each call's record."""

    mode: str
    compiler: str = "inductor"
    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)  # the first line of each
    calls: list[CallRecord] = field(default_factory=list)
    seconds: float = 0.0  # the block's wall time
    failure: str | None = None
    current_phase: str = field(default="", repr=False)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the block's calls as part of ``name`` (``cached step 3`` of a decoding)."""
        outer, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = outer

    def in_phase(self, name: str) -> list[CallRecord]:
        """The calls recorded as part of ``name``, in order."""
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

    def to_dict(self) -> dict[str, object]:
        """The log as a report's JSON writes it."""
        return {"mode": self.mode, "compiler": self.compiler, "graphs": self.graphs,
                "graph_breaks": self.graph_breaks, "break_reasons": self.break_reasons,
                "recompiles": self.recompiles, "recompiles_every_call":
                self.recompiles_every_call, "seconds": self.seconds,
                "compile_seconds": self.compile_seconds,
                "run_seconds": max(self.seconds - self.compile_seconds, 0.0),
                "failure": self.failure, "calls": [asdict(c) for c in self.calls]}


class _Recorder:
    """Compiles functions for one block, moving dynamo's metrics into its log as they appear."""

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
        # the running call, or the last: a backward compiles after its forward returned
        call = self.log.calls[-1]
        for metric in metrics:
            call.compiles += 1
            call.compile_seconds += (metric.duration_us or 0) / 1e6
            if metric.recompile_reason:
                call.recompiles.append(metric.recompile_reason.strip().splitlines()[0])

    def compile(self, fn: Callable[..., object], forward: Callable[..., object], module: str = ""
                ) -> Callable[..., object]:
        """``fn`` (running ``forward``) compiled in the block's form, each call recorded."""
        from torch._dynamo import trace_rules
        from torch._dynamo.external_utils import wrap_inline

        # Dynamo starts tracing at the first frame outside torch: a torch.nn module's own
        # forward needs a frame of ours around it, as torch.compile(module) gives it.
        if trace_rules.check(forward):
            fn = wrap_inline(fn)
        compiled = torch.compile(fn, dynamic=MODES[self.log.mode], backend=self.backend)

        def recorded(*args: object, **kwargs: object) -> object:
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
    """``torch.compile (backend) failed: Error: line`` where ``exc`` failed to compile, or None."""
    import torch._dynamo.exc as dynamo_exc
    from torch._inductor.exc import InductorError

    compile_errors = (dynamo_exc.TorchDynamoException, dynamo_exc.FailOnRecompileLimitHit,
                      InductorError)
    # a compile failure is a cell the compiler cannot run here, not a numerical departure
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
    """Compile ``model`` in place, hooks included (as ``model.compile()``), logging what it cost.

    Every block starts from dynamo's empty caches, so its counts are its own; the model is eager
    again after it. ``mode`` None leaves it eager and yields None.

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
    """Compile each module's ``forward`` on its own, into one log; else as :func:`compiled`."""
    with _compiling(mode, compiler) as (log, recorder):
        # a module's hooks stay outside its graph, so whoever hooks it sees its compiled output
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
    """A compiled block: dynamo reset, compile failures raised as :class:`CompileFailed`."""
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
        # past the limit dynamo would run eagerly, judged as compiled: hitting it is a failure
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
