"""The cells of a check share their models: the factory's own model serves its dtype and the
float64 cells (run module by module), one converted copy serves each other dtype, and the
factory's weights come out unchanged."""

from __future__ import annotations

import pytest
import torch

from torchparity.golden.model_check import check_subject, model_cells
from torchparity.golden.store import GoldenStore
from torchparity.golden.user_models import write_goldens
from torchparity.subject import Subject, model

transformers = pytest.importorskip("transformers")
import tiny_transformers  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.transformers


def llama():
    torch.manual_seed(0)
    ids = torch.randint(0, tiny_transformers.VOCAB, (2, 8),
                        generator=torch.Generator().manual_seed(0))
    return tiny_transformers.llama(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_one_copy_per_other_dtype_and_the_weights_untouched(tmp_path, monkeypatch):
    copies = []
    convert = model.converted

    def counted(module, device, dtype):
        found = convert(module, device, dtype)
        if found is not module:
            copies.append(dtype)
        return found

    monkeypatch.setattr(model, "converted", counted)
    subject = Subject.load(llama)
    weights = {k: v.clone() for k, v in subject.model.state_dict().items()}
    store = GoldenStore(tmp_path)
    write_goldens(subject, store)
    results = check_subject(subject, store, model_cells(
        backends=["manual", "sdpa", "hf-eager"], dtypes=["fp32", "bf16"]))
    assert all(r.ok for r in results), [r.explain for r in results if not r.ok]
    assert copies == [torch.bfloat16]  # the golden, the reference and fp32 cells: the model
    assert all(torch.equal(v, weights[k]) and v.dtype == weights[k].dtype
               for k, v in subject.model.state_dict().items())
