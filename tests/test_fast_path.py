"""The eager fast path: a repeated call signature reuses its validation, plan and
compiled kernel (``elementwise.KEPT``, ``fusedkit.runtime.launch``), and nothing it
reuses may go stale. On the CPU the recipes run through the interpreter; the
direct launches of compiled kernels are checked on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU
from helpers import norm_forward_addresses, norms_recorded, rand

import fusedkit
from fusedkit.errors import ArgumentError, ShapeError
from fusedkit.library import ADD, ADD_RELU
from fusedkit.runtime import elementwise as ew
from fusedkit.runtime import launch as fk_launch
from fusedkit.runtime import matmul as mm
from fusedkit.runtime import native
from fusedkit.testing import NORM_TOLERANCES, assert_rel_err, matmul_rel_err

gpu_only = pytest.mark.skipif(not ON_GPU, reason="direct launches of compiled kernels need a CUDA GPU")


@pytest.fixture(autouse=True)
def _fresh_caches(fk_settings, monkeypatch):
    # The Python fast path under test: C++ launches (tests/test_native.py) stay out of it.
    fk_settings(native_launch=False)
    fusedkit.clear_caches()
    yield


def _recipe(kernel, *operands, alpha=1):
    return ew.KEPT[ew.call_key(kernel, operands, alpha)]


def test_repeated_signature_reuses_one_recipe_with_new_values():
    x, y = rand((37, 19), torch.float32, DEVICE), rand((37, 19), torch.float32, DEVICE)
    for alpha in (2, 0.0, -1.5, 3e38):
        x.copy_(rand((37, 19), torch.float32, DEVICE))
        torch.testing.assert_close(fusedkit.add_relu(x, y, alpha=alpha), torch.relu(torch.add(x, y, alpha=alpha)))
    # int and float alpha are two signatures (the type is in the key), nothing more
    assert len(ew.KEPT) == 2


def test_each_layout_and_dtype_takes_its_own_recipe():
    base = rand((64, 65), torch.float32, DEVICE)
    y = rand((64, 64), torch.float32, DEVICE)
    cases = [base[:, :64], base[:, 1:], base[:, :64].t(), base[:1, :64].expand(64, 64), base[:, :64].bfloat16()]
    for x in cases * 2:
        got = fusedkit.add(x, y if x.dtype == torch.float32 else y.bfloat16(), alpha=3)
        want = torch.add(x, y.to(x.dtype), alpha=3)
        torch.testing.assert_close(got, want)
    # base[:, :64] and base[:, 1:] share shape and strides: one signature, two offsets
    assert len(ew.KEPT) == len(cases) - 1


def test_scalar_operands_and_default_dtype():
    xi = rand((33,), torch.int32, DEVICE)
    for s in (3, 5, -7):
        assert torch.equal(fusedkit.add(xi, s), xi + s)
    torch.testing.assert_close(fusedkit.add(xi, 2.5), xi + 2.5)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = fusedkit.add(xi, 2.5)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, xi + 2.5)
    finally:
        torch.set_default_dtype(previous)


def test_cached_signature_still_checks_integral_alpha():
    x, y = rand((10,), torch.int32, DEVICE), rand((10,), torch.int32, DEVICE)
    assert torch.equal(fusedkit.add(x, y, alpha=3), torch.add(x, y, alpha=3))
    with pytest.raises(ArgumentError, match="does not fit"):
        fusedkit.add(x, y, alpha=2**40)
    assert torch.equal(fusedkit.add(x, y, alpha=-4), torch.add(x, y, alpha=-4))


def test_grad_calls_do_not_take_the_recipe():
    x = rand((20,), torch.float32, DEVICE).requires_grad_()
    y = rand((20,), torch.float32, DEVICE)
    with torch.no_grad():
        assert fusedkit.add_relu(x, y).grad_fn is None
    assert len(ew.KEPT) == 1
    out = fusedkit.add_relu(x, y)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(x.grad, ((x + y) > 0).float())


def test_eager_grad_calls_skip_the_registered_ops(monkeypatch):
    """Autograd records eager calls through plain autograd Functions whose forward takes
    the fast path: on the H200 host a call through a registered op cost ~100 us. (Traced
    calls still go through the ops: tests/test_autograd_compile.py.)"""

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through the registered op")

    from fusedkit import autograd

    monkeypatch.setattr(autograd, "elementwise_op", refuse)
    monkeypatch.setattr(autograd, "matmul_op", refuse)
    x = rand((6, 8), torch.float32, DEVICE).requires_grad_()
    y = rand((8,), torch.float32, DEVICE).requires_grad_()
    for _ in range(2):  # the second call's forward runs the recipe the first one kept
        x.grad = y.grad = None
        fusedkit.add_relu(x, y, alpha=0.5).sum().backward()
        mask = ((x + 0.5 * y) > 0).float()
        torch.testing.assert_close(x.grad, mask)
        torch.testing.assert_close(y.grad, 0.5 * mask.sum(0))
    assert ew.call_key(ADD_RELU, (x.detach(), y.detach()), 0.5) in ew.KEPT  # the forward's, kept
    w = rand((5, 8), torch.float64, DEVICE).requires_grad_()
    b = rand((5,), torch.float64, DEVICE).requires_grad_()
    xd = rand((3, 8), torch.float64, DEVICE).requires_grad_()
    fusedkit.linear_relu(xd, w, b).square().sum().backward()
    grads = [t.grad for t in (xd, w, b)]
    ref = [t.detach().requires_grad_() for t in (xd, w, b)]
    torch.relu(torch.nn.functional.linear(*ref)).square().sum().backward()
    for ours, theirs in zip(grads, ref):
        torch.testing.assert_close(ours, theirs.grad)


def test_kernel_specs_need_not_be_hashable():
    from fusedkit import registry
    from fusedkit.kernels import activations

    spec = registry.ElementwiseKernel(
        name="test_listy_add",
        math=activations.add_math,
        reference=lambda x, y: x + y,
        arg_names=["x", "y"],
        dtypes=[torch.float32],
        unfused=["torch.add"],
    )
    registry.register(spec)
    try:
        x, y = rand((9,), torch.float32, DEVICE), rand((9,), torch.float32, DEVICE)
        for _ in range(2):
            torch.testing.assert_close(fusedkit.elementwise("test_listy_add", x, y), x + y)
    finally:
        registry.unregister("test_listy_add")


def test_negated_views_are_read_as_negated():
    z = torch.randn(64, dtype=torch.complex64, device=DEVICE)
    neg = z.conj().imag
    assert neg.is_neg()
    plain = rand((64,), torch.float32, DEVICE)
    y = rand((64,), torch.float32, DEVICE)
    for x in (plain, neg, plain, neg):  # same signature but for the neg bit
        torch.testing.assert_close(fusedkit.add(x, y), torch.add(x, y))


def test_out_of_range_int_scalar_after_a_cached_call():
    x = rand((8,), torch.float32, DEVICE)
    torch.testing.assert_close(fusedkit.add(x, 3), x + 3)
    for huge in (2**64, -(2**63) - 1):
        with pytest.raises(OverflowError):
            torch.add(x, huge)
        with pytest.raises(OverflowError):
            fusedkit.add(x, huge)


def test_parameters_take_the_fast_path_without_grad():
    p = torch.nn.Parameter(rand((16,), torch.float32, DEVICE))
    x = rand((4, 16), torch.float32, DEVICE)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fusedkit.add_relu(x, p), torch.relu(x + p))
    assert len(ew.KEPT) == 1


def test_empty_results_repeat():
    x = torch.empty((0, 5), device=DEVICE)
    for _ in range(2):
        assert fusedkit.add_relu(x, 1.0).shape == (0, 5)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_matmul_recipes_reuse_plans_and_stay_correct(fk_settings, kernel, monkeypatch):
    fk_settings(matmul_kernel=kernel)
    fk_settings(autotune=False)
    w = torch.nn.Parameter(rand((48, 64), torch.float32, DEVICE))
    b = rand((48,), torch.float32, DEVICE)
    with torch.no_grad():
        for shape in ((8, 64), (2, 5, 64), (8, 64), (2, 5, 64)):
            x = rand(shape, torch.float32, DEVICE)
            got = fusedkit.linear_relu(x, w, b)
            ref = torch.relu(torch.nn.functional.linear(x.double(), w.double(), b.double()))
            assert got.shape == ref.shape
            assert_rel_err(got, ref, matmul_rel_err(torch.float32))
    assert len(mm.KEPT) == 2
    # grad enabled: autograd records the call, under a signature of its own
    assert fusedkit.linear_relu(rand((8, 64), torch.float32, DEVICE), w, b).grad_fn is not None
    assert len(mm.KEPT) == 3 and sum(r.grad for r in mm.KEPT.values()) == 1
    # a signature that fails validation is never cached
    with pytest.raises(ShapeError):
        fusedkit.linear_relu(rand((8, 63), torch.float32, DEVICE), w.detach(), b)
    fk_settings(matmul_kernel="pointer" if kernel == "tma" else "tma")
    with torch.no_grad():
        fusedkit.linear_relu(rand((8, 64), torch.float32, DEVICE), w, b)
    assert len(mm.KEPT) == 4  # the kernel choice is part of the signature


@pytest.mark.parametrize("activation", ["relu", "gelu"])  # gelu keeps its pre-activation
def test_matmul_recipes_with_autograd(fk_settings, activation, monkeypatch):
    # A repeated signature that autograd records skips validation and goes straight to
    # the autograd Function, whose forward launches with the kept plan; every repeat
    # gives the right values and gradients, with new tensors and with grad mode toggled.
    fk_settings(autotune=False)
    w = torch.nn.Parameter(rand((48, 64), torch.float32, DEVICE))
    bias = torch.nn.Parameter(rand((48,), torch.float32, DEVICE))
    validated, planned = [], []
    real, real_plan = mm.validate, mm.plan_matmul
    monkeypatch.setattr(mm, "validate", lambda *args: validated.append(step) or real(*args))
    monkeypatch.setattr(mm, "plan_matmul", lambda *args: planned.append(step) or real_plan(*args))
    for step in range(4):
        x = rand((2, 5, 64), torch.float32, DEVICE).requires_grad_()
        with torch.set_grad_enabled(step != 2):
            got = fusedkit.matmul(x, w.t(), bias, activation)
        xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, bias))
        ref = mm.matmul_reference(xr, wr.t(), br, activation)
        assert got.shape == ref.shape
        assert_rel_err(got, ref, matmul_rel_err(torch.float32))
        if step == 2:
            assert got.grad_fn is None
            continue
        g = rand(got.shape, torch.float32, DEVICE)
        grads = torch.autograd.grad(got, (x, w, bias), g)
        refs = torch.autograd.grad(ref, (xr, wr, br), g.double())
        for got_g, ref_g in zip(grads, refs):
            assert_rel_err(got_g, ref_g, matmul_rel_err(torch.float32))
    # Each signature is validated when it first appears (step 0: the forward with autograd,
    # its first inner launch and the backward's two products; step 2: without autograd),
    # and the repeats take their recipes.
    assert set(validated) == {0, 2}, validated
    # and launch with their kept plans (gelu's storing its pre-activation): no planning either.
    assert set(planned) <= {0, 2}, planned
    assert sorted(r.grad for r in mm.KEPT.values() if r.lead == (2, 5)) == [False, True]


class _StandInLauncher:
    """Records what a direct launch hands Triton's compiled launcher."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)

    @staticmethod
    def launch_metadata(grid, stream, *args):  # the CompiledKernel's, for hooks
        return ("metadata", grid, stream)


def _stand_in_entry(recipe, monkeypatch):
    """Route ``recipe``'s direct launches to a stand-in launcher (no GPU needed), kept
    with the tail the recipe keeps a compiled kernel with."""
    launcher = _StandInLauncher()
    entry = fk_launch.Entry(
        compiled=launcher,
        launcher=launcher,
        function=7,
        packed_metadata="packed",
        grid=(3, 1, 1),
        tail=recipe.launch_tail,
        extra=None,
    )
    monkeypatch.setattr(recipe.compiled, "get", lambda spec: entry)
    monkeypatch.setattr(fk_launch, "current_device", lambda: recipe.device.index)
    monkeypatch.setattr(fk_launch, "current_stream", lambda index: 1234)
    return launcher


def test_direct_launch_arguments(monkeypatch):
    # What a cached launch passes, checked on any machine: grid, stream, function,
    # no launch metadata or hooks while the hook chains are empty, then the
    # addresses (ints) of out, x, y, the unused slot and out2 (out), the scalar bit patterns,
    # the planned sizes and strides, and the compile-time constants.
    x, y = rand((37, 19), torch.float32, DEVICE), rand((37, 19), torch.float32, DEVICE)
    fusedkit.add_relu(x, y, alpha=2.0)
    recipe = _recipe(ADD_RELU, x, y, alpha=2.0)
    launcher = _stand_in_entry(recipe, monkeypatch)
    out = recipe.run((x, y), 2.0)
    (args,) = launcher.calls
    assert args[:9] == (3, 1, 1, 1234, 7, "packed", None, None, None)
    assert args[9:14] == (out.data_ptr(), x.data_ptr(), y.data_ptr(), out.data_ptr(), out.data_ptr())
    assert all(type(p) is int for p in args[9:14])
    assert args[14:18] == (0, 0, 0, ew.scalar_bits(2.0, torch.float32, "alpha"))
    assert args[18:] == (*recipe.static_args, *recipe.constexprs)


def test_tensor_maps_are_encoded_once_per_operand(monkeypatch):
    encoded = []
    monkeypatch.setattr(fk_launch, "encode_tensor_map", lambda *args: encoded.append(args) or f"map{len(encoded)}")
    monkeypatch.setattr(fk_launch, "TENSOR_MAPS", {})
    layout = (3, 2, 8, (128, 64))
    first = fk_launch.tensor_map_args(4096, (300, 64), (64, 1), layout)
    assert first == ["map1", 300, 64, 64, 1]
    assert encoded == [(4096, 3, 2, 8, (128, 64), (300, 64), (64, 1), 0)]  # zero padding
    assert fk_launch.tensor_map_args(4096, (300, 64), (64, 1), layout) is first  # reused
    # Any other address, size, stride or layout is its own encoding.
    for args in (
        (8192, (300, 64), (64, 1), layout),
        (4096, (299, 64), (64, 1), layout),
        (4096, (300, 64), (128, 1), layout),
        (4096, (300, 64), (64, 1), (3, 2, 8, (64, 64))),
    ):
        fk_launch.tensor_map_args(*args)
    assert len(encoded) == 5
    # A full cache starts over.
    monkeypatch.setattr(fk_launch, "TENSOR_MAP_CACHE_SIZE", 5)
    fk_launch.tensor_map_args(1, (1, 1), (1, 1), layout)
    assert len(fk_launch.TENSOR_MAPS) == 1


def test_encoded_operands_are_the_row_major_views_tma_reads():
    # The operand views encoded_args encodes: a column-major a and an nn.Linear weight's
    # transpose are read as the row-major tensors they are in memory.
    from fusedkit.runtime import matmul_tma

    x, w = torch.empty(96, 64), torch.empty(48, 64)
    for t, flip in ((x, False), (x.t(), True), (w.t(), True), (w, False)):
        v = t.t() if flip else t
        assert matmul_tma.row_major(t, flip) == (v.data_ptr(), tuple(v.shape), v.stride())
    assert matmul_tma.a_mmajor(x.t()) and matmul_tma.b_kmajor(w.t())


def test_direct_launch_feeds_installed_hooks(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    if not isinstance(knobs.runtime.launch_enter_hook, knobs.HookChain):
        pytest.skip("this Triton has no launch-hook chains")
    x, y = rand((64,), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    fusedkit.add(x, y)
    launcher = _stand_in_entry(_recipe(ADD, x, y), monkeypatch)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        fusedkit.add(x, y)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    (args,) = launcher.calls
    assert args[6] == ("metadata", (3, 1, 1), 1234)  # a profiler's hook gets its metadata
    assert args[7] is knobs.runtime.launch_enter_hook and args[8] is None


def test_hooks_idle_sees_an_installed_hook():
    knobs = pytest.importorskip("triton.knobs")
    if not isinstance(knobs.runtime.launch_exit_hook, knobs.HookChain):
        pytest.skip("this Triton has no launch-hook chains")
    assert fk_launch.hooks_idle()

    def hook(metadata):
        pass

    knobs.runtime.launch_exit_hook.add(hook)
    try:
        assert not fk_launch.hooks_idle()
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    assert fk_launch.hooks_idle()


@gpu_only
def test_direct_launch_after_the_first_call():
    # Call 1 validates and keeps the recipe; call 2 compiles (or finds) the kernel
    # through Triton and keeps it; later calls launch it directly.
    x, y = rand((1000,), torch.float32, DEVICE), rand((1000,), torch.float32, DEVICE)
    fusedkit.add_relu(x, y)
    recipe = _recipe(ADD_RELU, x, y)
    assert len(recipe.compiled) == 0
    for _ in range(3):
        x.copy_(rand((1000,), torch.float32, DEVICE))
        assert torch.equal(fusedkit.add_relu(x, y), torch.relu(x + y))
        assert len(recipe.compiled) == 1
    (entry,) = recipe.compiled.entries()
    assert bool(entry.flags) == fk_launch.RAW_LAUNCH  # a supported release: its C launch function, called directly


def test_two_output_launches_are_kept_with_both_results():
    # A gate's backward (run_pair) keeps its launch as one-output calls do; each call gets
    # two new tensors, and new values and a misaligned view are read correctly.
    from fusedkit.library import SILU_MUL_GRAD

    base = rand((3 * 97 + 1,), torch.float32, DEVICE)
    g, b = rand((3, 97), torch.float32, DEVICE), rand((3, 97), torch.float32, DEVICE)
    seen = []
    for a in (base[:291].view(3, 97), base[1:].view(3, 97), base[:291].view(3, 97)):
        da, db = ew.run_pair(SILU_MUL_GRAD, (g, a, b), None)
        ref_da, ref_db = SILU_MUL_GRAD.reference(g.double(), a.double(), b.double())
        torch.testing.assert_close(da, ref_da.float())
        torch.testing.assert_close(db, ref_db.float())
        seen += [da.data_ptr(), db.data_ptr()]
        assert da.data_ptr() != db.data_ptr()
    recipe = ew.KEPT[ew.call_key(SILU_MUL_GRAD, (g, base[:291].view(3, 97), b), None)]
    assert recipe.pair and len(ew.KEPT) == 1
    if ON_GPU:
        assert len(recipe.compiled) == 2  # aligned and misaligned a


def test_a_kept_two_output_launch_answers_run_pair_only():
    from fusedkit.library import SILU_MUL, SILU_MUL_GRAD

    g, a, b = (rand((2, 5), torch.float32, DEVICE) for _ in range(3))
    ew.run_pair(SILU_MUL_GRAD, (g, a, b), None)
    with pytest.raises(fusedkit.ArgumentError):
        ew.run(SILU_MUL_GRAD, (g, a, b), None)  # a one-output call of a two-output kernel
    ew.run(SILU_MUL, (a, b), None)
    with pytest.raises(fusedkit.ArgumentError):
        ew.run_pair(SILU_MUL, (a, b), None)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_misaligned_view_takes_its_own_kernel(dtype):
    # Same shape and strides, 16-byte aligned vs not: an aligned kernel's vector
    # loads on the misaligned pointer would fault or read wrong.
    n = 4096
    base = rand((n + 8,), dtype, DEVICE)
    aligned, misaligned = base[:n], base[1 : n + 1]
    y = rand((n,), dtype, DEVICE)
    for x in (aligned, misaligned, aligned, misaligned):
        assert torch.equal(fusedkit.add(x, y), torch.add(x, y))
    assert len(_recipe(ADD, aligned, y).compiled) == 2
    torch.cuda.synchronize()


@gpu_only
def test_alpha_bit_classes():
    x, y = rand((512,), torch.float32, DEVICE), rand((512,), torch.float32, DEVICE)
    # 0.0 has all-zero bits (an int32 argument); other doubles need int64
    for alpha in (0.0, 1.5, 0.0, -2.0):
        assert torch.equal(fusedkit.add(x, y, alpha=alpha), torch.add(x, y, alpha=alpha))
    assert len(_recipe(ADD, x, y, alpha=1.5).compiled) == 2


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matmul_direct_launch_and_alignment(dtype):
    base = rand((64, 129), dtype, DEVICE)
    w = rand((96, 128), dtype, DEVICE)
    bias = rand((96,), dtype, DEVICE)
    for a in (base[:, :128], base[:, 1:], base[:, :128]):
        out = fusedkit.linear_relu(a, w, bias)
        ref = torch.relu(torch.nn.functional.linear(a.double(), w.double(), bias.double()))
        assert_rel_err(out, ref, matmul_rel_err(dtype))
    assert len(mm.LAUNCHES) == 2
    a = base[:, :128]
    first = fusedkit.linear_relu(a, w, bias)
    assert torch.equal(fusedkit.linear_relu(a, w, bias), first)


@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_a_norm_recipe_launches_what_the_ordinary_path_launches(monkeypatch, residual):
    # A kept norm without a gradient launches from its recipe (runtime.norm.run_recipe) with the
    # same kernel arguments the ordinary path (_launch) passes for the same call, its new
    # results' addresses in their places; checked on the CPU with a recording launcher.
    from fusedkit.kernels.norm import norm_forward_kernel
    from fusedkit.runtime import norm as rn

    base = rand((6, 36), torch.float32, DEVICE)
    x, r = base[:, :32], rand((6, 32), torch.float32, DEVICE) if residual else None  # (rows at a stride)
    w = rand((32,), torch.float32, DEVICE)
    x2, r2, w1 = rn.rows_of(x, 6, 32), None if r is None else rn.rows_of(r, 6, 32), w.reshape(32)
    y, h, _, _ = rn.forward(x2, r2, w1, None, 1e-6, 1.0, True, torch.float32, torch.float32, False)
    _, args, meta = rn.forward_launch(x2, r2, w1, None, y, h, None, None, 1e-6, 1.0, True)
    key, pointers, scalars = rn._launch_key(norm_forward_kernel, args, meta, x2.device.index)
    calls = []
    entry = fk_launch.Entry(None, lambda *a: calls.append(a), 7, "packed", (5, 1, 1), ("tail",), None)
    monkeypatch.setattr(fk_launch, "INTERPRETED", False)
    monkeypatch.setattr(fk_launch, "current_device", lambda: x2.device.index)
    monkeypatch.setattr(fk_launch, "current_stream", lambda index: 99)
    monkeypatch.setitem(rn.LAUNCHES._entries, key, entry)  # (on a GPU, in the kept kernel's place: put back after)
    recipe = rn.recipe(x, r, w, None, x2, r2, w1, None, y, h, 1e-6, 1.0, True)
    assert recipe is not None and recipe.scalars == scalars
    out = rn.run_recipe(recipe, x, r, w, None)
    y2, h2 = out if residual else (out, None)
    assert y2.shape == h2.shape == x.shape if residual else y2.shape == x.shape
    (call,) = calls
    fresh = {y.data_ptr(): y2.data_ptr(), **({h.data_ptr(): h2.data_ptr()} if residual else {})}
    want = (*[fresh.get(p, p) for p in pointers], *scalars, "tail")
    assert call[:5] == (5, 1, 1, 99, 7) and call[-len(want) :] == want
    # a rows view that is a copy keeps no recipe; a call aligned otherwise takes the ordinary path
    assert rn.recipe(x.clone(), r, w, None, x2, r2, w1, None, y, h, 1e-6, 1.0, True) is None
    shifted = base[:, 1:33]  # (4 bytes off: the kernel was compiled for 16-byte-aligned rows)
    assert rn.run_recipe(recipe, shifted, r, w, None) is None and len(calls) == 1


@gpu_only
def test_norm_recipe_on_the_gpu():
    # The second no-grad call of a signature launches from its recipe: the same bits as the
    # first; a call at another alignment takes the ordinary path, and is right too.
    from fusedkit.runtime import norm as rn

    base = rand((64, 129), torch.bfloat16, DEVICE)
    r = rand((64, 128), torch.bfloat16, DEVICE)
    w = rand((128,), torch.bfloat16, DEVICE)
    with torch.no_grad():
        first = fusedkit.add_rms_norm(base[:, :128], r, w, 1e-6)
        assert len(rn.RECIPES) == 1
        again = fusedkit.add_rms_norm(base[:, :128], r, w, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        shifted = fusedkit.add_rms_norm(base[:, 1:], r, w, 1e-6)
    h = base[:, 1:].double() + r.double()
    torch.testing.assert_close(shifted[1].double(), h, atol=2e-2, rtol=2e-2)
    want = torch.nn.functional.rms_norm(h, (128,), w.double(), 1e-6)
    torch.testing.assert_close(shifted[0].double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("residual", [False, True], ids=["layer_norm", "add_layer_norm"])
def test_a_norm_grad_recipe_launches_what_the_ordinary_path_launches(monkeypatch, residual):
    # A kept norm with a gradient launches its forward, and its backward once one backward ran
    # the ordinary path, from its grad recipe (runtime.norm.run_grad_forward, run_grad_backward)
    # with the kernel arguments the ordinary path (_launch) passes, the call's new tensors'
    # addresses in their places; checked on the CPU with a recording launcher (the values: on
    # a GPU, test_norm_grad_recipe_on_the_gpu).

    x = rand((2, 3, 28), torch.float32, DEVICE)[..., :24].detach().requires_grad_()  # (rows at a stride)
    r = rand((2, 3, 24), torch.float32, DEVICE).requires_grad_() if residual else None
    w, b = (rand((24,), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    dy = rand((2, 3, 24), torch.float32, DEVICE)
    direct = []

    def kept(kernel, grid, args, meta, pointers, scalars):  # (a launcher that records its call)
        launcher = lambda *a: direct.append((kernel, a))
        return (kernel, pointers, scalars), fk_launch.Entry(None, launcher, 7, "packed", (*grid, 1, 1)[:3], (), None)

    ordinary = norms_recorded(monkeypatch, x.device.index, kept)

    def call():
        out = fusedkit.add_layer_norm(x, r, w, b, 1e-5) if residual else fusedkit.layer_norm(x, (24,), w, b, 1e-5)
        torch.autograd.grad(out[0] if residual else out, (x, r, w, b) if residual else (x, w, b), dy)
        return out if residual else (out, None)

    call()  # the ordinary path, forward and backward: the recipe kept
    call()  # the recipe's forward; its first backward the ordinary path's, kept
    y, h = call()  # both from the recipe
    (fwd, _, fwd_scalars), (bwd, _, bwd_scalars), (_, _, again) = ordinary
    assert [k for k, _ in direct] == [fwd, fwd, bwd] and again == bwd_scalars
    *_, (_, forward), (_, backward) = direct
    forward, backward = forward[-(8 + len(fwd_scalars)) :], backward[-(9 + len(bwd_scalars)) :]
    assert forward[8:] == fwd_scalars and backward[9:] == bwd_scalars
    stats = forward[6]  # (one buffer: LayerNorm's mean, then its rstd 16-byte aligned)
    # (forward: x, residual, weight, bias, y, h, mean, rstd, an absent one at y's address;
    # backward: dy, the normalised rows (h, else x), weight, mean, rstd, ...)
    assert forward[:6] == norm_forward_addresses(x, r, w, b, y, h)
    assert forward[7] == stats + 4 * 8 and stats % 16 == 0
    normalised = h if residual else x
    assert backward[:5] == (dy.data_ptr(), normalised.data_ptr(), w.data_ptr(), stats, stats + 4 * 8)
    # (the partial sums of both parameters' gradients in one buffer, weight's first; scalars:
    # rows, n, rows a program, ...)
    programs = -(-6 // bwd_scalars[2])
    assert backward[8] - backward[7] == 4 * programs * 24 and backward[7] % 16 == 0
    # Saved tensors given back laid out otherwise (a saved-tensor hook that restores a copy):
    # x's rows at another stride take the ordinary backward; h is as it was
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.contiguous()):
        call()
    assert [k for k, _ in direct[3:]] == ([fwd, bwd] if residual else [fwd])
    assert len(ordinary) == (3 if residual else 4)


@gpu_only
@pytest.mark.parametrize("n", [128, 8200], ids=["one_pass", "chunked"])
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"])
def test_norm_grad_recipe_on_the_gpu(monkeypatch, request, name, n):
    # Calls with a gradient repeated: the first on the ordinary path, the next from the grad
    # recipe (forward; the backward once one backward kept its launch), with a gradient
    # reaching h too: every output and gradient the same bits as the first call's, and near
    # float64's; a call 2 bytes off (another kernel for Triton) is right too.
    from fusedkit.runtime import norm as rn

    monkeypatch.setattr(rn, "GRAD_RECIPES_ON", True)
    fusedkit.clear_caches()
    request.addfinalizer(fusedkit.clear_caches)  # (no recipe outlives the switch)
    rms, residual = "rms" in name, name.startswith("add_")
    base = rand((2, 33, n + 1), torch.bfloat16, DEVICE)
    r = rand((2, 33, n), torch.bfloat16, DEVICE).requires_grad_() if residual else None
    w = rand((n,), torch.float32, DEVICE).requires_grad_()
    b = None if rms else rand((n,), torch.float32, DEVICE).requires_grad_()
    dy, dh = rand((2, 33, n), torch.bfloat16, DEVICE), rand((2, 33, n), torch.bfloat16, DEVICE)

    def call(x):
        op = getattr(fusedkit, name)
        args = (x, r, w) if residual else (x, (n,), w)
        out = op(*args, 1e-6) if rms else op(*args, b, 1e-5)
        y, h = out if residual else (out, None)
        loss = (y.float() * dy).sum() + ((h.float() * dh).sum() if residual else 0)
        leaves = [t for t in (x, r, w, b) if t is not None]
        return (y, h, *torch.autograd.grad(loss, leaves))

    x = base[..., :n].detach().requires_grad_()
    runs = [call(x) for _ in range(4)]
    assert any(v is not None and v.backward for v in rn.GRAD_RECIPES.values())
    if native.applies() and native.enabled():  # (the C++ table's copy ran the later calls)
        assert runs[-1][0].grad_fn.name() == "FusedkitNormBackward"
    for run in runs[1:]:
        assert all(a is b or torch.equal(a, b) for a, b in zip(runs[0], run))
    shifted = call(base[..., 1:].detach().requires_grad_())
    for got, xin in ((runs[-1], x), (shifted, base[..., 1:])):
        xd = xin.detach().double().requires_grad_()
        rd, wd, bd = (None if t is None else t.detach().double().requires_grad_() for t in (r, w, b))
        hd = xd if rd is None else xd + rd
        if residual:  # (the norm reads h rounded to its dtype, as the eager add rounds it)
            hd = hd + (got[1].detach().double() - hd).detach()
        yd = F.rms_norm(hd, (n,), wd, 1e-6) if rms else F.layer_norm(hd, (n,), wd, bd, 1e-5)
        loss = (yd * dy.double()).sum() + ((hd * dh.double()).sum() if residual else 0)
        leaves = [t for t in (xd, rd, wd, bd) if t is not None]
        want = (yd, (xd + rd).detach() if residual else None, *torch.autograd.grad(loss, leaves))
        for a, e in zip(got, want):
            if e is not None:
                # (the parameters' float32 gradients: sums over rows, held to their size's rounding)
                scale = max(e.abs().max().item(), 1) if a.dtype is torch.float32 else 1
                tol = NORM_TOLERANCES[a.dtype]
                torch.testing.assert_close(a.double(), e, atol=tol.atol * scale, rtol=tol.rtol)


@gpu_only
def test_norm_direct_launch_and_alignment():
    # A norm's repeated launch goes straight to its compiled kernel, kept per pointer
    # alignment (rows at a 2-byte offset are another kernel for Triton), forward and backward.
    from fusedkit.runtime import norm as rn

    base = rand((64, 129), torch.bfloat16, DEVICE)
    w = rand((128,), torch.bfloat16, DEVICE).requires_grad_()
    g = rand((64, 128), torch.bfloat16, DEVICE)
    rn.LAUNCHES.clear()
    results = []
    for x in (base[:, :128], base[:, 1:], base[:, :128]):
        x = x.detach().requires_grad_()
        y = fusedkit.rms_norm(x, (128,), w, 1e-6)
        xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        want = torch.nn.functional.rms_norm(xd, (128,), wd, 1e-6)
        torch.testing.assert_close(y.double(), want, atol=2e-2, rtol=2e-2)
        got_grads = torch.autograd.grad(y, (x, w), g)
        want_grads = torch.autograd.grad(want, (xd, wd), g.double())
        for got, ref in zip(got_grads, want_grads):
            torch.testing.assert_close(got.double(), ref, atol=5e-2 * max(ref.abs().max().item(), 1), rtol=2e-2)
        results.append((y, *got_grads))
    assert len(rn.LAUNCHES) == 4  # forward and backward, at each alignment
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2]))  # the kept launch gives the same bits


@gpu_only
def test_fast_path_calls_capture_in_a_cuda_graph():
    x, y = rand((300, 64), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    w = rand((48, 64), torch.float32, DEVICE)
    fusedkit.linear_relu(fusedkit.add_relu(x, y), w)  # warm-up: compile before capture
    fusedkit.linear_relu(fusedkit.add_relu(x, y), w)  # and a direct launch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = fusedkit.add_relu(x, y)
        out = fusedkit.linear_relu(h, w)
    x.copy_(rand((300, 64), torch.float32, DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h, fusedkit.add_relu(x, y))
    assert torch.equal(out, fusedkit.linear_relu(h, w))


@gpu_only
def test_fast_launch_can_be_turned_off(fk_settings, monkeypatch):
    x, y = rand((100,), torch.float32, DEVICE), rand((100,), torch.float32, DEVICE)
    fk_settings(fast_launch=False)
    for _ in range(2):
        assert torch.equal(fusedkit.add_relu(x, y), torch.relu(x + y))
    assert ew.call_key(ADD_RELU, (x, y), 1) not in ew.KEPT  # every call takes the full path
    fk_settings(fast_launch=True)
    fusedkit.add_relu(x, y)
    assert len(_recipe(ADD_RELU, x, y).compiled) == 0


@gpu_only
@pytest.mark.parametrize("layout", ["weight", "column_major_a", "row_major_b"])
def test_tma_kept_launches_with_encoded_descriptors(fk_settings, layout, monkeypatch):
    # Kept TMA launches pass descriptors encoded once per operand address (Triton 3.6):
    # values, layouts and the saved pre-activation must match a fresh reference on every
    # repeat, with new tensors, with the same tensors refilled in place, and in backward.
    if torch.cuda.get_device_capability(DEVICE)[0] not in (9, 10):
        pytest.skip("the TMA kernel needs Hopper or datacenter Blackwell")
    fk_settings(matmul_kernel="tma")
    fk_settings(autotune=False)
    dt = torch.bfloat16
    m, k, n = 200, 136, 72
    bias = rand((n,), dt, DEVICE)

    def operands():
        a = rand((k, m), dt, DEVICE).t() if layout == "column_major_a" else rand((m, k), dt, DEVICE)
        b = rand((k, n), dt, DEVICE) if layout == "row_major_b" else rand((n, k), dt, DEVICE).t()
        return a, b

    a, b = operands()
    for step in range(4):
        if step == 2:
            a.copy_(rand(a.shape, dt, DEVICE))  # the same addresses, new values
        elif step:
            a, b = operands()
        a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
        got = fusedkit.matmul(a_, b_, bias, "gelu")  # gelu with grad: the pre-activation is stored
        ref_a, ref_b = a.double().requires_grad_(), b.double().requires_grad_()
        ref = torch.nn.functional.gelu(ref_a @ ref_b + bias.double())
        assert_rel_err(got, ref, matmul_rel_err(dt))
        g = rand(got.shape, dt, DEVICE)
        got.backward(g)
        ref.backward(g.double())
        assert_rel_err(a_.grad, ref_a.grad, matmul_rel_err(dt))
        assert_rel_err(b_.grad, ref_b.grad, matmul_rel_err(dt))
    if fk_launch.RAW_LAUNCH:
        assert mm.TMA_LAUNCHES.entries() and all(e.layouts for e in mm.TMA_LAUNCHES.entries())


def test_a_norm_grad_recipe_learns_its_backward_from_a_later_call_where_the_first_had_an_expanded_dy(monkeypatch):
    # A loss's sum gives the norm an expanded gradient, which the kept backward does not take:
    # that backward runs the ordinary path and keeps nothing, and a later one with a
    # gradient of unit stride keeps the launch, which the next takes.
    x = rand((4, 24), torch.float32, DEVICE).requires_grad_()
    w = rand((24,), torch.float32, DEVICE).requires_grad_()
    direct = []

    def kept(kernel, grid, args, meta, pointers, scalars):
        launcher = lambda *a: direct.append(kernel)
        return kernel, fk_launch.Entry(None, launcher, 7, "packed", (*grid, 1, 1)[:3], (), None)

    ordinary = norms_recorded(monkeypatch, x.device.index, kept)
    dy = rand((4, 24), torch.float32, DEVICE)
    fusedkit.rms_norm(x, (24,), w, 1e-6)  # the recipe kept
    torch.autograd.grad(fusedkit.rms_norm(x, (24,), w, 1e-6).sum(), (x, w))  # expanded: ordinary
    torch.autograd.grad(fusedkit.rms_norm(x, (24,), w, 1e-6), (x, w), dy)  # ordinary, kept
    torch.autograd.grad(fusedkit.rms_norm(x, (24,), w, 1e-6), (x, w), dy)  # from the recipe
    fwd, bwd = ordinary[0], ordinary[1]
    assert ordinary == [fwd, bwd, bwd] and direct == [fwd, fwd, fwd, bwd]
