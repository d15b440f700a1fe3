"""Float64 versions of the operations whose kernels have none.

``transformers``' mixture-of-experts layers use ``torch._grouped_mm``, which takes float32,
bfloat16 and float16 only. :class:`Float64Ops` runs such an operation on float64 operands as the
plain float64 operations it stands for, differentiable as they are, and a product of float64 and
a narrower operand (a router's ``F.linear(hidden.float(), self.weight)``) in float64: the
narrower value joins exactly, its cast staying the island the run notes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """``torch._grouped_mm`` as one ``mm`` per group, in the operands' dtype.

    Args:
        mat_a: ``(M, K)`` or ``(G, M, K)``.
        mat_b: ``(K, N)`` or ``(G, K, N)``.
        offs: the ends of the groups along the 2-D operands' grouped dimension: the rows of a
            2-D ``mat_a`` against a 3-D ``mat_b``, the columns of a 2-D ``mat_b`` against a
            3-D ``mat_a``, the shared ``K`` of two 2-D operands; None for two 3-D operands.
        bias: added to each group's product, ``(G, N)``.
        out_dtype: the result's dtype (default: the operands').

    Returns:
        ``(M, N)`` where one operand is 2-D and the other 3-D (rows or columns past the last
        group are zero), ``(G, M, N)`` otherwise.
    """
    groups = _groups(offs)
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        products = [mat_a[g] @ mat_b[g] for g in range(mat_a.size(0))]
        out = torch.stack(_biased(products, bias))
    elif mat_a.dim() == 2 and mat_b.dim() == 3:
        products = _biased([mat_a[start:end] @ mat_b[g] for g, (start, end) in groups], bias)
        out = torch.cat([*products, mat_a.new_zeros(mat_a.size(0) - _end(groups),
                                                    mat_b.size(2))])
    elif mat_a.dim() == 3 and mat_b.dim() == 2:
        products = _biased([mat_a[g] @ mat_b[:, start:end] for g, (start, end) in groups],
                           bias, columns=groups)
        out = torch.cat([*products, mat_b.new_zeros(mat_a.size(1),
                                                    mat_b.size(1) - _end(groups))], dim=1)
    else:
        products = [mat_a[:, start:end] @ mat_b[start:end] for _, (start, end) in groups]
        out = torch.stack(_biased(products, bias))
    return out if out_dtype is None else out.to(out_dtype)


def _groups(offs: torch.Tensor | None) -> list[tuple[int, tuple[int, int]]]:
    """Each group's index and ``(start, end)`` along the grouped dimension."""
    return list(enumerate(itertools.pairwise([0, *([] if offs is None else offs.tolist())])))


def _end(groups: list[tuple[int, tuple[int, int]]]) -> int:
    return groups[-1][1][1] if groups else 0


def _biased(products: list[torch.Tensor], bias: torch.Tensor | None, *,
            columns: list[tuple[int, tuple[int, int]]] | None = None) -> list[torch.Tensor]:
    """Each group's product plus its bias (for groups of columns, the bias's own columns)."""
    if bias is None:
        return products
    if columns is not None:
        return [p + bias[g, start:end] for p, (g, (start, end)) in zip(products, columns,
                                                                       strict=True)]
    return [p + bias[g] for g, p in enumerate(products)]


#: An operation without a float64 kernel -> the float64 operations it stands for.
FALLBACKS: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {
    torch._grouped_mm: grouped_mm,
}


#: Products whose operands must share a dtype.
SAME_DTYPE = {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.mm,
              torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm,
              torch.einsum}


class Float64Ops(TorchFunctionMode):
    """Runs :data:`FALLBACKS` and :data:`SAME_DTYPE` products meeting float64 in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in FALLBACKS and func not in SAME_DTYPE:
            return func(*args, **kwargs)
        dtypes = {t.dtype for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if torch.float64 not in dtypes:
            return func(*args, **kwargs)
        if func in FALLBACKS:
            return FALLBACKS[func](*args, **kwargs)
        if len(dtypes) > 1:
            args, kwargs = tree_map(_float64, (args, kwargs))
        return func(*args, **kwargs)


def _float64(leaf: object) -> object:
    if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
        return leaf.to(torch.float64)
    return leaf
