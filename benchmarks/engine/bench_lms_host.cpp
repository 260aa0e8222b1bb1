// The engine's host time per operator when everything fits.
//
// A training loop over a stack of layers is driven through the engine the
// way the operator observer drives it (LmsPinning.cpp): every operator
// announces itself to the learned schedule, starts its working set (what
// packing weighs), pins its managed inputs, allocates its output, releases
// it, ends its working set (what packing learns) and unpins its inputs. The
// forward pass reads the previous activation and the layer's weight, the
// backward pass the gradient, the saved activation and the weight, and an
// optimizer operator updates each weight in place. The limit is far above
// what the loop uses, so nothing is ever paged out: what is measured is the
// bookkeeping alone, in nanoseconds per operator, for
//   off:      LMS disabled (the allocator's own path; no engine calls);
//   reactive: LMS on, learned schedule off;
//   no-pack:  LMS on with its defaults but packing off (setPackingEnabled):
//             the working set is still counted, no operator is weighed;
//   schedule: LMS on with its defaults.
// What the dispatcher costs to call the observer is not in these figures
// (benchmarks/host_overhead.py measures everything on a GPU host).
//
// Usage: bench_lms_host [--layers N] [--iterations N] [--bytes B] [--repeat N]

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

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
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
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
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
    } else {
      std::fprintf(
          stderr,
          "unknown option %s (--layers, --iterations, --bytes, --repeat)\n",
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
      ++ops;
    }
    StoragePtr grad = op("loss_backward", {saved.back()}, o_.bytes);
    ++ops;
    std::vector<StoragePtr> weight_grads(o_.layers);
    for (int i = o_.layers - 1; i >= 0; --i) {
      weight_grads[i] = op("mm", {grad, saved[i]}, o_.bytes);
      grad = op("mm", {grad, weights_[i]}, o_.bytes);
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

// Best nanoseconds per operator over `repeat` rounds of `iterations`.
double measure(const Options& o, bool engine) {
  Loop loop(o, engine);
  for (int i = 0; i < 4; ++i) { // the schedule confirms its period
    loop.iteration();
  }
  double best = 1e300;
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
    best = std::min(best, ns / static_cast<double>(ops));
  }
  return best;
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

  lms::setEnabled(false);
  const double off = measure(o, /*engine=*/false);

  lms::setEnabled(true);
  lms::setSizeThreshold(std::min<size_t>(o.bytes, 64 * 1024));
  lms::setLimit(0, size_t(1) << 50); // everything fits
  lms::setScheduleEnabled(false);
  const double reactive = measure(o, /*engine=*/true);
  lms::setScheduleEnabled(true);
  lms::resetSchedule();
  lms::setPackingEnabled(false);
  const double no_pack = measure(o, /*engine=*/true);
  lms::setPackingEnabled(true);
  lms::resetSchedule();
  const double schedule = measure(o, /*engine=*/true);
  const lms::LmsStats stats = lms::getStats(0);
  lms::setEnabled(false);

  std::printf("%-9s %10s %12s\n", "config", "ns/op", "engine ns/op");
  std::printf("%-9s %10.0f %12s\n", "off", off, "-");
  std::printf("%-9s %10.0f %12.0f\n", "reactive", reactive, reactive - off);
  std::printf("%-9s %10.0f %12.0f\n", "no-pack", no_pack, no_pack - off);
  std::printf("%-9s %10.0f %12.0f\n", "schedule", schedule, schedule - off);
  std::printf(
      "schedule period %lld operators, %lld page-outs\n",
      static_cast<long long>(stats.schedule_period),
      static_cast<long long>(stats.pageout_count));
  return stats.pageout_count == 0 ? 0 : 1;
}
