"""The C++ launch table (the ``native_launch`` setting, ``fusedkit/runtime/native.py``).

On any machine: a dry-run table (it records the kernel parameters it would pass to
``cuLaunchKernel``) is filled from a real recipe with a stand-in compiled kernel, and
must pack exactly what Triton's launcher would get, refuse every call that differs in
type, dtype, shape, strides, device, alignment or parameter, and give a call that needs
a gradient the autograd node torch's own ops would get (edges, saved output with its
version check, saved-tensor hooks, retain_graph, create_graph, errors). On a GPU, calls
of each layout launch through the table (and from a CUDA graph, and a new thread) and
must equal torch, gradients included, and the gates' and add_gelu's planned backwards
the Python backward's; ``scripts/sanitize.sh`` runs these tests under
memcheck.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, ON_GPU
from helpers import norm_forward_addresses, norms_recorded, rand

import fusedkit
from fusedkit import testing as fk_testing
from fusedkit.kernels.elementwise import NOT_SPECIALISED, POINTER_ARGS
from fusedkit.library import ADD_GELU, ADD_RELU, SILU_MUL, SILU_MUL_GRAD
from fusedkit.runtime import elementwise as ew
from fusedkit.runtime import launch as fk_launch
from fusedkit.runtime import native

pytestmark = pytest.mark.skipif(
    shutil.which("ninja") is None or shutil.which("c++") is None,
    reason="building the extension needs ninja and a C++ compiler",
)


@pytest.fixture(autouse=True)
def _forget_native_launches():
    yield
    fusedkit.clear_caches()  # later tests in this process take the Python path they test


@pytest.fixture
def table(fk_settings, monkeypatch):
    try:
        t = native.build(dry_run=True)
    except Exception as exc:  # pragma: no cover - depends on the machine's toolchain
        pytest.skip(f"the extension did not build: {exc}")
    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    return t


def _triton_signature(recipe, bits):
    """The signature Triton would compile for this recipe's arguments: pointers by dtype,
    specialised integers equal to 1 and the constants as constexpr, other integers by
    their 32/64-bit class (the kernel's ``do_not_specialize`` names stay runtime)."""
    names = ew.elementwise_kernel.arg_names
    values = (None,) * POINTER_ARGS + tuple(bits) + recipe.launch_tail
    ptr = "*" + {torch.float32: "fp32", torch.bfloat16: "bf16"}[recipe.dtype]
    signature = {}
    for i, (name, value) in enumerate(zip(names, values)):
        if i < POINTER_ARGS:
            signature[name] = ptr
        elif name in ew.CONSTEXPR_NAMES or (value == 1 and name not in NOT_SPECIALISED):
            signature[name] = "constexpr"
        else:
            signature[name] = "i32" if fk_launch.int_class(value) else "i64"
    return signature, values


def _kept(recipe, operands, param):
    """A stand-in kept launch of ``recipe``, as a supported release's raw launch would keep it."""
    recipe.run(operands, param)  # encodes the parameter, as a launch does
    bits = recipe.last_param[1][0]
    signature, values = _triton_signature(recipe, bits)
    compiled = SimpleNamespace(src=SimpleNamespace(signature=signature), packed_metadata=(4, 1, 0))
    entry = fk_launch.Entry(
        compiled=compiled,
        launcher=None,
        function=7,
        packed_metadata=(4, 1, 0),
        grid=(3, 1, 1),
        tail=recipe.launch_tail,
        extra=None,
        head=(0, 0, None, None),
        flags=(0, 0),
    )
    return entry, signature, values


def _expected_params(signature, values, pointers):
    packed = []
    for i, (ty, value) in enumerate(zip(signature.values(), values)):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            packed.append(pointers[i])
        else:
            packed.append(value & (0xFFFFFFFF if ty == "i32" else 0xFFFFFFFFFFFFFFFF))
    return packed + [0, 0]  # the two scratch pointers every supported release appends


def test_table_packs_what_tritons_launcher_gets(table):
    x, y = rand((37, 19), torch.float32, DEVICE), rand((37, 19), torch.float32, DEVICE)
    fusedkit.add_relu(x, y, alpha=2.0)
    recipe = ew.KEPT[ew.call_key(ADD_RELU, (x, y), 2.0)]
    entry, signature, values = _kept(recipe, (x, y), 2.0)
    assert native.register(recipe, entry, table) and len(table) == 1

    out = table.call(ADD_RELU, (x, y), 2.0)
    assert out.shape == recipe.shape and out.stride() == recipe.out_strides and out.dtype == torch.float32
    pointers = (out.data_ptr(), x.data_ptr(), y.data_ptr(), out.data_ptr(), out.data_ptr())  # (c, out2: out)
    assert table.last_params() == _expected_params(signature, values, pointers)
    # A new float object of the same value matches; the parameter is compared by value and type.
    assert table.call(ADD_RELU, (x, y), float("2.0")) is not None


def test_table_refuses_every_other_call(table):
    x, y = rand((37, 19), torch.float32, DEVICE), rand((37, 19), torch.float32, DEVICE)
    fusedkit.add_relu(x, y)
    recipe = ew.KEPT[ew.call_key(ADD_RELU, (x, y), 1)]
    entry, _, _ = _kept(recipe, (x, y), 1)
    assert native.register(recipe, entry, table)
    call = lambda *ops, alpha=1: table.call(ADD_RELU, ops, alpha)
    assert call(x, y) is not None

    base = rand((37 * 19 + 1,), torch.float32, DEVICE)
    misaligned = base[1:].view(37, 19)  # same shape and strides, 4 bytes off
    refused = {
        "another kernel": table.call(fusedkit.library.ADD, (x, y), 1),
        "float alpha": call(x, y, alpha=1.0),
        "bool alpha": call(x, y, alpha=True),
        "another alpha": call(x, y, alpha=2),
        "another dtype": call(x, y.double()),
        "another shape": call(x[:36], y[:36]),
        "other strides": call(x.t().contiguous().t(), y),
        "a broadcast": call(x, y[0]),
        "a number": call(x, 2.0),
        "one operand": call(x),
        "misaligned": call(misaligned, y),
        "negated view": call(x, torch._neg_view(y)),
        "a subclass": call(x.as_subclass(_Sub), y),
    }
    with torch.autograd.forward_ad.dual_level():  # a tangent, with and without requires_grad
        refused["a dual tensor"] = call(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)), y)
        x.requires_grad_(True)
        refused["a dual tensor requiring grad"] = call(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)), y)
    assert all(v is None for v in refused.values()), [k for k, v in refused.items() if v is not None]
    assert call(x, y).requires_grad  # a gradient: the table records the call
    with torch.no_grad():
        assert not call(x, y).requires_grad  # grad off: the same call, nothing recorded


class _Sub(torch.Tensor):
    pass


def _kept_in(table, x, y, alpha=1):
    fusedkit.add_relu(x.detach(), y.detach(), alpha=alpha)
    recipe = ew.KEPT[ew.call_key(ADD_RELU, (x.detach(), y.detach()), alpha)]
    entry, _, _ = _kept(recipe, (x.detach(), y.detach()), alpha)
    assert native.register(recipe, entry, table)


def _relu_grad(grad, out, alpha=1):
    return torch.where(out <= 0, torch.zeros_like(grad), grad * alpha)  # (NaN passes the gradient, as torch's)


def test_a_call_that_needs_a_gradient_gets_its_node_in_cpp(table):
    x, y = (rand((37, 19), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    _kept_in(table, x, y, alpha=2)
    out = table.call(ADD_RELU, (x, y), 2)
    assert out.requires_grad and out.grad_fn.name() == "FusedkitAddReluBackward"
    edges = [fn for fn, _ in out.grad_fn.next_functions]
    assert [type(fn).__name__ for fn in edges] == ["AccumulateGrad"] * 2
    assert edges[0].variable is x and edges[1].variable is y
    grad = rand(out.shape, torch.float32, DEVICE)
    out.backward(grad)
    # (a dry run writes nothing: the saved output is whatever the allocation held)
    expected = _relu_grad(grad, out.detach())
    assert torch.equal(x.grad, expected) and torch.equal(y.grad, _relu_grad(grad, out.detach(), 2))


def _kept_relu_grad_in(table, grad, out, alpha=1):
    fusedkit.elementwise("relu_grad", grad, out.detach(), alpha=alpha)
    relu_grad = fusedkit.registry.get("relu_grad")
    recipe = ew.KEPT[ew.call_key(relu_grad, (grad, out.detach()), alpha)]
    entry, _, _ = _kept(recipe, (grad, out.detach()), alpha)
    assert native.register(recipe, entry, table)


def test_the_cpp_node_launches_a_planned_backward_without_python(table, monkeypatch):
    calls = []
    factory = native._backward_factory

    def counting(*args):
        fn, saves, plan = factory(*args)
        return (lambda grad, saved: calls.append(1) or fn(grad, saved)), saves, plan

    monkeypatch.setattr(native, "_backward_factory", counting)
    x, y = (rand((37, 19), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    _kept_in(table, x, y)
    grad = rand((37, 19), torch.float32, DEVICE)
    out = table.call(ADD_RELU, (x, y), 1)
    out.backward(grad)  # relu_grad on (grad, out) is not kept yet: the Python backward runs
    assert len(calls) == 1
    _kept_relu_grad_in(table, grad, out)
    out = table.call(ADD_RELU, (x, y), 1)
    x.grad = y.grad = None
    out.backward(grad)
    assert len(calls) == 1  # the planned launch: no Python
    # One relu_grad launch for both operands (alpha == 1), on (grad, out), into a new result.
    *pointers, _, _ = table.last_params()
    assert grad.data_ptr() in pointers and out.data_ptr() in pointers
    # (a dry run's result holds whatever the allocation held: NaNs compare equal here)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0, equal_nan=True)
    # What the plan cannot take goes to Python: a gradient of the gradient to record, or a
    # gradient of other strides.
    out = table.call(ADD_RELU, (x, y), 1)
    torch.autograd.grad(out, x, grad.clone().requires_grad_(), create_graph=True)
    out = table.call(ADD_RELU, (x, y), 1)
    torch.autograd.grad(out, x, grad.t().contiguous().t())
    assert len(calls) == 3


def _keep(table, kernel, operands, param=None):
    """A stand-in kept launch of ``kernel`` on ``operands`` (a two-output kernel's too) in the
    table; returns the launch's signature and values, as :func:`_kept` does."""
    run = ew.run_pair if kernel.outputs == 2 else ew.run
    run(kernel, operands, param)  # validated, launched and kept
    recipe = ew.KEPT[ew.call_key(kernel, operands, param)]
    entry, signature, values = _kept(recipe, operands, param)
    assert native.register(recipe, entry, table)
    return signature, values


def _counting_backwards(monkeypatch) -> list:
    """Calls of the Python backward of every launch registered from now on."""
    calls = []
    factory = native._backward_factory

    def counting(*args):
        made = factory(*args)
        if made is None:
            return None
        fn, saves, plan = made
        return (lambda grad, saved: calls.append(1) or fn(grad, saved)), saves, plan

    monkeypatch.setattr(native, "_backward_factory", counting)
    return calls


def test_a_gates_backward_is_one_pair_launch_without_python(table, monkeypatch):
    calls = _counting_backwards(monkeypatch)
    a, b = (rand((37, 19), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    _keep(table, SILU_MUL, (a.detach(), b.detach()))
    grad = rand((37, 19), torch.float32, DEVICE)
    out = table.call(SILU_MUL, (a, b), None)
    assert out.grad_fn.name() == "FusedkitSiluMulBackward"
    out.backward(grad)  # silu_mul_grad on (grad, a, b) is not kept yet: the Python backward runs
    assert len(calls) == 1
    signature, values = _keep(table, SILU_MUL_GRAD, (grad, a.detach(), b.detach()))
    assert table.call(SILU_MUL_GRAD, (grad, a.detach(), b.detach()), None) is None  # plans launch pairs, calls don't
    out = table.call(SILU_MUL, (a, b), None)
    a.grad = b.grad = None
    out.backward(grad)
    assert len(calls) == 1  # the planned launch: no Python
    # One launch on (grad, a, b) into two new results, which are the gradients.
    da, db = a.grad.data_ptr(), b.grad.data_ptr()
    assert da != db
    pointers = (da, grad.data_ptr(), a.data_ptr(), b.data_ptr(), db)
    assert table.last_params() == _expected_params(signature, values, pointers)
    # Only the saved inputs' own versions are accepted, as torch's nodes check them.
    out = table.call(SILU_MUL, (a, b), None)
    with torch.no_grad():
        b.mul_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad)
    # What the plan cannot take goes to Python: a gradient of the gradient, another layout.
    out = table.call(SILU_MUL, (a, b), None)
    torch.autograd.grad(out, a, grad.clone().requires_grad_(), create_graph=True)
    out = table.call(SILU_MUL, (a, b), None)
    torch.autograd.grad(out, a, grad.t().contiguous().t())
    assert len(calls) == 3


def test_a_broadcast_or_promoting_call_gets_its_plan_and_autograd_reduces_it(table, monkeypatch):
    """The plan's kernels give gradients of the result's shape and dtype; autograd sums a
    broadcast operand's to its shape and casts it to its dtype, as for torch's own nodes
    (the Python backward does both itself). An integral operand's call is left to Python."""
    from fusedkit.autograd import native_backward

    f32, cpu = torch.float32, torch.device("cpu")
    full, row, ints = (f32, (37, 19), (19, 1)), (f32, (19,), (1,)), (torch.int32, (19,), (1,))
    assert native_backward(SILU_MUL, None, (full, row), cpu, (37, 19), f32)[2]
    assert native_backward(fusedkit.library.ADD_RELU, 1, (full, ints), cpu, (37, 19), f32)[2] == ()
    calls = _counting_backwards(monkeypatch)
    a = rand((37, 19), torch.float32, DEVICE).requires_grad_()
    b = rand((19,), torch.float16, DEVICE).requires_grad_()  # broadcast, and promoted to float32
    _keep(table, SILU_MUL, (a.detach(), b.detach()))
    grad = rand((37, 19), torch.float32, DEVICE)
    _keep(table, SILU_MUL_GRAD, (grad, a.detach(), b.detach()))
    table.call(SILU_MUL, (a, b), None).backward(grad)
    assert not calls
    assert a.grad.shape == a.shape and a.grad.dtype == torch.float32
    assert b.grad.shape == b.shape and b.grad.dtype == torch.float16


def test_add_gelu_under_autograd_is_pythons_which_keeps_the_sum(table):
    # The C++ node would keep x and y; add_gelu keeps the sum its forward pair writes (as
    # F.gelu keeps its input), which the Python path does: the table takes its calls without grad.
    x, y = (rand((64,), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    _keep(table, ADD_GELU, (x.detach(), y.detach()), 1)
    assert table.call(ADD_GELU, (x.detach(), y.detach()), 1) is not None
    assert table.call(ADD_GELU, (x, y), 1) is None


def test_a_node_keeping_operands_needs_every_one_to_need_a_gradient(table):
    # A node that saves the operands keeps all of them; where one needs no gradient Python
    # keeps only those the requested gradients read, and an inference tensor (which autograd
    # refuses to save) is Python's to hold.
    a, b = (rand((37, 19), torch.float32, DEVICE) for _ in range(2))
    _keep(table, SILU_MUL, (a, b))
    assert table.call(SILU_MUL, (a.requires_grad_(), b.requires_grad_()), None).grad_fn is not None
    assert table.call(SILU_MUL, (a.detach(), b), None) is None
    with torch.inference_mode():
        frozen = a.detach().clone()
    assert table.call(SILU_MUL, (frozen, b), None) is None
    with torch.no_grad():  # no gradient: nothing saved, the launch is the table's
        assert table.call(SILU_MUL, (frozen, b), None) is not None


def test_the_cpp_node_keeps_autograds_rules(table):
    x, y = (rand((64,), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    _kept_in(table, x, y)
    grad = rand((64,), torch.float32, DEVICE)
    # A second backward needs retain_graph, as with torch's own nodes.
    out = table.call(ADD_RELU, (x, y), 1)
    out.backward(grad, retain_graph=True)
    out.backward(grad)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(grad)
    # The saved output is version-checked.
    out = table.call(ADD_RELU, (x, y), 1)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad)
    # Saved-tensor hooks see what the node saves (activation offloading, checkpointing).
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = table.call(ADD_RELU, (x, y), 1)
    assert len(packed) == 1 and packed[0].data_ptr() == out.data_ptr()
    # create_graph: the gradient is itself differentiable (relu_grad is linear in grad).
    g = grad.clone().requires_grad_()
    (gx,) = torch.autograd.grad(table.call(ADD_RELU, (x, y), 1), x, g, create_graph=True)
    assert gx.requires_grad
    # Only the operands that require a gradient get one.
    z = rand((64,), torch.float32, DEVICE)
    out = table.call(ADD_RELU, (x, z), 1)
    x.grad = None
    out.backward(grad)
    assert x.grad is not None and z.grad is None


def test_an_error_in_the_backward_reaches_the_caller(table, monkeypatch):
    x, y = (rand((64,), torch.float32, DEVICE).requires_grad_() for _ in range(2))

    def failing(*args):
        def backward(grad, saved):
            raise fusedkit.errors.ShapeError("from the backward")

        return backward, 1, ()

    monkeypatch.setattr(native, "_backward_factory", failing)
    _kept_in(table, x, y)
    out = table.call(ADD_RELU, (x, y), 1)
    with pytest.raises(fusedkit.errors.ShapeError, match="from the backward"):
        out.sum().backward()
    # A kept launch without a gradient formula leaves such calls to Python.
    monkeypatch.setattr(native, "_backward_factory", lambda *args: None)
    table.clear()
    _kept_in(table, x, y)
    assert table.call(ADD_RELU, (x, y), 1) is None
    with torch.no_grad():
        assert table.call(ADD_RELU, (x, y), 1) is not None


def test_a_failed_build_leaves_python_in_charge(fk_settings, monkeypatch):
    def no_compiler(**kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(native, "build", no_compiler)
    monkeypatch.setattr(native, "TABLE", None)
    monkeypatch.setattr(native, "_BUILD_FAILED", False)
    with pytest.warns(UserWarning, match="no compiler here"):
        assert native._table() is None
    assert native._table() is None  # warned once
    x, y = rand((64,), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    for _ in range(3):
        assert torch.equal(fusedkit.add_relu(x, y), torch.relu(x + y))


def test_the_build_is_cached_by_source_and_versions(tmp_path):
    a, b = native.library_path(tmp_path), native.library_path(tmp_path)
    assert a == b and a.parent.parent == tmp_path and a.name.startswith("fusedkit_eager_")


def test_a_build_lock_left_by_a_dead_process_does_not_block(tmp_path, monkeypatch):
    # flock locks die with their process: a lock file left behind is taken at once.
    lock = tmp_path / "eager.lock"
    lock.write_text("")
    with native._build_lock(lock):
        pass
    # A live holder makes the other wait, then give up: the Python path runs.
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, time; f = open({str(lock)!r}, 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(native, "BUILD_WAIT_S", 0.5)
        with pytest.raises(TimeoutError, match="another process"):
            with native._build_lock(lock):
                pass
    finally:
        holder.kill()
        holder.wait()
    with native._build_lock(lock):  # its holder gone, the lock is free
        pass


def test_dispatch_consults_the_table_first(table, monkeypatch):
    x, y = rand((64,), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    fusedkit.add_relu(x, y)
    recipe = ew.KEPT[ew.call_key(ADD_RELU, (x, y), 1)]
    entry, _, _ = _kept(recipe, (x, y), 1)
    assert native.register(recipe, entry, table)
    monkeypatch.setattr(native, "TABLE", table)
    before = table.last_params()
    fusedkit.add_relu(x, y)
    assert table.last_params() != before  # the table took the call (a dry run computes nothing)
    # The table steps aside wherever the Python path would not launch directly: under a
    # launch hook (a profiler must see every launch), a Python dispatch mode, a profiler.
    knobs = pytest.importorskip("triton.knobs")

    def hook(metadata):
        pass

    stepped_aside = {}
    for name, context in {
        "launch hook": lambda: _hooked(knobs.runtime.launch_enter_hook, hook),
        "dispatch mode": _PassThrough,
        "profiler": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
    }.items():
        before = table.last_params()
        with context():
            assert table.call(ADD_RELU, (x, y), 1) is None
            assert torch.equal(fusedkit.add_relu(x, y), torch.relu(x + y))
        stepped_aside[name] = table.last_params() == before
    assert all(stepped_aside.values()), stepped_aside
    # Under a torch.func transform, even plain tensors captured by the function.
    seen = []
    torch.func.vmap(lambda a: seen.append(table.call(ADD_RELU, (x, y), 1)) or a)(x[None])
    assert seen == [None]
    assert table.call(ADD_RELU, (x, y), 1) is not None  # and takes calls again after


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _hooked(chain, hook):
    chain.add(hook)
    try:
        yield
    finally:
        chain.remove(hook)


def test_register_needs_the_setting_and_a_plain_launch(fk_settings, table, monkeypatch):
    x, y = rand((64,), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    fusedkit.add_relu(x, y)
    recipe = ew.KEPT[ew.call_key(ADD_RELU, (x, y), 1)]
    entry, _, _ = _kept(recipe, (x, y), 1)
    assert not native.register(recipe, entry._replace(flags=()), table)  # Triton's Python launcher
    assert not native.register(recipe, entry._replace(flags=(1, 0)), table)  # cooperative
    cluster = SimpleNamespace(src=entry.compiled.src, packed_metadata=(4, 2, 0))
    assert not native.register(recipe, entry._replace(compiled=cluster), table)  # a cluster
    fk_settings(native_launch=False)
    assert not native.register(recipe, entry, table)
    assert len(table) == 0


def _gpu_cases():
    f32, bf16 = torch.float32, torch.bfloat16
    return {
        "contiguous-fp32": lambda: (rand((1000,), f32, DEVICE), rand((1000,), f32, DEVICE)),
        "contiguous-bf16": lambda: (rand((4096,), bf16, DEVICE), rand((4096,), bf16, DEVICE)),
        "bias": lambda: (rand((64, 96), f32, DEVICE), rand((96,), f32, DEVICE)),
        "transposed": lambda: (rand((96, 64), f32, DEVICE).t(), rand((64, 96), f32, DEVICE)),
        "one element": lambda: (rand((), f32, DEVICE), rand((), f32, DEVICE)),
    }


@pytest.mark.skipif(not ON_GPU, reason="native launches run on a CUDA GPU")
@pytest.mark.parametrize("case", list(_gpu_cases()))
def test_native_launches_match_torch(fk_settings, case, monkeypatch):
    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    x, y = _gpu_cases()[case]()
    for _ in range(2):  # the first call keeps the recipe, the second the compiled kernel (and the table's entry)
        fusedkit.add_relu(x, y, alpha=0.5)
    if native.TABLE is None or len(native.TABLE) == 0:
        pytest.skip("no native launch was kept (a Triton other than 3.6, or the build failed)")
    assert native.TABLE.call(ADD_RELU, (x, y), 0.5) is not None
    for _ in range(3):
        x.copy_(rand(x.shape, x.dtype, DEVICE))
        got = fusedkit.add_relu(x, y, alpha=0.5)
        assert (
            torch.equal(got, torch.relu(torch.add(x, y, alpha=0.5)))
            and got.stride() == ew.allocate_out(ew.validate(ADD_RELU, (x, y), 0.5, None)).stride()
        )
    # Captured in a CUDA graph and replayed: the launch goes to the capturing stream.
    graph, static = torch.cuda.CUDAGraph(), None
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static = fusedkit.add_relu(x, y, alpha=0.5)
    x.copy_(rand(x.shape, x.dtype, DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, torch.relu(torch.add(x, y, alpha=0.5)))


@pytest.mark.skipif(not ON_GPU, reason="native launches run on a CUDA GPU")
def test_native_launch_from_a_new_thread(fk_settings, monkeypatch):
    # A thread that never touched the GPU has no current driver context; the table makes one.
    import threading

    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    x, y = rand((1000,), torch.float32, DEVICE), rand((1000,), torch.float32, DEVICE)
    for _ in range(2):
        fusedkit.add_relu(x, y)
    if native.TABLE is None or len(native.TABLE) == 0:
        pytest.skip("no native launch was kept (a Triton other than 3.6, or the build failed)")
    results = []
    worker = threading.Thread(target=lambda: results.append(native.TABLE.call(ADD_RELU, (x, y), 1)))
    worker.start()
    worker.join()
    (got,) = results
    torch.cuda.synchronize()
    assert got is not None and torch.equal(got, torch.relu(x + y))


@pytest.mark.skipif(not ON_GPU, reason="native launches run on a CUDA GPU")
@pytest.mark.parametrize("case", ["contiguous-fp32", "contiguous-bf16", "bias", "transposed"])
def test_native_gradients_match_torch(fk_settings, case):
    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    x, y = (t.requires_grad_() for t in _gpu_cases()[case]())
    grad = None
    for _ in range(3):  # the first calls keep the launch; the last runs in C++, node and all
        out = fusedkit.add_relu(x, y, alpha=0.5)
        grad = rand(out.shape, out.dtype, DEVICE) if grad is None else grad
        gx, gy = torch.autograd.grad(out, (x, y), grad)
    if not out.grad_fn.name().startswith("Fusedkit"):
        pytest.skip("no native launch was kept (a Triton other than 3.6, or the build failed)")
    xr, yr = (t.detach().clone().requires_grad_() for t in (x, y))
    ref = torch.relu(torch.add(xr, yr, alpha=0.5))
    rx, ry = torch.autograd.grad(ref, (xr, yr), grad)
    assert torch.equal(out, ref) and torch.equal(gx, rx) and torch.equal(gy, ry)


#: The ops whose backward the C++ node launches from a plan that saves the inputs.
_PLANNED = {
    "silu_mul": fusedkit.silu_mul,
    "gelu_mul": fusedkit.gelu_mul,
    "gelu_tanh_mul": lambda a, b: fusedkit.gelu_mul(a, b, approximate="tanh"),
}


@pytest.mark.skipif(not ON_GPU, reason="native launches run on a CUDA GPU")
@pytest.mark.parametrize("op", list(_PLANNED))
@pytest.mark.parametrize(
    "case", ["contiguous-fp32", "contiguous-bf16", "transposed", "bias", "bias-bf16", "one tensor"]
)
def test_planned_gradients_equal_the_python_backwards(fk_settings, monkeypatch, op, case):
    fn = _PLANNED[op]
    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    calls = _counting_backwards(monkeypatch)
    if case == "bias-bf16":  # a broadcast operand promoted to the result's float32
        x, y = rand((64, 96), torch.float32, DEVICE), rand((96,), torch.bfloat16, DEVICE)
    elif case == "one tensor":  # fn(x, x): both gradients flow to x
        x = rand((1000,), torch.float32, DEVICE)
        y = x
    else:
        x, y = _gpu_cases()[case]()
    x.requires_grad_(), y.requires_grad_()
    inputs = (x,) if y is x else (x, y)
    grad = None
    for _ in range(4):  # the forward's launch kept, then the backward's, then both in C++
        out = fn(x, y)
        grad = rand(out.shape, out.dtype, DEVICE) if grad is None else grad
        before = len(calls)
        got = torch.autograd.grad(out, inputs, grad)
    if not out.grad_fn.name().startswith("Fusedkit"):
        pytest.skip("no native launch was kept (a Triton other than 3.6, or the build failed)")
    assert len(calls) == before, "the last backward ran in Python"
    fk_settings(native_launch=False)
    fusedkit.clear_caches()
    expected = torch.autograd.grad(fn(x, y), inputs, grad)
    assert all(g.dtype == e.dtype and torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.skipif(not ON_GPU, reason="native launches run on a CUDA GPU")
def test_native_gradcheck(fk_settings):
    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    x, y = (torch.randn(7, 5, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b: fusedkit.add_relu(a, b, alpha=1.5), (x, y))
    assert torch.autograd.gradgradcheck(lambda a, b: fusedkit.add_relu(a, b, alpha=1.5), (x, y))
    assert fusedkit.add_relu(x, y, alpha=1.5).grad_fn.name() == "FusedkitAddReluBackward" or native.TABLE is None


def test_a_wrong_backward_plan_falls_back_to_the_python_backward():
    """A plan the C++ node cannot trust (too few steps, an unknown kernel, one that raises, a
    kernel of another arity) is dropped: the Python backward runs, and the forward is never
    the one to fail."""
    from fusedkit import autograd

    def kernel(plan, saves="output"):
        return SimpleNamespace(arity=2, backward_kernels=plan, saves=saves)

    def raising(param):
        raise RuntimeError("a plan that fails")

    assert autograd._plan(kernel(lambda p: (("relu_grad", 1), ("relu_grad", p))), 2.0)  # a good one
    for bad in (
        lambda p: (("relu_grad", 1),),
        lambda p: (("no_such_kernel", 1), None),
        raising,
        lambda p: (("relu_grad", "1"), None),
        lambda p: None,
        lambda p: (("relu_grad", 1, 1), None),  # a second result of a one-output kernel
        lambda p: (("relu_grad", None), None),  # no parameter for a kernel that takes one
        lambda p: ((SILU_MUL_GRAD, None, 0), None),
    ):  # three operands, where (grad, output) are two
        assert autograd._plan(kernel(bad), 1) == ()
    # Saving the inputs: a two-output kernel on (grad, a, b), given to register_pair.
    gate = kernel(lambda p: ((SILU_MUL_GRAD, None, 0), (SILU_MUL_GRAD, None, 1)), saves="inputs")
    assert autograd._plan(gate, None) == ((SILU_MUL_GRAD, None, 0), (SILU_MUL_GRAD, None, 1))
    unregistered = SimpleNamespace(name="silu_mul_grad_copy", arity=3, param=None, outputs=2)
    for bad in (
        lambda p: ((SILU_MUL_GRAD, None, 2), None),
        lambda p: ((SILU_MUL_GRAD, 1.0, 0), None),
        lambda p: ((unregistered, None, 0), None),
    ):
        assert autograd._plan(kernel(bad, saves="inputs"), None) == ()
    # A parameter the table cannot hold (an int beyond int64) leaves the step to Python.
    assert native._param_encoding(2**63) is None and native._param_encoding(-(2**63)) == (1, -(2**63))


def test_registry_changes_empty_the_table(table, monkeypatch):
    x, y = rand((64,), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    _kept_in(table, x, y)
    monkeypatch.setattr(native, "TABLE", table)
    assert len(table) == 1
    user = fusedkit.registry.register(
        fusedkit.registry.ElementwiseKernel(
            name="fk_test_user_add",
            math=fusedkit.library.ADD.math,
            reference=fusedkit.library.ADD.reference,
            unfused=("torch.add",),
        )
    )
    assert len(table) == 1  # a new name changes nothing kept
    fusedkit.registry.unregister(user.name)
    assert len(table) == 0


def test_the_launch_path_is_reported_and_logged_once(monkeypatch, caplog):
    # `python -m fusedkit build` says which path repeated calls take here and why; a process
    # whose Triton has no launcher adapter logs it once, at INFO, when a launch is kept.
    monkeypatch.setattr(native.launch, "INTERPRETED", False)
    monkeypatch.setattr(native.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native.launch, "RAW_LAUNCH", False)
    assert "C++ launch table is off" in native.launch_path() and "3.6" in native.launch_path()
    monkeypatch.setattr(native.launch, "RAW_LAUNCH", True)
    monkeypatch.setattr(native.triton_api, "ADAPTER", native.triton_api.SHARED)
    assert native.launch_path().startswith("the C++ launch table") and "shared C launcher" in native.launch_path()
    monkeypatch.setattr(native.launch, "INTERPRETED", True)
    assert "interpreter" in native.launch_path()
    monkeypatch.setattr(native, "_PATH_LOGGED", False)
    with caplog.at_level(logging.INFO, logger="fusedkit"):
        native._log_path_once()
        native._log_path_once()
    assert [r.levelno for r in caplog.records if "repeated calls take" in r.message] == [logging.INFO]


def _norm_signature(kernel, args, meta):
    """The signature Triton would compile a norm launch for: pointers, the floats, integers
    equal to 1 specialised (constexpr) and the others 32-bit, the switches constexpr."""
    from fusedkit.runtime import norm as rn

    count = rn._POINTERS[kernel]
    signature = {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, (*args, *meta.values()))):
        if i < count:
            signature[name] = "*fp32"
        elif name in rn._CONSTEXPRS[kernel]:
            signature[name] = "constexpr"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr" if value == 1 else "i32"
    return signature


def _norms_through(table, monkeypatch, index) -> list:
    """Norm calls with a gradient through the dry-run ``table``: the grad recipes on, the
    ordinary path's launches recorded (``(kernel, signature, scalars)``, returned) and kept as
    stand-in compiled kernels."""

    def kept(kernel, grid, args, meta, pointers, scalars):  # (a stand-in compiled kernel, its signature)
        constants = {k: v for k, v in meta.items() if k != "num_warps"}
        signature = _norm_signature(kernel, args, constants)
        compiled = SimpleNamespace(src=SimpleNamespace(signature=signature), packed_metadata=(4, 1, 0))
        entry = fk_launch.Entry(
            compiled, None, 7, (4, 1, 0), (*grid, 1, 1)[:3], tuple(constants.values()), None, (), None, (0, 0)
        )
        return (kernel, signature, scalars), entry

    ordinary = norms_recorded(monkeypatch, index, kept)
    monkeypatch.setattr(native, "applies", lambda: True)
    monkeypatch.setattr(native, "_table", lambda: table)
    return ordinary


@pytest.mark.parametrize("residual", [False, True], ids=["layer_norm", "add_layer_norm"])
def test_a_norm_with_a_gradient_launches_from_the_table(table, monkeypatch, residual):
    # A repeated norm call with a gradient: its forward from the C++ table, with the node that
    # Python's KeptNorm would give; its first backward Python's (which hands the table the
    # backward launch it kept), the next from the table. The parameters packed are the ordinary
    # path's (the same kernel arguments, the call's own addresses); checked with a dry-run table.
    from fusedkit.runtime import norm as rn

    x = rand((2, 3, 28), torch.float32, DEVICE)[..., :24].detach().requires_grad_()  # (rows at a stride)
    r = rand((2, 3, 24), torch.float32, DEVICE).requires_grad_() if residual else None
    w, b = (rand((24,), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    dy = rand((2, 3, 24), torch.float32, DEVICE)
    ordinary = _norms_through(table, monkeypatch, x.device.index)

    def call():
        out = fusedkit.add_layer_norm(x, r, w, b, 1e-5) if residual else fusedkit.layer_norm(x, (24,), w, b, 1e-5)
        y = out[0] if residual else out
        forward = table.last_params()
        grads = torch.autograd.grad(y, (x, r, w, b) if residual else (x, w, b), dy)
        return y, out[1] if residual else None, forward, table.last_params(), grads

    call()  # the ordinary path, forward and backward: the recipe kept, and its C++ copy
    ((_, made),) = rn.NATIVE.items()
    assert made is not None and not made[1].has_backward(False)
    y, h, forward, _, _ = call()  # from the table; the backward Python's, kept for the table
    assert y.grad_fn.name() == "FusedkitNormBackward" and made[1].has_backward(False)
    assert len(ordinary) == 3  # (forward, backward, backward)
    y, h, forward, backward, grads = call()  # both from the table
    assert len(ordinary) == 3
    (_, fsig, fscalars), (_, bsig, bscalars) = ordinary[:2]

    def runtime(signature, values):  # the kernel's non-constant arguments, as Triton packs them
        packed = [
            struct.unpack("<I", struct.pack("<f", v))[0] if ty == "fp32" else v
            for ty, v in zip(signature.values(), values)
            if ty != "constexpr"
        ]
        return packed + [0, 0]  # (the two scratch pointers)

    stats = forward[6]  # (LayerNorm's mean; its rstd 16-byte aligned after it)
    pointers = (*norm_forward_addresses(x, r, w, b, y, h), stats, stats + 4 * 8)
    assert forward == runtime(fsig, (*pointers, *fscalars, *[0] * 8)) and stats % 16 == 0
    normalised, dx = (h if residual else x), grads[0]
    programs = -(-6 // bscalars[2])
    parts = backward[7]
    bpointers = (
        dy.data_ptr(),
        normalised.data_ptr(),
        w.data_ptr(),
        stats,
        stats + 4 * 8,
        dx.data_ptr(),
        dx.data_ptr(),
        parts,
        parts + 4 * programs * 24,
    )
    assert backward == runtime(bsig, (*bpointers, *bscalars, *[0] * 9))
    # (a dry run writes nothing: the gradients are the empty results, laid out as torch's)
    assert [g.shape for g in grads] == [t.shape for t in ((x, r, w, b) if residual else (x, w, b))]


def test_the_tables_norm_node_under_a_gradient_of_the_gradient(table, monkeypatch):
    # create_graph: the node's Python backward differentiates the composition on the saved h,
    # whose node is this one (with edges to the weight and bias): it runs the node again, on
    # this thread, and must not wait on itself.
    x, r = (rand((2, 3, 24), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    w, b = (rand((24,), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    _norms_through(table, monkeypatch, x.device.index)
    fusedkit.add_layer_norm(x, r, w, b, 1e-5)
    y, _ = fusedkit.add_layer_norm(x, r, w, b, 1e-5)
    assert y.grad_fn.name() == "FusedkitNormBackward"
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)
    assert gx.requires_grad and gx.shape == x.shape


def test_the_tables_norm_node_passes_hs_gradient_through_unshared(table, monkeypatch):
    # Only h reaches the loss: x and the residual each get the gradient that reached h, in a
    # .grad of their own, and the caller's gradient is left as it was (the node's Python
    # backward returns one tensor for both, not two views of one).
    x, r = (rand((2, 3, 24), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    w = rand((24,), torch.float32, DEVICE).requires_grad_()
    _norms_through(table, monkeypatch, x.device.index)
    fusedkit.add_rms_norm(x, r, w, 1e-5)
    dh = rand((2, 3, 24), torch.float32, DEVICE)
    kept = dh.clone()
    for _ in range(2):
        y, h = fusedkit.add_rms_norm(x, r, w, 1e-5)
        assert y.grad_fn.name() == "FusedkitNormBackward"
        torch.autograd.backward([h], [dh])
    assert torch.equal(dh, kept) and w.grad is None
    assert torch.equal(x.grad, 2 * kept) and torch.equal(r.grad, 2 * kept)
    assert x.grad.data_ptr() != r.grad.data_ptr()


def test_a_norm_parameter_past_float32_keeps_no_table_copy(table, monkeypatch):
    # alpha past float32's range: Triton's launcher rounds it, the table cannot pack it; the
    # call runs on Python's path
    from fusedkit.runtime import norm as rn

    x, r = (rand((2, 3, 24), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    _norms_through(table, monkeypatch, x.device.index)
    fusedkit.add_rms_norm(x, r, None, 1e-5, alpha=1e39)
    assert list(rn.NATIVE.values()) == [None]


# --- Matmuls: a repeated call's launch and node from the table ----------------------------


def _matmul_kept(a, b, bias, activation, grad=True):
    """A stand-in kept matmul call (``runtime.matmul.KeptMatmul``) on the TMA kernel, and the
    stand-in kept launch its recipe copies (as Triton 3.6 keeps it: descriptor layouts read
    from the compiled kernel)."""
    from fusedkit.kernels.matmul_tma import matmul_tma_kernel
    from fusedkit.runtime.configs import matmul_m_bucket

    k = a.shape[-1]
    m, n = a.numel() // k, b.shape[1]
    plan = SimpleNamespace(copy_b=False, tma_ok=True, prefix=("stand-in",), split_k=1, ints=())
    kept = SimpleNamespace(
        plan=plan, grad=grad, activation=activation, device=a.device, m=m, k=k, n=n, lead=a.shape[:-1], dtype=a.dtype
    )
    ints = {"M": m, "N": n, "K": k, "M_BUCKET": matmul_m_bucket(m), "stride_bias": 1 if bias is not None else 0}
    constants = fk_launch.constexpr_names(matmul_tma_kernel)
    signature = {}
    for name in matmul_tma_kernel.arg_names:
        if name.endswith("_desc"):
            signature[name] = "tensordesc<fp32[64, 32]>"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        elif name in constants or ints[name] == 1:
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
    layouts = tuple((3, 4, 7, (64, 32)) for _ in range(6))
    compiled = SimpleNamespace(src=SimpleNamespace(signature=signature), packed_metadata=(4, 1, 0))
    entry = fk_launch.Entry(compiled, None, 7, (4, 1, 0), (3, 1, 1), (0,) * len(constants), None, (), layouts, (0, 0))
    return kept, entry, ints


def _matmul_recipe(table, monkeypatch, a, b, bias, activation, grad_step=None, fallback=None):
    from fusedkit import autograd
    from fusedkit.runtime import matmul as mm

    kept, entry, ints = _matmul_kept(a, b, bias, activation)
    monkeypatch.setattr(mm, "TMA_LAUNCHES", SimpleNamespace(get=lambda key: entry))
    out = torch.empty(kept.m, kept.n, dtype=a.dtype)
    if fallback is None:
        fallback = functools.partial(autograd._native_matmul_grads, activation, bias is not None)
    a2 = a.reshape(kept.m, kept.k)
    launched = mm.table_launch(kept.plan, a2, b, bias)
    store_pre = activation in mm.NEEDS_PRE
    made = native.matmul_recipe(
        kept, a, a2, b, bias, out, launched, store_pre, grad_step, "FusedkitMatmulBackward", fallback, table
    )
    assert made is not None
    return made[1], ints


def test_a_matmul_launches_from_the_table_with_its_node(table, monkeypatch):
    # The kept TMA launch's parameters, the call's own: each descriptor (encoded from the
    # slot's address in C++; a dry run records the address) then its view's sizes and strides,
    # the pointers, the integers; the result laid out (lead..., N) with its node in C++, whose
    # backward is the Python backward's products on the saved a and b.
    a = rand((2, 3, 32), torch.float32, "cpu").requires_grad_()
    weight = rand((48, 32), torch.float32, "cpu").requires_grad_()
    bias = rand((48,), torch.float32, "cpu").requires_grad_()
    handle, ints = _matmul_recipe(table, monkeypatch, a, weight.t(), bias, None)
    out = table.matmul(handle, a, weight.t(), bias)
    assert out.shape == (2, 3, 48) and out.grad_fn.name() == "FusedkitMatmulBackward"
    o = out.data_ptr()
    views = [(a.data_ptr(), 6, 32, 32, 1), (weight.data_ptr(), 48, 32, 32, 1), (o, 6, 48, 48, 1), (o, 6, 48, 48, 1)]
    views += [views[1], views[2]]
    expected = [v for view in views for v in view] + [bias.data_ptr(), o, o]
    expected += [ints[name] for name in ("M", "N", "K", "M_BUCKET") if ints[name] != 1] + [0, 0]
    assert table.last_params() == expected
    edges = [fn for fn, _ in out.grad_fn.next_functions]
    assert edges[0].variable is a and edges[2].variable is bias and edges[1].name() == "TBackward0"
    grad = rand(out.shape, torch.float32, "cpu")
    out.backward(grad)
    g2 = grad.reshape(6, 48)
    assert torch.equal(a.grad, torch.mm(g2, weight).reshape(a.shape))
    assert torch.equal(weight.grad, torch.mm(a.detach().reshape(6, 32).t(), g2).t())
    assert torch.equal(bias.grad, g2.sum(0))
    # (no gradient wanted, no node: the result only)
    with torch.no_grad():
        assert table.matmul(handle, a, weight.t(), bias).grad_fn is None
    # (a bias missing, a misaligned operand: Python's)
    assert table.matmul(handle, a, weight.t(), None) is None
    misaligned = rand((2 * 3 * 32 + 1,), torch.float32, "cpu")[1:].view(2, 3, 32)
    assert table.matmul(handle, misaligned, weight.t(), bias) is None


@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32), (32,)], ids=["2d", "3d", "1d"])
def test_a_matmul_nodes_backward_launches_the_kept_activation_gradient(table, monkeypatch, shape):
    # ReLU: the node saves the result (laid out as a's leading dims) and launches relu_grad's kept
    # launch on the 2-D (grad, out), as the Python backward would, from the table, no Python;
    # the products after it. Without that launch kept, the Python backward gets the 2-D views.
    from fusedkit import autograd
    from fusedkit.library import RELU_GRAD

    a = rand(shape, torch.float32, DEVICE).requires_grad_()
    weight = rand((48, 32), torch.float32, DEVICE).requires_grad_()
    calls = []

    def fallback(*args):
        calls.append(args)
        return autograd._native_matmul_grads("relu", False, *args)

    handle, _ = _matmul_recipe(table, monkeypatch, a, weight.t(), None, "relu", (RELU_GRAD, 1), fallback)
    out = table.matmul(handle, a, weight.t(), None)
    grad = rand(out.shape, torch.float32, DEVICE)
    grads = torch.autograd.grad(out, (a, weight), grad)
    assert len(calls) == 1 and calls[0][0].shape == calls[0][3].shape == (a.numel() // 32, 48)
    assert [g.shape for g in grads] == [a.shape, weight.shape]
    out = table.matmul(handle, a, weight.t(), None)
    _kept_relu_grad_in(table, grad.reshape(-1, 48), out.reshape(-1, 48))
    params = table.last_params()
    grads = torch.autograd.grad(out, (a, weight), grad)
    assert len(calls) == 1  # (the Python backward did not run again)
    launched = table.last_params()
    assert launched != params and launched[1:3] == [grad.data_ptr(), out.data_ptr()]  # (its result first)
    assert [g.shape for g in grads] == [a.shape, weight.shape]


def test_a_matmul_node_keeps_autograds_rules(table, monkeypatch):
    # The saved a is version-checked; a GELU node under create_graph refuses, as EagerMatmul does.
    a = rand((6, 32), torch.float32, "cpu").requires_grad_()
    weight = rand((48, 32), torch.float32, "cpu").requires_grad_()
    handle, _ = _matmul_recipe(table, monkeypatch, a.detach().clone(), weight.t(), None, None)
    x = a * 1
    out = table.matmul(handle, x, weight.t(), None)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    from fusedkit.library import GELU_GRAD

    handle, _ = _matmul_recipe(table, monkeypatch, a, weight.t(), None, "gelu", (GELU_GRAD, None))
    out = table.matmul(handle, a, weight.t(), None)
    with pytest.raises(fusedkit.NotDifferentiableError):
        torch.autograd.grad(out.sum(), a, create_graph=True)


_MATMUL_CASES = {
    "gelu-bias-3d-bf16": ((2, 64, 256), torch.bfloat16, True, "gelu", True),
    "relu-fp16": ((128, 256), torch.float16, False, "relu", True),
    "relu-3d-bias": ((2, 64, 256), torch.bfloat16, True, "relu", True),
    "plain-bias-no-grad": ((128, 256), torch.bfloat16, True, None, False),
    "silu-fp32": ((64, 256), torch.float32, True, "silu", True),
    "gelu_tanh-a-column-major": ((128, 256), torch.bfloat16, True, "gelu_tanh", "mmajor"),
    "gelu-decode": ((1, 256), torch.bfloat16, True, "gelu", True),
    "gelu-no-grad": ((2, 64, 256), torch.bfloat16, True, "gelu", False),
}


@pytest.mark.skipif(not ON_GPU, reason="the table launches on a GPU")
@pytest.mark.parametrize("case", _MATMUL_CASES, ids=list(_MATMUL_CASES))
def test_matmuls_from_the_table_equal_pythons(fk_settings, monkeypatch, case):
    # The same calls through the first call's path, the Python kept launch (the second) and the
    # C++ table (the third on, its backward launching the kept activation gradient from the
    # fourth): bit-identical results and gradients, and within the float64 reference's bound.
    from fusedkit import autograd
    from fusedkit.runtime import matmul as mm

    shape, dtype, has_bias, activation, grad = _MATMUL_CASES[case]
    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    fallbacks = []
    python_grads = autograd._native_matmul_grads
    monkeypatch.setattr(autograd, "_native_matmul_grads", lambda *args: fallbacks.append(1) or python_grads(*args))
    a = rand(shape, dtype, DEVICE)
    if grad == "mmajor":
        a = rand(shape[::-1], dtype, DEVICE).t()
    weight = rand((384, 256), dtype, DEVICE)
    bias = rand((384,), dtype, DEVICE) if has_bias else None
    leaves = [t for t in (a, weight, bias) if t is not None]
    for t in leaves:
        t.requires_grad_(bool(grad))
    g = rand((*shape[:-1], 384), dtype, DEVICE)
    results, python_backwards = [], []
    for _ in range(5):
        out = fusedkit.matmul(a, weight.t(), bias, activation)
        grads = torch.autograd.grad(out, leaves, g) if grad else ()
        results.append((out.detach(), grads, out.grad_fn))
        python_backwards.append(len(fallbacks))
    # (the table's node runs the Python backward at most once, before the activation gradient's
    # launch is kept: the fourth and fifth backwards are the table's own)
    assert python_backwards[2] == python_backwards[4] <= 1
    key = mm.call_key(a, weight.t(), bias, activation)
    assert type(mm.NATIVE.get(key)) is tuple
    for i, (out, grads, fn) in enumerate(results):
        if i >= 2:
            assert fn is None if not grad else fn.name() == "FusedkitMatmulBackward"
        # (every call path gives the first call's bits: the first call, the kept plan, the table)
        assert torch.equal(out, results[0][0]), i
        assert all(torch.equal(x, y) for x, y in zip(grads, results[0][1])), i
    wide = [None if t is None else t.detach().double() for t in (a, weight.t(), bias)]
    reference = mm.matmul_reference(*wide, activation)
    floor = fk_testing.matmul_error_floor(*wide)
    fk_testing.assert_rel_err(results[-1][0].double(), reference, fk_testing.matmul_rel_err(dtype), floor)


@pytest.mark.skipif(not ON_GPU, reason="the table launches on a GPU")
def test_a_matmul_from_the_table_in_a_cuda_graph_and_a_new_thread(fk_settings):
    # Its descriptors are encoded on the host for the captured addresses: a replay reads the
    # inputs' new values; a thread without a current context launches too.
    import threading

    from fusedkit.runtime import matmul as mm

    fk_settings(native_launch=True)
    fusedkit.clear_caches()
    a, weight = rand((96, 256), torch.bfloat16, DEVICE), rand((384, 256), torch.bfloat16, DEVICE)
    for _ in range(3):
        fusedkit.matmul(a, weight.t(), None, "gelu")
    if type(mm.NATIVE.get(mm.call_key(a, weight.t(), None, "gelu"))) is not tuple:
        pytest.skip("no table copy was made (a Triton other than 3.6, or the build failed)")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static = fusedkit.matmul(a, weight.t(), None, "gelu")
    a.copy_(rand(a.shape, a.dtype, DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, fusedkit.matmul(a, weight.t(), None, "gelu"))
    got = []
    thread = threading.Thread(target=lambda: got.append(fusedkit.matmul(a, weight.t(), None, "gelu")))
    thread.start()
    thread.join()
    assert torch.equal(got[0], static)
