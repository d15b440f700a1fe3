"""Root conftest: hypothesis profiles, and the plugin when no installed entry point loads it."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

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

if not any(ep.name == "torchparity" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["torchparity.pytest_plugin"]
