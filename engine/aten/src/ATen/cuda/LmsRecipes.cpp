// Large Model Support is CUDA-only; ROCm builds, which compile a hipified
// copy of this file, leave it out.
#ifndef USE_ROCM

#include <ATen/cuda/LmsRecipes.h>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace at::cuda::lms::recipes {

namespace {

namespace engine = c10::cuda::lms;

// Pure, deterministic operators (see LmsRecipes.h); any overload whose
// schema writes nothing and returns no alias. Only operators whose tensor
// arguments autograd saves for their own backward anyway: a dropped storage
// keeps its recipe's arguments alive, and an argument that would otherwise
// die (the scores under a softmax, the two sides of a residual add) then
// takes memory that paging has to make room for. (With softmax, add, relu
// and casts on the list, ViT-L at 2x its device paged more and stalled
// longer with recompute on than with paging alone,
// benchmarks/results/recompute/2026-11-26-h200x2-12049f0/; this list is the
// remedy that reasoning suggests, not yet measured.)
bool onAllowList(std::string_view name) {
  static const std::unordered_set<std::string_view> names{
      // Convolution: saves its input and weight.
      "aten::conv1d",
      "aten::conv2d",
      "aten::conv3d",
      "aten::convolution",
      "aten::_convolution",
      "aten::cudnn_convolution",
      "aten::conv_transpose1d",
      "aten::conv_transpose2d",
      "aten::conv_transpose3d",
      // Matrix products: save both operands.
      "aten::linear",
      "aten::addmm",
      "aten::mm",
      "aten::bmm",
      "aten::baddbmm",
      "aten::matmul",
      // Pointwise operators whose backward reads their inputs.
      "aten::mul",
      "aten::div",
      "aten::gelu",
      "aten::silu",
      "aten::hardswish",
      "aten::leaky_relu",
      "aten::clamp",
      // Normalizations without running statistics: save their input.
      "aten::layer_norm",
      "aten::native_layer_norm",
      "aten::group_norm",
      "aten::native_group_norm",
      // Batch normalization in training mode: saves its input. Its running
      // statistics are updated in place (scratchArguments): a replay runs on
      // copies of them, so they change once, in the operator's own run. The
      // output depends only on the batch's statistics. Whichever of these
      // the boundary sees: batch_norm (the outermost), or what it calls
      // under autocast (_batch_norm_with_update in PyTorch 2.x, through
      // _batch_norm_impl_index in 1.x), and the kernels' own.
      "aten::batch_norm",
      "aten::_batch_norm_impl_index",
      "aten::_batch_norm_with_update",
      "aten::native_batch_norm",
      "aten::_native_batch_norm_legit",
      "aten::cudnn_batch_norm",
      // Pooling: saves its input.
      "aten::max_pool2d",
      "aten::max_pool2d_with_indices",
      "aten::avg_pool2d",
      "aten::adaptive_avg_pool2d",
      "aten::_adaptive_avg_pool2d",
      // Lookups: the indices are saved, the table is a parameter.
      "aten::embedding",
      // Random (isRandom()): the output is saved by the operator that reads
      // it next; the input, where it is alive (after a softmax, whose
      // backward saves its output), costs nothing to keep.
      "aten::dropout",
      "aten::native_dropout",
  };
  return names.count(name) > 0;
}

// Operators on the allow-list that draw from the device's default CUDA
// generator: their recipes save its state (seed and Philox offset) at the
// operator's start, and a replay draws the same numbers from it.
bool isRandom(std::string_view name) {
  return name == "aten::dropout" || name == "aten::native_dropout";
}

// Whether an argument named `name` of an operator on the allow-list is state
// the operator updates in place but that does not shape its output: batch
// normalization's running statistics in training mode. A recipe neither
// holds nor tracks it, and a replay runs on a copy of it.
bool isScratchArgument(std::string_view name) {
  return name == "running_mean" || name == "running_var";
}

// Composite operators (no CUDA kernel of their own) of the allow-list that
// autocast leaves alone all the way down: neither they nor any operator they
// call has an autocast kernel, so they are their own recipe under autocast
// as without it. Under autocast the boundary sees batch_norm, and what it
// calls is no operator autocast calls (the recipes' second level): without
// this, a training-mode batch norm under autocast had no recipe at all.
bool isAutocastFreeComposite(std::string_view name) {
  return name == "aten::batch_norm";
}

thread_local int t_replaying = 0;

// An operator's handle and whether it may be a recipe, per operator name.
struct OperatorInfo {
  std::optional<c10::OperatorHandle> handle;
  bool pure = false; // on the allow-list, writes nothing, returns no alias
  bool random = false; // draws from the default CUDA generator
  // Has a CUDA kernel of its own (or is isAutocastFreeComposite) and none for
  // autocast: under autocast it runs on its arguments as given, so its recipe
  // replays the same way whatever autocast's state at the replay.
  bool cast_free = false;
  std::vector<size_t> written; // the arguments its schema writes
  // Running statistics (isScratchArgument): replayed on copies.
  std::vector<size_t> scratch;
  // Its `training` argument, where it has one: only a training-mode run is
  // a recipe (in evaluation mode the output reads the running statistics,
  // which a later training step changes in place).
  std::optional<size_t> training;
};

const OperatorInfo& infoOf(const c10::OperatorName& name) {
  static std::mutex mutex;
  static std::unordered_map<c10::OperatorName, std::unique_ptr<OperatorInfo>>
      cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[name];
  if (slot == nullptr) {
    slot = std::make_unique<OperatorInfo>();
    const auto handle = c10::Dispatcher::singleton().findOp(name);
    if (handle.has_value() && handle->hasSchema()) {
      const c10::FunctionSchema& schema = handle->schema();
      const auto& arguments = schema.arguments();
      const bool listed = onAllowList(name.name);
      bool writes_state_only = true; // every written argument is scratch
      for (size_t i = 0; i < arguments.size(); ++i) {
        const bool scratch = listed && isScratchArgument(arguments[i].name());
        if (scratch) {
          slot->scratch.push_back(i);
        }
        if (listed && arguments[i].name() == "training") {
          slot->training = i;
        }
        if (arguments[i].alias_info() && arguments[i].alias_info()->isWrite()) {
          slot->written.push_back(i);
          writes_state_only = writes_state_only && scratch;
        }
      }
      bool aliases = false;
      for (const c10::Argument& ret : schema.returns()) {
        aliases = aliases || static_cast<bool>(ret.alias_info());
      }
      slot->pure = listed && writes_state_only &&
          (slot->written.empty() ? !schema.is_mutable() : true) && !aliases;
      slot->random = isRandom(name.name);
      slot->cast_free =
          (handle->hasKernelForDispatchKey(c10::DispatchKey::CUDA) ||
           isAutocastFreeComposite(name.name)) &&
          !handle->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA);
      slot->handle.emplace(*handle);
    }
  }
  return *slot;
}

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

Events& events() {
  static auto* pool = new Events(); // never freed: used by late deleters
  return *pool;
}

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

// Whether a recipe can hold `tensor` as its storage and view: a dense,
// strided CPU or CUDA tensor of a plain TensorImpl (not a wrapper, a nested,
// sparse or quantized tensor, or a Python subclass).
bool viewable(const at::Tensor& tensor) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  const c10::DispatchKeySet keys = impl->key_set();
  return typeid(*impl) == typeid(c10::TensorImpl) && impl->has_storage() &&
      tensor.layout() == c10::kStrided &&
      (tensor.is_cuda() || tensor.is_cpu()) &&
      !keys.has(c10::DispatchKey::Python) &&
      !keys.has(c10::DispatchKey::ZeroTensor);
}

// The argument's tensor on `storage`: a new TensorImpl with the view, type
// and bits the argument had.
at::Tensor viewOf(const TensorArg& arg, StorageStrong storage) {
  at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(storage)),
      c10::DispatchKeySet(arg.backend),
      arg.dtype);
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(arg.sizes, arg.strides);
  impl->set_storage_offset(arg.offset);
  impl->_set_conj(arg.conj);
  impl->_set_neg(arg.neg);
  if (arg.wrapped_number) {
    impl->set_wrapped_number(true); // asserts a zero-dimensional tensor
  }
  return tensor;
}

bool versionHolds(const c10::VariableVersion& counter, uint32_t version) {
  return counter.enabled() && counter.current_version() == version;
}

// The state of a device's default CUDA generator: a random operator started
// at it draws the same numbers again.
struct GeneratorState {
  uint64_t seed = 0;
  uint64_t offset = 0; // Philox offset per thread
};

GeneratorState generatorState(c10::DeviceIndex device) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const auto* impl = gen.get<at::CUDAGeneratorImpl>();
  return GeneratorState{impl->current_seed(), impl->philox_offset_per_thread()};
}

void setGeneratorState(c10::DeviceIndex device, const GeneratorState& state) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = gen.get<at::CUDAGeneratorImpl>();
  if (impl->current_seed() != state.seed) {
    impl->set_current_seed(state.seed); // resets the offset, set below
  }
  impl->set_philox_offset_per_thread(state.offset);
}

// Sets a device's default CUDA generator to a recipe's saved state for its
// replay, and back to where it was afterwards: the program's own random
// stream goes on as if the replay had not drawn. Another thread drawing from
// the same generator during a replay would draw from the saved state; the
// generator's lock cannot be held across the operator, which takes it.
class GeneratorReplay {
 public:
  GeneratorReplay(c10::DeviceIndex device, const GeneratorState& saved)
      : device_(device), before_(generatorState(device)) {
    setGeneratorState(device_, saved);
  }
  GeneratorReplay(const GeneratorReplay&) = delete;
  GeneratorReplay& operator=(const GeneratorReplay&) = delete;
  ~GeneratorReplay() {
    try {
      setGeneratorState(device_, before_);
    } catch (const std::exception& e) {
      TORCH_WARN(
          "Large Model Support: could not restore the CUDA generator after "
          "recomputing a random operator: ",
          e.what());
    }
  }

 private:
  c10::DeviceIndex device_;
  GeneratorState before_;
};

} // namespace

namespace {

uint64_t mix(uint64_t hash, uint64_t value) {
  return (hash ^ value) * 0x100000001b3ULL; // FNV-1a step
}

uint64_t mix(uint64_t hash, const std::string& text) {
  return mix(hash, std::hash<std::string>()(text));
}

// The recipe an in-place step extends (captureStep).
struct Recipe;

} // namespace

struct Capture {
  c10::OperatorHandle handle;
  std::vector<c10::IValue> args; // tensors left undefined
  std::vector<TensorArg> tensors;
  c10::impl::LocalDispatchKeySet keys; // in force when it ran
  c10::DeviceIndex device = -1;
  std::optional<GeneratorState> rng; // a random operator's generator state
  cudaEvent_t start = nullptr;
  // The operator and its tensor arguments' types, sizes and strides: what
  // its measured duration is shared by (fastest()).
  uint64_t signature;
  // For an in-place step on a recipe's output (captureStep): that recipe,
  // and its output's version before the step.
  std::shared_ptr<Recipe> extends;
  uint32_t extends_version = 0;
  // A cast of that output into a storage of its own (isCastStep), which
  // gets a recipe of its own: the recipe's, then the cast.
  bool derives = false;

  explicit Capture(c10::OperatorHandle h)
      : handle(std::move(h)),
        keys(c10::impl::tls_local_dispatch_key_set()),
        signature(
            mix(mix(0xcbf29ce484222325ULL, handle.schema().name()),
                handle.schema().overload_name())) {}
};

void CaptureDeleter::operator()(Capture* capture) const {
  if (capture != nullptr) {
    events().put(capture->device, capture->start);
    delete capture;
  }
}

namespace {

// The fastest run seen of each operator signature (the operator and its
// tensor arguments' shapes and types): a first run that included a
// library's lazy initialization (a cuBLAS handle, a cuDNN plan) must not
// price every later one. Guarded by g_mutex, as Timing is.
std::unordered_map<uint64_t, double>& fastest() {
  static auto* runs = new std::unordered_map<uint64_t, double>();
  return *runs;
}

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
  // The measured milliseconds, or -1 while the operator has not finished.
  double read() {
    if (ms < 0.0 && end != nullptr) {
      const cudaError_t done = cudaEventQuery(end);
      if (done == cudaErrorNotReady) {
        (void)cudaGetLastError(); // a status, not an error
        return -1.0;
      }
      C10_CUDA_CHECK(done);
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
    }
    const auto it = fastest().find(signature);
    return it == fastest().end()
        ? ms
        : (ms < 0.0 ? it->second : std::min(ms, it->second));
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
  // In-place pointwise operators applied to the output after the operator,
  // in order (relu_ on a batch norm's output, add_ of a residual): replayed
  // on the result, each with its arguments (the output first; its tensor
  // arguments are in `tensors`, marked with the step's index). Their time is
  // not priced: a pointwise pass over the output is a fraction of the
  // operators that make one worth dropping.
  struct Step {
    c10::OperatorHandle handle;
    std::vector<c10::IValue> args; // tensors left undefined
    // Writes its first argument; else returns what the next step reads (a
    // cast, isCastStep).
    bool in_place = true;
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
// recipes; both guarded by g_mutex. Never destroyed: a retained recipe holds
// tensors, whose deleters must not run after the allocator is gone at exit.
std::mutex& g_mutex = *new std::mutex();
auto& g_recipes = *new std::unordered_map<void*, std::shared_ptr<Recipe>>();
auto& g_dependents =
    *new std::unordered_map<c10::StorageImpl*, std::vector<void*>>();
std::atomic<size_t> g_dependent_count{0};
// Per device and operator; guarded by g_mutex.
auto& g_counts = *new std::unordered_map<
    c10::DeviceIndex,
    std::map<std::string, OperatorCounts>>();

std::shared_ptr<Recipe> find(void* context) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = g_recipes.find(context);
  return it != g_recipes.end() ? it->second : nullptr;
}

void* contextOf(c10::StorageImpl& storage) {
  return storage._mutable_data_ptr_no_checks().get_context();
}

// Forgets that `context`'s recipe depends on its inputs. g_mutex held.
void removeDependents(const Recipe& recipe, void* context) {
  for (const TensorArg& arg : recipe.tensors) {
    if (arg.storage == nullptr) {
      continue;
    }
    const auto it = g_dependents.find(arg.storage);
    if (it == g_dependents.end()) {
      continue;
    }
    auto& list = it->second;
    const auto at = std::find(list.begin(), list.end(), context);
    if (at != list.end()) {
      list.erase(at);
      g_dependent_count.fetch_sub(1);
    }
    if (list.empty()) {
      g_dependents.erase(it);
    }
  }
}

// Releases the strong references a retained recipe holds. g_mutex held; the
// tensors come back in `dead` to be destroyed after it is released (their
// deleters may come back here).
void unretain(Recipe& recipe, void* context, std::vector<at::Tensor>& dead) {
  if (!recipe.retained) {
    return;
  }
  removeDependents(recipe, context);
  for (TensorArg& arg : recipe.tensors) {
    if (arg.strong.defined()) {
      dead.push_back(std::move(arg.strong));
      arg.strong = at::Tensor();
    }
  }
  recipe.retained = false;
}

// The tensor of an argument: the strong reference while retained, else a view
// of its storage, if the storage is alive and the tensor unchanged; undefined
// otherwise.
at::Tensor tensorOf(const TensorArg& arg) {
  if (!versionHolds(arg.version_counter, arg.version)) {
    return at::Tensor();
  }
  if (arg.strong.defined()) {
    return arg.strong;
  }
  StorageStrong storage = arg.weak.lock();
  return storage ? viewOf(arg, std::move(storage)) : at::Tensor();
}

c10::StorageImpl* cudaStorageOf(const at::Tensor& tensor) {
  c10::StorageImpl* storage =
      tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  return storage != nullptr && storage->device_type() == c10::DeviceType::CUDA
      ? storage
      : nullptr;
}

// A tensor argument at `index` of an operator's arguments, as a recipe holds
// it; none when a recipe cannot hold it (see viewable(); an inference tensor
// or one without a version counter could change unseen). Running statistics
// (`scratch`) are no input a recipe depends on: the operator writes them
// itself, and a replay copies them.
std::optional<TensorArg> argOf(
    const at::Tensor& tensor,
    size_t index,
    bool scratch) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (tensor.is_inference() || !viewable(tensor) ||
      (!scratch && !impl->version_counter().enabled())) {
    return std::nullopt;
  }
  TensorArg arg;
  arg.index = index;
  arg.weak = impl->storage().getWeakStorageImpl();
  arg.sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  arg.strides.assign(tensor.strides().begin(), tensor.strides().end());
  arg.offset = tensor.storage_offset();
  arg.dtype = tensor.dtype();
  arg.backend =
      tensor.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
  arg.conj = tensor.is_conj();
  arg.neg = tensor.is_neg();
  arg.wrapped_number = impl->is_wrapped_number();
  arg.version_counter = impl->version_counter();
  arg.version = arg.version_counter.current_version();
  arg.scratch = scratch;
  arg.storage = scratch ? nullptr : cudaStorageOf(tensor);
  return arg;
}

// The running statistics an argument held (its view of their storage, of
// whatever version), or undefined when they are gone.
at::Tensor scratchOf(const TensorArg& arg) {
  StorageStrong storage = arg.weak.lock();
  return storage ? viewOf(arg, std::move(storage)) : at::Tensor();
}

// With the recompute log on (engine::isRecomputeLogEnabled), why a recipe
// cannot price a recompute, and recipes an existing one blocks, are printed.
double noCost(const Recipe& recipe, const char* why) {
  if (engine::isRecomputeLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS recompute: %s cannot be recomputed now: %s\n",
        recipe.handle.schema().name().c_str(),
        why);
  }
  return -1.0;
}

bool outputHolds(const Recipe& recipe) {
  return !recipe.invalid &&
      versionHolds(recipe.out_counter, recipe.out_version);
}

// ---------------------------------------------------------------------------
// Engine hooks
// ---------------------------------------------------------------------------

// A chain of replays: recomputing a dropped storage recomputes its recipe's
// dropped inputs first, theirs before them, and so on. Longer chains are
// refused when a storage is dropped (costMs): in a backward pass a long
// chain replays at one use what the uses before left dropped, and its
// memory comes all at once. Three replays: a storage, its dropped input and
// theirs, as deep as a replay ahead of use looks (the engine's
// kAheadDepth, two dropped inputs below the storage).
constexpr int kMaxChainReplays = 3;

struct Chain {
  int replays = 0; // in the chain; negative: it cannot be replayed (why)
  double ms = 0.0; // their measured device time
  const char* why = nullptr;
};

// The chain that recomputing dropped `storage` runs: its own replay and the
// chains of its recipe's dropped inputs, counted no deeper than `limit`
// replays (deeper: refused). g_mutex not held.
Chain chainOf(c10::StorageImpl& storage, int limit) {
  if (limit <= 0) {
    return Chain{-1, 0.0, "its chain of replays would be too long"};
  }
  std::shared_ptr<Recipe> recipe = find(contextOf(storage));
  Chain chain;
  std::vector<StorageStrong> inputs;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    chain.ms = recipe != nullptr && recipe->timing != nullptr
        ? recipe->timing->read()
        : -1.0;
    if (chain.ms < 0.0) {
      return Chain{-1, 0.0, "a dropped input's replay is not timed"};
    }
    for (const TensorArg& arg : recipe->tensors) {
      if (arg.storage != nullptr && arg.strong.defined()) {
        inputs.push_back(StorageStrong::reclaim_copy(arg.storage));
      }
    }
  }
  int below = 0;
  for (const StorageStrong& input : inputs) {
    if (engine::getState(*input) != engine::StorageState::Dropped) {
      continue;
    }
    const Chain inner = chainOf(*input, limit - 1);
    if (inner.replays < 0) {
      return inner;
    }
    chain.ms += inner.ms;
    below = std::max(below, inner.replays);
  }
  chain.replays = 1 + below;
  return chain;
}

// The longest chain of dropped storages whose recipes read `storage`,
// directly or through each other, counted up to `limit`. g_mutex not held.
int replaysAbove(c10::StorageImpl& storage, int limit) {
  if (limit <= 0 || g_dependent_count.load(std::memory_order_relaxed) == 0) {
    return 0;
  }
  std::vector<StorageStrong> dependents;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto it = g_dependents.find(&storage);
    if (it == g_dependents.end()) {
      return 0;
    }
    for (void* context : it->second) {
      const auto recipe = g_recipes.find(context);
      if (recipe != g_recipes.end()) {
        if (StorageStrong dropped = recipe->second->storage.lock()) {
          dependents.push_back(std::move(dropped));
        }
      }
    }
  }
  int most = 0;
  for (const StorageStrong& dependent : dependents) {
    most = std::max(most, 1 + replaysAbove(*dependent, limit - 1));
  }
  return std::min(most, limit);
}

// Whether `tensor`, an in-place step's argument (a residual), is held by
// nothing but this look at it: dropping the recipe's output would keep
// alive, for the replay, what would otherwise be freed. Not asked of the
// operator's own arguments: the allow-list holds operators whose backward
// saves them (onAllowList). g_mutex held.
bool heldOnlyHere(
    const Recipe& recipe,
    const TensorArg& arg,
    const at::Tensor& tensor) {
  return arg.step >= 0 && !recipe.retained && tensor.storage().use_count() <= 1;
}

double costMs(c10::StorageImpl& storage) {
  std::shared_ptr<Recipe> recipe = find(contextOf(storage));
  if (recipe == nullptr) {
    return -1.0;
  }
  double ms = 0.0;
  std::vector<std::pair<at::Tensor, bool>> inputs; // and whether on the GPU
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!outputHolds(*recipe)) {
      return noCost(*recipe, "its output was written");
    }
    ms = recipe->timing != nullptr ? recipe->timing->read() : -1.0;
    if (ms < 0.0) {
      return noCost(*recipe, "its run is not timed yet");
    }
    for (const TensorArg& arg : recipe->tensors) {
      if (arg.scratch) {
        continue; // resident (small) or copied: not priced
      }
      at::Tensor t = tensorOf(arg);
      if (!t.defined()) {
        return noCost(*recipe, "an input is gone or was written");
      }
      if (heldOnlyHere(*recipe, arg, t)) {
        return noCost(*recipe, "a step's argument is held by nothing else");
      }
      inputs.emplace_back(std::move(t), arg.storage != nullptr);
    }
  }
  int below = 0; // the longest chain of dropped inputs' replays
  for (const auto& [tensor, cuda] : inputs) {
    if (!cuda) {
      continue;
    }
    c10::StorageImpl* input =
        tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
    switch (engine::getState(*input)) {
      case engine::StorageState::Active:
        // A running operator uses it, and may be writing it.
        return noCost(*recipe, "a running operator uses an input");
      case engine::StorageState::PagedOut: {
        // Priced as paging is: the copy as far as it makes streams wait.
        const double in =
            engine::copyCostMs(recipe->device, input->nbytes(), true);
        if (in < 0.0) {
          return -1.0;
        }
        ms += in * engine::copyStallShare(recipe->device);
        break;
      }
      case engine::StorageState::Dropped: {
        // Recursive recompute: its own replay and those below it.
        const Chain inner = chainOf(*input, kMaxChainReplays - 1);
        if (inner.replays < 0) {
          return noCost(*recipe, inner.why);
        }
        ms += inner.ms;
        below = std::max(below, inner.replays);
        break;
      }
      default:
        break;
    }
  }
  const int above = replaysAbove(storage, kMaxChainReplays);
  if (1 + below + above > kMaxChainReplays) {
    return noCost(*recipe, "its chain of replays would be too long");
  }
  return ms;
}

bool retain(c10::StorageImpl& storage) {
  void* context = contextOf(storage);
  // Destroyed after the lock: a tensor whose last reference this was would
  // come back here through its deleter.
  std::vector<at::Tensor> held;
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = g_recipes.find(context);
  if (it == g_recipes.end()) {
    return false;
  }
  Recipe& recipe = *it->second;
  if (!outputHolds(recipe)) {
    return false;
  }
  held.reserve(recipe.tensors.size());
  for (const TensorArg& arg : recipe.tensors) {
    if (arg.scratch) {
      held.emplace_back(); // not held: a replay copies what is there then
      continue;
    }
    at::Tensor t = tensorOf(arg);
    if (!t.defined() || heldOnlyHere(recipe, arg, t)) {
      return false;
    }
    held.push_back(std::move(t));
  }
  // A retained recipe is a drop: the engine drops the storage next.
  OperatorCounts& counts =
      g_counts[recipe.device][recipe.handle.schema().name()];
  ++counts.drops;
  counts.drop_bytes += static_cast<int64_t>(storage.nbytes());
  if (recipe.retained) {
    return true;
  }
  for (size_t i = 0; i < held.size(); ++i) {
    TensorArg& arg = recipe.tensors[i];
    arg.strong = std::move(held[i]);
    if (arg.storage != nullptr) {
      g_dependents[arg.storage].push_back(context);
      g_dependent_count.fetch_add(1);
    }
  }
  recipe.retained = true;
  return true;
}

// Pins (and unpins on the way out) the storages of a replay's inputs.
class ReplayPins {
 public:
  ReplayPins() = default;
  ReplayPins(const ReplayPins&) = delete;
  ReplayPins& operator=(const ReplayPins&) = delete;
  ~ReplayPins() {
    for (c10::StorageImpl* storage : pinned_) {
      try {
        if (engine::getState(*storage) == engine::StorageState::Active) {
          engine::unpin(*storage);
        }
      } catch (const std::exception& e) {
        TORCH_WARN(
            "Large Model Support: could not unpin an input of a recompute; "
            "it stays resident. ",
            e.what());
      }
    }
  }
  void pin(c10::StorageImpl* storage) {
    if (std::find(pinned_.begin(), pinned_.end(), storage) != pinned_.end()) {
      return;
    }
    engine::pinForRecompute(*storage);
    if (engine::isManaged(storage->_mutable_data_ptr_no_checks())) {
      pinned_.push_back(storage);
    }
  }

 private:
  std::vector<c10::StorageImpl*> pinned_;
};

std::string describe(const Recipe& recipe) {
  return recipe.handle.schema().name();
}

// Storages being recomputed on this thread, innermost last.
thread_local std::vector<c10::StorageImpl*> t_recomputing;

void recompute(c10::StorageImpl& storage) {
  TORCH_CHECK(
      std::find(t_recomputing.begin(), t_recomputing.end(), &storage) ==
          t_recomputing.end(),
      "Large Model Support: recomputing a dropped storage of ",
      std::to_string(storage.nbytes()),
      " bytes needs that storage itself; its recipe is circular. Turn "
      "recompute off (torch.cuda.set_recompute_lms(False)) for this program.");
  t_recomputing.push_back(&storage);
  struct Pop {
    ~Pop() {
      t_recomputing.pop_back();
    }
  } pop;
  void* context = contextOf(storage);
  std::shared_ptr<Recipe> recipe = find(context);
  TORCH_CHECK(
      recipe != nullptr,
      "Large Model Support: a dropped storage of ",
      std::to_string(storage.nbytes()),
      " bytes has no recipe to recompute it from");
  // The replay's arguments: every tensor alive and unchanged.
  std::vector<c10::IValue> stack = recipe->args;
  std::vector<c10::StorageImpl*> inputs;
  // Running statistics: replayed on copies (scratchArguments), by index.
  std::vector<std::pair<const TensorArg*, at::Tensor>> scratch;
  // The tensor arguments of the in-place steps.
  std::vector<std::pair<const TensorArg*, at::Tensor>> step_args;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const TensorArg& arg : recipe->tensors) {
      if (arg.scratch) {
        at::Tensor t = scratchOf(arg);
        if (c10::StorageImpl* held = t.defined() ? cudaStorageOf(t) : nullptr) {
          inputs.push_back(held); // read by the copy
        }
        scratch.emplace_back(&arg, std::move(t));
        continue;
      }
      at::Tensor t = tensorOf(arg);
      TORCH_CHECK(
          t.defined(),
          "Large Model Support: cannot recompute a dropped output of ",
          describe(*recipe),
          " (",
          std::to_string(storage.nbytes()),
          " bytes): argument ",
          std::to_string(arg.index),
          " was written in place (version ",
          std::to_string(arg.version),
          ", now ",
          arg.version_counter.enabled()
              ? std::to_string(arg.version_counter.current_version())
              : std::string("untracked"),
          ") or freed, bypassing LMS. Turn recompute off "
          "(torch.cuda.set_recompute_lms(False)) for this program.");
      if (arg.storage != nullptr) {
        inputs.push_back(arg.storage);
      }
      if (arg.step >= 0) {
        step_args.emplace_back(&arg, std::move(t));
      } else {
        stack[arg.index] = std::move(t);
      }
    }
  }
  {
    ReplayPins pins;
    for (c10::StorageImpl* input : inputs) {
      pins.pin(input); // pages in, or recomputes, what it reads
    }
    // Replayed below autograd, with the dispatch keys the operator ran
    // under, as an operator nested in the one that needs the storage.
    const c10::impl::ForceDispatchKeyGuard keys(recipe->keys);
    const c10::AutoGradMode no_grad(false);
    const uint64_t caught = engine::outOfMemoryErrorsRaised();
    std::optional<GeneratorReplay> rng;
    if (recipe->rng.has_value()) {
      rng.emplace(recipe->device, *recipe->rng);
    }
    ++t_replaying;
    try {
      for (auto& [arg, stats] : scratch) {
        // The operator updates them in place: it updates a copy here, so the
        // real ones change once, in its own run. In training mode the output
        // reads only the batch's statistics: the same bits either way (zeros
        // where the module that held them is gone).
        stack[arg->index] = stats.defined()
            ? stats.clone()
            : stack[recipe->tensors.front().index].toTensor().new_zeros(
                  arg->sizes, at::TensorOptions().dtype(arg->dtype));
      }
      recipe->handle.callBoxed(&stack);
      if (!recipe->steps.empty() && recipe->output < stack.size() &&
          stack[recipe->output].isTensor()) {
        at::Tensor out = stack[recipe->output].toTensor();
        for (size_t k = 0; k < recipe->steps.size(); ++k) {
          const Recipe::Step& step = recipe->steps[k];
          std::vector<c10::IValue> step_stack = step.args;
          step_stack[0] = out;
          for (const auto& [arg, tensor] : step_args) {
            if (arg->step == static_cast<int>(k)) {
              step_stack[arg->index] = tensor;
            }
          }
          step.handle.callBoxed(&step_stack);
          if (!step.in_place) {
            TORCH_CHECK(
                !step_stack.empty() && step_stack[0].isTensor(),
                "Large Model Support: the replay of ",
                step.handle.schema().name(),
                " returned no tensor");
            out = step_stack[0].toTensor();
          }
        }
        stack[recipe->output] = out;
      }
    } catch (...) {
      --t_replaying;
      throw;
    }
    --t_replaying;
    if (engine::outOfMemoryErrorsRaised() != caught) {
      TORCH_WARN_ONCE(
          "Large Model Support: recomputing a dropped output of ",
          describe(*recipe),
          " caught an out-of-memory error inside it: a library such as cuDNN "
          "then runs an algorithm that needs less memory, whose results can "
          "differ in the last bits from the first run. Give the program more "
          "room (a higher memory cap, a smaller batch), or turn recompute "
          "off (torch.cuda.set_recompute_lms(False)), for the same numbers.");
    }
  }
  TORCH_CHECK(
      recipe->output < stack.size() && stack[recipe->output].isTensor(),
      "Large Model Support: the replay of ",
      describe(*recipe),
      " returned no tensor at position ",
      std::to_string(recipe->output));
  const at::Tensor result = stack[recipe->output].toTensor();
  c10::StorageImpl* fresh =
      result.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  TORCH_CHECK(
      fresh != nullptr && fresh != &storage,
      "Large Model Support: the replay of ",
      describe(*recipe),
      " returned no storage of its own");
  void* now = engine::fillDropped(storage, *fresh);
  std::vector<at::Tensor> dead;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    unretain(*recipe, context, dead);
    g_recipes.erase(context);
    g_recipes[now] = recipe;
    OperatorCounts& counts =
        g_counts[recipe->device][recipe->handle.schema().name()];
    ++counts.recomputes;
    counts.recompute_bytes += static_cast<int64_t>(storage.nbytes());
  }
  engine::setRecomputable(storage, true);
  stack.clear();
  dead.clear();
}

void forget(void* context) {
  std::shared_ptr<Recipe> gone;
  std::vector<at::Tensor> dead;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto it = g_recipes.find(context);
    if (it == g_recipes.end()) {
      return;
    }
    gone = std::move(it->second);
    g_recipes.erase(it);
    unretain(*gone, context, dead);
  }
  // Destroyed here, outside the lock: the inputs' deleters may come back.
}

void inputsOf(
    c10::StorageImpl& storage,
    std::vector<c10::intrusive_ptr<c10::StorageImpl>>& out) {
  std::shared_ptr<Recipe> recipe = find(contextOf(storage));
  if (recipe == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const TensorArg& arg : recipe->tensors) {
    if (arg.storage == nullptr || !arg.strong.defined()) {
      continue; // not on a GPU, or not held: not retained
    }
    c10::StorageImpl* input = arg.strong.unsafeGetTensorImpl()
                                  ->unsafe_storage()
                                  .unsafeGetStorageImpl();
    if (input != nullptr) {
      out.push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(input));
    }
  }
}

const engine::RecomputeHooks kHooks{
    &costMs,
    &retain,
    &recompute,
    &forget,
    &inputsOf};

bool collectable(const c10::IValue& value) {
  if (value.isTensorList() || value.isTuple() || value.isGenericDict()) {
    return false;
  }
  if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      if (element.isTensor()) {
        return false;
      }
    }
  }
  return true;
}

} // namespace

bool replaying() {
  return t_replaying > 0;
}

bool autocastActive() {
  // Autocast keys are in the default excluded set; enabling autocast takes
  // its key out of it (CUDA tensors carry the key themselves), and autocast's
  // wrappers exclude it again around the operator they call.
  return !c10::impl::tls_is_dispatch_key_excluded(
      c10::DispatchKey::AutocastCUDA);
}

std::map<std::string, OperatorCounts> operatorCounts(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = g_counts.find(device);
  return it != g_counts.end() ? it->second
                              : std::map<std::string, OperatorCounts>();
}

void resetOperatorCounts(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counts.erase(device);
}

static bool anyDependents() {
  return g_dependent_count.load(std::memory_order_relaxed) > 0;
}

void installHooks() {
  engine::setRecomputeHooks(&kHooks);
}

namespace {

// In-place pointwise operators that can extend the recipe of the tensor they
// write (captureStep): self written, the same result for the same input
// bits. torchvision's ResNets run relu(inplace=True) on batch norm outputs,
// and a bottleneck's last batch norm output takes the residual in place
// (`out += identity`, add_) before its relu: either would otherwise
// invalidate the recipe, and the block's output (a quarter of its saved
// bytes) could only be paged. The residual is saved for the next block's
// first convolution anyway; a step argument nothing else holds is no reason
// to keep it (retain).
bool isInPlaceStep(const c10::OperatorName& name) {
  return (name.name == "aten::relu_" && name.overload_name.empty()) ||
      (name.name == "aten::add_" && name.overload_name == "Tensor");
}

// A cast of a recipe's output to a storage of its own (autocast's cast of a
// layer norm's float output for the matrix product after it, which saves
// the cast): the cast's output gets a recipe of its own, the output's recipe
// followed by the cast, while the float output itself dies. Without it the
// cast could only be paged.
bool isCastStep(const c10::OperatorName& name) {
  return name.name == "aten::_to_copy" && name.overload_name.empty();
}

// At most this many steps extend one recipe.
constexpr size_t kMaxSteps = 4;

// The capture of an outermost in-place step on `self` when self is a
// recipe's output as the recipe made it: the same view of its storage, at
// the version the recipe (with its steps so far) produced. At the step's end,
// record() appends it to the recipe (appendStep). Null otherwise: the write
// then invalidates the recipe, as any write to its output does.
CapturePtr captureStep(const at::RecordFunction& fn, bool derives) {
  const OperatorInfo& info = infoOf(*fn.operator_name());
  const auto inputs = fn.inputs();
  if (!info.handle.has_value() ||
      inputs.size() != info.handle->schema().arguments().size() ||
      inputs.empty() || !inputs[0].isTensor() ||
      !inputs[0].toTensor().defined()) {
    return nullptr;
  }
  const at::Tensor& self = inputs[0].toTensor();
  c10::StorageImpl* storage = cudaStorageOf(self);
  if (storage == nullptr ||
      !engine::isManaged(storage->_mutable_data_ptr_no_checks())) {
    return nullptr;
  }
  // The step's other arguments: tensors on the output's device, held as a
  // recipe's arguments are (argOf), none of them a view of the output.
  CapturePtr capture(new Capture(*info.handle));
  capture->args.emplace_back(at::Tensor());
  for (size_t i = 1; i < inputs.size(); ++i) {
    const c10::IValue& value = inputs[i];
    if (!collectable(value)) {
      return nullptr;
    }
    if (!value.isTensor() || !value.toTensor().defined()) {
      capture->args.push_back(value);
      continue;
    }
    std::optional<TensorArg> arg = argOf(value.toTensor(), i, false);
    if (!arg.has_value() || arg->storage == nullptr ||
        arg->storage == storage ||
        arg->storage->device() != storage->device()) {
      return nullptr;
    }
    capture->tensors.push_back(std::move(*arg));
    capture->args.emplace_back(at::Tensor());
  }
  std::shared_ptr<Recipe> recipe = find(contextOf(*storage));
  if (recipe == nullptr) {
    return nullptr;
  }
  uint32_t version = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!outputHolds(*recipe) || recipe->retained ||
        recipe->steps.size() >= kMaxSteps || self.is_inference() ||
        self.storage_offset() != recipe->out_offset ||
        !self.sizes().equals(recipe->out_sizes) ||
        !self.strides().equals(recipe->out_strides)) {
      return nullptr;
    }
    version = recipe->out_counter.current_version();
  }
  capture->device = storage->device().index();
  capture->extends = std::move(recipe);
  capture->extends_version = version;
  capture->derives = derives;
  return capture;
}

// At the end of a step captureStep() took: when the step wrote its recipe's
// output exactly once (one version more, through the recipe's own counter)
// and the recipe is still its storage's, the step becomes part of it.
void appendStep(const at::RecordFunction& fn, Capture& capture) {
  Recipe& recipe = *capture.extends;
  c10::intrusive_ptr<c10::StorageImpl> storage = recipe.storage.lock();
  if (!storage) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = g_recipes.find(contextOf(*storage));
  if (it == g_recipes.end() || it->second != capture.extends ||
      recipe.invalid || recipe.retained ||
      recipe.out_counter.current_version() != capture.extends_version + 1) {
    return;
  }
  for (const TensorArg& arg : capture.tensors) {
    if (!versionHolds(arg.version_counter, arg.version)) {
      recipe.invalid = true; // the step wrote its own argument
      return;
    }
  }
  recipe.steps.push_back(Recipe::Step{capture.handle, capture.args});
  for (TensorArg& arg : capture.tensors) {
    arg.step = static_cast<int>(recipe.steps.size() - 1);
    recipe.tensors.push_back(std::move(arg));
  }
  recipe.out_version = recipe.out_counter.current_version();
  if (engine::isRecomputeLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS recompute: %s extends the recipe of %s\n",
        fn.name(),
        recipe.handle.schema().name().c_str());
  }
}

// At the end of a cast captureStep() took: when its source still holds what
// its recipe made, the cast's output gets a recipe of its own, a copy of
// the source's with the cast as its last step, timed as the source's.
void deriveRecipe(const at::RecordFunction& fn, Capture& capture) {
  const auto outputs = fn.outputs();
  if (outputs.empty() || !outputs[0].isTensor() ||
      !outputs[0].toTensor().defined()) {
    return;
  }
  const at::Tensor& out = outputs[0].toTensor();
  c10::StorageImpl* storage = cudaStorageOf(out);
  if (storage == nullptr ||
      !engine::isManaged(storage->_mutable_data_ptr_no_checks()) ||
      !out.unsafeGetTensorImpl()->version_counter().enabled() ||
      storage->device().index() != capture.device) {
    return;
  }
  std::shared_ptr<Recipe> recipe;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const Recipe& source = *capture.extends;
    if (!outputHolds(source) || source.retained ||
        source.out_counter.current_version() != capture.extends_version) {
      return;
    }
    for (const TensorArg& arg : source.tensors) {
      if (arg.storage == storage) {
        return; // not a storage of its own
      }
    }
    recipe = std::make_shared<Recipe>(source);
  }
  Recipe::Step cast{capture.handle, capture.args};
  cast.in_place = false;
  recipe->steps.push_back(std::move(cast));
  recipe->out_counter = out.unsafeGetTensorImpl()->version_counter();
  recipe->out_version = recipe->out_counter.current_version();
  recipe->out_sizes.assign(out.sizes().begin(), out.sizes().end());
  recipe->out_strides.assign(out.strides().begin(), out.strides().end());
  recipe->out_offset = out.storage_offset();
  recipe->storage = c10::weak_intrusive_ptr<c10::StorageImpl>(
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage));
  void* context = contextOf(*storage);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto [it, added] = g_recipes.emplace(context, recipe);
    if (!added) {
      if (outputHolds(*it->second) || it->second->retained) {
        return; // a recipe that still makes it
      }
      it->second = std::move(recipe);
    }
  }
  engine::setRecomputable(*storage, true);
  if (engine::isRecomputeLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS recompute: %s extends the recipe of %s\n",
        fn.name(),
        capture.extends->handle.schema().name().c_str());
  }
}

} // namespace

CapturePtr capture(const at::RecordFunction& fn) {
  if (!engine::isRecomputeEnabled() || t_replaying > 0) {
    return nullptr;
  }
  const auto& name = fn.operator_name();
  if (name.has_value() && (isInPlaceStep(*name) || isCastStep(*name))) {
    return captureStep(fn, /*derives=*/isCastStep(*name));
  }
  if (!name.has_value() || !onAllowList(name->name)) {
    return nullptr;
  }
  const OperatorInfo& info = infoOf(*name);
  if (!info.pure || !info.handle.has_value()) {
    return nullptr;
  }
  // Under autocast, the recipe of an operator autocast casts for is the
  // inner one it calls, with the casted arguments.
  if (autocastActive() && !info.cast_free) {
    return nullptr;
  }
  const auto inputs = fn.inputs();
  if (inputs.size() != info.handle->schema().arguments().size()) {
    return nullptr; // the record has no arguments to replay with
  }
  if (info.training.has_value() &&
      !(inputs[*info.training].isBool() && inputs[*info.training].toBool())) {
    return nullptr; // evaluation mode: reads the running statistics
  }
  CapturePtr capture(new Capture(*info.handle));
  capture->args.reserve(inputs.size());
  for (const c10::IValue& value : inputs) {
    if (!collectable(value)) {
      return nullptr;
    }
    if (value.isTensor() && value.toTensor().defined()) {
      const at::Tensor& tensor = value.toTensor();
      const bool scratch =
          std::find(
              info.scratch.begin(), info.scratch.end(), capture->args.size()) !=
          info.scratch.end();
      std::optional<TensorArg> arg =
          argOf(tensor, capture->args.size(), scratch);
      if (!arg.has_value()) {
        return nullptr;
      }
      if (arg->storage != nullptr && capture->device < 0) {
        capture->device = arg->storage->device().index();
      }
      capture->tensors.push_back(std::move(*arg));
      uint64_t& hash = capture->signature;
      hash = mix(hash, static_cast<uint64_t>(tensor.scalar_type()));
      for (const int64_t size : tensor.sizes()) {
        hash = mix(hash, static_cast<uint64_t>(size));
      }
      for (const int64_t stride : tensor.strides()) {
        hash = mix(hash, static_cast<uint64_t>(stride));
      }
      capture->args.emplace_back(at::Tensor());
    } else {
      capture->args.push_back(value);
    }
  }
  if (capture->device < 0) {
    return nullptr; // nothing on a GPU to time or recompute
  }
  if (info.random) {
    // Before the operator runs: the state it starts drawing from.
    capture->rng = generatorState(capture->device);
  }
  capture->start = events().get(capture->device);
  C10_CUDA_CHECK(cudaEventRecord(
      capture->start, c10::cuda::getCurrentCUDAStream(capture->device)));
  return capture;
}

void record(const at::RecordFunction& fn, Capture& capture) {
  if (std::uncaught_exceptions() > 0) {
    return; // the operator failed: nothing to record
  }
  if (capture.extends != nullptr) {
    if (capture.derives) {
      deriveRecipe(fn, capture);
    } else {
      appendStep(fn, capture);
    }
    return;
  }
  auto timing = std::make_shared<Timing>();
  timing->device = capture.device;
  timing->signature = capture.signature;
  timing->start = std::exchange(capture.start, nullptr);
  timing->end = events().get(capture.device);
  C10_CUDA_CHECK(cudaEventRecord(
      timing->end, c10::cuda::getCurrentCUDAStream(capture.device)));
  const auto outputs = fn.outputs();
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (!outputs[k].isTensor() || !outputs[k].toTensor().defined()) {
      continue;
    }
    const at::Tensor& out = outputs[k].toTensor();
    c10::StorageImpl* storage = cudaStorageOf(out);
    if (storage == nullptr ||
        !engine::isManaged(storage->_mutable_data_ptr_no_checks()) ||
        !out.unsafeGetTensorImpl()->version_counter().enabled()) {
      continue;
    }
    bool aliases = false;
    for (const TensorArg& arg : capture.tensors) {
      aliases = aliases || arg.storage == storage;
    }
    if (aliases) {
      continue;
    }
    auto recipe = std::make_shared<Recipe>(capture);
    recipe->output = k;
    recipe->out_counter = out.unsafeGetTensorImpl()->version_counter();
    recipe->out_version = recipe->out_counter.current_version();
    recipe->out_sizes.assign(out.sizes().begin(), out.sizes().end());
    recipe->out_strides.assign(out.strides().begin(), out.strides().end());
    recipe->out_offset = out.storage_offset();
    recipe->storage = c10::weak_intrusive_ptr<c10::StorageImpl>(
        c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage));
    recipe->device = capture.device;
    recipe->timing = timing;
    void* context = contextOf(*storage);
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      auto [it, added] = g_recipes.emplace(context, recipe);
      if (!added) {
        if (outputHolds(*it->second) || it->second->retained) {
          if (engine::isRecomputeLogEnabled()) {
            std::fprintf(
                stderr,
                "LMS recompute: %s output kept the recipe of %s\n",
                recipe->handle.schema().name().c_str(),
                it->second->handle.schema().name().c_str());
          }
          continue; // a recipe that still makes it
        }
        it->second = std::move(recipe);
      }
    }
    engine::setRecomputable(*storage, true);
  }
}

void beforeWrites(const at::RecordFunction& fn) {
  if (t_replaying > 0 || !anyDependents()) {
    return; // a replay writes only what it allocates itself
  }
  const auto& name = fn.operator_name();
  if (!name.has_value()) {
    return;
  }
  const OperatorInfo& info = infoOf(*name);
  const auto inputs = fn.inputs();
  std::vector<c10::StorageImpl*> written;
  for (size_t i : info.written) {
    if (i < inputs.size() && inputs[i].isTensor() &&
        inputs[i].toTensor().defined()) {
      if (c10::StorageImpl* storage = cudaStorageOf(inputs[i].toTensor())) {
        written.push_back(storage);
      }
    }
  }
  if (written.empty()) {
    return;
  }
  std::vector<std::shared_ptr<Recipe>> affected;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (c10::StorageImpl* storage : written) {
      const auto it = g_dependents.find(storage);
      if (it == g_dependents.end()) {
        continue;
      }
      for (void* context : it->second) {
        const auto recipe = g_recipes.find(context);
        if (recipe != g_recipes.end()) {
          affected.push_back(recipe->second);
        }
      }
    }
  }
  for (const auto& recipe : affected) {
    c10::intrusive_ptr<c10::StorageImpl> dropped = recipe->storage.lock();
    if (!dropped) {
      continue;
    }
    // Recompute it while its inputs still hold what it was made from; after
    // the write its recipe would make something else.
    engine::pinForRecompute(*dropped);
    engine::unpin(*dropped);
    std::lock_guard<std::mutex> lock(g_mutex);
    recipe->invalid = true;
  }
}

} // namespace at::cuda::lms::recipes

#endif // USE_ROCM
