// Large Model Support is CUDA-only; ROCm builds, which compile a hipified
// copy of this file, leave it out.
#ifndef USE_ROCM

#include <torch/csrc/cuda/LmsBindings.h>

#include <ATen/cuda/LmsPinning.h>
#include <ATen/cuda/LmsRecipes.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/device_lazy_init.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch::cuda::lms {

namespace {

namespace py = pybind11;
namespace engine = c10::cuda::lms;

int64_t asInt(size_t bytes) {
  return static_cast<int64_t>(bytes);
}

// A counter of LmsStats as the stats dict holds it: an int, or a float for
// the milliseconds.
int64_t counterValue(int64_t count) {
  return count;
}

double counterValue(double ms) {
  return ms;
}

int64_t counterValue(size_t bytes) {
  return asInt(bytes);
}

py::dict gaugeToDict(const engine::LmsStat& stat) {
  py::dict dict;
  dict["current"] = stat.current;
  dict["peak"] = stat.peak;
  return dict;
}

c10::StorageImpl& storageOf(const at::Tensor& tensor, const char* function) {
  TORCH_CHECK_VALUE(tensor.defined(), function, ": expected a defined tensor");
  TORCH_CHECK_VALUE(
      tensor.has_storage(),
      function,
      ": the tensor has no storage (sparse, nested or a tensor subclass "
      "without data)");
  return *tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
}

// The pins of one compiled kernel launch (see at::cuda::lms::LaunchPins),
// held by Python until the launch has been queued. A type of this file's own,
// so that the Python class has this file's visibility.
struct LaunchPinsHandle {
  at::cuda::lms::LaunchPins pins;
};

std::unique_ptr<LaunchPinsHandle> pinForLaunch(
    const std::vector<at::Tensor>& tensors,
    const std::string& kernel) {
  auto handle = std::make_unique<LaunchPinsHandle>();
  handle->pins.pin(tensors, kernel.c_str());
  return handle;
}

// How the bindings pass a setting of each kind (Bool, Mebibytes, Count,
// Seconds, Path: see
// LargeModelSupportSettingTable.h) between Python and the engine, checking
// the value before it reaches the engine.
struct BoolSetting {
  using Python = bool;
  using Engine = bool;
  static bool toEngine(bool enabled, const char* /*what*/) {
    return enabled;
  }
  static bool toPython(bool enabled) {
    return enabled;
  }
};

struct MebibytesSetting {
  using Python = int64_t;
  using Engine = size_t;
  static size_t toEngine(int64_t bytes, const char* what) {
    return checkedBytes(bytes, what);
  }
  static int64_t toPython(size_t bytes) {
    return asInt(bytes);
  }
};

struct CountSetting {
  using Python = int64_t;
  using Engine = int;
  static int toEngine(int64_t count, const char* what) {
    TORCH_CHECK_VALUE(
        count >= 0 && count <= std::numeric_limits<int>::max(),
        "Large Model Support: ",
        what,
        " must be between 0 and ",
        std::to_string(std::numeric_limits<int>::max()),
        ", got ",
        std::to_string(count));
    return static_cast<int>(count);
  }
  static int64_t toPython(int count) {
    return count;
  }
};

struct SecondsSetting {
  using Python = double;
  using Engine = double;
  static double toEngine(double seconds, const char* what) {
    TORCH_CHECK_VALUE(
        seconds >= 0 && seconds < 1e9,
        "Large Model Support: ",
        what,
        " must be between 0 and 1e9 seconds, got ",
        std::to_string(seconds));
    return seconds;
  }
  static double toPython(double seconds) {
    return seconds;
  }
};

// A path goes to the engine as given: its setter says what is wrong with
// it (a missing or unwritable directory), naming the setting.
struct PathSetting {
  using Python = std::string;
  using Engine = std::string;
  static std::string toEngine(const std::string& path, const char* /*what*/) {
    return path;
  }
  static std::string toPython(const std::string& path) {
    return path;
  }
};

// _cuda_lms_set<Camel>() and _cuda_lms_get<Camel>() of every setting. A
// device setting's getter initializes CUDA first: until set, a device's
// value is measured from the device, which needs the caching allocator (the
// engine's backend).
namespace settings {
#define C10_LMS_SETTING(stem, Camel, key, Kind, type, setter, getter, what) \
  static_assert(std::is_same_v<Kind##Setting::Engine, type>);               \
  void set##Camel(Kind##Setting::Python value) {                            \
    engine::setter(Kind##Setting::toEngine(value, what));                   \
  }                                                                         \
  Kind##Setting::Python get##Camel() {                                      \
    return Kind##Setting::toPython(engine::getter());                       \
  }
#define C10_LMS_DEVICE_SETTING(                                       \
    stem, Camel, key, Kind, type, setter, getter, what, conf_setter)  \
  static_assert(std::is_same_v<Kind##Setting::Engine, type>);         \
  void set##Camel(int64_t device, Kind##Setting::Python value) {      \
    engine::setter(                                                   \
        checkedDevice(device), Kind##Setting::toEngine(value, what)); \
  }                                                                   \
  Kind##Setting::Python get##Camel(int64_t device) {                  \
    const c10::DeviceIndex index = checkedDevice(device);             \
    torch::utils::device_lazy_init(at::kCUDA);                        \
    return Kind##Setting::toPython(engine::getter(index));            \
  }
#include <c10/cuda/LargeModelSupportSettingTable.h>
} // namespace settings

void resetSchedule() {
  engine::resetSchedule();
}

int64_t reclaimInactive(int64_t device) {
  return asInt(engine::reclaimInactive(checkedDevice(device)));
}

py::dict stats(int64_t device) {
  return statsToDict(engine::getStats(checkedDevice(device)));
}

void resetPeakStats(int64_t device) {
  engine::resetPeakStats(checkedDevice(device));
}

void resetAccumulatedStats(int64_t device) {
  at::cuda::lms::recipes::resetOperatorCounts(checkedDevice(device));
  engine::resetAccumulatedStats(checkedDevice(device));
}

std::string storageState(const at::Tensor& tensor) {
  return engine::toString(
      engine::getState(storageOf(tensor, "_cuda_lms_storageState")));
}

void access(const at::Tensor& tensor) {
  engine::access(storageOf(tensor, "_cuda_lms_access"));
}

// Gives the storage of `tensor` memory of its own from the device's caching
// allocator, holding the same bytes. For outputs of CUDA graphs that the
// program holds: their storages own nothing, their memory is the graph pool's,
// and the pool of an idle graph tree can go back to the device only once
// nothing in it is used (torch/cuda/_lms_cudagraphs.py). The copy runs on the
// current stream, which is synchronized before the storage changes hands: the
// pool's memory goes to others as soon as the tree's graphs are dropped.
void moveOutOfPool(const at::Tensor& tensor) {
  c10::StorageImpl& storage = storageOf(tensor, "_cuda_lms_moveOutOfPool");
  TORCH_CHECK_VALUE(
      storage.device_type() == c10::DeviceType::CUDA,
      "_cuda_lms_moveOutOfPool: expected a CUDA tensor, got one on ",
      storage.device().str());
  const size_t nbytes = storage.nbytes();
  const c10::cuda::CUDAGuard guard(storage.device());
  c10::DataPtr fresh = c10::cuda::CUDACachingAllocator::get()->allocate(nbytes);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (nbytes > 0) {
    C10_CUDA_CHECK(cudaMemcpyAsync(
        fresh.get(),
        storage.data_ptr().get(),
        nbytes,
        cudaMemcpyDeviceToDevice,
        stream));
  }
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  storage.set_data_ptr_noswap(std::move(fresh));
}

int64_t pageInAhead(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::StorageImpl*> storages;
  storages.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) {
    if (tensor.defined() && tensor.has_storage() && tensor.is_cuda()) {
      storages.push_back(tensor.unsafeGetTensorImpl()
                             ->unsafe_storage()
                             .unsafeGetStorageImpl());
    }
  }
  return asInt(engine::pageInAhead(storages));
}

// The Python function that gives memory outside LMS back to the device when
// no page-out makes room (torch/cuda/_lms_cudagraphs.py: the pools of idle
// CUDA graph trees), called as release(device, size) -> (released, note). A
// strong reference, never dropped at exit: the engine may call it from any
// thread until the interpreter is gone.
PyObject* g_outside_releaser = nullptr;

bool interpreterRunning() {
  if (!Py_IsInitialized()) {
    return false;
  }
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

// The engine's releaser (engine::setOutsideMemoryReleaser). It takes the GIL
// from the allocating thread as PyTorch's out-of-memory observers do, with no
// allocator or engine lock held. An error of the Python side is reported as
// unraisable and counts as nothing given back: the allocation then fails as
// it would have.
bool releaseOutside(c10::DeviceIndex device, size_t size, std::string& note) {
  if (!interpreterRunning()) {
    return false;
  }
  py::gil_scoped_acquire gil;
  if (g_outside_releaser == nullptr) {
    return false;
  }
  try {
    auto release = py::reinterpret_borrow<py::object>(g_outside_releaser);
    auto [released, text] = release(static_cast<int>(device), size)
                                .cast<std::tuple<bool, std::string>>();
    note = std::move(text);
    return released;
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable(
        "Large Model Support: releasing memory outside LMS");
  } catch (const py::cast_error&) {
    note =
        "(The release of memory outside LMS returned something other than "
        "(bool, str).)";
  }
  return false;
}

void registerOutsideReleaser(const py::object& release) {
  TORCH_CHECK_TYPE(
      release.is_none() || PyCallable_Check(release.ptr()),
      "Large Model Support: expected a callable or None");
  PyObject* previous = g_outside_releaser;
  if (release.is_none()) {
    engine::setOutsideMemoryReleaser(nullptr);
    g_outside_releaser = nullptr;
  } else {
    g_outside_releaser = release.inc_ref().ptr();
    engine::setOutsideMemoryReleaser(&releaseOutside);
  }
  Py_XDECREF(previous);
}

py::dict recomputeOperators(int64_t device) {
  py::dict out;
  for (const auto& [name, counts] :
       at::cuda::lms::recipes::operatorCounts(checkedDevice(device))) {
    py::dict entry;
    entry["drop_count"] = counts.drops;
    entry["drop_bytes"] = counts.drop_bytes;
    entry["recompute_count"] = counts.recomputes;
    entry["recompute_bytes"] = counts.recompute_bytes;
    out[py::str(name)] = entry;
  }
  return out;
}

} // namespace

// The Python layer (torch/cuda/lms.py) validates arguments with friendlier
// messages; these checks keep direct callers of the bindings from reaching
// the engine with out-of-range values.
c10::DeviceIndex checkedDevice(int64_t device) {
  const int64_t count = c10::cuda::device_count();
  TORCH_CHECK_VALUE(
      device >= 0 && device < count,
      "Large Model Support: invalid CUDA device index ",
      std::to_string(device),
      " (",
      std::to_string(count),
      " CUDA device(s) visible)");
  return static_cast<c10::DeviceIndex>(device);
}

size_t checkedBytes(int64_t bytes, const char* what) {
  TORCH_CHECK_VALUE(
      bytes >= 0,
      "Large Model Support: ",
      what,
      " must be a non-negative number of bytes, got ",
      std::to_string(bytes));
  return static_cast<size_t>(bytes);
}

py::dict statsToDict(const engine::LmsStats& stats) {
  // An entry for each row of LargeModelSupportStatTable.h, under its name.
  py::dict dict;
#define C10_LMS_COUNTER(type, name) dict[#name] = counterValue(stats.name);
#define C10_LMS_GAUGE(name) dict[#name] = gaugeToDict(stats.name);
#include <c10/cuda/LargeModelSupportStatTable.h>
  return dict;
}

void initLmsBindings(PyObject* module) {
  auto m = py::reinterpret_borrow<py::module_>(module);
  // wrap_pybind_function: c10 errors become the matching Python exceptions
  // (ValueError, torch.OutOfMemoryError, ...) and TORCH_WARN a Python
  // warning. Functions that may wait for copies release the GIL. Each
  // setting's setter and getter come from LargeModelSupportSettingTable.h.
#define C10_LMS_SETTING(stem, Camel, ...)                  \
  m.def(                                                   \
      "_cuda_lms_set" #Camel,                              \
      torch::wrap_pybind_function(&settings::set##Camel)); \
  m.def(                                                   \
      "_cuda_lms_get" #Camel,                              \
      torch::wrap_pybind_function(&settings::get##Camel));
#define C10_LMS_DEVICE_SETTING C10_LMS_SETTING
#include <c10/cuda/LargeModelSupportSettingTable.h>
  m.def("_cuda_lms_resetSchedule", torch::wrap_pybind_function(&resetSchedule));
  m.def(
      "_cuda_lms_reclaimInactive",
      torch::wrap_pybind_function_no_gil(&reclaimInactive));
  m.def("_cuda_lms_stats", torch::wrap_pybind_function(&stats));
  m.def(
      "_cuda_lms_resetPeakStats", torch::wrap_pybind_function(&resetPeakStats));
  m.def(
      "_cuda_lms_resetAccumulatedStats",
      torch::wrap_pybind_function_no_gil(&resetAccumulatedStats));
  m.def("_cuda_lms_storageState", torch::wrap_pybind_function(&storageState));
  m.def("_cuda_lms_access", torch::wrap_pybind_function_no_gil(&access));
  m.def(
      "_cuda_lms_moveOutOfPool",
      torch::wrap_pybind_function_no_gil(&moveOutOfPool));
  py::class_<LaunchPinsHandle>(m, "_CudaLmsLaunchPins")
      .def(
          "release",
          torch::wrap_pybind_function_no_gil(
              [](LaunchPinsHandle& handle) { handle.pins.release(); }));
  m.def(
      "_cuda_lms_pinForLaunch",
      torch::wrap_pybind_function_no_gil(&pinForLaunch));
  m.def(
      "_cuda_lms_pageInAhead",
      torch::wrap_pybind_function_no_gil(&pageInAhead));
  m.def(
      "_cuda_lms_registerOutsideReleaser",
      torch::wrap_pybind_function(&registerOutsideReleaser));
  m.def(
      "_cuda_lms_recomputeOperators",
      torch::wrap_pybind_function(&recomputeOperators));
  m.def(
      "_cuda_lms_beginGraphPoolStep",
      torch::wrap_pybind_function(&engine::beginGraphPoolStep));
  m.def(
      "_cuda_lms_endGraphPoolStep",
      torch::wrap_pybind_function(&engine::endGraphPoolStep));
}

} // namespace torch::cuda::lms

#endif // USE_ROCM
