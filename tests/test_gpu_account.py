"""The gpu cells' account (``tests/conftest.py``) in a throw-away suite run by a real pytest:
the table per backend and dtype, and a run that cannot pass by skipping what the machine offers.

On the CPU the probe offers ``sdpa-math`` and ``flex`` in fp32 and not ``sdpa-efficient``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

ACCOUNT = (Path(__file__).parent / "conftest.py").read_text()
INSTALLED = any(ep.name == "torchparity" for ep in entry_points(group="pytest11"))
WITH_PLUGIN = () if INSTALLED else ("-p", "torchparity.pytest_plugin")
INI = "[pytest]\ntorchparity_gpu_marker = true\n"

# One cell per backend in fp32; SKIP names the backends whose cell skips for no good reason.
CELLS = '''
import pytest

SKIP = {skip!r}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32"])
@pytest.mark.parametrize("backend", ["sdpa-math", "sdpa-efficient", "flex"])
def test_cell(backend, dtype, gpu_cell):
    if backend == "sdpa-efficient":
        pytest.skip("sdpa-efficient needs a CUDA device; tensors are on cpu")
    if backend in SKIP:
        pytest.skip("an error the wrapper swallowed")
    if backend == "flex":
        gpu_cell.forward_only("flex has no backward pass on the CPU")


def test_not_a_cell():
    pytest.skip("no backend, no dtype: not counted")
'''


def _run(pytester: pytest.Pytester, *skip: str, xdist: bool = False) -> pytest.RunResult:
    pytester.makeconftest(ACCOUNT)
    pytester.makeini(INI)
    pytester.makepyfile(test_cells=CELLS.format(skip=set(skip)))
    args = ("-p", "no:cacheprovider", "-m", "gpu", "--torchparity-device", "cpu", *WITH_PLUGIN)
    if xdist:
        return pytester.runpytest_subprocess(*args, "-n", "2")
    return pytester.runpytest_inprocess(*args)


def test_a_run_whose_offered_backends_ran_is_green_and_tabled(pytester: pytest.Pytester):
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([
        "*torchparity gpu cells on cpu*",
        "backend*dtype*offered*ran*forward only*failed*skipped",
        "sdpa-math*fp32*yes*1*0*0*0",
        "sdpa-efficient*fp32*no*0*0*0*1",
        "  1 skipped: sdpa-efficient needs a CUDA device; tensors are on cpu",
        "flex*fp32*yes*0*1*0*0",
        "  1 forward only: flex has no backward pass on the CPU",
    ])
    assert "not counted" not in result.stdout.str()
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "torchparity gpu cells" in line)
    assert max(len(line) for line in lines[start:-1]) <= 80


@pytest.mark.parametrize("backend", ["sdpa-math", "flex"])
def test_an_offered_backend_that_ran_no_cell_fails_the_run(pytester, backend):
    result = _run(pytester, backend)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "  1 skipped: an error the wrapper swallowed",
        f"{backend} fp32 on cpu: ran 0 of 1 cells, though offered",
    ])


@pytest.mark.slow
def test_the_account_is_kept_by_the_xdist_controller(pytester: pytest.Pytester):
    result = _run(pytester, "sdpa-math", xdist=True)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "sdpa-math*fp32*yes*0*0*0*1",
        "flex*fp32*yes*0*1*0*0",
        "sdpa-math fp32 on cpu: ran 0 of 1 cells, though offered",
    ])
