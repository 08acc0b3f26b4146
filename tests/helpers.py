"""Input makers shared by the tests."""

from __future__ import annotations

import torch


def rand(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Random values, never zeros: normal for floats, small signed integers otherwise."""
    if dtype.is_floating_point:
        t = torch.randn(shape, dtype=torch.float32, device=device) * 3
        return t.to(dtype)
    t = torch.randint(-50, 50, shape, dtype=dtype, device=device)
    return torch.where(t == 0, torch.ones_like(t), t)


def views(shape2d, dtype, device):
    """Named non-contiguous views of 2-D shape ``shape2d`` (rows, cols)."""
    r, c = shape2d
    base = rand((c, r), dtype, device)
    big = rand((r * 2 + 3, c * 3 + 1), dtype, device)
    return {
        "transposed": base.t(),
        "row_sliced": big[1 : 1 + 2 * r : 2, :c],
        "col_strided": big[3 : 3 + r, 1 : 1 + 2 * c : 2][:, :c] if 2 * c <= big.shape[1] - 1 else big[3 : 3 + r, :c],
        "offset": big[2 : 2 + r, 5 : 5 + c],
        "expanded_row": rand((1, c), dtype, device).expand(r, c),
        "expanded_col": rand((r, 1), dtype, device).expand(r, c),
    }
