"""A diagnosis of a model sharded over the ranks of ``torchrun`` (see
:mod:`~torchparity.diagnosis.pipelines.ranks.api`): what ``diagnose --nproc`` calls."""

from torchparity.diagnosis.pipelines.ranks.api import (
    diagnose_across_ranks,
    diagnose_pair_across_ranks,
)
from torchparity.diagnosis.pipelines.ranks.report import RankReport

__all__ = ["RankReport", "diagnose_across_ranks", "diagnose_pair_across_ranks"]
