// The learned swap schedule: period detection and next-use prediction of
// AccessSchedule on their own, then the engine driven by a synthetic training
// loop (forward, loss, backward, optimizer) through beginOperator(), on the
// simulated GPU in CI and on a real GPU alike.
//
// Each simulated operator pins its inputs, checks that every input holds the
// bytes its last writer stored, writes its outputs, and ends with a device
// synchronization: a page-in queued at an earlier operator boundary is then
// complete when the next operator pins its storage, and one queued at the
// operator's own boundary (not ahead) is still running (counted as
// prefetch_late) or is a demand page-in (pagein_demand_count).

#include "lms_test.h"
#include "lms_test_allocator.h"
#include "lms_test_data.h"
#include "lms_test_recipes.h"

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/cuda/LargeModelSupportSchedule.h>
#include <c10/util/Exception.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10_compat.h>
#pragma GCC diagnostic pop

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

extern "C" {
__attribute__((weak)) size_t simgpu_device_bytes_in_use(int device);
__attribute__((weak)) size_t simgpu_host_bytes_in_use(void);
}

namespace {

namespace lms = c10::cuda::lms;
namespace cca = c10::cuda::CUDACachingAllocator;
using StoragePtr = c10::intrusive_ptr<c10::StorageImpl>;
using Schedule = lms::AccessSchedule;

constexpr size_t kMiB = 1024 * 1024;

// ---------------------------------------------------------------------------
// AccessSchedule alone

// Records one operator whose inputs are identified by (touch, size).
uint64_t recordOp(
    Schedule& s,
    const std::string& name,
    std::vector<Schedule::Use> uses) {
  return s.record(name, uses.data(), uses.size());
}

// A toy iteration: four "storages" p, q, r (each touched by op a, then used
// once more by b, c and d in that order) plus two filler operators.
struct ToyLoop {
  std::map<char, uint64_t> touch;
  std::map<char, uint64_t> gap;
  std::map<char, uint64_t> size{{'p', 100}, {'q', 200}, {'r', 300}};

  uint64_t op(Schedule& s, const std::string& name, const std::string& ins) {
    std::vector<Schedule::Use> uses;
    for (const char c : ins) {
      uses.push_back({touch[c], size[c], gap[c]});
    }
    const uint64_t t = recordOp(s, name, uses);
    for (const char c : ins) {
      gap[c] = t - touch[c];
      touch[c] = t;
    }
    return t;
  }

  void iteration(Schedule& s) {
    op(s, "a", "pqr");
    op(s, "fill", "");
    op(s, "b", "p");
    op(s, "c", "q");
    op(s, "fill", "");
    op(s, "d", "r");
  }
};

TEST_CASE(schedule_detects_the_period_and_predicts_next_uses) {
  Schedule s;
  ToyLoop loop;
  // A prefix that is not part of the loop.
  recordOp(s, "setup", {});
  recordOp(s, "init", {{0, 7, 0}});
  int iterations = 0;
  while (!s.active() && iterations < 20) {
    loop.iteration(s);
    ++iterations;
  }
  REQUIRE(s.active());
  CHECK_EQ(s.period(), uint64_t(6));
  // 16 matching operators at least: the loop repeats four times at most.
  CHECK(iterations <= 5);
  CHECK_EQ(s.detections(), int64_t(1));
  CHECK_EQ(s.fallbacks(), int64_t(0));
  // At an iteration boundary: check the predictions after op a.
  const uint64_t t = loop.op(s, "a", "pqr");
  REQUIRE(s.active());
  CHECK_EQ(s.nextUse(t, 100, loop.gap['p']), t + 2); // b
  CHECK_EQ(s.nextUse(t, 200, loop.gap['q']), t + 3); // c
  CHECK_EQ(s.nextUse(t, 300, loop.gap['r']), t + 5); // d
  // A size the period never uses: no prediction.
  CHECK_EQ(s.nextUse(t, 12345, 1), Schedule::kNever);
}

TEST_CASE(schedule_predicts_storages_freed_before_any_further_use) {
  Schedule s;
  ToyLoop loop;
  while (!s.active()) {
    loop.iteration(s);
  }
  // A storage of 400 bytes that op a touches and that is freed, unused, two
  // operators later (a temporary the forward pass keeps for a while); p is
  // used again by b. Before any death is seen, nothing is predicted.
  const uint64_t kGap = 5;
  uint64_t t = loop.op(s, "a", "pqr");
  CHECK_EQ(s.deathBeforeUse(t, 400, kGap), Schedule::kNever);
  loop.op(s, "fill", "");
  loop.op(s, "b", "p");
  s.recordDeath(t, 400, kGap);
  // A death more than a period after the touch is not a pattern.
  s.recordDeath(s.now() - s.period() - 1, 800, kGap);
  loop.op(s, "c", "q");
  loop.op(s, "fill", "");
  loop.op(s, "d", "r");
  // The next iteration: such a storage is expected to die two operators
  // after its touch, before any use; p and the long-lived one are not.
  t = loop.op(s, "a", "pqr");
  REQUIRE(s.active());
  CHECK_EQ(s.deathBeforeUse(t, 400, kGap), t + 2);
  CHECK_EQ(s.deathBeforeUse(t, 400, kGap + 1), Schedule::kNever);
  CHECK_EQ(s.deathBeforeUse(t, 100, loop.gap['p']), Schedule::kNever);
  CHECK_EQ(s.deathBeforeUse(t - s.period() - 1, 800, kGap), Schedule::kNever);
  // A death that does not come before the next use is no prediction: a
  // storage touched like p that is freed when b uses p.
  const uint64_t p_gap = loop.gap['p'];
  loop.op(s, "fill", "");
  loop.op(s, "b", "p");
  s.recordDeath(t, 100, p_gap);
  CHECK_EQ(s.deathBeforeUse(t, 100, p_gap), Schedule::kNever);
  loop.op(s, "c", "q");
  // Once the expected death has passed and the storage lives on, it is not
  // expected to die any more.
  CHECK_EQ(s.deathBeforeUse(t, 400, kGap), Schedule::kNever);
  // A dropped schedule forgets its deaths.
  loop.op(s, "eval", "p");
  REQUIRE(!s.active());
  loop.op(s, "fill", "");
  loop.op(s, "d", "r");
  for (int i = 0; i < 8 && !s.active(); ++i) {
    loop.iteration(s);
  }
  REQUIRE(s.active());
  t = loop.op(s, "a", "pqr");
  CHECK_EQ(s.deathBeforeUse(t, 400, kGap), Schedule::kNever);
}

TEST_CASE(schedule_falls_back_when_the_pattern_breaks_and_relearns) {
  Schedule s;
  s.setLogging(true);
  ToyLoop loop;
  for (int i = 0; i < 6; ++i) {
    loop.iteration(s);
  }
  REQUIRE(s.active());
  CHECK_EQ(s.takeDropReport(), std::string());
  const uint64_t generation = s.generation();
  // An evaluation step: other operators.
  loop.op(s, "eval", "p");
  CHECK(!s.active());
  CHECK_EQ(s.fallbacks(), int64_t(1));
  // The report names the operator that broke the pattern and the one it
  // replaced, with their inputs; it is handed out once.
  const std::string report = s.takeDropReport();
  CHECK(
      report.find("eval with inputs [size 100 last used") != std::string::npos);
  CHECK(report.find("a period earlier: a with inputs [") != std::string::npos);
  CHECK_EQ(s.takeDropReport(), std::string());
  // Traced operators are reported with their inputs, whether or not they
  // break anything.
  s.setTracedOperators(s.now() + 2, s.now() + 2);
  loop.op(s, "a", "pqr");
  CHECK_EQ(s.takeDropReport(), std::string());
  const uint64_t gap = loop.gap['p'];
  const uint64_t traced = loop.op(s, "fill", "p");
  CHECK_EQ(
      s.takeDropReport(),
      "operator " + std::to_string(traced) +
          ": fill with inputs [size 100 last used 1 ops ago, gap " +
          std::to_string(gap) + "]");
  CHECK(s.generation() != generation);
  CHECK_EQ(s.nextUse(loop.touch['p'], 100, loop.gap['p']), Schedule::kNever);
  // Other shapes: q and r grow. The new loop is learned.
  loop.size['q'] = 400;
  loop.size['r'] = 600;
  for (int i = 0; i < 8 && !s.active(); ++i) {
    loop.iteration(s);
  }
  CHECK(s.active());
  CHECK_EQ(s.period(), uint64_t(6));
  CHECK_EQ(s.detections(), int64_t(2));
}

TEST_CASE(schedule_does_not_take_repeated_layers_for_an_iteration) {
  // Forty identical layers, then a different tail: a period of one layer
  // must not be adopted while the stack repeats fewer than kMinConfirm ops.
  Schedule s;
  for (int iteration = 0; iteration < 6; ++iteration) {
    for (int layer = 0; layer < 4; ++layer) {
      recordOp(s, "layer", {});
      recordOp(s, "act", {});
    }
    recordOp(s, "loss", {});
    recordOp(s, "step", {});
  }
  REQUIRE(s.active());
  CHECK_EQ(s.period(), uint64_t(10));
}

TEST_CASE(schedule_predicts_alike_storages_used_at_different_distances) {
  // p and q have one size and are touched together by "a" after being
  // touched together by "z": the schedule cannot tell them apart. p is used
  // again one operator after "a", q four. Once p's use has passed, the
  // prediction for a storage like them is q's use, not "never" (which would
  // make q the first victim although it is needed three operators later).
  Schedule s;
  std::map<char, uint64_t> touch;
  std::map<char, uint64_t> gap;
  const auto op = [&](const std::string& name, const std::string& ins) {
    std::vector<Schedule::Use> uses;
    for (const char c : ins) {
      uses.push_back({touch[c], 100, gap[c]});
    }
    const uint64_t t = recordOp(s, name, uses);
    for (const char c : ins) {
      gap[c] = t - touch[c];
      touch[c] = t;
    }
    return t;
  };
  uint64_t a = 0;
  const auto iteration = [&] {
    a = op("a", "pq");
    op("b", "p");
    op("fill", "");
    op("fill", "");
    op("c", "q");
    op("z", "pq");
  };
  for (int i = 0; i < 8; ++i) {
    iteration();
  }
  REQUIRE(s.active());
  CHECK_EQ(s.period(), uint64_t(6));
  a = op("a", "pq");
  // Right after "a": the sooner of the two uses.
  CHECK_EQ(s.nextUse(a, 100, 1), a + 1);
  op("b", "p");
  op("fill", "");
  // p's use has passed: q's is still ahead.
  CHECK_EQ(s.nextUse(a, 100, 1), a + 4);
  op("fill", "");
  op("c", "q");
  op("z", "pq");
  // Both uses have passed unseen by this storage: never.
  CHECK_EQ(s.nextUse(a, 100, 1), Schedule::kNever);
}

TEST_CASE(schedule_does_not_take_a_stack_of_identical_layers_for_an_iteration) {
  // Thirty layers with a parameter each (all of one size), then a loss: the
  // layers' operators look alike, and 30 of them in a row match one layer
  // later (more than kMinConfirm). But each layer's parameter was last used
  // an iteration ago, further back than a layer: that period is never
  // adopted, and the iteration's (31 operators) is, without a fallback.
  Schedule s;
  s.setLogging(true);
  std::vector<uint64_t> touch(30, 0);
  std::vector<uint64_t> gap(30, 0);
  const auto iteration = [&] {
    for (size_t layer = 0; layer < touch.size(); ++layer) {
      const uint64_t t =
          recordOp(s, "layer", {{touch[layer], 4096, gap[layer]}});
      gap[layer] = t - touch[layer];
      touch[layer] = t;
    }
    recordOp(s, "loss", {});
  };
  for (int i = 0; i < 4; ++i) {
    iteration();
    CHECK(!s.active() || s.period() == 31);
  }
  REQUIRE(s.active());
  CHECK_EQ(s.period(), uint64_t(31));
  CHECK_EQ(s.fallbacks(), int64_t(0));
  CHECK_EQ(s.takeDropReport(), std::string());
}

// ---------------------------------------------------------------------------
// The engine, driven by operators

using lms_test::pattern;

int deviceCount() {
  int n = 0;
  C10_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

size_t allocatedBytes() {
  return static_cast<size_t>(
      lms_compat::aggregate(cca::getDeviceStats(0).allocated_bytes));
}

cudaStream_t stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

// A storage and the seed of the pattern its last writer stored.
struct Tensor {
  StoragePtr storage;
  uint64_t seed = 0;
};

class Runner {
 public:
  explicit Runner(size_t limit) {
    static bool initialized = [] {
      cca::init(deviceCount());
      return true;
    }();
    (void)initialized;
    c10::cuda::set_device(0);
    lms::setEnabled(true);
    lms::setSizeThreshold(1 * kMiB);
    lms::setPrefetchDepth(0);
    lms::setSpeculativeMargin(0);
    lms::setScheduleEnabled(true);
    lms::setLookahead(0);
    lms::setPrefetchBudget(0);
    lms::resetSchedule();
    lms::setLimit(0, limit);
    lms::resetAccumulatedStats(0);
    lms::resetPeakStats(0);
  }
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  ~Runner() {
    lms::setLookahead(0);
    lms::setPrefetchBudget(0);
    lms::resetSchedule();
  }

  Tensor make(size_t bytes, uint64_t seed) {
    Tensor t{newStorage(bytes), seed};
    fill(t);
    return t;
  }

  // One operator: reads `inputs` (each must hold its pattern), then lets
  // `body` allocate and write outputs, as a kernel would.
  void op(
      const char* name,
      const std::vector<Tensor*>& inputs,
      const std::function<void()>& body = [] {}) {
    std::vector<c10::StorageImpl*> storages;
    for (Tensor* t : inputs) {
      storages.push_back(t->storage.get());
    }
    lms::beginOperator(
        name,
        c10::ArrayRef<c10::StorageImpl*>(storages.data(), storages.size()));
    if (after_begin) {
      after_begin();
    }
    for (c10::StorageImpl* s : storages) {
      if (before_pin) {
        before_pin(*s);
      }
      lms::pin(*s);
    }
    for (Tensor* t : inputs) {
      if (!holds(*t)) {
        ++mismatches;
      }
    }
    body();
    // The "kernel" is done before the next operator starts, and so is every
    // copy queued so far, on any stream.
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    for (c10::StorageImpl* s : storages) {
      lms::unpin(*s);
    }
    if (after_op) {
      after_op();
    }
  }

  // One operator whose inputs may not all fit, as operator-boundary pinning
  // runs it: inputs are pinned in address order until one cannot be made
  // resident; the paged-out ones after it are used over the bus (their host
  // copies), the resident ones are still pinned. Returns the inputs used over
  // the bus.
  int opOverBus(const char* name, const std::vector<Tensor*>& inputs) {
    std::vector<c10::StorageImpl*> storages;
    for (Tensor* t : inputs) {
      storages.push_back(t->storage.get());
    }
    std::sort(storages.begin(), storages.end());
    lms::beginOperator(
        name,
        c10::ArrayRef<c10::StorageImpl*>(storages.data(), storages.size()));
    std::vector<c10::StorageImpl*> pinned;
    std::vector<c10::StorageImpl*> on_host;
    bool failed = false;
    for (c10::StorageImpl* s : storages) {
      if (!failed || lms::getState(*s) != lms::StorageState::PagedOut) {
        try {
          lms::pin(*s);
          pinned.push_back(s);
          continue;
        } catch (const c10::OutOfMemoryError&) {
          failed = true;
        }
      }
      lms::beginHostUse(*s);
      on_host.push_back(s);
    }
    for (Tensor* t : inputs) {
      if (!holds(*t)) {
        ++mismatches;
      }
    }
    for (c10::StorageImpl* s : pinned) {
      lms::unpin(*s);
    }
    for (c10::StorageImpl* s : on_host) {
      lms::endHostUse(*s);
    }
    return static_cast<int>(on_host.size());
  }

  // An output of the running operator: allocated, written, reclaimable when
  // the operator ends (as operator-boundary pinning releases outputs).
  Tensor output(size_t bytes, uint64_t seed) {
    Tensor t{newStorage(bytes), seed};
    write(t);
    outputs_.push_back(t.storage);
    return t;
  }

  // A scratch buffer of the running operator (a workspace, or the logits a
  // loss makes and frees): allocated and written, freed when the caller
  // drops it, before the operator ends.
  Tensor scratch(size_t bytes, uint64_t seed) {
    Tensor t{newStorage(bytes), seed};
    write(t);
    return t;
  }

  void endOutputs() {
    for (const StoragePtr& s : outputs_) {
      lms::releaseOutput(*s);
    }
    outputs_.clear();
  }

  // In-place update of an input of the running operator.
  void update(Tensor& t, uint64_t seed) {
    t.seed = seed;
    write(t);
  }

  int mismatches = 0;
  // Called after each operator of op(), to watch the engine between them.
  std::function<void()> after_op;
  // Called after the schedule acted at an operator boundary, before the
  // operator pins its inputs; and before each of those pins.
  std::function<void()> after_begin;
  std::function<void(c10::StorageImpl&)> before_pin;

 private:
  static StoragePtr newStorage(size_t bytes) {
    return c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(),
        static_cast<int64_t>(bytes),
        cca::get(),
        /*resizable=*/false);
  }

  void fill(Tensor& t) {
    lms::pin(*t.storage);
    write(t);
    C10_CUDA_CHECK(cudaStreamSynchronize(stream()));
    lms::unpin(*t.storage);
  }

  static void write(const Tensor& t) {
    const auto words = pattern(t.storage->nbytes(), t.seed);
    C10_CUDA_CHECK(cudaMemcpyAsync(
        lms_compat::mutableData(*t.storage),
        words.data(),
        t.storage->nbytes(),
        cudaMemcpyHostToDevice,
        stream()));
  }

  // Reads where the operator's kernel would: the DataPtr (device memory, or
  // the host copy of an input used over the bus), without raw access, which
  // would page the storage in.
  static bool holds(const Tensor& t) {
    const auto expected = pattern(t.storage->nbytes(), t.seed);
    std::vector<uint64_t> got(expected.size());
    C10_CUDA_CHECK(cudaMemcpyAsync(
        got.data(),
        t.storage->_mutable_data_ptr_no_checks().get(),
        t.storage->nbytes(),
        cudaMemcpyDefault,
        stream()));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream()));
    return std::memcmp(got.data(), expected.data(), t.storage->nbytes()) == 0;
  }

  std::vector<StoragePtr> outputs_;
};

constexpr int kLayers = 6;
constexpr size_t kWeight = 2 * kMiB;
constexpr size_t kActivation = 4 * kMiB;
// Operators per training iteration: input, forward layers, loss, backward
// layers, optimizer steps.
constexpr uint64_t kOpsPerIteration = 1 + kLayers + 1 + kLayers + kLayers;

struct Model {
  std::vector<Tensor> weights;
};

// Called with each forward layer's activation and the tensor it was made
// from, after the layer's operator and before its outputs are released; and
// with each activation before the backward pass frees it.
struct LayerHooks {
  std::function<void(Tensor& activation, Tensor& input)> made;
  std::function<void(Tensor& activation)> freed;
};

// One training iteration (or, with `train` false, an evaluation step: the
// forward pass alone). With `temporaries`, each forward layer also writes a
// temporary that nothing reads and that lives for two more operators (a
// buffer a framework keeps for a while, then frees). With `loss_scratch`,
// the loss allocates a scratch buffer of that many bytes and frees it
// before it ends (a language model's logits and their log-softmax).
void iterate(
    Runner& run,
    Model& m,
    int iteration,
    bool train = true,
    bool temporaries = false,
    const LayerHooks& hooks = {},
    size_t loss_scratch = 0) {
  const int layers = static_cast<int>(m.weights.size());
  const uint64_t base = static_cast<uint64_t>(iteration) * 1000;
  Tensor x;
  run.op("input", {}, [&] { x = run.output(kActivation, base + 999); });
  run.endOutputs();
  std::vector<Tensor> acts;
  acts.reserve(layers); // `prev` points into it
  Tensor* prev = &x;
  std::vector<Tensor> temps(layers);
  for (int i = 0; i < layers; ++i) {
    Tensor a;
    run.op("forward", {&m.weights[i], prev}, [&] {
      a = run.output(kActivation, base + i);
      if (temporaries) {
        temps[i] = run.output(kActivation, base + 400 + i);
      }
    });
    if (hooks.made) {
      hooks.made(a, *prev);
    }
    run.endOutputs();
    if (i >= 2) {
      temps[i - 2] = Tensor{};
    }
    acts.push_back(a);
    prev = &acts.back();
  }
  temps.clear();
  if (!train) {
    return;
  }
  Tensor grad;
  run.op("loss", {&acts.back()}, [&] {
    if (loss_scratch > 0) {
      const Tensor logits = run.scratch(loss_scratch, base + 150);
    }
    grad = run.output(kActivation, base + 100);
  });
  run.endOutputs();
  for (int i = layers - 1; i >= 0; --i) {
    Tensor next;
    run.op("backward", {&m.weights[i], &acts[i], &grad}, [&] {
      next = run.output(kActivation, base + 200 + i);
    });
    run.endOutputs();
    grad = next;
    if (hooks.freed) {
      hooks.freed(acts[i]);
    }
    acts[i] = Tensor{}; // freed after its last use, as autograd does
  }
  for (int i = 0; i < layers; ++i) {
    run.op("step", {&m.weights[i]}, [&] {
      run.update(m.weights[i], base + 300 + i);
    });
  }
}

Model makeModel(Runner& run, int layers = kLayers) {
  Model m;
  for (int i = 0; i < layers; ++i) {
    m.weights.push_back(run.make(kWeight, 50 + i));
  }
  return m;
}

void checkBaseline() {
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  const auto st = lms::getStats(0);
  CHECK_EQ(st.managed_bytes.current, 0);
  CHECK_EQ(st.pagedout_bytes.current, 0);
  CHECK_EQ(allocatedBytes(), size_t(0));
  cca::emptyCache();
  if (simgpu_device_bytes_in_use != nullptr) {
    CHECK_EQ(simgpu_device_bytes_in_use(0), size_t(0));
    CHECK_EQ(simgpu_host_bytes_in_use(), size_t(0));
  }
}

// The forward pass of iterate() without its temporaries, for tests that
// drive the rest themselves: the input (its pattern seeded `base` + 999; the
// caller keeps it alive, as iterate() does) and the layers' activations in
// `acts` (seeded `base` + layer).
Tensor forwardPass(
    Runner& run,
    Model& m,
    uint64_t base,
    std::vector<Tensor>& acts) {
  Tensor x;
  run.op("input", {}, [&] { x = run.output(kActivation, base + 999); });
  run.endOutputs();
  acts.clear();
  acts.reserve(m.weights.size()); // `prev` points into it
  Tensor* prev = &x;
  for (size_t i = 0; i < m.weights.size(); ++i) {
    Tensor a;
    run.op("forward", {&m.weights[i], prev}, [&] {
      a = run.output(kActivation, base + i);
    });
    run.endOutputs();
    acts.push_back(a);
    prev = &acts.back();
  }
  return x;
}

// A compiled graph knows the order in which it uses its inputs and says so
// (pageInAhead) before it needs them: the backward pass below names the next
// three saved activations before each layer, with the learned schedule off.
// Storages it names are paged in ahead of use, within the budget; when the
// limit leaves no room, others (least recently used, not named) are paged out
// early to make some. Returns the statistics of the last two iterations.
// (Peak demand: weights 12 MiB, activations 24 MiB, an input and two
// gradients, about 48 MiB.)
lms::LmsStats trainWithGraphPlan(size_t limit, bool plan) {
  Runner run(limit);
  lms::setScheduleEnabled(false);
  lms::setGraphPrefetchEnabled(plan);
  lms::setPrefetchBudget(12 * kMiB);
  lms::LmsStats st;
  {
    Model m = makeModel(run);
    for (int iteration = 0; iteration < 4; ++iteration) {
      if (iteration == 2) {
        lms::resetAccumulatedStats(0);
      }
      const uint64_t base = static_cast<uint64_t>(iteration) * 1000;
      std::vector<Tensor> acts;
      const Tensor x = forwardPass(run, m, base, acts);
      Tensor grad;
      run.op("loss", {&acts.back()}, [&] {
        grad = run.output(kActivation, base + 100);
      });
      run.endOutputs();
      for (int i = kLayers - 1; i >= 0; --i) {
        std::vector<c10::StorageImpl*> next;
        for (int j = i - 1; j >= std::max(0, i - 3); --j) {
          next.push_back(acts[j].storage.get());
          next.push_back(m.weights[j].storage.get());
        }
        lms::pageInAhead(
            c10::ArrayRef<c10::StorageImpl*>(next.data(), next.size()));
        Tensor out;
        run.op("backward", {&m.weights[i], &acts[i], &grad}, [&] {
          out = run.output(kActivation, base + 200 + i);
        });
        run.endOutputs();
        grad = out;
        acts[i] = Tensor{};
      }
      for (int i = 0; i < kLayers; ++i) {
        run.op("step", {&m.weights[i]}, [&] {
          run.update(m.weights[i], base + 300 + i);
        });
      }
    }
    st = lms::getStats(0);
    CHECK_EQ(run.mismatches, 0);
  }
  lms::setScheduleEnabled(true);
  lms::setGraphPrefetchEnabled(true);
  return st;
}

struct PlanRuns {
  lms::LmsStats off; // graph prefetch off
  lms::LmsStats on;
};

// The loop above under `limit` without the plan and with it, reported.
PlanRuns trainWithAndWithoutGraphPlan(size_t limit) {
  PlanRuns runs;
  runs.off = trainWithGraphPlan(limit, false);
  checkBaseline();
  runs.on = trainWithGraphPlan(limit, true);
  checkBaseline();
  std::printf(
      "  demand page-ins %lld without the plan, %lld with it; %lld planned "
      "page-ins, %lld hits, %lld early page-outs for room\n",
      static_cast<long long>(runs.off.pagein_demand_count),
      static_cast<long long>(runs.on.pagein_demand_count),
      static_cast<long long>(runs.on.graph_prefetch_count),
      static_cast<long long>(runs.on.prefetch_hits),
      static_cast<long long>(runs.on.graph_pageout_count));
  return runs;
}

TEST_CASE(a_compiled_graph_plan_pages_in_ahead_without_a_schedule) {
  const auto [off, on] = trainWithAndWithoutGraphPlan(28 * kMiB);
  // The behaviour under test happened: storages were paged out, and without
  // the plan every one came back on demand.
  CHECK(off.pageout_count > 0);
  CHECK(off.pagein_demand_count > 0);
  CHECK_EQ(off.graph_prefetch_count, int64_t(0));
  CHECK_EQ(off.graph_pageout_count, int64_t(0));
  // With it, named storages came in ahead and were found resident.
  CHECK(on.graph_prefetch_count > 0);
  CHECK(on.prefetch_hits > 0);
  CHECK(on.pagein_demand_count < off.pagein_demand_count);
  // No schedule was learned: the plan did it alone.
  CHECK_EQ(on.schedule_prefetch_count, int64_t(0));
}

// Under a limit that the backward pass fills, the plan's page-ins find no
// room: storages it does not name are paged out early for them, and the
// next call pages in.
TEST_CASE(a_compiled_graph_plan_makes_room_for_its_page_ins) {
  const auto [off, on] = trainWithAndWithoutGraphPlan(24 * kMiB);
  CHECK(on.graph_pageout_count > 0);
  CHECK(on.early_pageout_count >= on.graph_pageout_count);
  CHECK(on.graph_prefetch_count > 0);
  CHECK(on.pagein_demand_count < off.pagein_demand_count);
}

// Once a learned schedule is active it pages in ahead what a compiled graph
// would name (and knows the rest of the iteration): the plan steps aside.
TEST_CASE(a_compiled_graph_plan_steps_aside_for_a_learned_schedule) {
  {
    Runner run(36 * kMiB);
    lms::setPrefetchBudget(12 * kMiB);
    lms::setLookahead(6);
    Model m = makeModel(run);
    for (int iteration = 0; iteration < 4; ++iteration) {
      iterate(run, m, iteration);
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    // The forward pass of the next iteration, which does not fit: some of
    // its storages are paged out when the plan names them all.
    std::vector<Tensor> acts;
    const Tensor x = forwardPass(run, m, 4000, acts);
    std::vector<c10::StorageImpl*> all;
    for (int i = 0; i < kLayers; ++i) {
      all.push_back(acts[i].storage.get());
      all.push_back(m.weights[i].storage.get());
    }
    const lms::LmsStats before = lms::getStats(0);
    REQUIRE(before.pagedout_bytes.current > 0);
    CHECK_EQ(
        lms::pageInAhead(
            c10::ArrayRef<c10::StorageImpl*>(all.data(), all.size())),
        size_t(0));
    CHECK_EQ(lms::getStats(0).graph_prefetch_count, int64_t(0));
    // Without the schedule, the same call pages in.
    lms::setScheduleEnabled(false);
    CHECK(
        lms::pageInAhead(
            c10::ArrayRef<c10::StorageImpl*>(all.data(), all.size())) > 0);
    CHECK(lms::getStats(0).graph_prefetch_count > 0);
    lms::setScheduleEnabled(true);
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

TEST_CASE(training_loop_runs_on_the_learned_schedule) {
  {
    // Peak demand: weights 12 MiB, activations 24 MiB, two gradients and an
    // input: about 48 MiB, under a 36 MiB limit.
    Runner run(36 * kMiB);
    lms::setPrefetchBudget(12 * kMiB);
    lms::setLookahead(6);
    Model m = makeModel(run);
    int iteration = 0;
    for (; iteration < 4; ++iteration) {
      iterate(run, m, iteration);
    }
    auto st = lms::getStats(0);
    REQUIRE(st.schedule_active == 1);
    CHECK_EQ(st.schedule_period, int64_t(kOpsPerIteration));
    CHECK_EQ(st.schedule_fallbacks, int64_t(0));
    CHECK(st.pageout_count > 0); // the loop does not fit: it must swap
    lms::resetAccumulatedStats(0);
    for (; iteration < 8; ++iteration) {
      iterate(run, m, iteration);
    }
    st = lms::getStats(0);
    std::printf(
        "  steady state, 4 iterations: %lld page-outs (%lld early), %lld "
        "page-ins (%lld ahead, %lld on demand, %lld late), %lld rescued, "
        "%lld victims by next use, %.1f MiB out, %.1f MiB in\n",
        static_cast<long long>(st.pageout_count),
        static_cast<long long>(st.early_pageout_count),
        static_cast<long long>(st.pagein_count),
        static_cast<long long>(st.schedule_prefetch_count),
        static_cast<long long>(st.pagein_demand_count),
        static_cast<long long>(st.prefetch_late),
        static_cast<long long>(st.schedule_rescues),
        static_cast<long long>(st.schedule_victims),
        static_cast<double>(st.pageout_bytes) / kMiB,
        static_cast<double>(st.pagein_bytes) / kMiB);
    CHECK_EQ(st.schedule_active, int64_t(1));
    CHECK_EQ(st.schedule_fallbacks, int64_t(0));
    // Page-outs are made early, after a last use, not when an allocation
    // needs the memory.
    CHECK(st.early_pageout_count > 0);
    CHECK(st.early_pageout_count * 2 >= st.pageout_count);
    // Every page-in is issued ahead of use on the H2D stream and complete
    // when its operator pins the storage: no compute stream waits.
    CHECK(st.schedule_prefetch_count > 0);
    CHECK_EQ(st.pagein_demand_count, int64_t(0));
    CHECK_EQ(st.prefetch_late, int64_t(0));
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

// Recompute on the learned schedule: each layer's activation has a recipe
// that reads the activation before it (as a convolution's output is made from
// its saved input), which the backward pass uses only after it. Under the
// limit some are dropped; the schedule files a dropped storage under its next
// use like a paged-out one and pages its recipe's input in ahead of it, so
// the recompute, on demand, finds the input resident.
TEST_CASE(
    the_inputs_of_dropped_storages_are_paged_in_ahead_of_their_recompute) {
  lms_test::FakeRecipes& fake = lms_test::recipes();
  {
    const lms_test::FakeRecipesInstalled installed;
    // Peak demand about 48 MiB: at 42 MiB a few activations are dropped and
    // the inputs paged in for their recompute stay until it.
    Runner run(42 * kMiB);
    lms::setPrefetchBudget(12 * kMiB);
    lms::setLookahead(6);
    Model m = makeModel(run);
    LayerHooks recipes;
    recipes.made = [&](Tensor& a, Tensor& input) {
      lms_test::giveRecipe(*a.storage, a.seed, input.storage.get());
    };
    recipes.freed = [&](Tensor& a) { lms_test::forgetInput(*a.storage); };
    const auto train = [&](int iteration) {
      iterate(
          run, m, iteration, /*train=*/true, /*temporaries=*/false, recipes);
    };
    int iteration = 0;
    for (; iteration < 4; ++iteration) {
      train(iteration);
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    lms::resetAccumulatedStats(0);
    {
      std::lock_guard<std::mutex> lock(fake.mutex);
      fake.inputs_paged_out = 0;
    }
    for (; iteration < 8; ++iteration) {
      train(iteration);
    }
    const auto st = lms::getStats(0);
    int inputs_paged_out = 0;
    {
      std::lock_guard<std::mutex> lock(fake.mutex);
      inputs_paged_out = fake.inputs_paged_out;
    }
    std::printf(
        "  steady state, 4 iterations: %lld dropped, %lld recomputed (%d "
        "with the input paged out), %lld recipe inputs paged in ahead, %lld "
        "page-ins on demand, %lld page-outs\n",
        static_cast<long long>(st.drop_count),
        static_cast<long long>(st.recompute_count),
        inputs_paged_out,
        static_cast<long long>(st.recompute_input_prefetch_count),
        static_cast<long long>(st.pagein_demand_count),
        static_cast<long long>(st.pageout_count));
    CHECK_EQ(st.schedule_active, int64_t(1));
    CHECK(st.drop_count > 0);
    CHECK(st.recompute_count > 0);
    CHECK(st.recompute_input_prefetch_count > 0);
    // Without the inputs paged in ahead, every recompute here finds its input
    // paged out and pages it in on demand.
    CHECK_EQ(inputs_paged_out, 0);
    CHECK_EQ(
        st.recompute_input_prefetch_bytes,
        st.recompute_input_prefetch_count * int64_t(kActivation));
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

// Recompute ahead of use: the loop of the test above, where the schedule
// also replays a dropped storage itself, at an operator boundary before its
// use, once its recipe's input is resident. Each replay is watched: one made
// at a boundary (after the schedule acted, before the operator pins) is
// ahead of use, one made by a pin is on demand.
struct AheadSeen {
  lms::LmsStats stats; // the steady state's
  int ahead = 0; // replays made at boundaries, asked for
  int ahead_inputs = 0; // and of dropped inputs those replays read
  int most_at_a_boundary = 0;
  int boundaries_at_most = 0; // boundaries with most_at_a_boundary replays
  int replayed_twice = 0; // replayed ahead, dropped again before its use
  int dropped_at_pin = 0; // recomputed on demand
  int used_after_replay = 0;
  int freed_unused = 0; // replayed ahead, freed before any use
  int ahead_miscounted = 0; // boundaries where the statistic disagreed
  int mismatches = 0;
};

AheadSeen recomputeAheadLoop(size_t limit, int layers, int lookahead) {
  lms_test::FakeRecipes& fake = lms_test::recipes();
  AheadSeen seen;
  const lms_test::FakeRecipesInstalled installed;
  Runner run(limit);
  lms::setPrefetchBudget(12 * kMiB);
  lms::setLookahead(lookahead);
  Model m = makeModel(run, layers);
  LayerHooks recipes;
  recipes.made = [&](Tensor& a, Tensor& input) {
    lms_test::giveRecipe(*a.storage, a.seed, input.storage.get());
  };
  std::set<c10::StorageImpl*> unused; // replayed ahead, not pinned since
  bool watching = false;
  int64_t ahead_counted = 0; // recompute_ahead_count, boundary by boundary
  int inputs_made = 0; // replays of dropped inputs, since the last take()
  const auto take = [&] {
    std::lock_guard<std::mutex> lock(fake.mutex);
    std::vector<c10::StorageImpl*> made;
    made.swap(fake.replayed);
    inputs_made = static_cast<int>(fake.replayed_inputs.size());
    fake.replayed_inputs.clear();
    return made;
  };
  recipes.freed = [&](Tensor& a) {
    lms_test::forgetInput(*a.storage);
    seen.freed_unused += static_cast<int>(unused.erase(a.storage.get()));
  };
  run.after_begin = [&] {
    const std::vector<c10::StorageImpl*> made = take();
    if (!watching) {
      return;
    }
    const int n = static_cast<int>(made.size()) + inputs_made;
    seen.ahead += static_cast<int>(made.size());
    seen.ahead_inputs += inputs_made;
    if (n > 0 && n == seen.most_at_a_boundary) {
      ++seen.boundaries_at_most;
    } else if (n > seen.most_at_a_boundary) {
      seen.most_at_a_boundary = n;
      seen.boundaries_at_most = 1;
    }
    for (c10::StorageImpl* s : made) {
      if (!unused.insert(s).second) {
        ++seen.replayed_twice;
      }
    }
    const int64_t count = lms::getStats(0).recompute_ahead_count;
    seen.ahead_miscounted += count - ahead_counted != n ? 1 : 0;
    ahead_counted = count;
  };
  run.before_pin = [&](c10::StorageImpl& s) {
    if (!watching) {
      return;
    }
    const bool dropped = lms::getState(s) == lms::StorageState::Dropped;
    seen.dropped_at_pin += dropped ? 1 : 0;
    if (unused.erase(&s) > 0) {
      ++seen.used_after_replay;
      seen.replayed_twice += dropped ? 1 : 0;
    }
  };
  run.after_op = [&] {
    take(); // replays on demand, by this operator's pins
  };
  const auto train = [&](int iteration) {
    iterate(run, m, iteration, /*train=*/true, /*temporaries=*/false, recipes);
  };
  int iteration = 0;
  for (; iteration < 4; ++iteration) {
    train(iteration);
  }
  REQUIRE(lms::getStats(0).schedule_active == 1);
  lms::resetAccumulatedStats(0);
  watching = true;
  for (; iteration < 8; ++iteration) {
    train(iteration);
  }
  watching = false;
  seen.stats = lms::getStats(0);
  seen.mismatches = run.mismatches;
  run.after_begin = nullptr;
  run.before_pin = nullptr;
  run.after_op = nullptr;
  const auto& st = seen.stats;
  std::printf(
      "  steady state, 4 iterations: %lld dropped, %lld recomputed (%lld "
      "ahead of use, %d of them inputs of others, at most %d at a boundary, "
      "%d times; %d still dropped when pinned), %d replayed ahead and used, "
      "%lld recipe inputs paged in ahead, %lld page-ins on demand\n",
      static_cast<long long>(st.drop_count),
      static_cast<long long>(st.recompute_count),
      static_cast<long long>(st.recompute_ahead_count),
      seen.ahead_inputs,
      seen.most_at_a_boundary,
      seen.boundaries_at_most,
      seen.dropped_at_pin,
      seen.used_after_replay,
      static_cast<long long>(st.recompute_input_prefetch_count),
      static_cast<long long>(st.pagein_demand_count));
  return seen;
}

// What holds of every run of recomputeAheadLoop().
void checkAhead(const AheadSeen& seen) {
  const auto& st = seen.stats;
  CHECK_EQ(st.schedule_active, int64_t(1));
  CHECK(st.drop_count > 0);
  CHECK(st.recompute_ahead_count > 0);
  CHECK_EQ(st.recompute_ahead_count, int64_t(seen.ahead + seen.ahead_inputs));
  CHECK_EQ(seen.ahead_miscounted, 0);
  CHECK_EQ(
      st.recompute_ahead_bytes,
      st.recompute_ahead_count * int64_t(kActivation));
  // Every replay ahead of use is in recompute_count, and every storage
  // replayed ahead for its own use is used before it is dropped again: none
  // is replayed twice for one use, none dies unused.
  CHECK(st.recompute_count >= st.recompute_ahead_count);
  CHECK_EQ(seen.replayed_twice, 0);
  CHECK_EQ(seen.freed_unused, 0);
  CHECK_EQ(seen.used_after_replay, seen.ahead);
  // The bound on replays at one operator boundary.
  CHECK(seen.most_at_a_boundary <= 4); // kAheadReplaysPerBoundary
  CHECK_EQ(seen.mismatches, 0);
}

TEST_CASE(dropped_storages_are_recomputed_ahead_of_their_use) {
  {
    const AheadSeen seen = recomputeAheadLoop(42 * kMiB, kLayers, 6);
    checkAhead(seen);
    // Every dropped storage is recomputed before the operator that uses it
    // pins it: none on demand.
    CHECK_EQ(seen.dropped_at_pin, 0);
    CHECK_EQ(seen.stats.recompute_ahead_count, seen.stats.recompute_count);
  }
  checkBaseline();
}

// A deeper model under more pressure: a dropped activation's recipe reads
// the activation before it, often dropped too; the replay ahead of use
// recomputes that one first (a chain, at most kAheadDepth deep).
TEST_CASE(recompute_ahead_of_use_recomputes_dropped_inputs_first) {
  {
    const AheadSeen seen = recomputeAheadLoop(60 * kMiB, 16, 12);
    checkAhead(seen);
    CHECK(seen.ahead_inputs > 0);
  }
  checkBaseline();
}

// The bound per operator boundary: an iteration makes eight activations
// from one weight (each recipe reads only the weight), a large temporary
// then makes a reclaim drop seven of them, and three operators later one
// operator reads all eight. Once the schedule has learned the loop, the
// boundary at which that use comes into view finds seven dropped storages
// whose input is resident, replays four (kAheadReplaysPerBoundary), and the
// next boundary the other three: none is left to the pins.
TEST_CASE(recompute_ahead_of_use_is_bounded_per_operator_boundary) {
  lms_test::FakeRecipes& fake = lms_test::recipes();
  {
    const lms_test::FakeRecipesInstalled installed;
    constexpr int kMade = 8;
    Runner run(48 * kMiB);
    lms::setPrefetchBudget(40 * kMiB);
    lms::setLookahead(4);
    Tensor w = run.make(kWeight, 1);
    std::vector<int> at_boundary; // replays at each boundary, by operator
    std::vector<int> still_dropped; // inputs dropped when pinned, by operator
    bool watching = false;
    const auto take = [&] {
      std::lock_guard<std::mutex> lock(fake.mutex);
      const int n = static_cast<int>(fake.replayed.size());
      fake.replayed.clear();
      fake.replayed_inputs.clear();
      return n;
    };
    run.after_begin = [&] {
      const int n = take();
      if (watching) {
        at_boundary.push_back(n);
        still_dropped.push_back(0);
      }
    };
    run.before_pin = [&](c10::StorageImpl& s) {
      if (watching && lms::getState(s) == lms::StorageState::Dropped) {
        ++still_dropped.back();
      }
    };
    run.after_op = [&] { take(); };
    const auto iteration = [&](int i) {
      const uint64_t base = static_cast<uint64_t>(i) * 1000;
      std::vector<Tensor> made(kMade);
      run.op("make", {&w}, [&] {
        for (int k = 0; k < kMade; ++k) {
          made[k] = run.output(kActivation, base + k);
        }
      });
      for (const Tensor& a : made) {
        lms_test::giveRecipe(*a.storage, a.seed, w.storage.get());
      }
      run.endOutputs();
      run.op("temporary", {&w}, [&] {
        const Tensor t = run.output(40 * kMiB, base + 100);
      });
      run.endOutputs();
      for (int k = 0; k < 3; ++k) {
        run.op("idle", {&w});
      }
      std::vector<Tensor*> inputs;
      for (Tensor& a : made) {
        inputs.push_back(&a);
      }
      run.op("use", inputs);
      for (const Tensor& a : made) {
        lms_test::forgetInput(*a.storage);
      }
    };
    int i = 0;
    for (; i < 6; ++i) {
      iteration(i);
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    lms::resetAccumulatedStats(0);
    watching = true;
    iteration(i);
    watching = false;
    const auto st = lms::getStats(0);
    std::string seen;
    for (size_t k = 0; k < at_boundary.size(); ++k) {
      seen += " " + std::to_string(at_boundary[k]) + "/" +
          std::to_string(still_dropped[k]);
    }
    std::printf(
        "  one iteration: %lld dropped, %lld recomputed, %lld ahead of use; "
        "replays ahead/inputs dropped at pin, by operator:%s\n",
        static_cast<long long>(st.drop_count),
        static_cast<long long>(st.recompute_count),
        static_cast<long long>(st.recompute_ahead_count),
        seen.c_str());
    REQUIRE(at_boundary.size() == size_t(6));
    CHECK_EQ(st.drop_count, int64_t(kMade - 1));
    // Seven were ready at the first boundary that saw the use: four, then
    // three, then none.
    CHECK_EQ(at_boundary[2], 4);
    CHECK_EQ(at_boundary[3], 3);
    for (int n : at_boundary) {
      CHECK(n <= 4);
    }
    CHECK_EQ(st.recompute_ahead_count, int64_t(kMade - 1));
    CHECK_EQ(st.recompute_count, st.recompute_ahead_count);
    CHECK_EQ(still_dropped[5], 0);
    CHECK_EQ(run.mismatches, 0);
    run.after_begin = nullptr;
    run.before_pin = nullptr;
    run.after_op = nullptr;
  }
  checkBaseline();
}

// Early page-outs with recompute on: recompute first, as a reclaim does. An
// iteration makes A (no recipe, next used last) and B (a cheap recipe of a
// resident weight, next used just before A), then a temporary that leaves
// less room under the limit than the prefetch budget keeps free. The early
// page-out that restores the room takes a storage used after the window:
// by next use alone A (the furthest), copied out and back in; with
// recompute first B, dropped and recomputed ahead of its use, and A never
// leaves the device: no copy crosses the bus.
TEST_CASE(early_page_outs_drop_storages_cheap_to_replay) {
  {
    const lms_test::FakeRecipesInstalled installed;
    Runner run(36 * kMiB);
    lms::setPrefetchBudget(4 * kMiB);
    lms::setLookahead(2);
    Tensor w = run.make(kWeight, 1);
    Tensor a;
    Tensor b;
    bool watching = false;
    int a_paged_out = 0; // operators after which A was paged out
    int b_dropped = 0; // and B dropped
    run.after_op = [&] {
      if (!watching || !a.storage || !b.storage) {
        return;
      }
      a_paged_out +=
          lms::getState(*a.storage) == lms::StorageState::PagedOut ? 1 : 0;
      b_dropped +=
          lms::getState(*b.storage) == lms::StorageState::Dropped ? 1 : 0;
    };
    const auto iteration = [&](int i) {
      const uint64_t base = static_cast<uint64_t>(i) * 1000;
      run.op("make", {&w}, [&] {
        a = run.output(8 * kMiB, base + 1);
        b = run.output(4 * kMiB, base + 2);
      });
      lms_test::giveRecipe(*b.storage, b.seed, w.storage.get());
      run.endOutputs();
      // 33 MiB allocated: 1 MiB more than the limit less the budget.
      Tensor t;
      run.op("grow", {&w}, [&] { t = run.output(19 * kMiB, base + 3); });
      run.endOutputs();
      run.op("shrink", {&t});
      t = Tensor{};
      for (int k = 0; k < 4; ++k) {
        run.op("idle", {&w});
      }
      run.op("use_b", {&b});
      run.op("use_a", {&a});
      lms_test::forgetInput(*b.storage);
      a = Tensor{};
      b = Tensor{};
    };
    int i = 0;
    for (; i < 6; ++i) {
      iteration(i);
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    lms::resetAccumulatedStats(0);
    watching = true;
    for (; i < 10; ++i) {
      iteration(i);
    }
    watching = false;
    run.after_op = nullptr;
    const auto st = lms::getStats(0);
    std::printf(
        "  steady state, 4 iterations: %lld dropped, %lld page-outs (%lld "
        "early, %lld ahead of the peak), %lld recomputed (%lld ahead of "
        "use), %lld reclaims at the limit; operators after which A was paged "
        "out: %d, B dropped: %d\n",
        static_cast<long long>(st.drop_count),
        static_cast<long long>(st.pageout_count),
        static_cast<long long>(st.early_pageout_count),
        static_cast<long long>(st.peak_pageout_count),
        static_cast<long long>(st.recompute_count),
        static_cast<long long>(st.recompute_ahead_count),
        static_cast<long long>(st.reclaim_limit),
        a_paged_out,
        b_dropped);
    CHECK_EQ(st.drop_count, int64_t(4));
    CHECK(b_dropped > 0);
    CHECK_EQ(st.pageout_count, int64_t(0));
    CHECK_EQ(a_paged_out, 0);
    CHECK_EQ(st.recompute_count, int64_t(4));
    CHECK_EQ(st.recompute_ahead_count, int64_t(4));
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

TEST_CASE(early_page_outs_leave_storages_that_die_first_alone) {
  {
    // The loop of the test above plus a 4 MiB temporary per forward layer
    // that dies two operators later, unread, under the same limit. An early
    // page-out makes room for the next operators; a temporary that dies
    // within them gives its memory back itself, so paging it out early would
    // be a copy for nothing. (When an allocation needs memory at once, a
    // storage that is never read again is the cheapest victim: one copy, not
    // two.) So every byte paged out and never paged back in was paged out by
    // a reclaim, not early. Before deaths were learned, early page-outs took
    // the temporaries first (192 MiB out, 96 MiB in, 56 MiB of it by reclaims).
    Runner run(36 * kMiB);
    lms::setPrefetchBudget(12 * kMiB);
    lms::setLookahead(6);
    Model m = makeModel(run);
    int iteration = 0;
    for (; iteration < 5; ++iteration) {
      iterate(run, m, iteration, true, /*temporaries=*/true);
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    lms::resetAccumulatedStats(0);
    for (; iteration < 9; ++iteration) {
      iterate(run, m, iteration, true, /*temporaries=*/true);
    }
    const auto st = lms::getStats(0);
    std::printf(
        "  with temporaries, 4 iterations: %lld page-outs (%lld early, "
        "%.1f MiB), %.1f MiB out, %.1f MiB in\n",
        static_cast<long long>(st.pageout_count),
        static_cast<long long>(st.early_pageout_count),
        static_cast<double>(st.early_pageout_bytes) / kMiB,
        static_cast<double>(st.pageout_bytes) / kMiB,
        static_cast<double>(st.pagein_bytes) / kMiB);
    CHECK_EQ(st.schedule_fallbacks, int64_t(0));
    CHECK(st.early_pageout_count > 0); // the loop does not fit
    const int64_t unread = st.pageout_bytes - st.pagein_bytes;
    const int64_t reclaimed = st.pageout_bytes - st.early_pageout_bytes;
    CHECK(unread > 0); // the temporaries do make reclaims pick them
    CHECK_LE(unread, reclaimed);
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

// A deep loop under a limit that binds late in the forward pass: the learned
// schedule pages out, from the start of the pass, what must be off the device
// at the iteration's peak of demand (storages used next after the peak,
// furthest first), so that the D2H stream works while the first layers
// compute instead of idling until the limit nears and then bounding the rest
// of the pass. It moves no more bytes for that. The engine without it
// queued the iteration's first page-out after operator 12 (the 11th forward
// layer), with 84 MiB allocated, and moved the same 28 MiB out per
// iteration.
TEST_CASE(page_outs_start_ahead_of_the_iterations_peak) {
  {
    // 16 layers: weights 32 MiB, activations 64 MiB, an input and two
    // gradients: a peak demand of about 108 MiB, under an 84 MiB limit.
    constexpr size_t kLimit = 84 * kMiB;
    constexpr size_t kBudget = 8 * kMiB;
    constexpr int kDeep = 16;
    Runner run(kLimit);
    lms::setPrefetchBudget(kBudget);
    Model m = makeModel(run, kDeep);
    int iteration = 0;
    for (; iteration < 5; ++iteration) {
      iterate(run, m, iteration);
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    lms::resetAccumulatedStats(0);
    // The operator (0: the input) after which the iteration's first
    // page-out was queued, and what was allocated then.
    int op = 0;
    int first_pageout_op = -1;
    size_t allocated_then = 0;
    run.after_op = [&] {
      if (first_pageout_op < 0 && lms::getStats(0).pageout_count > 0) {
        first_pageout_op = op;
        allocated_then = allocatedBytes();
      }
      ++op;
    };
    iterate(run, m, iteration++);
    run.after_op = nullptr;
    for (; iteration < 9; ++iteration) {
      iterate(run, m, iteration);
    }
    const auto st = lms::getStats(0);
    const double out_per_iteration =
        static_cast<double>(st.pageout_bytes) / kMiB / 4;
    std::printf(
        "  first page-out after operator %d (%zu MiB allocated); per "
        "iteration: %.1f MiB out (%.1f MiB ahead of the peak, %.1f MiB "
        "reclaimed), %.1f MiB in\n",
        first_pageout_op,
        allocated_then / kMiB,
        out_per_iteration,
        static_cast<double>(st.peak_pageout_bytes) / kMiB / 4,
        static_cast<double>(st.pageout_bytes - st.early_pageout_bytes) / kMiB /
            4,
        static_cast<double>(st.pagein_bytes) / kMiB / 4);
    CHECK_EQ(st.schedule_fallbacks, int64_t(0));
    CHECK(st.peak_pageout_count > 0);
    // Within the first quarter of the forward pass, with the limit far off.
    REQUIRE(first_pageout_op >= 0);
    CHECK_LE(first_pageout_op, kDeep / 4);
    CHECK_LE(allocated_then + 40 * kMiB, kLimit);
    // The deficit at the peak plus the room the prefetch budget keeps there.
    CHECK_LE(out_per_iteration, 108.0 - 84.0 + 8.0);
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

// What alternateRecipesLoop() saw: the operator of the iteration after the
// schedule settled (0: the input) after which the first copy out was queued
// (-1: none), and the statistics of that iteration and the next three.
struct FirstCopy {
  int op = -1;
  lms::LmsStats stats;
  int mismatches = 0;
};

// The deep loop of page_outs_start_ahead_of_the_iterations_peak (16 layers)
// with recompute on and a recipe for every other layer's activation, read
// from the activation before it; the others have none, so only a copy takes
// them off the device. With `loss_scratch`, the loss allocates and frees a
// scratch buffer of that many bytes inside itself (see iterate()).
FirstCopy alternateRecipesLoop(size_t limit, size_t loss_scratch) {
  FirstCopy seen;
  const lms_test::FakeRecipesInstalled installed;
  Runner run(limit);
  lms::setPrefetchBudget(loss_scratch > 0 ? 4 * kMiB : 8 * kMiB);
  Model m = makeModel(run, 16);
  int layer = 0;
  LayerHooks recipes;
  recipes.made = [&](Tensor& a, Tensor& input) {
    if (layer++ % 2 == 0) {
      return;
    }
    lms_test::giveRecipe(*a.storage, a.seed, input.storage.get());
  };
  recipes.freed = [&](Tensor& a) { lms_test::forgetInput(*a.storage); };
  const auto train = [&](int iteration) {
    layer = 0;
    iterate(
        run,
        m,
        iteration,
        /*train=*/true,
        /*temporaries=*/false,
        recipes,
        loss_scratch);
  };
  int iteration = 0;
  for (; iteration < 6; ++iteration) {
    train(iteration);
  }
  REQUIRE(lms::getStats(0).schedule_active == 1);
  lms::resetAccumulatedStats(0);
  int op = 0;
  run.after_op = [&] {
    if (seen.op < 0 && lms::getStats(0).pageout_count > 0) {
      seen.op = op;
    }
    ++op;
  };
  train(iteration++);
  run.after_op = nullptr;
  for (; iteration < 10; ++iteration) {
    train(iteration);
  }
  seen.stats = lms::getStats(0);
  seen.mismatches = run.mismatches;
  std::printf(
      "  first copy out after operator %d; per iteration: %.1f MiB copied "
      "out (%.1f MiB ahead of the peak), %.1f MiB dropped, %.1f MiB in\n",
      seen.op,
      static_cast<double>(seen.stats.pageout_bytes) / kMiB / 4,
      static_cast<double>(seen.stats.peak_pageout_bytes) / kMiB / 4,
      static_cast<double>(seen.stats.drop_bytes) / kMiB / 4,
      static_cast<double>(seen.stats.pagein_bytes) / kMiB / 4);
  return seen;
}

// Under a limit that drops alone cannot meet: drops free memory at once
// whenever it is needed, but a copy takes the bus's time, so the copies
// that must be made anyway start ahead of the peak as well, within the
// first quarter of the forward pass, rather than wait for the limit at its
// end (where the compute stream would wait for the bus).
// What both tests below require of alternateRecipesLoop(): a settled
// schedule, drops covering part of the deficit, copies made ahead of the
// peak, the first of them queued by operator `by`, and every byte intact.
void checkCopiesStartAheadBy(const FirstCopy& seen, int by) {
  CHECK_EQ(seen.stats.schedule_fallbacks, int64_t(0));
  CHECK(seen.stats.drop_count > 0);
  CHECK(seen.stats.peak_pageout_count > 0);
  REQUIRE(seen.op >= 0);
  CHECK_LE(seen.op, by);
  CHECK_EQ(seen.mismatches, 0);
}

TEST_CASE(copies_a_drop_cannot_spare_start_ahead_of_the_peak) {
  // Within the first quarter of the forward pass.
  checkCopiesStartAheadBy(alternateRecipesLoop(64 * kMiB, 0), 16 / 4);
  checkBaseline();
}

// Under a limit that the loop's operator boundaries never pass: what the
// loss allocates and frees inside itself does (a language model's logits
// and their log-softmax, GPT's at 1.5x an H100: about 20 GB). Drops cover
// part of it, copies the rest; measured at the boundaries alone, the peak of
// demand stayed under the limit, so no copy was made ahead of it, and each
// was made inside the operator that needed the room (GPT: 4.55 GiB copied
// out in the forward pass, the compute stream idle 88 ms for them). The
// peak counts the most allocated between two boundaries.
TEST_CASE(copies_for_a_transient_inside_an_operator_start_ahead_of_it) {
  {
    const FirstCopy seen = alternateRecipesLoop(112 * kMiB, 48 * kMiB);
    CHECK(seen.stats.pageout_count > 0); // drops alone do not make the room
    // The first copy within the first half of the forward pass, not at the
    // loss (operator 17).
    checkCopiesStartAheadBy(seen, 16 / 2);
  }
  checkBaseline();
}

// The derived prefetch budget is an eighth of the limit while an iteration
// pages in less than the limit holds, and grows to a quarter as it pages in
// up to twice as much: then copies bound the iteration, and the H2D stream
// must not wait for room.
TEST_CASE(the_derived_prefetch_budget_follows_the_page_in_traffic) {
  // Iterations that page in less than the limit, between one and two times
  // it, and more than twice it.
  enum class Traffic { Light, Middle, Heavy };
  struct Case {
    size_t limit;
    Traffic traffic;
  };
  for (const Case c :
       {Case{36 * kMiB, Traffic::Light},
        Case{20 * kMiB, Traffic::Middle},
        Case{16 * kMiB, Traffic::Heavy}}) {
    {
      Runner run(c.limit);
      Model m = makeModel(run);
      int iteration = 0;
      for (; iteration < 4; ++iteration) {
        iterate(run, m, iteration);
      }
      lms::resetAccumulatedStats(0);
      constexpr int kMeasured = 4;
      for (int i = 0; i < kMeasured; ++i) {
        iterate(run, m, iteration++);
      }
      const lms::LmsStats st = lms::getStats(0);
      REQUIRE(st.schedule_active == 1);
      const auto limit = static_cast<int64_t>(st.limit_bytes);
      const int64_t per_iteration = st.pagein_bytes / kMeasured;
      const int64_t budget = st.schedule_prefetch_budget_bytes;
      std::printf(
          "  limit %lld MiB: %.1f MiB paged in per iteration, budget %.2f "
          "MiB\n",
          static_cast<long long>(limit / int64_t(kMiB)),
          static_cast<double>(per_iteration) / kMiB,
          static_cast<double>(budget) / kMiB);
      // Each case has the traffic it is about.
      switch (c.traffic) {
        case Traffic::Light:
          REQUIRE(per_iteration > 0);
          REQUIRE(per_iteration <= limit);
          CHECK_EQ(budget, limit / 8);
          break;
        case Traffic::Middle:
          REQUIRE(per_iteration > limit);
          REQUIRE(per_iteration < 2 * limit);
          // An eighth of what an iteration pages in, within a percent.
          CHECK(budget > limit / 8);
          CHECK(budget < limit / 4);
          CHECK(std::abs(budget - per_iteration / 8) <= per_iteration / 800);
          break;
        case Traffic::Heavy:
          REQUIRE(per_iteration >= 2 * limit);
          CHECK_EQ(budget, limit / 8 * 2);
          break;
      }
      // Statistics reset at every iteration (as a training loop that logs
      // them may do) leave the derived budget as it is.
      for (int i = 0; i < 3; ++i) {
        lms::resetAccumulatedStats(0);
        iterate(run, m, iteration++);
      }
      CHECK_EQ(lms::getStats(0).schedule_prefetch_budget_bytes, budget);
      // A budget that is set is the one in force.
      lms::setPrefetchBudget(3 * kMiB);
      iterate(run, m, iteration++);
      CHECK_EQ(
          lms::getStats(0).schedule_prefetch_budget_bytes, int64_t(3 * kMiB));
      CHECK_EQ(run.mismatches, 0);
    }
    checkBaseline();
  }
}

// A page-in ahead of use takes only free memory. Where the device fills
// before the LMS limit is reached (other processes, a memory fraction), the
// allocator's own failure path reclaims through LMS; were it to do so for a
// prefetch, it could page out the storages just paged in ahead, which the
// schedule would page in again at once: a loop without end at one operator
// boundary. Here the allocator refuses more than 30 MiB, the limit is far
// above it, and the budget covers everything the loop pages.
TEST_CASE(a_page_in_ahead_never_pages_out_to_make_room) {
  {
    Runner run(size_t(1) << 50);
    const lms_test::AllocatorCap cap(30 * kMiB);
    lms::setPrefetchBudget(64 * kMiB);
    lms::setLookahead(int(kOpsPerIteration));
    {
      Model m = makeModel(run);
      for (int iteration = 0; iteration < 8; ++iteration) {
        iterate(run, m, iteration);
      }
      const lms::LmsStats st = lms::getStats(0);
      CHECK_EQ(st.schedule_active, int64_t(1));
      // The behaviour under test happened: the device filled (the allocator
      // failed and LMS reclaimed), and pages came in ahead of use.
      CHECK(st.reclaim_alloc_failure > 0);
      CHECK(st.schedule_prefetch_count > 0);
      CHECK_EQ(run.mismatches, 0);
    }
  }
  checkBaseline();
}

TEST_CASE(a_changed_pattern_falls_back_and_is_learned_again) {
  {
    Runner run(36 * kMiB);
    lms::setPrefetchBudget(12 * kMiB);
    lms::setLookahead(6);
    Model m = makeModel(run);
    int iteration = 0;
    for (; iteration < 4; ++iteration) {
      iterate(run, m, iteration);
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    // An evaluation step (the forward pass alone) breaks the pattern where
    // training would go on with the loss: LMS is reactive again, says so,
    // and the data survives.
    iterate(run, m, iteration++, /*train=*/false);
    iterate(run, m, iteration++);
    auto st = lms::getStats(0);
    CHECK_EQ(st.schedule_active, int64_t(0));
    CHECK_EQ(st.schedule_fallbacks, int64_t(1));
    CHECK_EQ(st.schedule_period, int64_t(0));
    // Training resumes: learned again within a few iterations, and the data
    // survived every mode. Signatures leave out the gaps between earlier
    // touches, so a period that spans the evaluation step can be taken once
    // before the training period is (one more fallback, no more).
    for (int i = 0; i < 4; ++i) {
      iterate(run, m, iteration++);
    }
    st = lms::getStats(0);
    CHECK_EQ(st.schedule_active, int64_t(1));
    CHECK(st.schedule_fallbacks <= 2);
    CHECK_EQ(st.schedule_detections, st.schedule_fallbacks + 1);
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

// An optimizer whose state does not fit beside the parameters (Adam under a
// cap below parameters plus state) uses the state paged out, over the bus,
// every iteration. Such a use is a use: were it not recorded, the state would
// look unused for ever longer, and no period would ever be confirmed.
TEST_CASE(inputs_used_over_the_bus_keep_the_schedule) {
  {
    Runner run(size_t(1) << 50);
    // The allocator refuses more than 40 MiB: of the step's five 12 MiB
    // inputs, two are used over the bus every time. The first of them is the
    // one whose pin failed; the others are not even tried.
    const lms_test::AllocatorCap cap(40 * kMiB);
    {
      Tensor w = run.make(12 * kMiB, 1);
      Tensor s1 = run.make(12 * kMiB, 2);
      Tensor s2 = run.make(12 * kMiB, 3);
      Tensor s3 = run.make(12 * kMiB, 4);
      Tensor s4 = run.make(12 * kMiB, 5);
      int over_bus = 0;
      for (int i = 0; i < 24; ++i) {
        run.op("forward", {&w});
        over_bus += run.opOverBus("step", {&w, &s1, &s2, &s3, &s4});
      }
      CHECK(over_bus >= 48); // the behaviour under test happened
      const lms::LmsStats st = lms::getStats(0);
      CHECK_EQ(st.schedule_active, int64_t(1));
      CHECK_EQ(st.schedule_period, int64_t(2));
      CHECK_EQ(run.mismatches, 0);
    }
  }
  checkBaseline();
}

TEST_CASE(victims_are_chosen_by_next_use_not_recency) {
  {
    Runner run(256 * kMiB);
    // p, q and r are used by op a, then p by b, q by c, r by d.
    Tensor p = run.make(2 * kMiB, 1);
    Tensor q = run.make(2 * kMiB, 2);
    Tensor r = run.make(2 * kMiB, 3);
    auto loop = [&] {
      run.op("a", {&p, &q, &r});
      run.op("b", {&p});
      run.op("c", {&q});
      run.op("d", {&r});
    };
    for (int i = 0; i < 8; ++i) {
      loop();
    }
    REQUIRE(lms::getStats(0).schedule_active == 1);
    CHECK_EQ(lms::getStats(0).schedule_period, int64_t(4));
    run.op("a", {&p, &q, &r});
    // Least recently used is p (unpinned first); furthest next use is r.
    CHECK(lms::getState(*r.storage) == lms::StorageState::Inactive);
    CHECK_EQ(lms::reclaimBytes(0, 2 * kMiB), 2 * kMiB);
    CHECK(lms::getState(*r.storage) == lms::StorageState::PagedOut);
    CHECK(lms::getState(*p.storage) == lms::StorageState::Inactive);
    CHECK(lms::getState(*q.storage) == lms::StorageState::Inactive);
    CHECK(lms::getStats(0).schedule_victims >= 1);
    // The next: q (used at c, after p at b).
    CHECK_EQ(lms::reclaimBytes(0, 2 * kMiB), 2 * kMiB);
    CHECK(lms::getState(*q.storage) == lms::StorageState::PagedOut);
    CHECK(lms::getState(*p.storage) == lms::StorageState::Inactive);
    // Without the schedule: least recently used.
    run.op("b", {&p});
    run.op("c", {&q});
    run.op("d", {&r});
    lms::setScheduleEnabled(false);
    run.op("a", {&p, &q, &r});
    CHECK_EQ(lms::reclaimBytes(0, 2 * kMiB), 2 * kMiB);
    CHECK(lms::getState(*p.storage) == lms::StorageState::PagedOut);
    CHECK(lms::getState(*r.storage) == lms::StorageState::Inactive);
    run.op("b", {&p});
    CHECK_EQ(run.mismatches, 0);
  }
  checkBaseline();
}

TEST_CASE(schedule_settings_parse) {
  lms::parseConfig(
      "lms_schedule:False,lms_lookahead:12,lms_prefetch_budget_mb:64,"
      "lms_graph_prefetch:False");
  CHECK(!lms::isScheduleEnabled());
  CHECK(!lms::isGraphPrefetchEnabled());
  CHECK_EQ(lms::getLookahead(), 12);
  CHECK_EQ(lms::getPrefetchBudget(), size_t(64 * kMiB));
  CHECK_THROWS_AS(
      lms::parseConfigOption("lms_schedule", "yes"), c10::Error, "True");
  CHECK_THROWS_AS(
      lms::parseConfigOption("lms_lookahead", "2.5"),
      c10::Error,
      "whole number");
  CHECK_THROWS_AS(lms::setLookahead(-1), c10::Error, ">= 0");
  CHECK_THROWS_AS(
      lms::parseConfigOption("lms_graph_prefetch", "1"), c10::Error, "True");
  lms::parseConfig(
      "lms_schedule:True,lms_lookahead:0,lms_prefetch_budget_mb:0,"
      "lms_graph_prefetch:True");
  CHECK(lms::isScheduleEnabled());
  CHECK(lms::isGraphPrefetchEnabled());
  CHECK_EQ(lms::getLookahead(), 0);
  CHECK_EQ(lms::getPrefetchBudget(), size_t(0));
}

} // namespace

LMS_TEST_MAIN()
