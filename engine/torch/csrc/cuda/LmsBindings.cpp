// Large Model Support is CUDA-only; ROCm builds, which compile a hipified
// copy of this file, leave it out.
#ifndef USE_ROCM

#include <torch/csrc/cuda/LmsBindings.h>

#include <ATen/cuda/LmsPinning.h>
#include <ATen/cuda/LmsRecipes.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/device_lazy_init.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace torch::cuda::lms {

namespace {

namespace py = pybind11;
namespace engine = c10::cuda::lms;

int64_t asInt(size_t bytes) {
  return static_cast<int64_t>(bytes);
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

void setEnabled(bool enabled) {
  engine::setEnabled(enabled);
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

bool getEnabled() {
  return engine::isEnabled();
}

void setLimit(int64_t device, int64_t bytes) {
  engine::setLimit(checkedDevice(device), checkedBytes(bytes, "the limit"));
}

int64_t getLimit(int64_t device) {
  const c10::DeviceIndex index = checkedDevice(device);
  // Until set, the limit is measured from the device's memory, which needs
  // the caching allocator (the engine's backend) to be initialized.
  torch::utils::device_lazy_init(at::kCUDA);
  return asInt(engine::getLimit(index));
}

void setSize(int64_t bytes) {
  engine::setSizeThreshold(checkedBytes(bytes, "the size threshold"));
}

int64_t getSize() {
  return asInt(engine::getSizeThreshold());
}

void setPrefetch(int64_t depth) {
  TORCH_CHECK_VALUE(
      depth >= 0 && depth <= std::numeric_limits<int>::max(),
      "Large Model Support: the prefetch depth must be between 0 and ",
      std::to_string(std::numeric_limits<int>::max()),
      ", got ",
      std::to_string(depth));
  engine::setPrefetchDepth(static_cast<int>(depth));
}

int64_t getPrefetch() {
  return engine::getPrefetchDepth();
}

void setSpeculative(int64_t bytes) {
  engine::setSpeculativeMargin(
      checkedBytes(bytes, "the speculative page-out margin"));
}

int64_t getSpeculative() {
  return asInt(engine::getSpeculativeMargin());
}

void setSchedule(bool enabled) {
  engine::setScheduleEnabled(enabled);
}

bool getSchedule() {
  return engine::isScheduleEnabled();
}

void setPacking(bool enabled) {
  engine::setPackingEnabled(enabled);
}

bool getPacking() {
  return engine::isPackingEnabled();
}

void setHostPlacement(bool enabled) {
  engine::setHostPlacementEnabled(enabled);
}

bool getHostPlacement() {
  return engine::isHostPlacementEnabled();
}

void setLookahead(int64_t operators) {
  TORCH_CHECK_VALUE(
      operators >= 0 && operators <= std::numeric_limits<int>::max(),
      "Large Model Support: the lookahead must be between 0 and ",
      std::to_string(std::numeric_limits<int>::max()),
      " operators, got ",
      std::to_string(operators));
  engine::setLookahead(static_cast<int>(operators));
}

int64_t getLookahead() {
  return engine::getLookahead();
}

void setPrefetchBudget(int64_t bytes) {
  engine::setPrefetchBudget(checkedBytes(bytes, "the prefetch budget"));
}

int64_t getPrefetchBudget() {
  return asInt(engine::getPrefetchBudget());
}

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

void setGraphPrefetch(bool enabled) {
  engine::setGraphPrefetchEnabled(enabled);
}

bool getGraphPrefetch() {
  return engine::isGraphPrefetchEnabled();
}

void setHostLimit(int64_t bytes) {
  engine::setHostLimit(checkedBytes(bytes, "the host limit"));
}

int64_t getHostLimit() {
  return asInt(engine::getHostLimit());
}

void setRecompute(bool enabled) {
  engine::setRecomputeEnabled(enabled);
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

bool getRecompute() {
  return engine::isRecomputeEnabled();
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
  py::dict dict;
  dict["pageout_count"] = stats.pageout_count;
  dict["pageout_bytes"] = stats.pageout_bytes;
  dict["pagein_count"] = stats.pagein_count;
  dict["pagein_bytes"] = stats.pagein_bytes;
  dict["reclaim_limit"] = stats.reclaim_limit;
  dict["reclaim_speculative"] = stats.reclaim_speculative;
  dict["reclaim_alloc_failure"] = stats.reclaim_alloc_failure;
  dict["reclaim_explicit"] = stats.reclaim_explicit;
  dict["pack_count"] = stats.pack_count;
  dict["pack_bytes"] = stats.pack_bytes;
  dict["workspace_releases"] = stats.workspace_releases;
  dict["fragment_reclaims"] = stats.fragment_reclaims;
  dict["host_placement_count"] = stats.host_placement_count;
  dict["host_placement_bytes"] = stats.host_placement_bytes;
  dict["alloc_from_cache"] = stats.alloc_from_cache;
  dict["alloc_from_device"] = stats.alloc_from_device;
  dict["alloc_after_reclaim"] = stats.alloc_after_reclaim;
  dict["prefetch_count"] = stats.prefetch_count;
  dict["prefetch_hits"] = stats.prefetch_hits;
  dict["prefetch_late"] = stats.prefetch_late;
  dict["pagein_demand_count"] = stats.pagein_demand_count;
  dict["schedule_active"] = stats.schedule_active;
  dict["schedule_period"] = stats.schedule_period;
  dict["schedule_detections"] = stats.schedule_detections;
  dict["schedule_fallbacks"] = stats.schedule_fallbacks;
  dict["schedule_victims"] = stats.schedule_victims;
  dict["schedule_prefetch_count"] = stats.schedule_prefetch_count;
  dict["schedule_rescues"] = stats.schedule_rescues;
  dict["schedule_prefetch_budget_bytes"] = stats.schedule_prefetch_budget_bytes;
  dict["early_pageout_count"] = stats.early_pageout_count;
  dict["early_pageout_bytes"] = stats.early_pageout_bytes;
  dict["peak_pageout_count"] = stats.peak_pageout_count;
  dict["peak_pageout_bytes"] = stats.peak_pageout_bytes;
  dict["graph_prefetch_count"] = stats.graph_prefetch_count;
  dict["graph_prefetch_bytes"] = stats.graph_prefetch_bytes;
  dict["graph_pageout_count"] = stats.graph_pageout_count;
  dict["stall_ms"] = stats.stall_ms;
  dict["copy_out_bytes"] = stats.copy_out_bytes;
  dict["copy_out_ms"] = stats.copy_out_ms;
  dict["copy_in_bytes"] = stats.copy_in_bytes;
  dict["copy_in_ms"] = stats.copy_in_ms;
  dict["drop_count"] = stats.drop_count;
  dict["drop_bytes"] = stats.drop_bytes;
  dict["recompute_count"] = stats.recompute_count;
  dict["recompute_bytes"] = stats.recompute_bytes;
  dict["recompute_ms"] = stats.recompute_ms;
  dict["recompute_input_prefetch_count"] = stats.recompute_input_prefetch_count;
  dict["recompute_input_prefetch_bytes"] = stats.recompute_input_prefetch_bytes;
  dict["oom_count"] = stats.oom_count;
  dict["pin_failures"] = stats.pin_failures;
  dict["cache_releases"] = stats.cache_releases;
  dict["host_budget_bytes"] = stats.host_budget_bytes;
  dict["host_ledger_bytes"] = stats.host_ledger_bytes;
  dict["host_refusals"] = stats.host_refusals;
  dict["limit_bytes"] = asInt(stats.limit_bytes);
  dict["managed_bytes"] = gaugeToDict(stats.managed_bytes);
  dict["active_bytes"] = gaugeToDict(stats.active_bytes);
  dict["inactive_bytes"] = gaugeToDict(stats.inactive_bytes);
  dict["pagedout_bytes"] = gaugeToDict(stats.pagedout_bytes);
  dict["dropped_bytes"] = gaugeToDict(stats.dropped_bytes);
  dict["host_bytes"] = gaugeToDict(stats.host_bytes);
  dict["over_limit_bytes"] = gaugeToDict(stats.over_limit_bytes);
  dict["operator_output_bytes"] = gaugeToDict(stats.operator_output_bytes);
  dict["private_pool_bytes"] = gaugeToDict(stats.private_pool_bytes);
  return dict;
}

void initLmsBindings(PyObject* module) {
  auto m = py::reinterpret_borrow<py::module_>(module);
  // wrap_pybind_function: c10 errors become the matching Python exceptions
  // (ValueError, torch.OutOfMemoryError, ...) and TORCH_WARN a Python
  // warning. Functions that may wait for copies release the GIL.
  m.def("_cuda_lms_setEnabled", torch::wrap_pybind_function(&setEnabled));
  m.def("_cuda_lms_getEnabled", torch::wrap_pybind_function(&getEnabled));
  m.def("_cuda_lms_setLimit", torch::wrap_pybind_function(&setLimit));
  m.def("_cuda_lms_getLimit", torch::wrap_pybind_function(&getLimit));
  m.def("_cuda_lms_setSize", torch::wrap_pybind_function(&setSize));
  m.def("_cuda_lms_getSize", torch::wrap_pybind_function(&getSize));
  m.def("_cuda_lms_setPrefetch", torch::wrap_pybind_function(&setPrefetch));
  m.def("_cuda_lms_getPrefetch", torch::wrap_pybind_function(&getPrefetch));
  m.def(
      "_cuda_lms_setSpeculative", torch::wrap_pybind_function(&setSpeculative));
  m.def(
      "_cuda_lms_getSpeculative", torch::wrap_pybind_function(&getSpeculative));
  m.def("_cuda_lms_setSchedule", torch::wrap_pybind_function(&setSchedule));
  m.def("_cuda_lms_getSchedule", torch::wrap_pybind_function(&getSchedule));
  m.def("_cuda_lms_setPacking", torch::wrap_pybind_function(&setPacking));
  m.def("_cuda_lms_getPacking", torch::wrap_pybind_function(&getPacking));
  m.def(
      "_cuda_lms_setHostPlacement",
      torch::wrap_pybind_function(&setHostPlacement));
  m.def(
      "_cuda_lms_getHostPlacement",
      torch::wrap_pybind_function(&getHostPlacement));
  m.def("_cuda_lms_setLookahead", torch::wrap_pybind_function(&setLookahead));
  m.def("_cuda_lms_getLookahead", torch::wrap_pybind_function(&getLookahead));
  m.def(
      "_cuda_lms_setPrefetchBudget",
      torch::wrap_pybind_function(&setPrefetchBudget));
  m.def(
      "_cuda_lms_getPrefetchBudget",
      torch::wrap_pybind_function(&getPrefetchBudget));
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
      "_cuda_lms_setGraphPrefetch",
      torch::wrap_pybind_function(&setGraphPrefetch));
  m.def(
      "_cuda_lms_getGraphPrefetch",
      torch::wrap_pybind_function(&getGraphPrefetch));
  m.def("_cuda_lms_setHostLimit", torch::wrap_pybind_function(&setHostLimit));
  m.def("_cuda_lms_getHostLimit", torch::wrap_pybind_function(&getHostLimit));
  m.def("_cuda_lms_setRecompute", torch::wrap_pybind_function(&setRecompute));
  m.def("_cuda_lms_getRecompute", torch::wrap_pybind_function(&getRecompute));
  m.def(
      "_cuda_lms_recomputeOperators",
      torch::wrap_pybind_function(&recomputeOperators));
}

} // namespace torch::cuda::lms

#endif // USE_ROCM
