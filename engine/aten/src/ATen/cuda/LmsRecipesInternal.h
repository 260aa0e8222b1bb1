#pragma once

// Not a public header: what the two halves of the recipes of Large Model
// Support's recompute (LmsRecipes.h) share, in namespace detail. Only those
// two files include it:
//   LmsRecipes.cpp       capture: at operator boundaries, which operators may
//                        be recipes and what a recipe holds of them (its
//                        arguments, the in-place and cast steps that extend
//                        it, its timing); recomputing before a write to an
//                        input; the operator counts
//   LmsRecipeReplay.cpp  replay: the engine's recompute hooks (pricing a
//                        recompute, keeping a dropped storage's inputs
//                        alive, replaying its recipe, forgetting it)
//
// The shared state (the recipes, the dependents of dropped storages, the
// counts, the replay depth) and the helpers both use have one definition, in
// LmsRecipes.cpp, and are declared extern below.

// Large Model Support is CUDA-only; ROCm builds, which hipify a copy of this
// file, leave it out.
#ifndef USE_ROCM

#include <ATen/cuda/LmsRecipes.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/intrusive_ptr.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace at::cuda::lms::recipes {

namespace detail {

// Recipes being replayed on this thread (replaying()).
extern thread_local int t_replaying;

// Timing events, reused; an event belongs to the device it was created on.
class Events {
 public:
  cudaEvent_t get(c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[device];
      if (!free.empty()) {
        cudaEvent_t event = free.back();
        free.pop_back();
        return event;
      }
    }
    const c10::DeviceIndex previous = c10::cuda::ExchangeDevice(device);
    cudaEvent_t event = nullptr;
    const cudaError_t err = cudaEventCreate(&event);
    c10::cuda::ExchangeDevice(previous);
    C10_CUDA_CHECK(err);
    return event;
  }
  void put(c10::DeviceIndex device, cudaEvent_t event) {
    if (event != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      free_[device].push_back(event);
    }
  }

 private:
  std::mutex mutex_;
  std::unordered_map<c10::DeviceIndex, std::vector<cudaEvent_t>> free_;
};

Events& events();

using StorageStrong = c10::intrusive_ptr<c10::StorageImpl>;
using StorageWeak = c10::weak_intrusive_ptr<c10::StorageImpl>;

// A tensor argument: its storage, held weakly until its recipe's storage is
// dropped, then strongly (through `strong`) until it is recomputed or dies,
// and how the tensor views the storage. The storage rather than the tensor
// object: autograd keeps a tensor it saves as an output of its own operator
// (softmax's result) through a shallow copy, which shares the storage and
// the version counter while the object the recipe saw dies.
struct TensorArg {
  size_t index = 0; // in Recipe::args
  StorageWeak weak{StorageStrong()};
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  caffe2::TypeMeta dtype;
  c10::DispatchKey backend = c10::DispatchKey::CUDA;
  bool conj = false;
  bool neg = false;
  bool wrapped_number = false;
  c10::VariableVersion version_counter{c10::VariableVersion::DISABLED};
  uint32_t version = 0;
  at::Tensor strong;
  c10::StorageImpl* storage = nullptr; // CUDA storage, for dependents
  // Running statistics (isScratchArgument): neither held nor tracked (the
  // operator itself writes them); a replay runs on a copy.
  bool scratch = false;
  // An argument of the recipe's operator (-1), or of its in-place step of
  // that index (Recipe::steps), whose argument `index` it then is.
  int step = -1;
};

bool versionHolds(const c10::VariableVersion& counter, uint32_t version);

// The state of a device's default CUDA generator: a random operator started
// at it draws the same numbers again.
struct GeneratorState {
  uint64_t seed = 0;
  uint64_t offset = 0; // Philox offset per thread
};

GeneratorState generatorState(c10::DeviceIndex device);

uint64_t mix(uint64_t hash, uint64_t value);
uint64_t mix(uint64_t hash, const std::string& text);

// The recipe an in-place step extends (captureStep).
struct Recipe;

} // namespace detail

struct Capture {
  c10::OperatorHandle handle;
  std::vector<c10::IValue> args; // tensors left undefined
  std::vector<detail::TensorArg> tensors;
  c10::impl::LocalDispatchKeySet keys; // in force when it ran
  c10::DeviceIndex device = -1;
  // A random operator's generator state.
  std::optional<detail::GeneratorState> rng;
  cudaEvent_t start = nullptr;
  // The operator and its tensor arguments' types, sizes and strides: what
  // its measured duration is shared by (fastest()).
  uint64_t signature;
  // For an in-place step on a recipe's output (captureStep): that recipe,
  // and its output's version before the step.
  std::shared_ptr<detail::Recipe> extends;
  uint32_t extends_version = 0;
  // A copy of that output into a storage of its own (isCopyStep), or a sum
  // with it (isResidualAdd), which gets a recipe of its own: the recipe's,
  // then the copy or the sum.
  bool derives = false;
  // The argument that output is (the sum's `other` where that is the
  // recipe's output); the step's other tensor arguments are in `tensors`.
  size_t source = 0;

  explicit Capture(c10::OperatorHandle h)
      : handle(std::move(h)),
        keys(c10::impl::tls_local_dispatch_key_set()),
        signature(detail::mix(
            detail::mix(0xcbf29ce484222325ULL, handle.schema().name()),
            handle.schema().overload_name())) {}
};

namespace detail {

// The fastest run seen of each operator signature (the operator and its
// tensor arguments' shapes and types): a first run that included a
// library's lazy initialization (a cuBLAS handle, a cuDNN plan) must not
// price every later one. Guarded by g_mutex, as Timing is.
std::unordered_map<uint64_t, double>& fastest();

// How many runs of each signature have been timed to the end (guarded by
// g_mutex). Past kTimedRuns a signature's runs are no longer timed: its
// fastest run prices them, and two CUDA events an operator were host time
// on every operator on the allow-list (GPT, H100: 197 ms an iteration in
// cudaEventRecord, with the device idle 183 ms waiting for the host).
std::unordered_map<uint64_t, int>& timedRuns();
constexpr int kTimedRuns = 4;

struct Timing {
  c10::DeviceIndex device = -1;
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
  double ms = -1.0;
  uint64_t signature = 0;

  ~Timing() {
    events().put(device, start);
    events().put(device, end);
  }
  // The fastest run of its signature so far, with this one once it has
  // finished; -1 while no run of the signature has finished. A run still in
  // flight is priced by the earlier runs of its signature: the host runs
  // ahead of the device, so most candidates of a reclaim are in flight.
  double read() {
    if (ms < 0.0 && end != nullptr && finished()) {
      float elapsed = 0.f;
      C10_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, end));
      ms = std::max(0.0, static_cast<double>(elapsed));
      events().put(device, start);
      events().put(device, end);
      start = end = nullptr;
      auto [it, added] = fastest().emplace(signature, ms);
      if (!added) {
        it->second = std::min(it->second, ms);
      }
      ++timedRuns()[signature];
    }
    const auto it = fastest().find(signature);
    return it == fastest().end()
        ? ms
        : (ms < 0.0 ? it->second : std::min(ms, it->second));
  }

 private:
  // Whether the run's end event has been reached.
  bool finished() const {
    const cudaError_t done = cudaEventQuery(end);
    if (done == cudaErrorNotReady) {
      (void)cudaGetLastError(); // a status, not an error
      return false;
    }
    C10_CUDA_CHECK(done);
    return true;
  }
};

struct Recipe {
  c10::OperatorHandle handle;
  std::vector<c10::IValue> args;
  std::vector<TensorArg> tensors;
  c10::impl::LocalDispatchKeySet keys;
  std::optional<GeneratorState> rng;
  size_t output = 0; // which return
  c10::VariableVersion out_counter{c10::VariableVersion::DISABLED};
  uint32_t out_version = 0;
  // How the return viewed the storage: an in-place step must write exactly
  // that view to extend the recipe (captureStep).
  std::vector<int64_t> out_sizes;
  std::vector<int64_t> out_strides;
  int64_t out_offset = 0;
  // Pointwise operators applied to the output after the operator, in order:
  // in place (relu_ on a batch norm's output, add_ of a residual), or into a
  // storage of their own, which a derived recipe makes (a cast, a residual
  // sum). Replayed on the result, each with its arguments (the result as
  // argument `input`; its other tensor arguments are in `tensors`, marked
  // with the step's index). Their time is not priced: a pointwise pass over
  // the output is a fraction of the operators that make one worth dropping.
  struct Step {
    c10::OperatorHandle handle;
    std::vector<c10::IValue> args; // tensors left undefined
    // Writes its first argument; else returns what the next step reads (a
    // copy, isCopyStep, or a sum, isResidualAdd).
    bool in_place = true;
    // The argument the result so far is: the first, but for a sum whose
    // recipe's output was its second.
    size_t input = 0;
  };
  std::vector<Step> steps;
  // The storage it makes, for recomputing before a write to an input.
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{
      c10::intrusive_ptr<c10::StorageImpl>()};
  c10::DeviceIndex device = -1;
  // The operator's device time: events until read, then milliseconds. Shared
  // by the recipes of one operator's outputs.
  std::shared_ptr<Timing> timing;
  bool retained = false; // dropped: inputs held strongly, dependents known
  bool invalid = false;

  explicit Recipe(const Capture& capture)
      : handle(capture.handle),
        args(capture.args),
        tensors(capture.tensors),
        keys(capture.keys),
        rng(capture.rng) {}
};

// Recipes by the DataPtr context of the allocation they make, and for each
// storage that a dropped storage's recipe reads, the contexts of those
// recipes; both guarded by g_mutex.
extern std::mutex& g_mutex;
extern std::unordered_map<void*, std::shared_ptr<Recipe>>& g_recipes;
extern std::unordered_map<c10::StorageImpl*, std::vector<void*>>& g_dependents;
extern std::atomic<size_t> g_dependent_count;
// Per device and operator; guarded by g_mutex.
extern std::unordered_map<
    c10::DeviceIndex,
    std::map<std::string, OperatorCounts>>& g_counts;

std::shared_ptr<Recipe> find(void* context);
void* contextOf(c10::StorageImpl& storage);
c10::StorageImpl* cudaStorageOf(const at::Tensor& tensor);
bool outputHolds(const Recipe& recipe);

} // namespace detail

} // namespace at::cuda::lms::recipes

#endif // USE_ROCM
