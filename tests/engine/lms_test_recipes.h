#pragma once

// A fake of the recipes operator-boundary pinning records for recompute
// (c10::cuda::lms::RecomputeHooks): a storage's contents are the pattern of a
// seed, and "replaying its operator" writes that pattern into a new storage
// after pinning the storage it reads (input_of), which may itself be dropped.

#include "lms_test_data.h"
#include "lms_test_storage.h"

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

extern "C" {
// The simulated GPU's copy speed (bytes per second; 0: instant), where the
// tests run on it.
__attribute__((weak)) void simgpu_set_copy_bandwidth(double bytes_per_second);
}

namespace lms_test {

struct FakeRecipes {
  std::mutex mutex;
  std::map<void*, uint64_t> seed; // by DataPtr context
  double cost_ms = 0.0;
  // A storage's own replay cost (by DataPtr context), instead of cost_ms.
  std::map<void*, double> cost_of;
  bool valid = true;
  int forgotten = 0;
  int replays = 0;
  // Replays whose input was paged out when they began (paged in on demand).
  int inputs_paged_out = 0;
  // The storage of each replay, in order (for tests to take and clear):
  // those asked for, and those of inputs that a replay recomputed first.
  std::vector<c10::StorageImpl*> replayed;
  std::vector<c10::StorageImpl*> replayed_inputs;
  bool fail_next = false;
  // Pinned (and so recomputed first) before a storage is replayed.
  std::map<c10::StorageImpl*, c10::StorageImpl*> input_of;
};

inline FakeRecipes& recipes() {
  static FakeRecipes r;
  return r;
}

inline double fakeCost(c10::StorageImpl& storage) {
  FakeRecipes& r = recipes();
  std::lock_guard<std::mutex> lock(r.mutex);
  void* context = storage._mutable_data_ptr_no_checks().get_context();
  const bool known = r.seed.count(context) > 0;
  const auto own = r.cost_of.find(context);
  return !known || !r.valid    ? -1.0
      : own != r.cost_of.end() ? own->second
                               : r.cost_ms;
}

inline bool fakeRetain(c10::StorageImpl& storage) {
  return fakeCost(storage) >= 0.0;
}

// Replays of inputs under way on this thread (a recipe pinning its input).
inline thread_local int t_replay_depth = 0;

inline void fakeRecompute(c10::StorageImpl& storage) {
  FakeRecipes& r = recipes();
  uint64_t seed = 0;
  c10::StorageImpl* input = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.fail_next) {
      r.fail_next = false;
      TORCH_CHECK(false, "fake recompute failure");
    }
    seed = r.seed.at(storage._mutable_data_ptr_no_checks().get_context());
    const auto it = r.input_of.find(&storage);
    input = it != r.input_of.end() ? it->second : nullptr;
    ++r.replays;
    (t_replay_depth > 0 ? r.replayed_inputs : r.replayed).push_back(&storage);
  }
  if (input != nullptr) {
    if (c10::cuda::lms::getState(*input) ==
        c10::cuda::lms::StorageState::PagedOut) {
      std::lock_guard<std::mutex> lock(r.mutex);
      ++r.inputs_paged_out;
    }
    // Recomputes it first if it was dropped too.
    ++t_replay_depth;
    try {
      c10::cuda::lms::pinForRecompute(*input);
    } catch (...) {
      --t_replay_depth;
      throw;
    }
    --t_replay_depth;
  }
  auto fresh = newStorage(storage.nbytes());
  const auto words = pattern(storage.nbytes(), seed);
  C10_CUDA_CHECK(cudaMemcpyAsync(
      fresh->_mutable_data_ptr_no_checks().get(),
      words.data(),
      storage.nbytes(),
      cudaMemcpyHostToDevice,
      lms_test::stream()));
  C10_CUDA_CHECK(cudaStreamSynchronize(lms_test::stream()));
  if (input != nullptr) {
    c10::cuda::lms::unpin(*input);
  }
  void* old_context = storage._mutable_data_ptr_no_checks().get_context();
  void* context = c10::cuda::lms::fillDropped(storage, *fresh);
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.seed.erase(old_context);
    r.seed[context] = seed;
    if (const auto own = r.cost_of.find(old_context); own != r.cost_of.end()) {
      r.cost_of[context] = own->second;
      r.cost_of.erase(own);
    }
  }
  c10::cuda::lms::setRecomputable(storage, true);
}

inline void fakeForget(void* context) {
  FakeRecipes& r = recipes();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.seed.erase(context);
  r.cost_of.erase(context);
  ++r.forgotten;
}

// Appends the storage a recipe reads (input_of), for the schedule to page in
// ahead of the recompute.
inline void fakeInputs(
    c10::StorageImpl& storage,
    std::vector<c10::intrusive_ptr<c10::StorageImpl>>& out) {
  FakeRecipes& r = recipes();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.input_of.find(&storage);
  if (it != r.input_of.end()) {
    out.push_back(
        c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(it->second));
  }
}

// Gives `storage` a fake recipe: "replaying its operator" writes the pattern
// of `seed` after pinning `input` (none: nullptr); then marks it recomputable.
inline void giveRecipe(
    c10::StorageImpl& storage,
    uint64_t seed,
    c10::StorageImpl* input) {
  FakeRecipes& r = recipes();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.seed[storage._mutable_data_ptr_no_checks().get_context()] = seed;
    r.input_of[&storage] = input;
  }
  c10::cuda::lms::setRecomputable(storage, true);
}

// Forgets the input of `storage`'s fake recipe, before the storage is freed
// (a later storage may get its address).
inline void forgetInput(c10::StorageImpl& storage) {
  FakeRecipes& r = recipes();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.input_of.erase(&storage);
}

inline const c10::cuda::lms::RecomputeHooks kFakeHooks{
    &fakeCost,
    &fakeRetain,
    &fakeRecompute,
    &fakeForget,
    &fakeInputs};

// Installs the fake recipes, reset, with recompute on and (on the simulated
// GPU) copies that take time, for one test; undoes it all at the end.
class FakeRecipesInstalled {
 public:
  FakeRecipesInstalled() {
    FakeRecipes& r = recipes();
    {
      std::lock_guard<std::mutex> lock(r.mutex);
      r.seed.clear();
      r.cost_of.clear();
      r.input_of.clear();
      r.cost_ms = 0.0;
      r.valid = true;
      r.forgotten = 0;
      r.replays = 0;
      r.inputs_paged_out = 0;
      r.replayed.clear();
      r.replayed_inputs.clear();
      r.fail_next = false;
    }
    c10::cuda::lms::setRecomputeHooks(&kFakeHooks);
    was_enabled_ = c10::cuda::lms::isRecomputeEnabled();
    c10::cuda::lms::setRecomputeEnabled(true);
    // A drop is priced against the measured bus: copies must take time.
    if (simgpu_set_copy_bandwidth != nullptr) {
      simgpu_set_copy_bandwidth(2e9);
    }
  }
  FakeRecipesInstalled(const FakeRecipesInstalled&) = delete;
  FakeRecipesInstalled& operator=(const FakeRecipesInstalled&) = delete;
  ~FakeRecipesInstalled() {
    c10::cuda::lms::setRecomputeEnabled(was_enabled_);
    c10::cuda::lms::setRecomputeHooks(nullptr);
    if (simgpu_set_copy_bandwidth != nullptr) {
      simgpu_set_copy_bandwidth(0);
    }
  }

 private:
  bool was_enabled_ = true; // the setting before, put back at the end
};

} // namespace lms_test
