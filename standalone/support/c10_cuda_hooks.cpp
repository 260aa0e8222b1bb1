// Linked into every test and benchmark of the standalone build.
//
// Inside PyTorch, ATen's CUDA hooks (aten/src/ATen/cuda/detail/CUDAHooks.cpp)
// give c10_cuda a way to ask whether a device already has a primary context;
// c10's placeholder throws "Should never been called". Stream pools and
// device guards ask (c10::cuda::MaybeSetDevice), so programs that use
// c10_cuda without ATen install the same hook at start-up, as ATen would.
// Releases whose c10_cuda has no such hook (standalone/CMakeLists.txt probes
// for it: LMS_C10_HAS_PRIMARY_CONTEXT_HOOK) never ask, and get nothing here.

#include <c10/core/Device.h>
#include <c10/cuda/CUDAMacros.h>

#if LMS_C10_HAS_PRIMARY_CONTEXT_HOOK

#if !defined(LMS_CUDA_RUNTIME_SIM)
#include <dlfcn.h>
#endif

namespace c10::cuda::_internal {
// Defined in c10/cuda/CUDAFunctions.cpp, declared in no header.
C10_CUDA_API void setHasPrimaryContext(bool (*func)(DeviceIndex));
} // namespace c10::cuda::_internal

namespace {

#if defined(LMS_CUDA_RUNTIME_SIM)

// simgpu has no contexts: every device is ready for use.
bool has_primary_context(c10::DeviceIndex) {
  return true;
}

#else

// What ATen does: cuDevicePrimaryCtxGetState from the driver, looked up at
// run time so the binary does not link libcuda (and runs on simgpu through
// its libcudart link, where libcuda is absent and every device counts as
// ready).
bool has_primary_context(c10::DeviceIndex index) {
  using DeviceGet = int (*)(int*, int);
  using CtxGetState = int (*)(int, unsigned int*, int*);
  static void* driver = dlopen("libcuda.so.1", RTLD_LAZY);
  static auto device_get = driver != nullptr
      ? reinterpret_cast<DeviceGet>(dlsym(driver, "cuDeviceGet"))
      : nullptr;
  static auto get_state = driver != nullptr
      ? reinterpret_cast<CtxGetState>(
            dlsym(driver, "cuDevicePrimaryCtxGetState"))
      : nullptr;
  if (device_get == nullptr || get_state == nullptr) {
    return true;
  }
  int device = 0;
  if (device_get(&device, index) != 0) {
    return false;
  }
  unsigned int flags = 0;
  int active = 0;
  if (get_state(device, &flags, &active) != 0) {
    return false;
  }
  return active == 1;
}

#endif

struct InstallHooks {
  InstallHooks() {
    c10::cuda::_internal::setHasPrimaryContext(&has_primary_context);
  }
} install_hooks;

} // namespace

#endif // LMS_C10_HAS_PRIMARY_CONTEXT_HOOK
