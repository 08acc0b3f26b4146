"""The one module that reads Triton's private API (``fusedkit.runtime.triton_api``).

Each supported release's adapter calls the launcher's C function past its Python wrapper.
Two kinds of check: stand-ins of both launcher conventions (any machine, any release), and
the installed release's own launcher object called beside the adapter's direct call, with the
C function replaced by a recorder, which fails when a release changes what the adapter reads.
On a GPU the launcher is the one Triton built for a kept kernel; on a CPU the shared-launcher
releases (3.7+) build theirs from a stand-in driver, and the per-kernel ones (3.5, 3.6: a C
source compiled against libcuda) are checked on the GPU only.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton
from conftest import DEVICE, ON_GPU
from helpers import rand

import fusedkit
from fusedkit.library import ADD_RELU
from fusedkit.runtime import elementwise as ew
from fusedkit.runtime import launch as fk_launch
from fusedkit.runtime import triton_api

ADAPTERS = {"per_kernel": triton_api.PER_KERNEL, "shared": triton_api.SHARED}


class _Recorder:
    """Records the calls of the C launch function it stands for."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _StandInCudaLauncher:
    """The attributes of Triton's CUDA launcher object that the raw launch reads."""

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.launch = _Recorder()
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size
        self.launch_cooperative_grid, self.launch_pdl = 0, 1
        self.arg_annotations, self.kernel_signature = "annotations", b"signature"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_raw_launch_calls_the_c_launch_function(monkeypatch, adapter):
    # A kept kernel is launched through the launcher object's C function, with the flags and
    # (absent) scratch buffers its Python wrapper adds, in the release's argument order.
    monkeypatch.setattr(triton_api, "ADAPTER", ADAPTERS[adapter])
    cuda_launcher = _StandInCudaLauncher()
    launch, head, layouts, flags = fk_launch.raw_launcher(cuda_launcher)
    assert layouts is None and flags == (0, 1)
    entry = fk_launch.Entry(None, launch, 7, "packed", (3, 1, 1), ("tail",), None, head, None, flags)
    monkeypatch.setattr(fk_launch, "current_stream", lambda index: 1234)
    fk_launch.CompiledCache.run(entry, (11, 12), 0)
    if adapter == "per_kernel":
        assert launch is cuda_launcher.launch and head == (0, 1, None, None)
        expected = (3, 1, 1, 1234, 7, 0, 1, None, None, "packed", None, None, None, 11, 12, "tail")
    else:  # the arguments as one tuple, after the annotations and signature Triton built
        assert head == ()
        expected = (3, 1, 1, 1234, 7, 0, 1, "packed", None, None, None, None, None, "annotations", b"signature")
        expected += ((11, 12, "tail"),)
    assert cuda_launcher.launch.calls == [expected]
    # A kernel that needs scratch memory, or an object without the attributes, keeps the wrapper.
    assert fk_launch.raw_launcher(_StandInCudaLauncher(global_scratch_size=64)) is None
    assert fk_launch.raw_launcher(object()) is None


def test_an_unsupported_release_keeps_tritons_launch(monkeypatch):
    monkeypatch.setattr(triton_api, "ADAPTER", None)
    assert fk_launch.raw_launcher(_StandInCudaLauncher()) is None


def _descriptor_wrapper(c_launch, tensordesc_meta):
    """A stand-in for the function Triton wraps its C launch in when a kernel takes TMA
    descriptors (its closure holds the C launch and the descriptors' metadata)."""
    launcher = c_launch

    def inner(*args):
        return launcher(tensordesc_meta, *args)

    return inner


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_raw_launch_takes_encoded_descriptors(monkeypatch, adapter):
    # A TMA kernel's launcher is Triton's descriptor-expanding wrapper: a kept launch calls
    # the C launch inside it, with the layouts the compiled kernel recorded.
    monkeypatch.setattr(triton_api, "ADAPTER", ADAPTERS[adapter])
    monkeypatch.setattr(triton_api, "TMA_HOST_TYPE", {10: 8, 7: 7})
    meta = [
        {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [128, 64], "fp4_padded": False},
        {"swizzle": 2, "elem_size": 4, "elem_type": 7, "block_size": [64, 32], "fp4_padded": False},
    ]
    cuda_launcher = _StandInCudaLauncher()
    c_launch = cuda_launcher.launch
    cuda_launcher.launch = _descriptor_wrapper(c_launch, meta)
    launch, head, layouts, _ = fk_launch.raw_launcher(cuda_launcher, types.SimpleNamespace(tensordesc_meta=meta))
    launch(1, 1, 1, 0, 7, *head, "packed", None, None, None, "map", 5)
    assert c_launch.calls and c_launch.calls[0][0] != meta  # the C launch itself, past the wrapper
    assert layouts == ((3, 2, 8, (128, 64)), (2, 4, 7, (64, 32)))  # host-side element type codes
    # A descriptor without a hardware layout, an fp4 or an im2col one: the wrapper stays.
    for odd in ([meta[0], None], [meta[0], {**meta[1], "fp4_padded": True}], [{**meta[0], "is_im2col": True}]):
        cuda_launcher.launch = _descriptor_wrapper(c_launch, odd)
        c_launch.calls.clear()
        launch, head, layouts, _ = fk_launch.raw_launcher(cuda_launcher, types.SimpleNamespace(tensordesc_meta=odd))
        assert layouts is None
        launch(1, 1, 1, 0, 7, *head, "packed", None, None, None)
        assert c_launch.calls[0][0] is odd  # through the wrapper


# --- The installed release's own launcher --------------------------------------------------


def _kept_gpu_launcher():
    """The launcher object Triton built for a kernel fusedkit keeps (GPU)."""
    x, y = rand((1000,), torch.float32, DEVICE), rand((1000,), torch.float32, DEVICE)
    for _ in range(2):  # the first call plans, the second keeps its launch
        fusedkit.add_relu(x, y)
    entries = ew.KEPT[ew.call_key(ADD_RELU, (x, y), 1)].compiled.entries()
    if not entries:
        pytest.skip("no kept launch to read the launcher of")
    compiled = entries[0].compiled
    return compiled.run, compiled.metadata, len(compiled.src.signature)


def _stand_in_driver_launcher(monkeypatch):
    """Triton's own CudaLauncher (a shared-launcher release) built on a CPU: the driver it
    asks for its C launch and signature encoding is a stand-in, the rest is Triton's code."""
    from triton.backends.nvidia import driver as nvidia_driver

    utils = types.SimpleNamespace(launch=_Recorder(), build_signature_metadata=lambda sig: tuple(sig))
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(utils=utils))
    monkeypatch.setattr(nvidia_driver, "PyKernelArg", lambda nested_tuple, type: (type, nested_tuple))
    for i, name in enumerate(("ARG_CONSTEXPR", "ARG_KERNEL", "ARG_TUPLE")):
        monkeypatch.setattr(nvidia_driver, name, i)
    names = ("out_ptr", "x_ptr", "n", "BLOCK")
    src = types.SimpleNamespace(
        signature={"out_ptr": "*fp32", "x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        constants={"BLOCK": 128},
        fn=types.SimpleNamespace(arg_names=names),
    )
    metadata = types.SimpleNamespace(
        global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
        launch_cooperative_grid=False, launch_pdl=False, num_ctas=1, tensordesc_meta=None,
    )  # fmt: skip
    return nvidia_driver.CudaLauncher(src, metadata), metadata, len(names)


def test_the_adapter_launches_as_tritons_own_launcher_does(monkeypatch):
    if triton_api.ADAPTER is None:
        pytest.skip(f"Triton {triton.__version__} has no adapter: every call takes Triton's own launch")
    if ON_GPU:
        launcher, metadata, n_args = _kept_gpu_launcher()
    elif triton_api.ADAPTER.shared:
        launcher, metadata, n_args = _stand_in_driver_launcher(monkeypatch)
    else:
        pytest.skip("a per-kernel launcher is compiled against libcuda: checked on the GPU")
    recorder = _Recorder()
    monkeypatch.setattr(launcher, "launch", recorder)  # the C function (no descriptors here)
    args = tuple(range(100, 100 + n_args))
    launcher(4, 2, 1, 1234, 77, "packed", "meta", None, None, *args)  # Triton's own call
    raw = triton_api.raw_launcher(launcher, metadata)
    assert raw is not None, f"Triton {triton.__version__}'s launcher no longer has what the adapter reads"
    launch, head, _, flags = raw
    launch(4, 2, 1, 1234, 77, *head, "packed", "meta", None, None, *args)  # the adapter's
    assert len(recorder.calls) == 2 and recorder.calls[0] == recorder.calls[1]
    assert flags == (metadata.launch_cooperative_grid, metadata.launch_pdl)


def test_geometry_and_signature_read_a_compiled_kernel():
    compiled = types.SimpleNamespace(
        packed_metadata=(4, 1, 2048, 1, 1, 1), src=types.SimpleNamespace(signature={"x": "*fp32"})
    )
    assert triton_api.geometry(compiled) == (4, 1, 2048)  # (3.5 appends cluster sizes)
    assert triton_api.signature(compiled) == {"x": "*fp32"}


def test_this_release_is_reported():
    from fusedkit.runtime import native

    path = native.launch_path()
    assert isinstance(path, str) and path
    if triton_api.ADAPTER is None and ON_GPU:
        assert triton.__version__ in path
