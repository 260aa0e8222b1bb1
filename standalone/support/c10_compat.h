#pragma once

// The c10 APIs that the standalone build's tests and benchmarks use where the
// supported PyTorch releases differ. standalone/CMakeLists.txt probes the tree
// and defines the LMS_C10_HAS_* macros. The LMS engine needs none of this: it
// builds unchanged against every release, whose series supplies what it uses.

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>
#include <cstdint>
#include <string>

#if LMS_C10_HAS_CACHING_DEVICE_ALLOCATOR
#include <c10/core/CachingDeviceAllocator.h>
#endif

namespace lms_compat {

namespace cca = c10::cuda::CUDACachingAllocator;

// The caching allocator's statistics of one device.
using DeviceStats = decltype(cca::getDeviceStats(0));

#if LMS_C10_HAS_CACHING_DEVICE_ALLOCATOR
using StatType = c10::CachingDeviceAllocator::StatType;
#else
using StatType = cca::StatType;
#endif

// The AGGREGATE entry of a per-pool statistic (allocated_bytes, segment, ...).
template <typename StatArray>
int64_t aggregate(const StatArray& stat) {
  return stat[static_cast<size_t>(StatType::AGGREGATE)].current;
}

// The address to write a storage's contents at: mutable_data() where
// StorageImpl separates it from data(), data() before.
inline void* mutableData(c10::StorageImpl& storage) {
#if LMS_C10_HAS_MUTABLE_DATA
  return storage.mutable_data();
#else
  return storage.data();
#endif
}

// The caching allocator's backend; releases without name() have only the
// native one.
inline std::string allocatorName() {
#if LMS_C10_HAS_ALLOCATOR_NAME
  return cca::name();
#else
  return "native";
#endif
}

} // namespace lms_compat
