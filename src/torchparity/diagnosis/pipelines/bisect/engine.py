"""A compiled cell's divergence bisected by PyTorch's ``CompilerBisector``, in this process.

The bisector tries each ``torch.compile`` backend in turn (``eager`` ... ``inductor``) until
one fails, then disables that backend's subsystems one by one until one makes it pass, then
bisects that subsystem's applications (the n-th pass, the n-th node lowered). The oracle is
the cell's own verdict (``.oracle``): only a change beyond the budget fails. Its state is
process-wide, so :func:`bisect` runs in a process of its own (``.worker``), with a temporary
status folder and the caches that would skip the passes off (:data:`CACHES_OFF`)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchparity.diagnosis.pipelines.bisect.applications import Recorder
from torchparity.diagnosis.pipelines.bisect.oracle import (
    NotBisected,
    Unstable,
    cell_checker,
    unrunnable,
    verdict,
)
from torchparity.errors import UsageError
from torchparity.golden.cells import Cell, CheckResult
from torchparity.subject.compiling import COMPILER_ENV
from torchparity.text import wrapped

if TYPE_CHECKING:  # inductor is imported only when a bisection runs
    from torch._inductor.compiler_bisector import BisectionResult, CompilerBisector

#: The caches turned off while bisecting, each of which would hand back a graph compiled
#: before without running the passes and lowerings whose applications the bisector counts
#: (dynamo's own cache is reset before every compile of a cell anyway).
CACHES_OFF = ("torch._inductor.config.fx_graph_cache",
              "torch._inductor.config.fx_graph_remote_cache",
              "torch._functorch.config.enable_autograd_cache")
#: The bisector's complaint when its oracle passes with every application enabled, after it
#: failed so in an earlier run: a verdict that changed between runs.
UPPER_BOUND_PASSED = "Function succeeded with 'find_max_bounds'"


@dataclass
class BisectOutcome:
    """A bisection's answer (``backend`` None: every backend passed), with its runs' cost and
    what they compiled."""

    backend: str | None = None
    subsystem: str | None = None
    name: str | None = None  # the pass, the op lowered or the config set
    number: int | None = None
    application: dict[str, Any] | None = None  # an Application as a dict: graph, node, line
    compiles: int = 0  # runs of the cell, the first one included
    bound: int = 0  # the most it could take, told before it started
    seconds: float = 0.0
    graphs: int = 0  # dynamo's graphs, each compiled forward and backward
    recompiles: int = 0
    compile_seconds: float = 0.0
    caches_off: list[str] = field(default_factory=lambda: list(CACHES_OFF))

    def counted(self, rows: list[CheckResult]) -> str:
        """Add what one run of the cell compiled (its rows' compile log) to the counts; that
        run's compiling in words."""
        log = next((row.compiled for row in rows if row.compiled), None)
        if log is None:
            return ""
        self.graphs += log["graphs"]
        self.recompiles += log["recompiles"]
        self.compile_seconds += log["compile_seconds"]
        return f", {log['compile_seconds']:.0f} s compiling {_graphs(log['graphs'])}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _graphs(count: int) -> str:
    return f"{count} graph" + ("" if count == 1 else "s")


def upper_bound(applications: int) -> int:
    """The most runs a bisection takes after the first: one per backend and per subsystem, one to
    count, and a binary search over ``applications``."""
    from torch._inductor.compiler_bisector import BACKENDS

    subsystems = max(len(listed) for listed in BACKENDS.values())
    return len(BACKENDS) + subsystems + 1 + math.ceil(math.log2(max(applications, 1)))


@contextlib.contextmanager
def caches_off() -> Iterator[None]:
    """:data:`CACHES_OFF` off for the block."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield


def bisect(entry: str, cell: Cell, *, repeats: int = 1,
           say: Callable[[str], None] | None = None) -> BisectOutcome:
    """Run ``cell`` of ``entry`` compiled; when it diverges, bisect the compiler by its verdict.

    ``say`` hears a line per run and the bound (default: printed). Each verdict must be the same
    in ``repeats`` runs.

    Returns:
        The :class:`BisectOutcome`; ``backend`` None when the cell passes or every backend did.

    Raises:
        NotBisected: the verdict changed between runs.
    """
    started = time.perf_counter()
    out = sys.stdout
    say = say or (lambda line: print(wrapped(line), file=out, flush=True))
    outcome = BisectOutcome()
    with tempfile.TemporaryDirectory(prefix="torchparity-bisect-") as folder, caches_off():
        check = cell_checker(entry, cell, Path(folder) / "goldens")
        recorder = Recorder()
        with recorder.watching():
            def oracle(describe: str = "as compiled") -> bool:
                recorder.new_run()
                run_started = time.perf_counter()
                ok, rows = verdict(check, repeats)
                if outcome.compiles == 0 and (reason := unrunnable(rows)):
                    raise UsageError(f"the cell cannot run compiled here: {reason}")
                outcome.compiles += 1
                compiled = outcome.counted(rows)
                bound = f"/{outcome.bound}" if outcome.bound else ""
                say(f"  run {outcome.compiles}{bound}: {describe}: "
                    f"{'within budget' if ok else 'diverged'} "
                    f"({time.perf_counter() - run_started:.0f} s{compiled})")
                return ok

            if oracle():
                outcome.seconds = time.perf_counter() - started
                return outcome
            outcome.bound = 1 + upper_bound(recorder.most())
            say(f"bisecting: at most {outcome.bound - 1} more compiled runs (the most "
                f"applications of a subsystem: {recorder.most()}); caches off: "
                f"{', '.join(CACHES_OFF)}")
            outcome = _bisected(oracle, Path(folder) / "bisector", recorder, outcome)
    outcome.seconds = time.perf_counter() - started
    return outcome


def _bisected(oracle: Callable[[str], bool], folder: Path, recorder: Recorder,
              outcome: BisectOutcome) -> BisectOutcome:
    from torch._inductor.compiler_bisector import CompilerBisector

    def run() -> bool:
        backend = CompilerBisector.get_backend()
        os.environ[COMPILER_ENV] = backend  # the backend whose turn it is compiles the cell
        return oracle(_state(CompilerBisector))

    CompilerBisector.in_process_cache = str(folder)
    compiler = os.environ.get(COMPILER_ENV)
    failure = None
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            result = CompilerBisector.do_bisect(run)
    except Unstable as exc:
        failure = str(exc)
    except RuntimeError as exc:
        if not str(exc).startswith(UPPER_BOUND_PASSED):
            raise
        failure = ("the cell passed with every application enabled after it diverged so: "
                   "its verdict changes between runs, so the compiler cannot be bisected")
    finally:
        if compiler is None:
            os.environ.pop(COMPILER_ENV, None)
        else:
            os.environ[COMPILER_ENV] = compiler
    if failure:
        raise NotBisected(f"could not bisect: {failure}")
    if result is None:
        return outcome
    outcome.backend, outcome.subsystem = result.backend, result.subsystem
    changed = _config_change(CompilerBisector, result)
    if changed:
        outcome.name = changed
    elif result.subsystem is not None:
        outcome.number = result.bisect_number
        recorded = recorder.applications.get((result.subsystem, result.bisect_number))
        outcome.application = recorded.to_dict() if recorded else None
        outcome.name = recorded.name if recorded else result.debug_info
    return outcome


def _config_change(bisector: type[CompilerBisector], result: BisectionResult) -> str | None:
    """``field=value`` when the subsystem found is a config setting that made the cell pass
    (``emulate_precision_casts=True``), else None."""
    from torch._inductor.compiler_bisector import ConfigChange

    if result.subsystem is None:
        return None
    subsystem = bisector.get_subsystem_object(result.backend, result.subsystem)
    if isinstance(subsystem, ConfigChange):
        return f"{subsystem.config_field}={subsystem.config_value}"
    return None


def _state(bisector: type[CompilerBisector]) -> str:
    """What the bisector enables in the coming run, in words."""
    from torch._inductor.compiler_bisector import ConfigChange

    backend, subsystem = bisector.get_backend(), bisector.get_subsystem()
    if not subsystem:
        return f"backend {backend}"
    state = bisector.get_run_state(backend, subsystem)
    changed = bisector.get_subsystem_object(backend, subsystem)
    if isinstance(changed, ConfigChange):
        return f"{backend} with {changed.config_field}={changed.config_value}"
    if state == "test_disable":
        return f"{backend} without {subsystem}"
    if state == "find_max_bounds":
        return f"{backend}, every {subsystem} counted"
    low, high = bisector.get_bisect_range(backend, subsystem)
    return f"{backend}, {subsystem} 0-{(low + high) // 2} of 0-{high} on"
