// LMS page-out / page-in throughput next to plain pinned-memory copies,
// measured in the same process, for storage sizes from 64 KiB to 1 GiB.
//
// For each size, `count` buffers of that size are copied:
//   pinned D2H / H2D: cudaMemcpyAsync between device buffers and pinned host
//                     buffers on one stream (the physical limit LMS works in);
//   LMS page-out:     reclaimInactive() of `count` inactive storages;
//   LMS page-in:      pin() + unpin() of each paged-out storage.
// Every figure is host wall time from the first call to the end of the last
// copy (device synchronized before and after), so LMS bookkeeping counts.
// One warm-up round fills the pinned host pool and the allocator's cache.
//
// Usage: bench_lms_copy [--min-size BYTES] [--max-size BYTES]
//                       [--total BYTES] [--repeat N] [--csv FILE]

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
#include <cstring>
#include <string>
#include <vector>

namespace {

namespace lms = c10::cuda::lms;
namespace cca = c10::cuda::CUDACachingAllocator;
using Clock = std::chrono::steady_clock;

struct Options {
  size_t min_size = 64 * 1024;
  size_t max_size = size_t(1) << 30;
  size_t total = size_t(4) << 30; // bytes moved per size and direction
  int repeat = 3; // best of
  std::string csv;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--min-size") {
      o.min_size = std::stoull(value());
    } else if (arg == "--max-size") {
      o.max_size = std::stoull(value());
    } else if (arg == "--total") {
      o.total = std::stoull(value());
    } else if (arg == "--repeat") {
      o.repeat = std::stoi(value());
    } else if (arg == "--csv") {
      o.csv = value();
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--min-size B] [--max-size B] [--total B] [--repeat N] "
          "[--csv FILE]\n",
          argv[0]);
      std::exit(2);
    }
  }
  return o;
}

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

template <typename F>
double timed(F&& body) {
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  const auto start = Clock::now();
  body();
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  return seconds(start, Clock::now());
}

struct Row {
  size_t size;
  size_t count;
  double pinned_d2h;
  double lms_out;
  double pinned_h2d;
  double lms_in;
};

Row measure(size_t size, size_t count, int repeat) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const double bytes = static_cast<double>(size) * count;
  Row row{size, count, 0, 0, 0, 0};

  // Plain pinned copies: the bandwidth the hardware gives.
  {
    std::vector<void*> dev(count);
    std::vector<void*> host(count);
    for (size_t i = 0; i < count; ++i) {
      dev[i] = cca::raw_alloc(size);
      C10_CUDA_CHECK(cudaHostAlloc(&host[i], size, cudaHostAllocPortable));
    }
    for (int r = 0; r < repeat + 1; ++r) { // first round: warm-up
      const double d2h = timed([&] {
        for (size_t i = 0; i < count; ++i) {
          C10_CUDA_CHECK(cudaMemcpyAsync(
              host[i], dev[i], size, cudaMemcpyDeviceToHost, stream));
        }
      });
      const double h2d = timed([&] {
        for (size_t i = 0; i < count; ++i) {
          C10_CUDA_CHECK(cudaMemcpyAsync(
              dev[i], host[i], size, cudaMemcpyHostToDevice, stream));
        }
      });
      if (r > 0) {
        row.pinned_d2h = std::max(row.pinned_d2h, bytes / d2h / 1e9);
        row.pinned_h2d = std::max(row.pinned_h2d, bytes / h2d / 1e9);
      }
    }
    for (size_t i = 0; i < count; ++i) {
      cca::raw_delete(dev[i]);
      C10_CUDA_CHECK(cudaFreeHost(host[i]));
    }
  }

  // LMS page-out and page-in of the same amount of data.
  {
    std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages;
    for (size_t i = 0; i < count; ++i) {
      storages.push_back(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(),
          static_cast<int64_t>(size),
          cca::get(),
          /*resizable=*/false));
      lms::pin(*storages.back());
      lms::unpin(*storages.back());
    }
    for (int r = 0; r < repeat + 1; ++r) {
      size_t freed = 0;
      const double out =
          timed([&] { freed = lms::reclaimInactive(c10::DeviceIndex(0)); });
      TORCH_CHECK(freed == size * count, "not every storage was paged out");
      const double in = timed([&] {
        for (auto& s : storages) {
          lms::pin(*s);
          lms::unpin(*s);
        }
      });
      if (r > 0) {
        row.lms_out = std::max(row.lms_out, bytes / out / 1e9);
        row.lms_in = std::max(row.lms_in, bytes / in / 1e9);
      }
    }
  }
  cca::emptyCache();
  return row;
}

std::string human(size_t bytes) {
  char buf[32];
  if (bytes >= (size_t(1) << 30)) {
    std::snprintf(buf, sizeof buf, "%zu GiB", bytes >> 30);
  } else if (bytes >= (size_t(1) << 20)) {
    std::snprintf(buf, sizeof buf, "%zu MiB", bytes >> 20);
  } else {
    std::snprintf(buf, sizeof buf, "%zu KiB", bytes >> 10);
  }
  return buf;
}

} // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int devices = 0;
  C10_CUDA_CHECK(cudaGetDeviceCount(&devices));
  cca::init(devices);
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  lms::setEnabled(true);
  lms::setSizeThreshold(o.min_size);
  lms::setLimit(0, size_t(1) << 50); // page out explicitly, never by limit

  std::printf("device: %s\n", prop.name);
  std::printf(
      "%10s %7s | %12s %12s %7s | %12s %12s %7s\n",
      "size",
      "count",
      "pinned D2H",
      "LMS out",
      "ratio",
      "pinned H2D",
      "LMS in",
      "ratio");
  std::FILE* csv = o.csv.empty() ? nullptr : std::fopen(o.csv.c_str(), "w");
  if (!o.csv.empty() && csv == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", o.csv.c_str());
    return 1;
  }
  if (csv != nullptr) {
    std::fprintf(
        csv,
        "device,size_bytes,count,pinned_d2h_gbps,lms_pageout_gbps,"
        "pageout_ratio,pinned_h2d_gbps,lms_pagein_gbps,pagein_ratio\n");
  }
  for (size_t size = o.min_size; size <= o.max_size; size *= 4) {
    const size_t count = std::clamp<size_t>(o.total / size, 2, 4096);
    const Row r = measure(size, count, o.repeat);
    std::printf(
        "%10s %7zu | %8.2f GB/s %7.2f GB/s %6.1f%% | %7.2f GB/s %7.2f GB/s "
        "%6.1f%%\n",
        human(size).c_str(),
        count,
        r.pinned_d2h,
        r.lms_out,
        100.0 * r.lms_out / r.pinned_d2h,
        r.pinned_h2d,
        r.lms_in,
        100.0 * r.lms_in / r.pinned_h2d);
    std::fflush(stdout);
    if (csv != nullptr) {
      std::fprintf(
          csv,
          "\"%s\",%zu,%zu,%.3f,%.3f,%.4f,%.3f,%.3f,%.4f\n",
          prop.name,
          size,
          count,
          r.pinned_d2h,
          r.lms_out,
          r.lms_out / r.pinned_d2h,
          r.pinned_h2d,
          r.lms_in,
          r.lms_in / r.pinned_h2d);
    }
  }
  if (csv != nullptr) {
    std::fclose(csv);
  }
  const auto st = lms::getStats(0);
  std::printf(
      "LMS totals: %lld page-outs, %lld page-ins, stall %.1f ms, host held "
      "peak %.1f MiB\n",
      static_cast<long long>(st.pageout_count),
      static_cast<long long>(st.pagein_count),
      st.stall_ms,
      static_cast<double>(st.host_bytes.peak) / (1 << 20));
  return 0;
}
