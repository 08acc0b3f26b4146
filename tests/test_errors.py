"""Bad input: a clear error naming the argument, raised before any launch, with
no input or ``out`` modified."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import rand

import fusedkit
from fusedkit.errors import DeviceError, DTypeError, FusedkitError, OverlapError, ShapeError
from fusedkit.runtime import elementwise as ew

OPS = [fusedkit.add, fusedkit.add_relu]


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any launch during these tests is a failure: errors must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr(ew, "launch_elementwise", refuse)


def x32(*shape):
    return rand(shape or (4, 5), torch.float32, DEVICE)


def snapshot(*tensors):
    return [t.clone() for t in tensors]


def unchanged(before, *tensors):
    """Bit-for-bit the same values (NaN where NaN was)."""
    return all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(before, tensors))


def test_unchanged_can_fail():
    assert not unchanged([torch.tensor([1.0, float("nan")])], torch.tensor([7.0, float("nan")]))
    assert unchanged([torch.tensor([1.0, float("nan")])], torch.tensor([1.0, float("nan")]))


BAD = [
    ("shape mismatch", lambda: (x32(4, 5), x32(4, 6)), {}, ShapeError, "do not broadcast"),
    ("complex input", lambda: (x32(), torch.ones(4, 5, dtype=torch.complex64, device=DEVICE)), {}, DTypeError, "'y'"),
    ("complex scalar", lambda: (x32(), 1 + 2j), {}, DTypeError, "'y'"),
    ("string operand", lambda: ("a", x32()), {}, DTypeError, "'x'"),
    ("None operand", lambda: (x32(), None), {}, DTypeError, "'y'"),
    ("uint16 tensor", lambda: (x32(), torch.ones(4, 5, dtype=torch.uint16, device=DEVICE)), {}, DTypeError, "'y'"),
    ("bool result", lambda: (torch.ones(3, dtype=torch.bool, device=DEVICE),) * 2, {}, DTypeError, "result dtype"),
    ("int8 result", lambda: (torch.ones(3, dtype=torch.int8, device=DEVICE), 2), {}, DTypeError, "result dtype"),
    ("no tensor", lambda: (1.0, 2.0), {}, DTypeError, "must be a Tensor"),
    (
        "float alpha, int result",
        lambda: (torch.ones(3, dtype=torch.int32, device=DEVICE),) * 2,
        {"alpha": 0.5},
        DTypeError,
        "alpha",
    ),
    ("complex alpha", lambda: (x32(), x32()), {"alpha": 1j}, DTypeError, "alpha"),
    ("string alpha", lambda: (x32(), x32()), {"alpha": "2"}, DTypeError, "alpha"),
    ("meta and device", lambda: (torch.ones(4, 5, device="meta"), x32()), {}, DeviceError, "'y'"),
]


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_operands(op, case):
    _, make, kwargs, error, words = case
    operands = make()
    with pytest.raises(error, match=words):
        op(*operands, **kwargs)


def test_errors_are_runtime_errors_like_torch():
    for cls in (ShapeError, DTypeError, DeviceError, OverlapError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, FusedkitError)
    assert issubclass(ShapeError, ValueError) and issubclass(DTypeError, TypeError)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_bad_out(op):
    x, y = x32(4, 5), x32(4, 5)
    cases = [
        (torch.empty(4, 6, device=DEVICE), ShapeError, "shape"),
        (torch.empty(5, 4, device=DEVICE), ShapeError, "shape"),
        (torch.empty(4, 5, dtype=torch.int32, device=DEVICE), DTypeError, "can't be cast"),
        (torch.empty(4, 5, device="meta"), DeviceError, "out is on"),
        (torch.empty(5, device=DEVICE).expand(4, 5), OverlapError, "share memory"),
        ("out", DTypeError, "must be a Tensor"),
    ]
    for out, error, words in cases:
        tensors = [x, y] + ([out] if isinstance(out, torch.Tensor) and out.device.type != "meta" else [])
        before = snapshot(*tensors)
        with pytest.raises(error, match=words):
            op(x, y, out=out)
        assert unchanged(before, *tensors)


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
def test_partial_overlap_is_refused(op):
    buf = x32(20)
    before = snapshot(buf)
    with pytest.raises(OverlapError, match="partially overlaps argument 'x'"):
        op(buf[:10], buf[10:], out=buf[5:15])
    with pytest.raises(OverlapError, match="partially overlaps argument 'y'"):
        op(x32(10), buf[:10], out=buf[1:11])
    m = x32(6, 6)
    with pytest.raises(OverlapError):
        op(m, m, out=m.t())  # same memory, other element order
    assert unchanged(before, buf)


def test_out_requires_grad_inputs_refused():
    x = x32().requires_grad_()
    with pytest.raises(FusedkitError, match="automatic differentiation"):
        fusedkit.add_relu(x, x32(), out=torch.empty(4, 5, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_and_cuda_mix_refused():
    with pytest.raises(DeviceError, match="'y' is on cpu"):
        fusedkit.add(torch.ones(3, device="cuda"), torch.ones(3))


def test_wrong_arity_and_keywords():
    with pytest.raises(TypeError, match="takes 2 operands"):
        fusedkit.elementwise("add", x32())
    with pytest.raises(TypeError, match="unexpected keyword"):
        fusedkit.elementwise("add", x32(), x32(), beta=2)
    with pytest.raises(KeyError, match="no elementwise kernel named"):
        fusedkit.elementwise("nope", x32(), x32())
