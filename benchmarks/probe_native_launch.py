"""How cheap can an eager fused call get? (GPU; needs a C++ compiler and ninja.)

The Python fast path costs about 1.8x ``torch.add`` at 1,024 elements on the H200
host, and its floor from Python is one ``torch.empty`` plus Triton's C launch
function, already more than ``torch.add``'s whole call (``docs/why-fusion.md``).
This probe builds the other candidate before fusedkit commits to it: a small C++
extension that allocates the result with ``at::empty_strided`` and launches the
kernel fusedkit already compiled and kept for the call, through the driver's
``cuLaunchKernel``, with the arguments packed as Triton 3.6's launcher packs them.
It checks the result and times it beside ``torch.add`` and ``fusedkit.add_relu``.

    python benchmarks/probe_native_launch.py [n]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

import fusedkit
from fusedkit import _elementwise as ew
from fusedkit.registry import ADD_RELU

CALLS, ROUNDS = 2000, 5

CPP = r"""
#include <torch/extension.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

// The driver entry point, resolved at run time: no CUDA headers or link step needed.
using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**);

static LaunchKernel launch_kernel() {
  static LaunchKernel fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib, "libcuda.so.1 not found");
    auto f = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    TORCH_CHECK(f, "cuLaunchKernel not found");
    return f;
  }();
  return fn;
}

// One kept launch of a two-operand elementwise kernel. kinds, per kernel parameter:
// 'o' the result's address, 'x' / 'y' an operand's, 'i' a 32-bit and 'l' a 64-bit
// integer from values; Triton 3.6 appends two scratch pointers (null here).
struct Launch {
  uint64_t function;
  unsigned grid, block, shared;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t device;
  std::string kinds;
  std::vector<int64_t> values;

  torch::Tensor call(const torch::Tensor& x, const torch::Tensor& y) const {
    auto out = at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype).device(at::kCUDA, device));
    const size_t n = kinds.size();
    std::vector<uint64_t> storage(n + 2, 0);
    std::vector<void*> params(n + 2);
    for (size_t i = 0; i < n; ++i) {
      switch (kinds[i]) {
        case 'o': storage[i] = reinterpret_cast<uint64_t>(out.data_ptr()); break;
        case 'x': storage[i] = reinterpret_cast<uint64_t>(x.data_ptr()); break;
        case 'y': storage[i] = reinterpret_cast<uint64_t>(y.data_ptr()); break;
        case 'i': { int32_t v = static_cast<int32_t>(values[i]); std::memcpy(&storage[i], &v, 4); break; }
        default: storage[i] = static_cast<uint64_t>(values[i]);
      }
      params[i] = &storage[i];
    }
    params[n] = &storage[n];
    params[n + 1] = &storage[n + 1];
    void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                       ->getStream(c10::Device(c10::DeviceType::CUDA, device)).native_handle();
    int rc = launch_kernel()(reinterpret_cast<void*>(function), grid, 1, 1, block, 1, 1, shared, stream,
                             params.data(), nullptr);
    TORCH_CHECK(rc == 0, "cuLaunchKernel failed: ", rc);
    return out;
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Launch>(m, "Launch")
      .def(pybind11::init([](uint64_t function, unsigned grid, unsigned block, unsigned shared,
                             std::vector<int64_t> sizes, std::vector<int64_t> strides, torch::Dtype dtype,
                             int64_t device, std::string kinds, std::vector<int64_t> values) {
        return Launch{function, grid, block, shared, sizes, strides, dtype, device, kinds, values};
      }))
      .def("__call__", &Launch::call);
}
"""


def per_call_us(fn) -> float:
    samples = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / CALLS * 1e6)
    return sorted(samples)[ROUNDS // 2]


def native_launch(module, x, y):
    """The extension's launch of the kernel fusedkit keeps for ``add_relu(x, y)``."""
    for _ in range(2):  # the first call keeps the recipe, the second the compiled kernel
        fusedkit.add_relu(x, y)
    recipe = ew._RECIPES[ew._call_key(ADD_RELU, (x, y), 1)]
    (entry,) = recipe.compiled._entries.values()
    bits, _ = recipe._bits((x, y), 1)
    values = (0, 0, 0, 0, *bits, *recipe.launch_tail)  # in the kernel's signature order
    # The pointers: out, x, y, and the unused third operand slot, which gets out's address.
    roles = ("o", "x", "y", "o") + (None,) * (len(values) - 4)
    kinds, kept = [], []
    for ty, role, value in zip(entry.compiled.src.signature.values(), roles, values, strict=True):
        if ty == "constexpr":
            continue
        kinds.append(role if role else ("i" if ty == "i32" else "l"))
        kept.append(0 if role else int(value))
    num_warps, _, shared = entry.packed_metadata
    return module.Launch(entry.function, entry.grid[0], 32 * num_warps, shared, list(recipe.shape),
                         list(recipe.out_strides), recipe.dtype, recipe.index, "".join(kinds), kept)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    t0 = time.perf_counter()
    module = load_inline("fusedkit_native_probe", cpp_sources=[CPP], verbose=False)
    print(f"extension built in {time.perf_counter() - t0:.1f} s")
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    launch = native_launch(module, x, y)
    for _ in range(3):
        x.copy_(torch.randn(n, device="cuda"))
        assert torch.equal(launch(x, y), torch.relu(x + y)), "the native launch computed something else"
    rows = [("torch.add(x, y)", lambda: torch.add(x, y)),
            ("torch.relu(x + y)", lambda: torch.relu(x + y)),
            ("fusedkit.add_relu(x, y)  [Python fast path]", lambda: fusedkit.add_relu(x, y)),
            ("C++ launch: empty_strided + cuLaunchKernel", lambda: launch(x, y)),
            ("torch.empty_like(x)", lambda: torch.empty_like(x))]
    for name, fn in rows:
        print(f"{name:48s} {per_call_us(fn):7.1f} us/call  (n={n}, fp32)")


if __name__ == "__main__":
    main()
