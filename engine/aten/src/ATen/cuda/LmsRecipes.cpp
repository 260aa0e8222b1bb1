// Recipes for Large Model Support's recompute, the capture side: at operator
// boundaries, which operators may be recipes (the allow-list), what a recipe
// holds of an operator's run (its arguments, the dispatch keys, its timing),
// the in-place and cast steps that extend a recipe, recomputing a dropped
// storage before a write to one of its recipe's inputs, and the operator
// counts. The replay side (the engine's recompute hooks) is
// LmsRecipeReplay.cpp; what the two share is LmsRecipesInternal.h, and the
// shared state and helpers are defined here.

// Large Model Support is CUDA-only; ROCm builds, which compile a hipified
// copy of this file, leave it out.
#ifndef USE_ROCM

#include <ATen/cuda/LmsRecipes.h>
#include <ATen/cuda/LmsRecipesInternal.h>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/intrusive_ptr.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <exception>
#include <initializer_list>
#include <map>
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

namespace detail {

thread_local int t_replaying = 0;

Events& events() {
  static auto* pool = new Events(); // never freed: used by late deleters
  return *pool;
}

bool versionHolds(const c10::VariableVersion& counter, uint32_t version) {
  return counter.enabled() && counter.current_version() == version;
}

GeneratorState generatorState(c10::DeviceIndex device) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const auto* impl = gen.get<at::CUDAGeneratorImpl>();
  return GeneratorState{impl->current_seed(), impl->philox_offset_per_thread()};
}

uint64_t mix(uint64_t hash, uint64_t value) {
  return (hash ^ value) * 0x100000001b3ULL; // FNV-1a step
}

uint64_t mix(uint64_t hash, const std::string& text) {
  return mix(hash, std::hash<std::string>()(text));
}

std::unordered_map<uint64_t, double>& fastest() {
  static auto* runs = new std::unordered_map<uint64_t, double>();
  return *runs;
}

std::unordered_map<uint64_t, int>& timedRuns() {
  static auto* counts = new std::unordered_map<uint64_t, int>();
  return *counts;
}

// Never destroyed: a retained recipe holds tensors, whose deleters must not
// run after the allocator is gone at exit.
std::mutex& g_mutex = *new std::mutex();
std::unordered_map<void*, std::shared_ptr<Recipe>>& g_recipes =
    *new std::unordered_map<void*, std::shared_ptr<Recipe>>();
std::unordered_map<c10::StorageImpl*, std::vector<void*>>& g_dependents =
    *new std::unordered_map<c10::StorageImpl*, std::vector<void*>>();
std::atomic<size_t> g_dependent_count{0};
std::unordered_map<c10::DeviceIndex, std::map<std::string, OperatorCounts>>&
    g_counts = *new std::unordered_map<
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

c10::StorageImpl* cudaStorageOf(const at::Tensor& tensor) {
  c10::StorageImpl* storage =
      tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  return storage != nullptr && storage->device_type() == c10::DeviceType::CUDA
      ? storage
      : nullptr;
}

bool outputHolds(const Recipe& recipe) {
  return !recipe.invalid &&
      versionHolds(recipe.out_counter, recipe.out_version);
}

} // namespace detail

using namespace detail;

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
// remedy that reasoning suggests, not yet measured.) Copies (isCopyStep) are
// the exception: their replay is a pass over memory, and the source of the
// copies worth dropping is saved anyway (attention's output, which
// scaled_dot_product_attention saves and the head merge copies for the
// projection that saves the copy); a source that died leaves the copy to
// paging, as any recipe whose input is gone.
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
      // Copies into a storage of their own (isCopyStep): the copy of a
      // recipe's output derives a recipe from it, any other is its own.
      "aten::clone",
      "aten::_to_copy",
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
  return name == "aten::batch_norm" || name == "aten::clone" ||
      name == "aten::_to_copy";
}

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

void CaptureDeleter::operator()(Capture* capture) const {
  if (capture != nullptr) {
    events().put(capture->device, capture->start);
    delete capture;
  }
}

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

namespace {

// In-place pointwise operators that can extend the recipe of the tensor they
// write (captureStep): self written, the same result for the same input
// bits. torchvision's ResNets run relu(inplace=True) on batch norm outputs,
// and a bottleneck's last batch norm output takes the residual in place
// (`out += identity`, add_) before its relu: either would otherwise
// invalidate the recipe, and the block's output (a quarter of its saved
// bytes) could only be paged. The residual is saved for the next block's
// first convolution anyway. A step's argument is held weakly, as the
// operator's are, until the output is dropped (retain): one that died before
// leaves the output to paging; one alive then stays alive, held by the
// recipe, until the replay.
bool isInPlaceStep(const c10::OperatorName& name) {
  return (name.name == "aten::relu_" && name.overload_name.empty()) ||
      (name.name == "aten::add_" && name.overload_name == "Tensor");
}

// A copy into a storage of its own, a cast (aten::_to_copy) or not
// (aten::clone). Of a recipe's output (autocast's cast of a layer norm's
// float output for the matrix product after it, which saves the cast), the
// copy's output gets a recipe of its own, the output's recipe followed by
// the copy, while the source itself dies: without it the copy could only be
// paged. Of anything else (attention's output, copied by the head merge's
// reshape of its transpose), the copy is a recipe of its own, with the
// source as its argument. Captured at whatever depth it runs: aten::to,
// reshape and contiguous call it, and autocast casts inside the operator it
// casts for, below the depth other recipes are captured at.
bool isCopyStep(const c10::OperatorName& name) {
  return (name.name == "aten::_to_copy" || name.name == "aten::clone") &&
      name.overload_name.empty();
}

// A sum into a storage of its own with a recipe's output as one side: the
// residual stream of a transformer, `x + proj(a)`, which autocast leaves in
// float32 (GPT with no cap, H100: 44 of the 63 GiB of victims with no recipe
// in a run).
// The projection's output dies after the sum, so a recipe of the sum itself
// (aten::add on the allow-list) would never be droppable: its arguments are
// held weakly until the drop. Derived instead, as a copy of a recipe's output
// is: the projection's recipe followed by the sum, whose other side (x) the
// layer norm after it saves anyway. Replayed as it ran: add has no autocast
// kernel, and a pointwise sum gives the same bits for the same inputs.
bool isResidualAdd(const c10::OperatorName& name) {
  return name.name == "aten::add" && name.overload_name == "Tensor";
}

// At most this many steps extend one recipe.
constexpr size_t kMaxSteps = 4;

// A recipe whose output an argument is as the recipe made it (madeBy), its
// output's version then, and its steps so far.
struct Made {
  std::shared_ptr<Recipe> recipe;
  uint32_t version = 0;
  size_t steps = 0;
};

// The recipe whose output `self` is as the recipe made it: the same view of
// its storage, at the version the recipe (with its steps so far) produced,
// with room for another step. No recipe otherwise.
Made madeBy(const at::Tensor& self) {
  c10::StorageImpl* storage = cudaStorageOf(self);
  if (storage == nullptr || self.is_inference() ||
      !engine::isManaged(storage->_mutable_data_ptr_no_checks())) {
    return {};
  }
  std::shared_ptr<Recipe> recipe = find(contextOf(*storage));
  if (recipe == nullptr) {
    return {};
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!outputHolds(*recipe) || recipe->retained ||
      recipe->steps.size() >= kMaxSteps ||
      self.storage_offset() != recipe->out_offset ||
      !self.sizes().equals(recipe->out_sizes) ||
      !self.strides().equals(recipe->out_strides)) {
    return {};
  }
  const uint32_t version = recipe->out_counter.current_version();
  const size_t steps = recipe->steps.size();
  return Made{std::move(recipe), version, steps};
}

// The capture of an outermost in-place step, copy or sum on the argument of
// `sides` that is a recipe's output as the recipe made it (madeBy); of a sum
// (isResidualAdd: sides 0 and 1) the side whose recipe has the fewest steps
// (the projection's, not the residual stream's own derived one), the second
// where both have as few (`x + f(x)`). At the step's end, record() appends
// it to the recipe (appendStep) or derives a recipe from it (deriveRecipe).
// Null where no side is one: an in-place write then invalidates the recipe,
// as any write to its output does.
CapturePtr captureStep(
    const at::RecordFunction& fn,
    bool derives,
    std::initializer_list<size_t> sides = {0}) {
  const OperatorInfo& info = infoOf(*fn.operator_name());
  const auto inputs = fn.inputs();
  if (!info.handle.has_value() ||
      inputs.size() != info.handle->schema().arguments().size()) {
    return nullptr;
  }
  size_t source = 0;
  Made made;
  for (const size_t side : sides) {
    if (side >= inputs.size() || !inputs[side].isTensor() ||
        !inputs[side].toTensor().defined()) {
      continue;
    }
    Made here = madeBy(inputs[side].toTensor());
    if (here.recipe != nullptr &&
        (made.recipe == nullptr || here.steps <= made.steps)) {
      source = side;
      made = std::move(here);
    }
  }
  if (made.recipe == nullptr) {
    return nullptr;
  }
  // Managed CUDA memory: madeBy found its recipe.
  c10::StorageImpl* storage = cudaStorageOf(inputs[source].toTensor());
  // The step's other arguments: tensors on the output's device, held as a
  // recipe's arguments are (argOf), none of them a view of the output.
  CapturePtr capture(new Capture(*info.handle));
  for (size_t i = 0; i < inputs.size(); ++i) {
    const c10::IValue& value = inputs[i];
    if (i == source) {
      capture->args.emplace_back(at::Tensor());
      continue;
    }
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
  capture->device = storage->device().index();
  capture->extends = std::move(made.recipe);
  capture->extends_version = made.version;
  capture->derives = derives;
  capture->source = source;
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

// Makes `recipe` the recipe of `storage`, which its operator's return `out`
// views, unless the storage has a recipe that still makes it (a nested
// operator's, recorded first). Returns whether it did.
bool install(
    std::shared_ptr<Recipe> recipe,
    const at::Tensor& out,
    c10::StorageImpl& storage) {
  recipe->out_counter = out.unsafeGetTensorImpl()->version_counter();
  recipe->out_version = recipe->out_counter.current_version();
  recipe->out_sizes.assign(out.sizes().begin(), out.sizes().end());
  recipe->out_strides.assign(out.strides().begin(), out.strides().end());
  recipe->out_offset = out.storage_offset();
  recipe->storage = c10::weak_intrusive_ptr<c10::StorageImpl>(
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(&storage));
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto [it, added] = g_recipes.emplace(contextOf(storage), recipe);
    if (!added) {
      if (outputHolds(*it->second) || it->second->retained) {
        if (engine::isRecomputeLogEnabled()) {
          std::fprintf(
              stderr,
              "LMS recompute: %s output kept the recipe of %s\n",
              recipe->handle.schema().name().c_str(),
              it->second->handle.schema().name().c_str());
        }
        return false;
      }
      it->second = std::move(recipe);
    }
  }
  engine::setRecomputable(storage, true);
  return true;
}

// At the end of a copy or sum captureStep() took: when its source still
// holds what its recipe made and the step's other arguments are as they
// were, the step's output gets a recipe of its own, a copy of the source's
// with the step as its last, timed as the source's.
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
    for (const TensorArg& arg : capture.tensors) {
      if (arg.storage == storage ||
          !versionHolds(arg.version_counter, arg.version)) {
        return; // the step wrote its own argument, or returned it
      }
    }
    recipe = std::make_shared<Recipe>(source);
  }
  Recipe::Step step{capture.handle, capture.args};
  step.in_place = false;
  step.input = capture.source;
  recipe->steps.push_back(std::move(step));
  for (TensorArg& arg : capture.tensors) {
    arg.step = static_cast<int>(recipe->steps.size() - 1);
    recipe->tensors.push_back(std::move(arg));
  }
  if (!install(std::move(recipe), out, *storage)) {
    return;
  }
  if (engine::isRecomputeLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS recompute: %s extends the recipe of %s\n",
        fn.name(),
        capture.extends->handle.schema().name().c_str());
  }
}

} // namespace

bool isCopy(const at::RecordFunction& fn) {
  const auto& name = fn.operator_name();
  return name.has_value() && isCopyStep(*name);
}

CapturePtr capture(const at::RecordFunction& fn) {
  if (!engine::isRecordingRecipes() || t_replaying > 0) {
    return nullptr;
  }
  const auto& name = fn.operator_name();
  if (name.has_value() && isInPlaceStep(*name)) {
    return captureStep(fn, /*derives=*/false);
  }
  if (name.has_value() && isCopyStep(*name)) {
    if (CapturePtr derived = captureStep(fn, /*derives=*/true)) {
      return derived;
    }
    // Not of a recipe's output: a recipe of its own, below.
  }
  if (name.has_value() && isResidualAdd(*name)) {
    // Not for an add autocast casts for (none in PyTorch today): its replay
    // would need autocast's state.
    if (!engine::isResidualRecipesEnabled() || !infoOf(*name).cast_free) {
      return nullptr;
    }
    return captureStep(fn, /*derives=*/true, {0, 1});
  }
  if (!name.has_value() || !onAllowList(name->name)) {
    return nullptr;
  }
  const OperatorInfo& info = infoOf(*name);
  if (!info.pure || !info.handle.has_value()) {
    return nullptr;
  }
  // Nothing a CUDA graph capture makes is ever dropped (the graph bakes in
  // its addresses, and its memory is a private pool's), and a timing's event
  // queries are illegal while a capture is under way: compiled code in
  // mode="reduce-overhead" records no recipes. (Steps and derived copies
  // record no events, and graph memory is not LMS's: captureStep refuses it.)
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
      c10::cuda::CaptureStatus::None) {
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
  bool timed_enough = false;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto it = timedRuns().find(capture->signature);
    timed_enough = it != timedRuns().end() && it->second >= kTimedRuns;
  }
  if (!timed_enough) {
    capture->start = events().get(capture->device);
    C10_CUDA_CHECK(cudaEventRecord(
        capture->start, c10::cuda::getCurrentCUDAStream(capture->device)));
  }
  return capture;
}

namespace {

// Timings of recorded runs, oldest first, until their runs end. Pricing reads
// a candidate's timing (costMs), but the host runs far ahead of the device
// on large operators: when a reclaim comes, the runs of most candidates are
// still in flight, and a signature whose runs were only ever read in flight
// would never be priced. Each record reads the oldest pending timings whose
// runs have ended, which fills the fastest run of their signatures as the
// device goes. Bounded: the oldest are let go first.
constexpr size_t kMaxPendingTimings = 4096;
std::deque<std::weak_ptr<Timing>>& pendingTimings() {
  static auto* pending = new std::deque<std::weak_ptr<Timing>>();
  return *pending;
}

void trackTiming(const std::shared_ptr<Timing>& timing) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& pending = pendingTimings();
  pending.push_back(timing);
  while (pending.size() > kMaxPendingTimings) {
    pending.pop_front();
  }
  while (!pending.empty()) {
    std::shared_ptr<Timing> oldest = pending.front().lock();
    if (oldest != nullptr) {
      (void)oldest->read();
      if (oldest->ms < 0.0) {
        break; // still running: so, mostly, is everything after it
      }
    }
    pending.pop_front();
  }
}

} // namespace

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
  if (timing->start != nullptr) {
    timing->end = events().get(capture.device);
    C10_CUDA_CHECK(cudaEventRecord(
        timing->end, c10::cuda::getCurrentCUDAStream(capture.device)));
    trackTiming(timing);
  } // else priced by its signature's fastest run (Timing::read)
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
    recipe->device = capture.device;
    recipe->timing = timing;
    install(std::move(recipe), out, *storage);
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
  auto add = [&written](const at::Tensor& tensor) {
    if (tensor.defined()) {
      if (c10::StorageImpl* storage = cudaStorageOf(tensor)) {
        written.push_back(storage);
      }
    }
  };
  for (size_t i : info.written) {
    if (i >= inputs.size()) {
      continue;
    }
    if (inputs[i].isTensor()) {
      add(inputs[i].toTensor());
    } else if (inputs[i].isTensorList()) {
      // The fused foreach kernels of the optimizers (_foreach_add_ and the
      // like) write a list of parameters with no operator per tensor.
      for (const at::Tensor& tensor : inputs[i].toTensorList().vec()) {
        add(tensor);
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
