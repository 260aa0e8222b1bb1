// The engine's host time per operator, and the CUDA runtime calls it makes.
//
// A training loop over a stack of layers is driven through the engine the
// way the operator observer drives it (LmsPinning.cpp): every operator
// announces itself to the learned schedule, starts its working set (what
// packing weighs), pins its managed inputs, allocates its output, releases
// it, ends its working set (what packing learns) and unpins its inputs. The
// forward pass reads the previous activation and the layer's weight, the
// backward pass the gradient, the saved activation and the weight, and an
// optimizer operator updates each weight in place. In the first four
// configurations the limit is far above what the loop uses, so nothing is
// ever paged out: what is measured is the bookkeeping alone, in nanoseconds
// per operator, for
//   off:      LMS disabled (the allocator's own path; no engine calls);
//   reactive: LMS on, learned schedule off;
//   no-pack:  LMS on with its defaults but packing off (setPackingEnabled):
//             the working set is still counted, no operator is weighed;
//   schedule: LMS on with its defaults;
// and then
//   paging:   LMS on with its defaults, storages of --paging-bytes (4 MiB:
//             the allocator's large pool) under a limit of twice the
//             weights' bytes, which the activations saved for the backward
//             pass take past: every iteration pages storages out and in,
//             and its time includes the simulated copies. Each iteration
//             ends with a synchronization, as a loop that reads its loss
//             does: without one the host, which launches no kernels here,
//             runs iterations ahead of the copies, and every page-out finds
//             the host buffers of the earlier ones still in flight;
//   recompute: the paging row with recipes for the forward pass's outputs
//             (a replay priced at 10 us that pins the layer's input and
//             weight): the engine prices victims, drops the cheap ones
//             instead of paging them, and replays them ahead of use or when
//             used.
// On simgpu (the CUDA runtime on host memory) each row also gives the CUDA
// runtime calls per operator, the most frequent by name: on a GPU each costs
// host time (0.1 to a few microseconds), which the simulated runtime does
// not show. On a real GPU those columns are empty.
// What the dispatcher costs to call the observer is not in these figures
// (benchmarks/host_overhead.py measures everything on a GPU host).
//
// Usage: bench_lms_host [--layers N] [--iterations N] [--bytes B] [--repeat N]
//                       [--paging-bytes B] [--host-limit-mb N] [--run-ahead]
// (--run-ahead and --host-limit-mb: the paging and recompute rows with no
// synchronization an iteration and under that host budget, where the host
// runs ahead of its copies and the pool's buffers are still in flight.)

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <c10/cuda/CUDACachingAllocator.h>
#pragma GCC diagnostic pop

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

namespace lms = c10::cuda::lms;
namespace cca = c10::cuda::CUDACachingAllocator;
using Clock = std::chrono::steady_clock;
using StoragePtr = c10::intrusive_ptr<c10::StorageImpl>;

struct Options {
  int layers = 48;
  int iterations = 50;
  size_t bytes = 128 * 1024; // activations and weights
  int repeat = 5; // best of
  // The paging row's storages. Its limit must leave packing's margin (200
  // MiB, LargeModelSupportPacking.cpp) beside an operator: below it every
  // operator is tight and packed.
  size_t paging_bytes = 4 * 1024 * 1024;
  bool sync_each_iteration = false; // the paging row's
  // --run-ahead: the paging and recompute rows without their synchronization
  // an iteration; --host-limit-mb: their host budget (default: the host's).
  bool run_ahead = false;
  size_t host_limit = 0;
  bool recipes = false; // the recompute row's
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--run-ahead") {
      o.run_ahead = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", arg.c_str());
      std::exit(2);
    }
    const long long v = std::atoll(argv[++i]);
    if (v <= 0) {
      std::fprintf(
          stderr, "%s must be positive, got %s\n", arg.c_str(), argv[i]);
      std::exit(2);
    }
    if (arg == "--layers") {
      o.layers = static_cast<int>(v);
    } else if (arg == "--iterations") {
      o.iterations = static_cast<int>(v);
    } else if (arg == "--bytes") {
      o.bytes = static_cast<size_t>(v);
    } else if (arg == "--repeat") {
      o.repeat = static_cast<int>(v);
    } else if (arg == "--paging-bytes") {
      o.paging_bytes = static_cast<size_t>(v);
    } else if (arg == "--host-limit-mb") {
      o.host_limit = static_cast<size_t>(v) << 20;
    } else {
      std::fprintf(
          stderr,
          "unknown option %s (--layers, --iterations, --bytes, --repeat, "
          "--paging-bytes, --host-limit-mb, --run-ahead)\n",
          arg.c_str());
      std::exit(2);
    }
  }
  return o;
}

StoragePtr newStorage(size_t bytes) {
  return c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(),
      static_cast<int64_t>(bytes),
      cca::get(),
      /*resizable=*/false);
}

// Recipes for the recompute row: a forward output is replayed from the
// layer's input and weight, which the replay pins (paging them in, or
// replaying a dropped input first) before it allocates the output anew and
// hands it over, as a replayed operator would (contents are not looked at).
namespace recipes {

std::mutex g_mutex;
std::unordered_map<c10::StorageImpl*, std::vector<StoragePtr>> g_inputs;

void remember(const StoragePtr& output, std::vector<StoragePtr> inputs) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_inputs[output.get()] = std::move(inputs);
}
void forgetOutput(const StoragePtr& output) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_inputs.erase(output.get());
}
std::vector<StoragePtr> inputsOf(c10::StorageImpl& storage) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = g_inputs.find(&storage);
  return it == g_inputs.end() ? std::vector<StoragePtr>{} : it->second;
}

double costMs(c10::StorageImpl& /*storage*/) {
  return 0.01;
}
bool retain(c10::StorageImpl& /*storage*/) {
  return true;
}
void recompute(c10::StorageImpl& storage) {
  const std::vector<StoragePtr> in = inputsOf(storage);
  for (const StoragePtr& s : in) {
    lms::pinForRecompute(*s);
  }
  StoragePtr fresh = newStorage(storage.nbytes());
  for (const StoragePtr& s : in) {
    lms::unpin(*s);
  }
  lms::fillDropped(storage, *fresh);
}
void forget(void* /*context*/) {}
void inputs(c10::StorageImpl& storage, std::vector<StoragePtr>& out) {
  for (StoragePtr& s : inputsOf(storage)) {
    out.push_back(std::move(s));
  }
}

const lms::RecomputeHooks kHooks{
    &costMs,
    &retain,
    &recompute,
    &forget,
    &inputs};

} // namespace recipes

class Loop {
 public:
  Loop(const Options& o, bool engine) : o_(o), engine_(engine) {
    for (int i = 0; i < o.layers; ++i) {
      weights_.push_back(newStorage(o.bytes));
    }
  }

  // One training iteration; returns the operators it ran.
  int64_t iteration() {
    int64_t ops = 0;
    std::vector<StoragePtr> saved{newStorage(o_.bytes)}; // the input batch
    for (int i = 0; i < o_.layers; ++i) {
      saved.push_back(op("linear", {saved.back(), weights_[i]}, o_.bytes));
      if (engine_ && o_.recipes) {
        recipes::remember(saved.back(), {saved[i], weights_[i]});
        lms::setRecomputable(*saved.back(), true);
      }
      ++ops;
    }
    StoragePtr grad = op("loss_backward", {saved.back()}, o_.bytes);
    ++ops;
    std::vector<StoragePtr> weight_grads(o_.layers);
    for (int i = o_.layers - 1; i >= 0; --i) {
      weight_grads[i] = op("mm", {grad, saved[i]}, o_.bytes);
      grad = op("mm", {grad, weights_[i]}, o_.bytes);
      recipes::forgetOutput(saved.back());
      saved.pop_back();
      ops += 2;
    }
    grad.reset();
    saved.clear();
    for (int i = 0; i < o_.layers; ++i) {
      op("add_", {weights_[i], weight_grads[i]}, 0);
      weight_grads[i].reset();
      ++ops;
    }
    if (o_.sync_each_iteration) {
      C10_CUDA_CHECK(cudaDeviceSynchronize());
    }
    return ops;
  }

 private:
  // What the observer does around one outermost operator.
  StoragePtr op(
      const char* name,
      std::vector<StoragePtr> inputs,
      size_t output_bytes) {
    std::vector<c10::StorageImpl*> storages;
    for (const StoragePtr& s : inputs) {
      storages.push_back(s.get());
    }
    std::sort(storages.begin(), storages.end());
    storages.erase(
        std::unique(storages.begin(), storages.end()), storages.end());
    const c10::ArrayRef<c10::StorageImpl*> pinned(
        storages.data(), storages.size());
    if (engine_) {
      lms::beginOperator(name, pinned);
      lms::beginWorkingSet(name, pinned);
      for (c10::StorageImpl* s : storages) {
        lms::pin(*s);
      }
    }
    StoragePtr out = output_bytes > 0 ? newStorage(output_bytes) : StoragePtr();
    if (engine_) {
      if (out) {
        lms::releaseOutput(*out);
      }
      lms::endWorkingSet(name);
      for (c10::StorageImpl* s : storages) {
        if (lms::getState(*s) == lms::StorageState::Active) {
          lms::unpin(*s);
        }
      }
    }
    return out;
  }

  const Options& o_;
  bool engine_;
  std::vector<StoragePtr> weights_;
};

// simgpu's runtime call counts (simgpu.h), found at run time so that the
// same binary runs on a real GPU, which has none.
struct CallEntry {
  const char* function;
  size_t calls;
};
using CallCountsFn = size_t (*)(CallEntry*, size_t);
using ResetCountersFn = void (*)();

struct CallCounter {
  CallCountsFn counts = nullptr;
  ResetCountersFn reset = nullptr;

  CallCounter() {
    counts = reinterpret_cast<CallCountsFn>(
        dlsym(RTLD_DEFAULT, "simgpu_call_counts"));
    reset = reinterpret_cast<ResetCountersFn>(
        dlsym(RTLD_DEFAULT, "simgpu_reset_counters"));
    if (counts == nullptr || reset == nullptr) {
      counts = nullptr;
      reset = nullptr;
    }
  }
  bool available() const {
    return counts != nullptr;
  }
};

// Untimed iterations before a row's rounds: the schedule confirms its period.
constexpr int kWarmup = 4;

struct Row {
  double ns_per_op = 0.0;
  double calls_per_op = -1.0; // -1: not counted (a real GPU)
  std::vector<CallEntry> calls; // most called first, per all rounds
  int64_t ops = 0; // in all rounds
  int64_t iterations = 0; // in all rounds
};

// Best nanoseconds per operator over `repeat` rounds of `iterations`, and the
// runtime calls of all rounds.
Row measure(const Options& o, bool engine, const CallCounter& counter) {
  Loop loop(o, engine);
  for (int i = 0; i < kWarmup; ++i) { // the schedule confirms its period
    loop.iteration();
  }
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  if (counter.available()) {
    counter.reset();
  }
  Row row;
  row.ns_per_op = 1e300;
  for (int r = 0; r < o.repeat; ++r) {
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    int64_t ops = 0;
    const auto begin = Clock::now();
    for (int i = 0; i < o.iterations; ++i) {
      ops += loop.iteration();
    }
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    const double ns =
        std::chrono::duration<double, std::nano>(Clock::now() - begin).count();
    row.ns_per_op = std::min(row.ns_per_op, ns / static_cast<double>(ops));
    row.ops += ops;
    row.iterations += o.iterations;
  }
  if (counter.available()) {
    row.calls.resize(counter.counts(nullptr, 0));
    row.calls.resize(counter.counts(row.calls.data(), row.calls.size()));
    size_t total = 0;
    for (const CallEntry& entry : row.calls) {
      // The synchronizations around the rounds are the benchmark's own.
      if (std::string(entry.function) != "cudaDeviceSynchronize") {
        total += entry.calls;
      }
    }
    row.calls_per_op =
        static_cast<double>(total) / static_cast<double>(row.ops);
  }
  return row;
}

void printRow(const char* config, const Row& row, const Row* off) {
  std::printf("%-9s %10.0f ", config, row.ns_per_op);
  if (off == nullptr) {
    std::printf("%12s", "-");
  } else {
    std::printf("%12.0f", row.ns_per_op - off->ns_per_op);
  }
  if (row.calls_per_op < 0.0) {
    std::printf(" %10s\n", "-");
    return;
  }
  std::printf(" %10.2f ", row.calls_per_op);
  int shown = 0;
  for (const CallEntry& entry : row.calls) {
    if (std::string(entry.function) == "cudaDeviceSynchronize") {
      continue;
    }
    if (shown == 4) {
      break;
    }
    std::printf(
        "%s%s %.2f",
        shown > 0 ? ", " : " ",
        entry.function,
        static_cast<double>(entry.calls) / static_cast<double>(row.ops));
    ++shown;
  }
  std::printf("\n");
}

} // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int devices = 0;
  C10_CUDA_CHECK(cudaGetDeviceCount(&devices));
  cca::init(devices);
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "device: %s; %d layers, %zu-byte storages, best of %d x %d iterations\n",
      prop.name,
      o.layers,
      o.bytes,
      o.repeat,
      o.iterations);
  const CallCounter counter;

  lms::setEnabled(false);
  const Row off = measure(o, /*engine=*/false, counter);

  lms::setEnabled(true);
  lms::setSizeThreshold(std::min<size_t>(o.bytes, 64 * 1024));
  lms::setLimit(0, size_t(1) << 50); // everything fits
  lms::setScheduleEnabled(false);
  const Row reactive = measure(o, /*engine=*/true, counter);
  lms::setScheduleEnabled(true);
  lms::resetSchedule();
  lms::setPackingEnabled(false);
  const Row no_pack = measure(o, /*engine=*/true, counter);
  lms::setPackingEnabled(true);
  lms::resetSchedule();
  const Row schedule = measure(o, /*engine=*/true, counter);
  const lms::LmsStats fits = lms::getStats(0);

  Options large = o;
  large.bytes = o.paging_bytes;
  large.sync_each_iteration = !o.run_ahead;
  lms::setHostLimit(o.host_limit);
  lms::resetSchedule();
  lms::setLimit(0, 2 * static_cast<size_t>(o.layers) * large.bytes);
  const Row paging = measure(large, /*engine=*/true, counter);
  const lms::LmsStats paged = lms::getStats(0);

  Options replayed = large;
  replayed.recipes = true;
  lms::setRecomputeHooks(&recipes::kHooks);
  lms::setRecomputeEnabled(true);
  lms::resetSchedule();
  const Row recompute = measure(replayed, /*engine=*/true, counter);
  const lms::LmsStats recomputed = lms::getStats(0);
  lms::setRecomputeHooks(nullptr);
  lms::setHostLimit(0);
  lms::setEnabled(false);

  std::printf(
      "%-9s %10s %12s %10s  %s\n",
      "config",
      "ns/op",
      "engine ns/op",
      "CUDA calls/op",
      counter.available() ? "most called, per op" : "(counted on simgpu only)");
  printRow("off", off, nullptr);
  printRow("reactive", reactive, &off);
  printRow("no-pack", no_pack, &off);
  printRow("schedule", schedule, &off);
  printRow("paging", paging, &off);
  printRow("recompute", recompute, &off);
  const int64_t paged_out = paged.pageout_count - fits.pageout_count;
  const auto per_iteration = [](int64_t count, const Row& row) {
    return static_cast<double>(count) /
        static_cast<double>(row.iterations + kWarmup);
  };
  const int64_t dropped = recomputed.drop_count - paged.drop_count;
  std::printf(
      "schedule period %lld operators, %lld page-outs; paging: %.1f "
      "page-outs per iteration; recompute: %.1f drops, %.1f replays (%.1f "
      "ahead of use) and %.1f page-outs per iteration\n",
      static_cast<long long>(fits.schedule_period),
      static_cast<long long>(fits.pageout_count),
      per_iteration(paged_out, paging),
      per_iteration(dropped, recompute),
      per_iteration(
          recomputed.recompute_count - paged.recompute_count, recompute),
      per_iteration(
          recomputed.recompute_ahead_count - paged.recompute_ahead_count,
          recompute),
      per_iteration(recomputed.pageout_count - paged.pageout_count, recompute));
  std::printf(
      "host memory, paging and recompute rows: %lld refused page-outs, %lld "
      "waits for the pool's own copies (%.1f ms), %lld buffers pinned, peak "
      "%.0f MiB\n",
      static_cast<long long>(recomputed.host_refusals - fits.host_refusals),
      static_cast<long long>(
          recomputed.host_copy_wait_count - fits.host_copy_wait_count),
      recomputed.host_copy_wait_ms - fits.host_copy_wait_ms,
      static_cast<long long>(recomputed.host_pin_count - fits.host_pin_count),
      static_cast<double>(recomputed.host_bytes.peak) / (1024.0 * 1024.0));
  // The rows that fit must not page, the paging row must, and the recompute
  // row must drop.
  return fits.pageout_count == 0 && paged_out > 0 && dropped > 0 ? 0 : 1;
}
