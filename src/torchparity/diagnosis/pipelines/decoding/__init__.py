"""The decoding diagnosis: where B's decoding parts from A, step by step (see
:mod:`~torchparity.diagnosis.pipelines.decoding.api`). What other wings and the commands call."""

from torchparity.diagnosis.pipelines.decoding.api import (
    STEPS,
    DecodeOptions,
    decode_against,
    diagnose_decode,
    diagnose_decode_against,
    record_decode,
)
from torchparity.diagnosis.pipelines.decoding.report import DecodeReport

__all__ = ["STEPS", "DecodeOptions", "DecodeReport", "decode_against", "diagnose_decode",
           "diagnose_decode_against", "record_decode"]
