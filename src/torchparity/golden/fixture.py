"""The ``golden`` pytest fixture: any project's tests keep goldens of their own beside them."""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from torchparity.golden.store import GoldenError, GoldenStore
from torchparity.tolerance import DtypeLike

if TYPE_CHECKING:
    from torchparity.comparison import Comparison

# Room for a golden's own name and suffix within the 255 bytes a file name may have.
_MAX_TEST_NAME = 120


class GoldenFixture:
    """Compares a test's tensors with goldens kept in ``<test folder>/golden/<module>/<test>/``.

    ``<test>`` comes from the node id (:func:`folder_of_test`), so two tests or parameters
    storing ``"logits"`` keep separate goldens. In update mode :meth:`check` writes the golden
    and lists it in :attr:`written`, which the plugin turns into a failure: an update cannot pass
    silently.
    """

    def __init__(self, store: GoldenStore, test: str, update: bool,
                 on_written: Callable[[Path], None]) -> None:
        self.store = store
        self.test = test
        self.update = update
        self.on_written = on_written
        self.written: list[Path] = []

    @classmethod
    def for_test(cls, node_path: Path, node_id: str, update: bool,
                 on_written: Callable[[Path], None],
                 update_option: str = "--torchparity-golden-update") -> GoldenFixture:
        """The fixture of one test; ``update_option`` rewrites its goldens, quoted in messages."""
        command = f"pytest {shlex.quote(node_id)} {update_option}"
        store = GoldenStore(node_path.parent / "golden" / node_path.stem,
                            update_command=command.replace("{", "{{").replace("}", "}}"))
        return cls(store, folder_of_test(node_id), update, on_written)

    def check(self, name: str, tensors: torch.Tensor | Mapping[str, torch.Tensor],
              kind: str = "forward", *,
              baseline: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
              compute_dtype: DtypeLike | None = None, reduction_length: int | None = None
              ) -> Comparison | None:
        """Compare ``tensors`` with golden ``name``, failing the test when one diverged.

        On a divergence the obtained values are first written to ``<name>.obtained.safetensors``.

        Args:
            name: the golden's name within the test.
            tensors: a tensor, or a mapping of names to tensors.
            kind: the tolerance model's kind (``forward``, ``gradient``...).
            baseline: the same computation in the candidate's dtype by a trusted path, whose error
                sets the budget (see :func:`torchparity.compare`); shaped as ``tensors``.
            compute_dtype: the dtype the candidate was computed in.
            reduction_length: the length of the longest reduction, for the analytic bound.

        Returns:
            The comparison, or None when updating (the test fails at teardown).
        """
        import pytest

        from torchparity.comparison import StructureMismatch, compare

        candidate = {"value": tensors} if isinstance(tensors, torch.Tensor) else dict(tensors)
        if self.update:
            for path in self.store.write(self.test, name, candidate, {"kind": kind}):
                self.written.append(path)
                self.on_written(path)
            return None
        try:
            golden = self.store.read(self.test, name).tensors
        except GoldenError as exc:
            pytest.fail(str(exc), pytrace=False)
        if isinstance(baseline, torch.Tensor):
            baseline = {"value": baseline}
        try:
            result = compare(candidate, golden, baseline, kind, compute_dtype=compute_dtype,
                             reduction_length=reduction_length)
            failure = None if result.ok and not result.structure_differs else result.explain()
        except StructureMismatch as exc:
            result, failure = None, f"structure differs from the golden: {exc}"
        if failure:
            obtained = self.store.write_obtained(self.test, name, candidate)
            pytest.fail(f"golden {name!r}: {failure} Obtained values: {obtained}; if the change "
                        f"is intended, run `{self.store.update_command}`", pytrace=False)
        return result


def folder_of_test(node_id: str) -> str:
    """A test's golden folder name: ``m.py::TestB::test_x[cpu-2]`` -> ``TestB.test_x-cpu-2``."""
    in_file = node_id.split("::", 1)[-1]
    function, _, params = in_file.partition("[")
    # . and - occur in no Python name, so distinct tests get distinct names
    readable = function.replace("::", ".") + (f"-{params.removesuffix(']')}" if params else "")
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", readable)
    # unsafe characters become _, and then, or for a very long id, a short hash keeps names apart
    if name != readable or len(name) > _MAX_TEST_NAME:
        digest = hashlib.sha256(in_file.encode()).hexdigest()[:10]
        name = f"{name[:_MAX_TEST_NAME - len(digest) - 1]}-{digest}"
    return name
