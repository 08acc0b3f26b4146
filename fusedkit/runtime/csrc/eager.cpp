// fusedkit's eager launches in C++ (see fusedkit/runtime/native.py).
//
// From Python, a small fused call costs one allocation plus Triton's C launch function,
// more than torch.add's whole call (docs/why-fusion.md). This table keeps, per call
// signature, the kernel fusedkit already compiled and the launch it already planned, and
// does a repeated call's work in C++: match the signature, allocate the result, pack the
// kernel's parameters the way Triton 3.6's launcher packs them, and cuLaunchKernel on the
// current stream. A call whose operands require a gradient gets its autograd node here
// too, as torch's own ops get theirs (KeptBackward: the saved tensors in C++; the kernel's
// backward as kept launches where its plan's are kept, else in Python). The norms
// (NormRecipe, NormNode) and the matmul (MatmulRecipe, MatmulNode: TMA descriptors encoded
// per call) are matched by their signature in Python and launched here the same way.
// Anything it does not match returns None, and Python takes the call.

#include <torch/extension.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/profiler/api.h>

#include <dlfcn.h>

#include <array>
#include <cstring>
#include <mutex>
#include <optional>
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

// cuLaunchKernel of a 1-D grid on the device's current stream, params as Triton's launcher
// packs them (its two scratch pointers included); the GIL released while it runs.
// (the device by value: a caller's launch record may move while the launch drops the GIL)
void drive(uint64_t function, unsigned grid, unsigned block, unsigned shared, std::vector<void*>& params,
           const c10::impl::DeviceGuardImplInterface* guard, c10::Device device) {
  void* stream = guard->getStream(device).native_handle();
  void* fn = reinterpret_cast<void*>(function);
  auto launch = [&] {
    py::gil_scoped_release no_gil;  // a full launch queue blocks here, as in Triton's launcher
    return driver_launch()(fn, grid, 1, 1, block, 1, 1, shared, stream, params.data(), nullptr);
  };
  int rc = launch();
  if (rc == kInvalidContext) {  // a thread without a current context: make it, launch again
    make_context_current(device.index());
    rc = launch();
  }
  TORCH_CHECK(rc == 0, "fusedkit native launch: cuLaunchKernel returned ", rc);
}

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

// Drop the Python references a C++ object holds: under the GIL, since its last owner may
// free it on an autograd thread (a node outliving the table); leaked, not touched, by an
// interpreter on its way out.
template <typename... Objects>
void drop_python(Objects&... objects) {
  if (Py_IsInitialized() && !Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    ((objects = py::object()), ...);
  } else {
    (objects.release(), ...);
  }
}

// Triton's launch hooks (a profiler's, e.g. proton): while one is set, launches go through
// Triton, where it sees them. `runtime` is triton.knobs.runtime (null: no hooks in this
// Triton); a hook is idle when None or an empty HookChain.
struct LaunchHooks {
  py::object runtime, chain_type;

  // (the store that holds these can be freed last by a node on an autograd thread)
  ~LaunchHooks() { drop_python(runtime, chain_type); }

  // Once a call: attribute names interned once, no Python frames.
  bool idle() const {
    if (!runtime) return true;
    static PyObject* const names[] = {PyUnicode_InternFromString("launch_enter_hook"),
                                      PyUnicode_InternFromString("launch_exit_hook")};
    static PyObject* const calls_name = PyUnicode_InternFromString("calls");
    for (PyObject* name : names) {
      py::object hook = py::reinterpret_steal<py::object>(PyObject_GetAttr(runtime.ptr(), name));
      if (!hook) throw py::error_already_set();
      if (hook.is_none()) continue;
      if (!chain_type || Py_TYPE(hook.ptr()) != reinterpret_cast<PyTypeObject*>(chain_type.ptr())) return false;
      py::object calls = py::reinterpret_steal<py::object>(PyObject_GetAttr(hook.ptr(), calls_name));
      if (!calls) throw py::error_already_set();
      if (!PyList_CheckExact(calls.ptr()) || PyList_GET_SIZE(calls.ptr()) != 0) return false;
    }
    return true;
  }
};

// Whether a launch from C++ is what the Python path would do: no Python dispatch mode
// (make_fx, FlopCounterMode, ...), torch.func transform or torch.jit trace to route the
// call through the custom op, and no profiler to give it a range (the Python path's
// conditions).
bool eager_and_unobserved() {
  // (a transform is active while its dynamic-layer keys are included in this thread's set,
  // the test torch._C._are_functorch_transforms_active makes)
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 &&
         !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
         !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) && !torch::jit::tracer::isTracing() &&
         !torch::profiler::impl::profilerEnabled();
}

// Operand i's gradient as one kept launch: `kernel` on (grad, *saved) with `param`, its
// result `output` (1: a two-output kernel's second); kernel 0: the operand gets none.
struct GradStep {
  int64_t kernel = 0;
  Param param;
  int output = 0;
  py::object kernel_ref;  // holds the kernel, so its id() names it while the step lives

  // Steps that differ only in the result they take share one launch.
  bool same_launch(const GradStep& o) const {
    return kernel == o.kernel && param.kind == o.param.kind && param.bits == o.param.bits;
  }
};

// What a kept launch's autograd node runs: fn(grad, saved) -> a gradient (or None) per
// operand, saved being the result (saves == 1) or the operands (2) or nothing (0); or,
// where `plan` is given and its launches are kept, the plan's launches on (grad, *saved),
// without Python.
struct BackwardSpec {
  py::object fn;
  int saves;
  std::string name;
  std::vector<GradStep> plan;

  BackwardSpec(py::object f, int s, std::string n, std::vector<GradStep> p)
      : fn(std::move(f)), saves(s), name(std::move(n)), plan(std::move(p)) {}
  // (a node can outlive the table, and be freed on an autograd thread)
  ~BackwardSpec() {
    drop_python(fn);
    for (auto& step : plan) drop_python(step.kernel_ref);
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
  // Per kernel parameter: 'o' the result's address, 'p' the second result's (a two-output
  // kernel's), '0'..'2' an operand's, 'i' / 'l' a 32- / 64-bit integer from values.
  // Triton 3.6 appends two scratch pointers (null).
  std::string kinds;
  std::vector<int64_t> values;
  bool pair;  // two results, laid out alike: a backward's kernel, launched by plans only
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

// The kept launches, shared by the Table (Python's handle on them) and the autograd nodes
// whose backward launches from them. Used under the GIL only.
struct Store {
  explicit Store(bool dry) : dry_run(dry) {}

  bool dry_run;
  std::unordered_map<uint64_t, std::vector<Launch>> entries;
  size_t size = 0;
  std::vector<uint64_t> last_params;  // what the last dry run would have launched with (tests)
  LaunchHooks hooks;

  // The launch kept for kernel on these operands (one device, checked by the caller) with a
  // parameter param_matches accepts; null when none is.
  template <typename ParamMatch>
  const Launch* find(int64_t kernel, const c10::Device& device, const std::vector<const at::Tensor*>& ts,
                     ParamMatch param_matches) const {
    uint64_t h = hash_start(kernel, device);
    for (const at::Tensor* t : ts) h = hash_operand(h, t->scalar_type(), t->sizes(), t->strides());
    auto found = entries.find(h);
    if (found == entries.end()) return nullptr;
    for (const Launch& l : found->second) {
      if (l.kernel != kernel || l.device != device || l.operands.size() != ts.size() || !param_matches(l.param)) {
        continue;
      }
      bool same = true;
      for (size_t i = 0; i < ts.size() && same; ++i) same = same_operand(l.operands[i], *ts[i]);
      if (same) return &l;
    }
    return nullptr;
  }

  // The results of l on ts (the second undefined unless l.pair), launched on the current
  // stream; undefined when it cannot run here (a misaligned operand, another current
  // device): the caller takes the Python path.
  std::array<at::Tensor, 2> launch(const Launch& l, const std::vector<const at::Tensor*>& ts) {
    if (!dry_run && !l.device.is_cuda()) return {};
    for (const at::Tensor* t : ts) {
      if (reinterpret_cast<uint64_t>(t->data_ptr()) % kAlignment != 0) return {};
    }
    const c10::impl::DeviceGuardImplInterface* guard = nullptr;
    if (l.device.is_cuda()) {
      guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      if (guard->getDevice() != l.device) return {};  // Python launches under the right device
    }
    const auto options = at::TensorOptions().dtype(l.out_dtype).device(l.device);
    at::Tensor out = at::empty_strided(l.out_sizes, l.out_strides, options);
    at::Tensor out2 = l.pair ? at::empty_strided(l.out_sizes, l.out_strides, options) : at::Tensor();
    const size_t n = l.kinds.size();
    std::vector<uint64_t> storage(n + 2, 0);
    std::vector<void*> params(n + 2);
    for (size_t i = 0; i < n; ++i) {
      const char kind = l.kinds[i];
      if (kind == 'o') {
        storage[i] = reinterpret_cast<uint64_t>(out.data_ptr());
      } else if (kind == 'p') {
        storage[i] = reinterpret_cast<uint64_t>(out2.data_ptr());
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
    if (dry_run) {
      last_params.assign(storage.begin(), storage.end());
      return {out, out2};
    }
    // (copies: without the GIL another thread may add to the store, moving l, or clear it)
    drive(l.function, l.grid, l.block, l.shared, params, guard, l.device);
    return {out, out2};
  }
};

// The gradients a node's Python backward (call) gives, a Tensor or None per operand, into
// result; its exception, as it is, to the caller of backward().
template <typename Call>
void python_backward(const std::string& name, torch::autograd::variable_list& result, Call call) {
  try {
    py::sequence out = call();
    const size_t n = result.size();
    TORCH_CHECK(out.size() == n, name, ": the backward gave ", out.size(), " gradients for ", n, " operands");
    for (size_t i = 0; i < n; ++i) {
      py::object g = out[i];
      TORCH_CHECK(g.is_none() || THPVariable_Check(g.ptr()), name, ": the backward gave a ",
                  py::str(py::type::of(g)).cast<std::string>(), " for operand ", i);
      result[i] = g.is_none() ? at::Tensor() : THPVariable_Unpack(g.ptr());
    }
  } catch (py::error_already_set& e) {
    e.restore();  // the Python exception itself reaches the caller of backward()
    python_error err;
    err.persist();
    throw std::move(err);
  }
}

class KeptBackward : public torch::autograd::Node {
 public:
  KeptBackward(std::shared_ptr<const BackwardSpec> spec, std::shared_ptr<Store> store)
      : spec_(std::move(spec)), store_(std::move(store)) {}

  std::string name() const override { return spec_->name; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const size_t n = num_outputs();
    torch::autograd::variable_list result(n);
    if (grads.empty() || !grads[0].defined()) return result;  // no gradient flows: none to pass on
    // (the lock against release_variables on another thread, held while the saved tensors
    // unpack only: a Python backward may run this node again, a gradient of the gradient)
    std::unique_lock<std::mutex> lock(mutex_);
    py::gil_scoped_acquire gil;  // the store and the Python backward are the GIL's
    std::vector<at::Tensor> saved;
    saved.reserve(saved_.size());
    for (auto& s : saved_) saved.push_back(s.unpack(getptr()));
    lock.unlock();
    if (planned(grads[0], saved, result)) return result;
    python_backward(spec_->name, result, [&] {
      py::tuple saved_py(saved.size());
      for (size_t i = 0; i < saved.size(); ++i) saved_py[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(saved[i]));
      py::object grad = py::reinterpret_steal<py::object>(THPVariable_Wrap(grads[0]));
      return spec_->fn(grad, saved_py);
    });
    return result;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : saved_) s.reset_data();
  }

  std::vector<torch::autograd::SavedVariable> saved_;

 private:
  // The plan's launches into result: only where the Python path would launch the same
  // kernels (no gradient of the gradient to record, no Python dispatch mode or profiler to
  // see them) and every one is kept; false leaves result for the Python backward.
  bool planned(const at::Tensor& grad, const std::vector<at::Tensor>& saved, torch::autograd::variable_list& result) {
    const auto& plan = spec_->plan;
    if (plan.empty() || !store_ || saved.empty() || saved.size() > 2 || at::GradMode::is_enabled() ||
        !eager_and_unobserved() || !store_->hooks.idle()) {
      return false;
    }
    std::vector<const at::Tensor*> ts{&grad};  // the steps' operands: (grad, *saved)
    for (const at::Tensor& t : saved) ts.push_back(&t);
    for (const at::Tensor* t : ts) {
      // (a subclass with its own dispatch, a wrapper without storage or a lazy view is
      // Python's to resolve)
      if (!t->defined() || t->device() != grad.device() || t->is_neg() || t->is_conj() ||
          t->layout() != at::kStrided || !t->has_storage() || t->key_set().has(c10::DispatchKey::Python)) {
        return false;
      }
    }
    std::vector<std::array<at::Tensor, 2>> launched(plan.size());
    for (size_t i = 0; i < plan.size() && i < result.size(); ++i) {
      const GradStep& step = plan[i];
      if (step.kernel == 0) continue;
      for (size_t j = 0; j < i && !launched[i][0].defined(); ++j) {
        if (plan[j].kernel != 0 && plan[j].same_launch(step)) launched[i] = launched[j];  // one launch for both
      }
      if (!launched[i][0].defined()) {
        const Launch* l = store_->find(step.kernel, grad.device(), ts, [&](const Param& p) {
          return p.kind == step.param.kind && p.bits == step.param.bits;
        });
        if (l != nullptr && (step.output == 0 || l->pair)) launched[i] = store_->launch(*l, ts);
      }
      if (!launched[i][step.output].defined()) {
        for (auto& r : result) r = at::Tensor();
        return false;
      }
      result[i] = launched[i][step.output];
    }
    return true;
  }

  std::shared_ptr<const BackwardSpec> spec_;
  std::shared_ptr<Store> store_;
};

// A new node, owned as this torch owns nodes: std::shared_ptr (deleted through deleteNode,
// which unlinks long graphs without deep recursion) up to torch 2.12, c10::intrusive_ptr
// from 2.13. Node::getptr() returns the owner type in both.
using NodeHandle = decltype(std::declval<torch::autograd::Node&>().getptr());

template <typename Handle>
struct NodeFactory;

template <typename N>
struct NodeFactory<std::shared_ptr<N>> {
  template <typename T, typename... Args>
  static std::shared_ptr<T> make(Args&&... args) {
    // (deleteNode found by argument-dependent lookup: named only where it exists)
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](T* node) { deleteNode(static_cast<N*>(node)); });
  }
};

template <typename N>
struct NodeFactory<c10::intrusive_ptr<N>> {
  template <typename T, typename... Args>  // (a template: checked only where instantiated)
  static c10::intrusive_ptr<T> make(Args&&... args) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
};

// cuTensorMapEncodeTiled, resolved at run time as cuLaunchKernel is.
using EncodeTiled = int (*)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                            const uint32_t*, int, int, int, int);

// A TMA descriptor parameter (CUtensorMap: 128 bytes, passed by value) of a slot's address,
// for a fixed 2-D row-major view: what Triton's launcher encodes from a TensorDescriptor
// (fill_tma_descriptor: unit element strides, no interleave, 128-byte L2 promotion, no
// out-of-bounds fill), every call, for the call's address.
struct TensorMapSpec {
  int slot = 0;
  int swizzle = 0, elem_size = 0, elem_type = 0;
  std::array<uint32_t, 2> box{};     // innermost first
  std::array<uint64_t, 2> dims{};    // innermost first
  uint64_t row_bytes = 0;            // the outer dimension's stride in bytes

  bool same_view(const TensorMapSpec& o) const {
    return swizzle == o.swizzle && elem_size == o.elem_size && elem_type == o.elem_type && box == o.box &&
           dims == o.dims && row_bytes == o.row_bytes;
  }

  bool encode(void* map, uint64_t address) const {
    static auto fn = reinterpret_cast<EncodeTiled>(driver_symbol("cuTensorMapEncodeTiled"));
    const uint64_t strides[2] = {row_bytes, row_bytes * dims[1]};  // (the launcher's; only the first is read)
    const uint32_t element_strides[2] = {1, 1};
    constexpr int kInterleaveNone = 0, kL2Promotion128B = 2, kFillNone = 0;
    return fn(map, elem_type, 2, reinterpret_cast<void*>(address), dims.data(), strides, box.data(), element_strides,
              kInterleaveNone, swizzle, kL2Promotion128B, kFillNone) == 0;
  }
};

struct alignas(128) TensorMapBytes {
  uint64_t words[16];
};

// A kept launch whose parameters are the addresses of slots (the call's tensors and the
// buffers it allocates), each plus a byte offset, numbers and TMA descriptors of slots: a
// norm's, forward or backward, or a matmul's.
struct SlotLaunch {
  uint64_t function = 0;
  unsigned grid = 0, block = 0, shared = 0;
  // Per kernel parameter: '0' + s the address of slot s plus values[i] bytes; 'i' / 'l' a
  // 32- / 64-bit integer, 'f' a float32's bits, from values[i]; 'T' the descriptor maps[values[i]].
  std::string kinds;
  std::vector<int64_t> values;
  std::vector<TensorMapSpec> maps;

  // Launched on the slots' addresses (false: it cannot run here, another device being
  // current, or a descriptor the driver would not encode); a dry run records the parameters
  // instead (a descriptor as its address).
  bool run(const std::vector<uint64_t>& slots, const c10::Device& device, Store& store) const {
    const size_t n = kinds.size();
    std::vector<uint64_t> storage(n + 2, 0);
    std::vector<TensorMapBytes> encoded(maps.size());
    std::vector<void*> params(n + 2);
    for (size_t i = 0; i < n; ++i) {
      const char kind = kinds[i];
      params[i] = &storage[i];
      if (kind == 'i' || kind == 'f') {
        const uint32_t v = static_cast<uint32_t>(values[i]);
        std::memcpy(&storage[i], &v, sizeof v);
      } else if (kind == 'l') {
        storage[i] = static_cast<uint64_t>(values[i]);
      } else if (kind == 'T') {
        const size_t j = static_cast<size_t>(values[i]);
        const TensorMapSpec& spec = maps.at(j);
        storage[i] = slots.at(spec.slot);
        if (!store.dry_run) {
          // (a descriptor of the same view at the same address is encoded once: an absent
          // pre or b2 is out's or b's, half of a plain call's six)
          size_t same = 0;
          while (same < j && !(slots.at(maps[same].slot) == storage[i] && maps[same].same_view(spec))) ++same;
          if (same < j) {
            encoded[j] = encoded[same];
          } else if (!spec.encode(&encoded[j], storage[i])) {
            return false;
          }
          params[i] = &encoded[j];
        }
      } else {
        TORCH_CHECK(kind >= '0' && kind <= '9', "fusedkit native launch: parameter kind ", kind);
        storage[i] = slots.at(kind - '0') + static_cast<uint64_t>(values[i]);
      }
    }
    params[n] = &storage[n];          // global scratch
    params[n + 1] = &storage[n + 1];  // profile scratch
    if (store.dry_run) {
      store.last_params.assign(storage.begin(), storage.end());
      return true;
    }
    if (!device.is_cuda()) return false;
    const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    if (guard->getDevice() != device) return false;
    drive(function, grid, block, shared, params, guard, device);
    return true;
  }
};

// A norm's backward launch, learnt from its first backward on the ordinary path
// (runtime.norm.BackwardRecipe): the saved rows' and weight's layouts it read, the partial
// sums' buffer (k, programs, n), weight's first.
struct NormBackwardPlan {
  SlotLaunch launch;
  at::ScalarType rows_dtype, weight_dtype;
  std::vector<int64_t> rows_strides, weight_strides;
  std::vector<int64_t> parts;
  bool zeroed, need_weight, has_bias;
  at::ScalarType dh_dtype;
};

// A repeated norm call with a gradient (runtime.norm.GradRecipe): its forward launch on slots
// (x, residual, weight, bias, y, h, stats), what its node keeps, its backward launches by
// whether a gradient reached h, and the Python backward for everything else.
struct NormRecipe {
  SlotLaunch forward;
  c10::Device device;
  std::vector<int64_t> shape;
  at::ScalarType y_dtype, x_dtype, h_dtype, r_dtype;  // (h's and the residual's: with one)
  bool residual;
  int64_t stats;
  double alpha;
  std::string name;
  py::object fallback;  // (this recipe, dy, dh_out, rows, weight, bias, stats, needs) -> four gradients
  std::array<std::optional<NormBackwardPlan>, 2> backward;

  NormRecipe(SlotLaunch f, c10::Device d) : forward(std::move(f)), device(d) {}
  // (a node can outlive its recipe's table, and be freed on an autograd thread)
  ~NormRecipe() { drop_python(fallback); }
};

bool aligned(const at::Tensor& t) {
  return !t.defined() || reinterpret_cast<uint64_t>(t.data_ptr()) % kAlignment == 0;
}

uint64_t address(const at::Tensor& t) { return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0; }

// The node of a recipe's call (a norm's, a matmul's): named as the recipe says, its saved
// tensors as torch's nodes save them (SavedVariable), released by the engine under a lock
// that unpacking them takes too (release_variables may run on another thread).
template <typename Recipe>
class RecipeNode : public torch::autograd::Node {
 public:
  RecipeNode(std::shared_ptr<Recipe> recipe, std::shared_ptr<Store> store)
      : recipe_(std::move(recipe)), store_(std::move(store)) {}

  std::string name() const override { return recipe_->name; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : saved_) s.reset_data();
  }

  std::vector<torch::autograd::SavedVariable> saved_;

 protected:
  // The saved tensors (undefined past those saved), the lock held while they unpack only: the
  // Python backward of a gradient of the gradient runs this node again, on this thread. Called
  // without the GIL: every path takes this lock before the GIL, never the other way round.
  template <size_t N>
  std::array<at::Tensor, N> unpack() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::array<at::Tensor, N> saved;
    for (size_t i = 0; i < saved_.size() && i < N; ++i) saved[i] = saved_[i].unpack(getptr());
    return saved;
  }

  static py::object wrap(const at::Tensor& t) {
    return t.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(t)) : py::none();
  }

  std::shared_ptr<Recipe> recipe_;
  std::shared_ptr<Store> store_;

 private:
  std::mutex mutex_;
};

// A norm call's autograd node: saves the normalised rows (h, an output, with a residual; else
// x), the parameters and the statistics; its backward is the kept launch where the call's
// gradients are laid out as the learnt one's were, else Python's.
class NormNode : public RecipeNode<NormRecipe> {
 public:
  using RecipeNode::RecipeNode;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // (unpacked before the GIL is taken: the lock, then the GIL, as release_variables takes
    // them when a saved-tensor hook's destructor needs the GIL; a hook's unpack takes it itself)
    const std::array<at::Tensor, 4> saved = unpack<4>();  // rows, weight, bias, stats
    py::gil_scoped_acquire gil;  // the recipe and the Python backward are the GIL's
    const at::Tensor dy = grads.empty() ? at::Tensor() : grads[0];
    const at::Tensor dh_out = grads.size() > 1 ? grads[1] : at::Tensor();
    torch::autograd::variable_list result(4);
    std::array<bool, 4> needs{};
    // (the inputs that take a gradient, as a Python Function's needs_input_grad says)
    for (size_t i = 0; i < 4; ++i) needs[i] = should_compute_output(i);
    if (planned(dy, dh_out, saved, needs, result)) return result;
    python_backward(recipe_->name, result, [&] {
      return recipe_->fallback(py::cast(recipe_), wrap(dy), wrap(dh_out), wrap(saved[0]), wrap(saved[1]),
                               wrap(saved[2]), wrap(saved[3]), py::make_tuple(needs[0], needs[1], needs[2], needs[3]));
    });
    return result;
  }

 private:
  // The kept backward launch into result: only where the Python path would launch it (no
  // gradient of the gradient to record, no dispatch mode or profiler to see it), with the
  // gradients and saved tensors laid out as the launch it learnt read them.
  bool planned(const at::Tensor& dy, const at::Tensor& dh_out, const std::array<at::Tensor, 4>& saved,
               const std::array<bool, 4>& needs, torch::autograd::variable_list& result) {
    const NormRecipe& r = *recipe_;
    if (!dy.defined() || at::GradMode::is_enabled() || !eager_and_unobserved() || !store_->hooks.idle()) return false;
    const auto& found = r.backward[dh_out.defined() ? 1 : 0];
    if (!found) return false;
    const NormBackwardPlan& plan = *found;
    const at::Tensor& rows = saved[0];
    const at::Tensor& weight = saved[1];
    if (needs[2] && weight.defined() && !plan.need_weight) return false;  // (learnt without the weight's)
    for (const at::Tensor* g : {&dy, &dh_out}) {
      const at::ScalarType want = g == &dy ? r.y_dtype : r.h_dtype;  // (the kernel's, as the engine casts them)
      if (g->defined() && (g->scalar_type() != want || !g->is_contiguous() || g->device() != r.device ||
                           !g->sizes().equals(r.shape) || g->is_neg() || g->key_set().has(c10::DispatchKey::Python))) {
        return false;
      }
    }
    // (the saved tensors as the launch read them: a saved-tensor hook may give them back
    // otherwise, another layout, dtype, device or offset)
    const at::Tensor& stats = saved[3];
    if (!rows.defined() || rows.device() != r.device || rows.scalar_type() != plan.rows_dtype ||
        !rows.strides().equals(plan.rows_strides) ||
        (weight.defined() && (weight.device() != r.device || weight.scalar_type() != plan.weight_dtype ||
                              !weight.strides().equals(plan.weight_strides))) ||
        !stats.defined() || stats.device() != r.device || stats.scalar_type() != at::kFloat ||
        !stats.is_contiguous() || stats.numel() != r.stats) {
      return false;
    }
    if (!aligned(dy) || !aligned(dh_out) || !aligned(rows) || !aligned(weight) || !aligned(stats)) return false;
    const auto options = at::TensorOptions().device(r.device);
    at::Tensor dh = at::empty(r.shape, options.dtype(plan.dh_dtype));
    const int64_t k = plan.parts.empty() ? 0 : plan.parts[0];
    at::Tensor parts;
    if (k > 0) {
      parts = plan.zeroed ? at::zeros(plan.parts, options.dtype(at::kFloat)) : at::empty(plan.parts, options.dtype(at::kFloat));
    }
    const std::vector<uint64_t> slots{address(dy), address(rows), address(weight), address(saved[3]),
                                      address(dh_out), address(dh), address(parts)};
    if (!plan.launch.run(slots, r.device, *store_)) return false;
    // (a sum over the programs' rows a parameter, in a fixed order: the same bits every run,
    // and storages of their own, as the Python path's)
    if (plan.need_weight && needs[2]) {
      at::Tensor dw = at::sum(parts.select(0, 0), 0);
      result[2] = weight.scalar_type() == at::kFloat ? dw : dw.to(weight.scalar_type());
    }
    if (plan.has_bias && needs[3]) {
      at::Tensor db = at::sum(parts.select(0, k - 1), 0);
      const at::ScalarType bias_dtype = saved[2].scalar_type();
      result[3] = bias_dtype == at::kFloat ? db : db.to(bias_dtype);
    }
    if (r.residual && needs[1]) {
      at::Tensor dr = r.alpha == 1.0 ? dh : at::mul(dh, c10::Scalar(r.alpha));
      result[1] = dr.scalar_type() == r.r_dtype ? dr : dr.to(r.r_dtype);
    }
    if (needs[0]) result[0] = dh.scalar_type() == r.x_dtype ? dh : dh.to(r.x_dtype);
    return true;
  }
};

// A repeated matmul call (runtime.matmul's kept signature; runtime.native.matmul_recipe):
// its launch on slots (a, b, bias, out, pre), out laid out (lead..., N), and for a call with
// a gradient what its node keeps and runs: the activation's gradient as a kept elementwise
// launch of (grad, saved), then the products and the bias's sum in ATen, as the Python
// backward (library.matmul_backward) runs them; the Python backward for everything else.
struct MatmulRecipe {
  SlotLaunch forward;
  c10::Device device;
  int64_t m = 0, k = 0, n = 0;
  std::vector<int64_t> out_shape;
  at::ScalarType dtype = at::kFloat;
  bool store_pre = false;  // pre (M, N) written beside out, kept for the backward
  int saves = 0;           // what the backward reads besides a and b: 0 nothing, 1 out (ReLU), 2 pre
  bool has_bias = false;
  GradStep act_grad;       // kernel 0: no activation (the gradient passes as it is)
  std::string name;
  py::object fallback;     // (grad (M, N), a, b, saved, needs) -> three gradients, a's as a is shaped

  MatmulRecipe(SlotLaunch f, c10::Device d) : forward(std::move(f)), device(d) {}
  ~MatmulRecipe() { drop_python(fallback, act_grad.kernel_ref); }
};

class MatmulNode : public RecipeNode<MatmulRecipe> {
 public:
  using RecipeNode::RecipeNode;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list result(3);
    if (grads.empty() || !grads[0].defined()) return result;
    std::array<at::Tensor, 3> saved = unpack<3>();  // a, b, then out or pre where saved (before the GIL: NormNode's)
    py::gil_scoped_acquire gil;  // the store and the Python backward are the GIL's
    const MatmulRecipe& r = *recipe_;
    // (the gradient and a saved output as the Python path's 2-D ones: views, the result being
    // laid out (lead..., N))
    at::Tensor grad = grads[0].reshape({r.m, r.n});
    if (saved[2].defined() && saved[2].dim() != 2) saved[2] = saved[2].reshape({r.m, r.n});
    std::array<bool, 3> needs{};
    for (size_t i = 0; i < 3; ++i) needs[i] = should_compute_output(i);
    if (planned(grads, grad, saved, needs, result)) return result;
    python_backward(r.name, result, [&] {
      return r.fallback(wrap(grad), wrap(saved[0]), wrap(saved[1]), wrap(saved[2]),
                        py::make_tuple(needs[0], needs[1], needs[2]));
    });
    return result;
  }

 private:
  // The Python backward's launches, from C++: only where it would launch them (no gradient of
  // the gradient, no dispatch mode or profiler) and the activation's gradient is kept.
  bool planned(torch::autograd::variable_list& grads, at::Tensor& grad, const std::array<at::Tensor, 3>& saved,
               const std::array<bool, 3>& needs, torch::autograd::variable_list& result) {
    const MatmulRecipe& r = *recipe_;
    if (at::GradMode::is_enabled() || !eager_and_unobserved() || !store_->hooks.idle()) return false;
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    for (const at::Tensor* t : {static_cast<const at::Tensor*>(&grad), &a, &b, &saved[2]}) {
      if (t->defined() && (t->device() != r.device || t->is_neg() || t->is_conj() || t->layout() != at::kStrided ||
                           !t->has_storage() || t->key_set().has(c10::DispatchKey::Python))) {
        return false;
      }
    }
    at::Tensor g;
    if (r.act_grad.kernel == 0) {
      g = grad.contiguous();
    } else {
      if (!saved[2].defined()) return false;
      const std::vector<const at::Tensor*> ts{&grad, &saved[2]};
      const GradStep& step = r.act_grad;
      const Launch* l = store_->find(step.kernel, r.device, ts, [&](const Param& p) {
        return p.kind == step.param.kind && p.bits == step.param.bits;
      });
      if (l == nullptr || l->pair) return false;
      g = store_->launch(*l, ts)[0];
      if (!g.defined()) return false;
      if (!g.is_contiguous()) g = g.contiguous();
      // The incoming gradient is read: let it go before the products allocate theirs, as
      // eager's activation node frees it before the linear's node runs (the step's peak
      // would otherwise hold it beside the activation's gradient and a's).
      grad.reset();
      grads[0].reset();
    }
    // (torch.mm as F.linear's backward runs them; the bias's sum as nn.Linear's)
    if (needs[0]) result[0] = at::mm(g, b.t()).reshape(a.sizes());
    if (needs[1]) result[1] = at::mm(a.reshape({r.m, r.k}).t(), g);
    if (needs[2] && r.has_bias) result[2] = g.sum(0);
    return true;
  }
};

class Table {
 public:
  explicit Table(bool dry_run) : store_(std::make_shared<Store>(dry_run)) {}

  void add(Launch launch) {
    uint64_t h = hash_start(launch.kernel, launch.device);
    for (const Operand& op : launch.operands) h = hash_operand(h, op.dtype, op.sizes, op.strides);
    store_->entries[h].push_back(std::move(launch));
    ++store_->size;
  }

  void clear() {
    store_->entries.clear();
    store_->size = 0;
  }

  size_t size() const { return store_->size; }

  // The result of a kept launch of kernel (the registry entry, matched by identity) on
  // operands (a tuple), or None: the Python path's fast checks are made here.
  py::object call(py::handle kernel_spec, py::tuple operands, py::handle param) {
    const size_t n = operands.size();
    if (n == 0 || n > 3 || store_->size == 0 || !eager_and_unobserved() || !store_->hooks.idle()) return py::none();
    const int64_t kernel = reinterpret_cast<int64_t>(kernel_spec.ptr());  // id()
    std::vector<const at::Tensor*> ts;
    ts.reserve(n);
    const bool grad_mode = at::GradMode::is_enabled();
    bool needs_grad = false;
    // A node that saves the operands keeps all of them: right only where every one needs a
    // gradient (else Python keeps those the requested gradients read) and none is an
    // inference tensor (which autograd refuses to save: Python holds it).
    bool keeps_all = true;
    for (size_t i = 0; i < n; ++i) {
      PyObject* obj = operands[i].ptr();
      if (!THPVariable_CheckExact(obj)) return py::none();  // numbers and subclasses: Python
      const at::Tensor& t = THPVariable_Unpack(obj);
      // (wrappers without storage, e.g. a transform's, and lazy negations are Python's)
      if (t.is_neg() || t.is_conj() || !t.has_storage()) return py::none();
      // Forward-mode AD (a dual tensor, with or without requires_grad) is Python's to refuse.
      if (t._fw_grad(/*level=*/0).defined()) return py::none();
      if (grad_mode && t.requires_grad()) needs_grad = true;
      if (!t.requires_grad() || t.is_inference()) keeps_all = false;
      ts.push_back(&t);
    }
    const c10::Device device = ts[0]->device();
    for (const at::Tensor* t : ts) {
      if (t->device() != device) return py::none();
    }
    const Launch* l = store_->find(kernel, device, ts, [&](const Param& p) { return p.matches(param.ptr()); });
    if (l == nullptr || l->pair || (needs_grad && (!l->backward || (l->backward->saves == 2 && !keeps_all)))) {
      return py::none();
    }
    std::shared_ptr<const BackwardSpec> backward = l->backward;  // (l may move while the launch drops the GIL)
    at::Tensor out = store_->launch(*l, ts)[0];
    if (!out.defined()) return py::none();
    if (needs_grad) record(backward, ts, out);
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }

  // The result of a repeated norm call with a gradient (y, or (y, h) with a residual), with
  // its autograd node, or None where the kept launch does not take it: the Python path's
  // checks of the call (its signature matched the recipe's) are made there.
  py::object norm(const std::shared_ptr<NormRecipe>& recipe, py::handle x_obj, py::handle r_obj, py::handle w_obj,
                  py::handle b_obj) {
    std::array<at::Tensor, 4> in;  // x, residual, weight, bias
    bool needs_grad = false;
    if (!take(std::array<py::handle, 4>{x_obj, r_obj, w_obj, b_obj}, recipe->device, in, needs_grad)) {
      return py::none();
    }
    const NormRecipe& r = *recipe;
    const auto options = at::TensorOptions().device(r.device);
    at::Tensor y = at::empty(r.shape, options.dtype(r.y_dtype));
    at::Tensor h = r.residual ? at::empty(r.shape, options.dtype(r.h_dtype)) : at::Tensor();
    at::Tensor stats = at::empty({r.stats}, options.dtype(at::kFloat));
    const std::vector<uint64_t> slots{address(in[0]), address(in[1]), address(in[2]), address(in[3]),
                                      address(y),     address(h),     address(stats)};
    if (!r.forward.run(slots, r.device, *store_)) return py::none();
    if (needs_grad) {
      auto node = NodeFactory<NodeHandle>::template make<NormNode>(recipe, store_);
      node->saved_.reserve(4);
      node->set_next_edges(torch::autograd::collect_next_edges(in[0], in[1], in[2], in[3]));
      torch::autograd::set_history(y, node);
      if (r.residual) torch::autograd::set_history(h, node);
      node->saved_.emplace_back(r.residual ? h : in[0], /*is_output=*/r.residual);
      node->saved_.emplace_back(in[2], false);
      node->saved_.emplace_back(in[3], false);
      node->saved_.emplace_back(stats, false);
    }
    py::object y_py = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
    if (!r.residual) return y_py;
    return py::make_tuple(y_py, py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(h))));
  }

  // The result of a repeated matmul call (out, laid out (lead..., N)), with its autograd node
  // where an operand needs a gradient, or None where the kept launch does not take it: the
  // signature matched the recipe's in Python (runtime.matmul.call_key).
  py::object matmul(const std::shared_ptr<MatmulRecipe>& recipe, py::handle a_obj, py::handle b_obj,
                    py::handle bias_obj) {
    const MatmulRecipe& r = *recipe;
    std::array<at::Tensor, 3> in;  // a, b, bias
    bool needs_grad = false;
    if (!take(std::array<py::handle, 3>{a_obj, b_obj, bias_obj}, r.device, in, needs_grad) ||
        in[2].defined() != r.has_bias) {
      return py::none();
    }
    const auto options = at::TensorOptions().device(r.device).dtype(r.dtype);
    at::Tensor out = at::empty(r.out_shape, options);
    at::Tensor pre = r.store_pre ? at::empty({r.m, r.n}, options) : at::Tensor();
    const uint64_t o = address(out);
    const std::vector<uint64_t> slots{address(in[0]), address(in[1]), in[2].defined() ? address(in[2]) : o, o,
                                      pre.defined() ? address(pre) : o};
    if (!r.forward.run(slots, r.device, *store_)) return py::none();
    if (needs_grad) {
      auto node = NodeFactory<NodeHandle>::template make<MatmulNode>(recipe, store_);
      node->set_next_edges(torch::autograd::collect_next_edges(in[0], in[1], in[2]));
      torch::autograd::set_history(out, node);
      node->saved_.reserve(3);
      node->saved_.emplace_back(in[0], false);
      node->saved_.emplace_back(in[1], false);
      if (r.saves == 1) node->saved_.emplace_back(out, /*is_output=*/true);
      if (r.saves == 2) node->saved_.emplace_back(pre, false);
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }

  std::vector<uint64_t> last_params() const { return store_->last_params; }

  void watch_launch_hooks(py::object runtime, py::object chain_type) {
    store_->hooks = LaunchHooks{runtime.is_none() ? py::object() : std::move(runtime),
                                chain_type.is_none() ? py::object() : std::move(chain_type)};
  }

 private:
  // A recipe call's operands (None: absent) into in, and whether autograd records the call;
  // false where the kept launch does not take them (Python's: no eager call unobserved, a
  // non-tensor, a wrapper without storage, a misaligned or dual tensor, another device, or
  // another device current). The call's key in Python holds the classes.
  template <size_t N>
  bool take(const std::array<py::handle, N>& objs, const c10::Device& device, std::array<at::Tensor, N>& in,
            bool& needs_grad) const {
    if (!eager_and_unobserved() || !store_->hooks.idle()) return false;
    const bool grad_mode = at::GradMode::is_enabled();
    for (size_t i = 0; i < N; ++i) {
      if (objs[i].is_none()) continue;
      if (!THPVariable_Check(objs[i].ptr())) return false;
      in[i] = THPVariable_Unpack(objs[i].ptr());
      if (!in[i].has_storage() || !aligned(in[i]) || in[i].device() != device ||
          in[i]._fw_grad(/*level=*/0).defined()) {
        return false;
      }
      needs_grad = needs_grad || (grad_mode && in[i].requires_grad());
    }
    // (Python launches under the right device)
    return store_->dry_run ||
           (device.is_cuda() && c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice() == device);
  }

  // The result's autograd node: its edges to the operands, and what the kernel's backward
  // reads saved as torch's own nodes save it (version-checked, through saved-tensor hooks,
  // released after a backward without retain_graph).
  void record(const std::shared_ptr<const BackwardSpec>& backward, const std::vector<const at::Tensor*>& ts,
              const at::Tensor& out) {
    torch::autograd::variable_list inputs;
    inputs.reserve(ts.size());
    for (const at::Tensor* t : ts) inputs.push_back(*t);
    auto node = NodeFactory<NodeHandle>::template make<KeptBackward>(backward, store_);
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    torch::autograd::set_history(out, node);
    if (backward->saves == 1) {
      node->saved_.emplace_back(out, /*is_output=*/true);
    } else if (backward->saves == 2) {
      for (const at::Tensor& t : inputs) node->saved_.emplace_back(t, /*is_output=*/false);
    }
  }

  std::shared_ptr<Store> store_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NormRecipe, std::shared_ptr<NormRecipe>>(m, "NormRecipe")
      .def("set_backward",
           [](NormRecipe& r, bool given, uint64_t function, unsigned grid, unsigned block, unsigned shared,
              std::string kinds, std::vector<int64_t> values, at::ScalarType rows_dtype, at::ScalarType weight_dtype,
              std::vector<int64_t> rows_strides, std::vector<int64_t> weight_strides, std::vector<int64_t> parts,
              bool zeroed, bool need_weight, bool has_bias, at::ScalarType dh_dtype) {
             TORCH_CHECK(kinds.size() == values.size(), "kinds and values differ in length");
             r.backward[given ? 1 : 0] = NormBackwardPlan{
                 SlotLaunch{function, grid, block, shared, std::move(kinds), std::move(values)},
                 rows_dtype, weight_dtype, std::move(rows_strides), std::move(weight_strides), std::move(parts),
                 zeroed, need_weight, has_bias, dh_dtype};
           })
      .def("has_backward", [](const NormRecipe& r, bool given) { return r.backward[given ? 1 : 0].has_value(); });
  py::class_<MatmulRecipe, std::shared_ptr<MatmulRecipe>>(m, "MatmulRecipe");
  py::class_<Table>(m, "Table")
      .def(py::init<bool>(), py::arg("dry_run") = false)
      .def("add",
           [](Table& table, int64_t kernel, c10::Device device, std::vector<std::tuple<at::ScalarType,
              std::vector<int64_t>, std::vector<int64_t>>> operands, int param_kind, int64_t param_bits,
              std::vector<int64_t> out_sizes, std::vector<int64_t> out_strides, at::ScalarType out_dtype,
              uint64_t function, unsigned grid, unsigned block, unsigned shared, std::string kinds,
              std::vector<int64_t> values, py::object backward, int saves, std::string name,
              std::vector<std::tuple<py::object, int, int64_t, int>> plan) {
             TORCH_CHECK(kinds.size() == values.size(), "kinds and values differ in length");
             TORCH_CHECK(saves >= 0 && saves <= 2, "saves must be 0, 1 or 2");
             const bool pair = kinds.find('p') != std::string::npos;
             Launch l{kernel, device, {}, Param{param_kind, param_bits}, std::move(out_sizes),
                      std::move(out_strides), out_dtype, function, grid, block, shared, std::move(kinds),
                      std::move(values), pair, nullptr};
             std::vector<GradStep> steps;
             for (auto& [step_kernel, kind, bits, output] : plan) {  // (None: the operand gets no gradient)
               TORCH_CHECK(output == 0 || output == 1, "a step's output must be 0 or 1");
               const int64_t id = step_kernel.is_none() ? 0 : reinterpret_cast<int64_t>(step_kernel.ptr());
               steps.push_back(GradStep{id, Param{kind, bits}, output, step_kernel});
             }
             if (!backward.is_none()) {
               l.backward = std::make_shared<const BackwardSpec>(backward, saves, name, std::move(steps));
             }
             for (auto& [dtype, sizes, strides] : operands) l.operands.push_back(Operand{dtype, sizes, strides});
             table.add(std::move(l));
           })
      .def("call", &Table::call)
      .def("norm", &Table::norm)
      .def("norm_recipe",
           [](Table&, uint64_t function, unsigned grid, unsigned block, unsigned shared, std::string kinds,
              std::vector<int64_t> values, c10::Device device, std::vector<int64_t> shape, at::ScalarType y_dtype,
              at::ScalarType x_dtype, bool residual, at::ScalarType h_dtype, at::ScalarType r_dtype, int64_t stats,
              double alpha, std::string name, py::object fallback) {
             TORCH_CHECK(kinds.size() == values.size(), "kinds and values differ in length");
             auto r = std::make_shared<NormRecipe>(
                 SlotLaunch{function, grid, block, shared, std::move(kinds), std::move(values)}, device);
             r->shape = std::move(shape);
             r->y_dtype = y_dtype;
             r->x_dtype = x_dtype;
             r->residual = residual;
             r->h_dtype = h_dtype;
             r->r_dtype = r_dtype;
             r->stats = stats;
             r->alpha = alpha;
             r->name = std::move(name);
             r->fallback = std::move(fallback);
             return r;
           })
      .def("matmul", &Table::matmul)
      .def("matmul_recipe",
           [](Table&, uint64_t function, unsigned grid, unsigned block, unsigned shared, std::string kinds,
              std::vector<int64_t> values,
              std::vector<std::tuple<int, int, int, int, std::array<uint32_t, 2>, std::array<uint64_t, 2>, uint64_t>> maps,
              c10::Device device, int64_t m, int64_t k, int64_t n, std::vector<int64_t> out_shape, at::ScalarType dtype,
              bool store_pre, int saves, bool has_bias, py::object act_grad, int act_kind, int64_t act_bits,
              std::string name, py::object fallback) {
             TORCH_CHECK(kinds.size() == values.size(), "kinds and values differ in length");
             TORCH_CHECK(saves >= 0 && saves <= 2, "saves must be 0, 1 or 2");
             SlotLaunch launch{function, grid, block, shared, std::move(kinds), std::move(values), {}};
             for (auto& [slot, swizzle, elem_size, elem_type, box, dims, row_bytes] : maps) {
               launch.maps.push_back(TensorMapSpec{slot, swizzle, elem_size, elem_type, box, dims, row_bytes});
             }
             auto r = std::make_shared<MatmulRecipe>(std::move(launch), device);
             r->m = m;
             r->k = k;
             r->n = n;
             r->out_shape = std::move(out_shape);
             r->dtype = dtype;
             r->store_pre = store_pre;
             r->saves = saves;
             r->has_bias = has_bias;
             const int64_t id = act_grad.is_none() ? 0 : reinterpret_cast<int64_t>(act_grad.ptr());
             r->act_grad = GradStep{id, Param{act_kind, act_bits}, 0, act_grad};
             r->name = std::move(name);
             r->fallback = std::move(fallback);
             return r;
           })
      .def("clear", &Table::clear)
      .def("__len__", &Table::size)
      .def("last_params", &Table::last_params)
      .def("watch_launch_hooks", &Table::watch_launch_hooks);
}
