"""Compiling a model under test: the forms count recompiles as dynamo makes them (static: one
per new shape, dynamic: none), a compile failure is an n/a reason and not a divergence, a
backend's own refusal passes through unchanged, and modules compiled on their own keep their
hooks outside the graph. The compiler here is ``aot_eager`` (dynamo and AOTAutograd, no
Inductor code generation): what is tested is the bookkeeping, which is the same."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchparity.errors import BackendUnavailable
from torchparity.subject.compiling import (
    CompileFailed,
    cache_dir,
    compiled,
    compiled_modules,
    default_compiler,
)

COMPILER = "aot_eager"


class Planted(nn.Module):
    """Doubles its input, plus one only while torch.compile traces it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + (1 if torch.compiler.is_compiling() else 0)


class Refusing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise BackendUnavailable("this backend cannot run here")


def _lengths(model: nn.Module, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    return [model(torch.ones(2, n)) for n in lengths]


@pytest.mark.parametrize("form, recompiled", [("static", [0, 1, 1]), ("dynamic", [0, 0, 0])])
def test_each_call_counts_the_recompiles_dynamo_made(form: str, recompiled: list[int]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with compiled(model, form, compiler=COMPILER) as log:
        for length in (3, 5, 7):
            model(torch.ones(length, 4))
    assert [len(call.recompiles) for call in log.calls] == recompiled
    assert log.recompiles_every_call == (form == "static")
    assert log.graph_breaks == 0 and log.calls[0].compiles == 1
    if form == "static":
        assert "size mismatch" in log.calls[1].recompiles[0]
    assert model._compiled_call_impl is None  # eager again after the block
    assert log.to_dict()["run_seconds"] >= 0 and log.compile_seconds > 0


def test_the_compiled_block_runs_the_compiled_branch_and_eager_runs_the_other() -> None:
    model = Planted()
    with compiled(model, "static", compiler=COMPILER):
        assert torch.equal(model(torch.ones(3)), torch.full((3,), 3.0))
    assert torch.equal(model(torch.ones(3)), torch.full((3,), 2.0))


def test_a_compile_failure_is_compile_failed_with_the_compilers_reason() -> None:
    def refuse(graph, example_inputs):
        raise RuntimeError("no kernel for this graph\nmore detail")

    model = Planted()
    with pytest.raises(CompileFailed, match=r"^torch.compile \(refuse\) failed: RuntimeError: "
                                            r"no kernel for this graph$"):
        with compiled(model, "static", compiler=refuse) as log:
            model(torch.ones(2))
    assert log.failure.startswith("torch.compile (refuse) failed") and log.compiler == "refuse"
    assert isinstance(CompileFailed("x"), BackendUnavailable)  # an n/a reason to the check


def test_a_backend_refusing_inside_the_graph_is_not_a_compile_failure() -> None:
    model = Refusing()
    with pytest.raises(BackendUnavailable, match="cannot run here") as refused:
        with compiled(model, "static", compiler=COMPILER):
            model(torch.ones(2))
    assert not isinstance(refused.value, CompileFailed)


def test_modules_compiled_on_their_own_keep_their_hooks_outside_the_graph() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Planted())
    seen = []
    model[1].register_forward_hook(lambda module, args, output: seen.append(output.clone()))
    x = torch.ones(1, 3)
    eager = model(x)
    with compiled_modules({"1": model[1]}, "static", compiler=COMPILER) as log:
        compiled_out = model(x)
    assert torch.equal(compiled_out, eager + 1) and torch.equal(seen[-1], compiled_out)
    assert [call.module for call in log.calls] == ["1"]
    assert "forward" not in vars(model[1])  # the class's forward again


def test_the_compiler_and_the_cache_follow_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TORCHPARITY_COMPILER", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compiler() == "inductor"
    assert cache_dir() == tmp_path / "torchparity" / "inductor"
    monkeypatch.setenv("TORCHPARITY_COMPILER", "aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert (default_compiler(), cache_dir()) == ("aot_eager", tmp_path / "mine")
