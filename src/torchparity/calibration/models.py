"""The calibration's model problems: reference transformers drawn from the property suite's space.

Each draw is what :mod:`torchparity.strategies` hands the suite (a config with ``d_model`` up
to 32 and two layers per stack, 1-3 rows of 2-12 columns padded either side, a seed, a dtype
with the suite's pins), drawn seeded by hypothesis, so the degenerate examples the suite
meets come too. Outputs are the logits and the sequence loss's gradients; bugs are planted in
every attention module."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from torchparity import backends
from torchparity.calibration.problems import (
    NORM_EPS,
    PLAIN,
    ProblemVariant,
    attention_with_softmax_in,
    leaked_mask,
)
from torchparity.dtypes import DTYPES, dtype_name
from torchparity.errors import BackendUnavailable, UsageError
from torchparity.reference import TransformerConfig, build_model, sequence_loss, variants
from torchparity.reference.attention import Attention, AttentionContext
from torchparity.subject.rounding import perturb_weights


@dataclass
class ModelProblem:
    """One draw of the property suite's space: config, model seed, batch and dtype."""

    seed: int  # the draw's index in its run
    config: TransformerConfig
    model_seed: int
    batch: dict[str, torch.Tensor]
    dtype: str  # the dtype the suite would run it in: fp32, bf16 or fp16

    family = "models"

    @property
    def target(self) -> torch.Tensor:
        return self.batch["tgt_ids" if self.config.is_encoder_decoder else "input_ids"]

    @property
    def description(self) -> str:
        rows, columns = self.target.shape
        return f"{self.config.architecture} {rows}x{columns} {self.padding}"

    @property
    def padding(self) -> str:
        """How the target rows are padded: "unpadded", "left-padded", "right-padded" or
        "padded" (only fully padded rows)."""
        mask = self.batch.get("tgt_mask" if self.config.is_encoder_decoder else "attention_mask")
        if mask is None or bool(mask.all()):
            return "unpadded"
        steps = mask[:, 1:] - mask[:, :-1]
        if bool((steps > 0).any()):
            return "left-padded"
        return "right-padded" if bool((steps < 0).any()) else "padded"

    def dtypes(self, requested: list[str]) -> list[str]:
        """The dtypes this problem runs in: its own (as in the suite) and fp64 (exact baseline)."""
        return [d for d in requested if d in (self.dtype, "fp64")]

    def applies(self, variant: ProblemVariant) -> bool:
        """Whether a planted bug can occur here: a leak needs a causal row with a masked key,
        dropping a head needs two; keys are not shifted (positions vary by config)."""
        if variant.leak:
            return self.target.shape[1] >= 2
        if variant.drop_head:
            return self.config.n_heads >= 2
        return variant.key_shift == 0

    def compares_gradients(self, backend: str, dtype: str) -> bool:
        """As the suite: not the CPU flash kernel's gradients below fp32."""
        from torchparity.strategies import compares_gradients

        return compares_gradients(backend, DTYPES[dtype])

    def run(self, dtype: str, variant: ProblemVariant = PLAIN, *, grad: bool = True,
            rerun: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """``{"forward": {"logits": ...}, "grad": {...}}`` in ``dtype`` with ``variant``'s
        backend or bug; ``grad=False`` leaves gradients out, ``rerun`` moves the weights by
        one rounding."""
        config = self.config
        if variant.norm_eps != NORM_EPS:
            config = config.replace(norm_eps=config.norm_eps * variant.norm_eps / NORM_EPS)
        model = build_model(config, self.model_seed, dtype=DTYPES[dtype])
        if rerun:
            perturb_weights(model)
        _plant(model, variant)
        with backends.use(variant.backend, intercept=False):
            if grad:
                try:
                    logits = model(**self.batch)
                    sequence_loss(logits, self.batch).backward()
                    return {"forward": {"logits": logits.detach()},
                            "grad": variants.reference_gradients(model)}
                except BackendUnavailable:
                    pass
            with torch.no_grad():
                return {"forward": {"logits": model(**self.batch)}}


def draw_model_problems(draws: int, seed: int) -> list[ModelProblem]:
    """``draws`` examples drawn by hypothesis from ``seed`` (the same command draws the same;
    hypothesis also draws from the loaded code's constants, so another program may not)."""
    try:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as seeded
        from hypothesis import strategies as st

        from torchparity import strategies as tps
    except ImportError as exc:
        raise UsageError("the model problems are drawn from torchparity.strategies, which needs"
                         " hypothesis: pip install 'torchparity[strategies]', or calibrate on"
                         " attention blocks alone with --problems blocks") from exc
    found: list[ModelProblem] = []

    @seeded(seed)
    @settings(max_examples=draws, phases=[Phase.generate], database=None, deadline=None,
              derandomize=False, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def draw(data: Any) -> None:
        dtype = data.draw(tps.dtypes())
        config = data.draw(tps.configs(**tps.differentiable_in(dtype)))
        batch = data.draw(tps.batches(config))
        model_seed = data.draw(st.integers(0, 2**16))
        found.append(ModelProblem(len(found), config, model_seed, batch, dtype_name(dtype)))

    draw()
    return found[:draws]


def _plant(model: torch.nn.Module, variant: ProblemVariant) -> None:
    """Plant ``variant``'s bug in the model's attention modules (the leak in the first
    self-attention of the stack that decodes)."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    leaking = next((m for m in attentions if not m.cross and _decodes(model, m)), None)
    for module in attentions:
        module.scale *= variant.scale_factor
        leak = variant.leak and module is leaking
        if leak or variant.softmax_dtype is not None or variant.drop_head:
            module.attend = functools.partial(_bugged_attend, module, variant, leak)


def _decodes(model: torch.nn.Module, module: Attention) -> bool:
    return any(m is module for m in model.decoder.modules())


def _bugged_attend(module: Attention, variant: ProblemVariant, leak: bool, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                   bias: torch.Tensor | None) -> torch.Tensor:
    mask, causal = ctx.mask, ctx.causal
    if leak:
        mask, causal = leaked_mask(mask, causal, q.shape[0], q.shape[-2], k.shape[-2]), False
    if variant.softmax_dtype is not None:
        if k.shape[1] != q.shape[1]:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = attention_with_softmax_in(variant.softmax_dtype, q, k, v, mask, causal,
                                        module.scale, bias)
    else:
        out = backends.attention(q, k, v, mask=mask, bias=bias, scale=module.scale,
                                 causal=causal, backend="manual")
    if variant.drop_head:
        out = torch.cat((out[:, :-1], torch.zeros_like(out[:, -1:])), dim=1)
    return out

