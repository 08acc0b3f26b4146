"""Input makers and the test grid shared by the tests.

Test grid: a parametrised test exists for one axis (shapes, layouts, broadcasts, scalars,
activations, ...). The quick subset (``-m "not slow"``) runs that axis whole against one
representative of each other axis (:func:`one_at_a_time`); the other combinations carry
the ``slow`` mark and run in the full suite. docs/design.md ("The test grid") says which
axis each large test exists for and where the quick subset meets every op and dtype.
"""

from __future__ import annotations

import pytest
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


def value_id(value) -> str:
    """A parameter's id: a kernel's name, a dtype without ``torch.``, else ``str``."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value)


def _is(value, wanted) -> bool:
    # ``wanted`` may name the value by its id ("add_relu", "float32") or be the value itself.
    return value_id(value) == wanted if isinstance(wanted, str) else value == wanted


def slow_unless(quick, combinations, ids=None) -> list:
    """``combinations`` (tuples of argument values) as ``pytest.param``s, marked slow where
    ``quick(*combination)`` is false; ``ids``, by default the values' ids joined by "-"."""
    combinations = [tuple(c) for c in combinations]
    ids = ids or ["-".join(value_id(v) for v in c) for c in combinations]
    marks = [() if quick(*c) else (pytest.mark.slow,) for c in combinations]
    if all(marks):  # every combination slow: the quick subset would lose the test
        raise ValueError(f"no combination of {combinations[:2]}... is quick")
    return [pytest.param(*c, id=i, marks=m) for c, i, m in zip(combinations, ids, marks)]


def two_at_a_time(combinations, representative, ids=None) -> list:
    """:func:`one_at_a_time` over the combinations that depart from ``representative`` in at
    most two arguments; those departing in three or more are not run at all. For a grid of
    op x dtype x layout: every pair of axes is crossed whole against one value of the third
    (each op in each dtype on one layout, each op on each layout in one dtype, each dtype on
    each layout for one op). The layout is indexing that ops and dtypes share, and a dtype
    reaches it only through its element size: the full cube added about 45 s of CI's 15
    minutes and no failure the pairs would miss."""
    combinations = [tuple(c) for c in combinations]
    ids = ids or ["-".join(value_id(v) for v in c) for c in combinations]
    kept = [(c, i) for c, i in zip(combinations, ids) if sum(not _is(v, r) for v, r in zip(c, representative)) <= 2]
    return one_at_a_time([c for c, _ in kept], representative, [i for _, i in kept])


def one_at_a_time(combinations, representative, ids=None) -> list:
    """:func:`slow_unless` keeping quick the ``representative`` combination (its values, or
    their ids) and each one that departs from it in a single argument: every axis whole
    against one representative of the others; the rest of the cross product is slow."""
    combinations = [tuple(c) for c in combinations]
    if not any(all(map(_is, c, representative)) for c in combinations):
        raise ValueError(f"the representative {representative} is not one of the combinations")
    return slow_unless(lambda *c: sum(not _is(v, r) for v, r in zip(c, representative)) <= 1, combinations, ids)


def norms_recorded(monkeypatch, index, kept) -> list:
    """Norm calls with a gradient on a stand-in launcher, on device ``index``: the grad recipes
    on, their caches fresh; each launch of the ordinary path (``runtime.norm._launch``) gives
    ``kept(kernel, grid, args, meta, pointers, scalars) -> (record, entry)``: ``record`` is
    appended to the list returned and ``entry`` kept as the launch's compiled kernel."""
    from fusedkit.runtime import launch as fk_launch
    from fusedkit.runtime import norm as rn

    ordinary = []

    def record(kernel, grid, args, meta):
        key, pointers, scalars = rn._launch_key(kernel, args, meta, args[0].device.index)
        item, entry = kept(kernel, grid, args, meta, pointers, scalars)
        ordinary.append(item)
        rn.LAUNCHES._entries[key] = entry

    fresh = {"LAUNCHES": fk_launch.CompiledCache(), "KEPT": {}, "GRAD_RECIPES": {}, "NATIVE": {}}
    for name, value in (*fresh.items(), ("_launch", record), ("GRAD_RECIPES_ON", True)):
        monkeypatch.setattr(rn, name, value)
    monkeypatch.setattr(fk_launch, "INTERPRETED", False)
    monkeypatch.setattr(fk_launch, "current_device", lambda: index)
    monkeypatch.setattr(fk_launch, "current_stream", lambda index: 99)
    return ordinary


def norm_forward_addresses(x, r, w, b, y, h) -> tuple:
    """The norm forward kernel's first six pointer arguments (x, residual, weight, bias, y, h)
    for a call's tensors, as the ordinary path passes them: an absent one at y's address."""
    at = y.data_ptr()
    return tuple(at if t is None else t.data_ptr() for t in (x, r, w, b, y, h))
