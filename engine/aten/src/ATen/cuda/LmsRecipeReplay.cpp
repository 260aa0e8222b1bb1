// Recipes for Large Model Support's recompute, the replay side: the hooks
// through which the engine (c10::cuda::lms::RecomputeHooks) prices
// recomputing a storage against paging it out, keeps a dropped storage's
// recipe inputs alive, has the storage recomputed by replaying its recipe
// (its dropped inputs first, the default CUDA generator set to the saved
// state of a random operator), and forgets a recipe. The recipes are
// captured by LmsRecipes.cpp; what the two share is LmsRecipesInternal.h.

// Large Model Support is CUDA-only; ROCm builds, which compile a hipified
// copy of this file, leave it out.
#ifndef USE_ROCM

#include <ATen/cuda/LmsRecipes.h>
#include <ATen/cuda/LmsRecipesInternal.h>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace at::cuda::lms::recipes {

using namespace detail;

namespace {

namespace engine = c10::cuda::lms;

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
    if (!t.defined()) {
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
          step_stack[step.input] = out;
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

} // namespace

void installHooks() {
  engine::setRecomputeHooks(&kHooks);
}

} // namespace at::cuda::lms::recipes

#endif // USE_ROCM
