#pragma once

// Python bindings of Large Model Support (c10/cuda/LargeModelSupport.h):
// the _cuda_lms_* functions behind torch.cuda.set_enabled_lms() and friends.
// The same source builds into torch._C (patched PyTorch) and into the drop-in
// extension's module for stock wheels, so both expose one binding contract.

#include <c10/cuda/LargeModelSupport.h>
#include <torch/csrc/python_headers.h>
#include <torch/csrc/utils/pybind.h>

namespace torch::cuda::lms {

// LMS statistics of one device as a dict: counters as ints, the times in
// milliseconds ("stall_ms", "copy_out_ms", "copy_in_ms", "recompute_ms") as
// floats, each gauge as {"current": int, "peak": int}. torch._C's
// _cuda_memoryStats() nests it under "lms", so torch.cuda.memory_stats()
// reports "lms.pageout_bytes", "lms.host_bytes.current", ...
pybind11::dict statsToDict(const c10::cuda::lms::LmsStats& stats);

// Argument checks of the bindings (ValueError with an LMS message); shared
// with bindings that wrap these ones, such as the drop-in extension's.
c10::DeviceIndex checkedDevice(int64_t device);
size_t checkedBytes(int64_t bytes, const char* what);

// Adds the _cuda_lms_* functions to `module`.
void initLmsBindings(PyObject* module);

} // namespace torch::cuda::lms
