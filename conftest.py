"""Root conftest: hypothesis profiles, the plugin when no installed entry point loads it, this
suite's short ``--device`` option and ``device`` fixture (the plugin's are namespaced), and the
``single_thread`` fixture."""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
from hypothesis import HealthCheck, settings

# ci: the CI default, reproducible and bounded. dev: random seeds, to find new failures
# locally. thorough: many examples, for a nightly run.
settings.register_profile(
    "ci", derandomize=True, max_examples=10, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=20, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Each xdist worker gets one core's worth of threads; two workers with torch's default of one
# thread per core would oversubscribe the machine and run slower than one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(
        os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

pytest_plugins = ["pytester"]
if not any(ep.name == "torchparity" for ep in entry_points(group="pytest11")):
    pytest_plugins.append("torchparity.pytest_plugin")


def pytest_addoption(parser: pytest.Parser) -> None:
    # Shares its destination with the plugin's --torchparity-device: `pytest -m gpu --device cpu`
    # proves the CUDA tests' logic on a machine without a GPU.
    parser.getgroup("torchparity").addoption(
        "--device", dest="torchparity_device", metavar="DEVICE",
        help="this suite's short form of --torchparity-device")


@pytest.fixture
def device(torchparity_device: str) -> str:
    """``cpu`` for ordinary tests; the ``--device`` (default ``cuda``) for tests marked gpu."""
    return torchparity_device


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """torch on one CPU thread for the module's tests, restored afterwards: tiny models run
    faster on one thread, and on a shared machine several threads contend for the cores."""
    from torchparity.threads import single_thread as one_thread

    with one_thread():
        yield
