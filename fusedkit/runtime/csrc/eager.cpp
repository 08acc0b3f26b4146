// fusedkit's eager launches in C++ (see fusedkit/runtime/native.py).
//
// From Python, a small fused call costs one allocation plus Triton's C launch function,
// more than torch.add's whole call (docs/why-fusion.md). This table keeps, per call
// signature, the kernel fusedkit already compiled and the launch it already planned, and
// does a repeated call's work in C++: match the signature, allocate the result, pack the
// kernel's parameters the way Triton 3.6's launcher packs them, and cuLaunchKernel on the
// current stream. A call whose operands require a gradient gets its autograd node here
// too (KeptBackward: the saved tensors in C++, the kernel's backward in Python), as
// torch's own ops get theirs. Anything it does not match returns None, and Python takes
// the call.

#include <torch/extension.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <dlfcn.h>

#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// cuLaunchKernel, resolved at run time: no CUDA headers and no link step.
using DriverLaunch = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**);

void* driver_symbol(const char* name) {
  static void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  void* fn = lib ? dlsym(lib, name) : nullptr;
  TORCH_CHECK(fn, "fusedkit native launch: ", name, " not found (no libcuda.so.1)");
  return fn;
}

DriverLaunch driver_launch() {
  static auto fn = reinterpret_cast<DriverLaunch>(driver_symbol("cuLaunchKernel"));
  return fn;
}

// Make the device's primary context current on this thread, as Triton's launcher does
// before each launch (a thread that never used the device has none).
void make_context_current(int device) {
  using DeviceGet = int (*)(int*, int);
  using PrimaryCtxRetain = int (*)(void**, int);
  using CtxSetCurrent = int (*)(void*);
  static auto device_get = reinterpret_cast<DeviceGet>(driver_symbol("cuDeviceGet"));
  static auto retain = reinterpret_cast<PrimaryCtxRetain>(driver_symbol("cuDevicePrimaryCtxRetain"));
  static auto set_current = reinterpret_cast<CtxSetCurrent>(driver_symbol("cuCtxSetCurrent"));
  int handle = 0;
  void* context = nullptr;
  TORCH_CHECK(device_get(&handle, device) == 0 && retain(&context, handle) == 0 && set_current(context) == 0,
              "fusedkit native launch: no CUDA context for device ", device);
}

// Triton proves 16-byte accesses from aligned pointers; a kept launch was compiled for
// aligned operands, so a misaligned one goes back to Python (it needs another kernel).
constexpr uint64_t kAlignment = 16;
// CUDA_ERROR_INVALID_CONTEXT
constexpr int kInvalidContext = 201;

struct Operand {
  at::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
};

// A Python number as the kernel's parameter was encoded for: its type and exact bits.
struct Param {
  int kind = 0;  // 0: none, 1: int, 2: float
  int64_t bits = 0;

  bool matches(PyObject* obj) const {
    if (kind == 0) return obj == Py_None;
    if (kind == 1) {
      if (!PyLong_CheckExact(obj)) return false;  // bool is an int subclass: Python validates it
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
      return overflow == 0 && value == bits;
    }
    if (!PyFloat_CheckExact(obj)) return false;
    const double value = PyFloat_AS_DOUBLE(obj);
    int64_t value_bits;
    std::memcpy(&value_bits, &value, sizeof value);
    return value_bits == bits;  // -0.0 and NaN payloads as well
  }
};

// What a kept launch's autograd node runs: fn(grad, saved) -> a gradient (or None) per
// operand, saved being the result (saves == 1) or the operands (2) or nothing (0).
struct BackwardSpec {
  py::object fn;
  int saves;
  std::string name;

  BackwardSpec(py::object f, int s, std::string n) : fn(std::move(f)), saves(s), name(std::move(n)) {}
  // A node can outlive the table (and be freed on an autograd thread): release the
  // Python function under the GIL.
  ~BackwardSpec() {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      fn = py::object();
    } else {
      fn.release();
    }
  }
};

class KeptBackward : public torch::autograd::Node {
 public:
  explicit KeptBackward(std::shared_ptr<const BackwardSpec> spec) : spec_(std::move(spec)) {}

  std::string name() const override { return spec_->name; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const size_t n = num_outputs();
    torch::autograd::variable_list result(n);
    if (grads.empty() || !grads[0].defined()) return result;  // no gradient flows: none to pass on
    std::vector<at::Tensor> saved;
    saved.reserve(saved_.size());
    for (auto& s : saved_) saved.push_back(s.unpack(getptr()));
    py::gil_scoped_acquire gil;
    try {
      py::tuple saved_py(saved.size());
      for (size_t i = 0; i < saved.size(); ++i) saved_py[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(saved[i]));
      py::object grad = py::reinterpret_steal<py::object>(THPVariable_Wrap(grads[0]));
      py::sequence out = spec_->fn(grad, saved_py);
      TORCH_CHECK(out.size() == n, spec_->name, ": the backward gave ", out.size(), " gradients for ", n, " operands");
      for (size_t i = 0; i < n; ++i) {
        py::object g = out[i];
        if (!g.is_none()) result[i] = THPVariable_Unpack(g.ptr());
      }
    } catch (py::error_already_set& e) {
      e.restore();  // the Python exception itself reaches the caller of backward()
      python_error err;
      err.persist();
      throw std::move(err);
    }
    return result;
  }

  void release_variables() override {
    for (auto& s : saved_) s.reset_data();
  }

  std::vector<torch::autograd::SavedVariable> saved_;

 private:
  std::shared_ptr<const BackwardSpec> spec_;
};

// A new node, owned as this torch owns nodes: std::shared_ptr (deleted through deleteNode,
// which unlinks long graphs without deep recursion) up to torch 2.12, c10::intrusive_ptr
// from 2.13. Node::getptr() returns the owner type in both.
using NodeHandle = decltype(std::declval<torch::autograd::Node&>().getptr());

template <typename Handle>
struct NodeFactory;

template <typename N>
struct NodeFactory<std::shared_ptr<N>> {
  static std::shared_ptr<KeptBackward> make(std::shared_ptr<const BackwardSpec> spec) {
    // (deleteNode found by argument-dependent lookup: named only where it exists)
    return std::shared_ptr<KeptBackward>(new KeptBackward(std::move(spec)),
                                         [](KeptBackward* node) { deleteNode(static_cast<N*>(node)); });
  }
};

template <typename N>
struct NodeFactory<c10::intrusive_ptr<N>> {
  template <typename Node = KeptBackward>  // (a template: checked only where instantiated)
  static c10::intrusive_ptr<Node> make(std::shared_ptr<const BackwardSpec> spec) {
    return c10::make_intrusive<Node>(std::move(spec));
  }
};

struct Launch {
  int64_t kernel;  // id() of the Python kernel spec
  c10::Device device;
  std::vector<Operand> operands;
  Param param;
  std::vector<int64_t> out_sizes, out_strides;
  at::ScalarType out_dtype;
  uint64_t function;
  unsigned grid, block, shared;
  // Per kernel parameter: 'o' the result's address, '0'..'2' an operand's, 'i' / 'l' a
  // 32- / 64-bit integer from values. Triton 3.6 appends two scratch pointers (null).
  std::string kinds;
  std::vector<int64_t> values;
  std::shared_ptr<const BackwardSpec> backward;  // null: a call that needs a gradient goes to Python
};

uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ULL; }

uint64_t hash_start(int64_t kernel, const c10::Device& device) {
  const uint64_t h = mix(0xcbf29ce484222325ULL, static_cast<uint64_t>(kernel));
  return mix(h, static_cast<uint64_t>(device.type()) << 8 | static_cast<uint8_t>(device.index()));
}

uint64_t hash_operand(uint64_t h, at::ScalarType dtype, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  h = mix(h, static_cast<uint64_t>(dtype));
  for (int64_t s : sizes) h = mix(h, static_cast<uint64_t>(s));
  for (int64_t s : strides) h = mix(h, static_cast<uint64_t>(s) ^ 0x9e3779b97f4a7c15ULL);
  return h;
}

bool same_operand(const Operand& want, const at::Tensor& t) {
  return t.scalar_type() == want.dtype && t.sizes().equals(want.sizes) && t.strides().equals(want.strides);
}

class Table {
 public:
  explicit Table(bool dry_run) : dry_run_(dry_run) {}

  void add(Launch launch) {
    uint64_t h = hash_start(launch.kernel, launch.device);
    for (const Operand& op : launch.operands) h = hash_operand(h, op.dtype, op.sizes, op.strides);
    entries_[h].push_back(std::move(launch));
    ++size_;
  }

  void clear() {
    entries_.clear();
    size_ = 0;
  }

  size_t size() const { return size_; }

  // The result of a kept launch of kernel on operands (a tuple), or None.
  py::object call(int64_t kernel, py::tuple operands, py::handle param) {
    const size_t n = operands.size();
    if (n == 0 || n > 3 || size_ == 0) return py::none();
    std::vector<const at::Tensor*> ts;
    ts.reserve(n);
    const bool grad_mode = at::GradMode::is_enabled();
    bool needs_grad = false;
    for (size_t i = 0; i < n; ++i) {
      PyObject* obj = operands[i].ptr();
      if (!THPVariable_CheckExact(obj)) return py::none();  // numbers and subclasses: Python
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (t.is_neg() || t.is_conj()) return py::none();
      if (grad_mode && t.requires_grad()) {
        // Forward-mode AD (a dual tensor) is Python's to refuse or handle.
        if (t._fw_grad(/*level=*/0).defined()) return py::none();
        needs_grad = true;
      }
      ts.push_back(&t);
    }
    const c10::Device device = ts[0]->device();
    for (const at::Tensor* t : ts) {
      if (t->device() != device) return py::none();
    }
    uint64_t h = hash_start(kernel, device);
    for (const at::Tensor* t : ts) h = hash_operand(h, t->scalar_type(), t->sizes(), t->strides());
    auto found = entries_.find(h);
    if (found == entries_.end()) return py::none();
    for (const Launch& l : found->second) {
      if (l.kernel != kernel || l.device != device || l.operands.size() != n || !l.param.matches(param.ptr())) continue;
      bool same = true;
      for (size_t i = 0; i < n && same; ++i) same = same_operand(l.operands[i], *ts[i]);
      if (!same) continue;
      if (!needs_grad) return run(l, ts);
      if (!l.backward) return py::none();
      return run_recorded(l, ts);
    }
    return py::none();
  }

  // The parameters the last dry run would have launched with (tests).
  std::vector<uint64_t> last_params() const { return last_params_; }

 private:
  // run(), with the result's autograd node: its edges to the operands, and what the
  // kernel's backward reads saved as torch's own nodes save it (version-checked, through
  // saved-tensor hooks, released after a backward without retain_graph).
  py::object run_recorded(const Launch& l, const std::vector<const at::Tensor*>& ts) {
    py::object result = run(l, ts);
    if (result.is_none()) return result;
    const at::Tensor& out = THPVariable_Unpack(result.ptr());
    torch::autograd::variable_list inputs;
    inputs.reserve(ts.size());
    for (const at::Tensor* t : ts) inputs.push_back(*t);
    auto node = NodeFactory<NodeHandle>::make(l.backward);
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    torch::autograd::set_history(out, node);
    if (l.backward->saves == 1) {
      node->saved_.emplace_back(out, /*is_output=*/true);
    } else if (l.backward->saves == 2) {
      for (const at::Tensor& t : inputs) node->saved_.emplace_back(t, /*is_output=*/false);
    }
    return result;
  }

  py::object run(const Launch& l, const std::vector<const at::Tensor*>& ts) {
    if (!dry_run_ && !l.device.is_cuda()) return py::none();
    for (const at::Tensor* t : ts) {
      if (reinterpret_cast<uint64_t>(t->data_ptr()) % kAlignment != 0) return py::none();
    }
    const c10::impl::DeviceGuardImplInterface* guard = nullptr;
    if (l.device.is_cuda()) {
      guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      if (guard->getDevice() != l.device) return py::none();  // Python launches under the right device
    }
    at::Tensor out = at::empty_strided(l.out_sizes, l.out_strides, at::TensorOptions().dtype(l.out_dtype).device(l.device));
    const size_t n = l.kinds.size();
    std::vector<uint64_t> storage(n + 2, 0);
    std::vector<void*> params(n + 2);
    for (size_t i = 0; i < n; ++i) {
      const char kind = l.kinds[i];
      if (kind == 'o') {
        storage[i] = reinterpret_cast<uint64_t>(out.data_ptr());
      } else if (kind >= '0' && kind <= '2') {
        storage[i] = reinterpret_cast<uint64_t>(ts[kind - '0']->data_ptr());
      } else if (kind == 'i') {
        const int32_t v = static_cast<int32_t>(l.values[i]);
        std::memcpy(&storage[i], &v, sizeof v);
      } else {
        storage[i] = static_cast<uint64_t>(l.values[i]);
      }
      params[i] = &storage[i];
    }
    params[n] = &storage[n];          // global scratch
    params[n + 1] = &storage[n + 1];  // profile scratch
    if (dry_run_) {
      last_params_.assign(storage.begin(), storage.end());
    } else {
      void* stream = guard->getStream(l.device).native_handle();
      auto launch = [&] {
        py::gil_scoped_release no_gil;  // a full launch queue blocks here, as in Triton's launcher
        return driver_launch()(reinterpret_cast<void*>(l.function), l.grid, 1, 1, l.block, 1, 1, l.shared, stream,
                               params.data(), nullptr);
      };
      int rc = launch();
      if (rc == kInvalidContext) {  // a thread without a current context: make it, launch again
        make_context_current(l.device.index());
        rc = launch();
      }
      TORCH_CHECK(rc == 0, "fusedkit native launch: cuLaunchKernel returned ", rc);
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }

  bool dry_run_;
  std::unordered_map<uint64_t, std::vector<Launch>> entries_;
  size_t size_ = 0;
  std::vector<uint64_t> last_params_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Table>(m, "Table")
      .def(py::init<bool>(), py::arg("dry_run") = false)
      .def("add",
           [](Table& table, int64_t kernel, c10::Device device, std::vector<std::tuple<at::ScalarType,
              std::vector<int64_t>, std::vector<int64_t>>> operands, int param_kind, int64_t param_bits,
              std::vector<int64_t> out_sizes, std::vector<int64_t> out_strides, at::ScalarType out_dtype,
              uint64_t function, unsigned grid, unsigned block, unsigned shared, std::string kinds,
              std::vector<int64_t> values, py::object backward, int saves, std::string name) {
             TORCH_CHECK(kinds.size() == values.size(), "kinds and values differ in length");
             TORCH_CHECK(saves >= 0 && saves <= 2, "saves must be 0, 1 or 2");
             Launch l{kernel, device, {}, Param{param_kind, param_bits}, std::move(out_sizes),
                      std::move(out_strides), out_dtype, function, grid, block, shared, std::move(kinds),
                      std::move(values), nullptr};
             if (!backward.is_none()) l.backward = std::make_shared<const BackwardSpec>(backward, saves, name);
             for (auto& [dtype, sizes, strides] : operands) l.operands.push_back(Operand{dtype, sizes, strides});
             table.add(std::move(l));
           })
      .def("call", &Table::call)
      .def("clear", &Table::clear)
      .def("__len__", &Table::size)
      .def("last_params", &Table::last_params);
}
