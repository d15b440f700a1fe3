"""Reports where CI and reviewers look: a Markdown summary (``--summary``: a GitHub job summary
or a pull-request comment), JUnit XML (``--junit``: any CI's test report) and, under GitHub
Actions, one ``::error`` annotation per failure. :mod:`~torchparity.ci.outcome` turns a check's
results or a diagnosis into an :class:`~torchparity.ci.outcome.Outcome`;
:mod:`~torchparity.ci.writers` writes it."""

from torchparity.ci.outcome import Case, Outcome, check_outcome, diagnosis_outcome
from torchparity.ci.writers import check_paths, junit_xml, publish, summary_markdown

__all__ = ["Case", "Outcome", "check_outcome", "check_paths", "diagnosis_outcome", "junit_xml",
           "publish", "summary_markdown"]
