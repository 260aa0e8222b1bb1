#pragma once

// Operator-boundary pinning for Large Model Support (LMS).
//
// Every CUDA storage an operator reads or writes must be resident while the
// operator runs, and should become reclaimable again once it returns. LMS
// achieves this with a RecordFunction global callback (FUNCTION scope, with
// inputs): the outermost operator on a thread pins the storages of all its
// tensor inputs when it starts and unpins them when it ends. Operators nested
// inside it need no pins of their own: they read the outer operator's inputs
// (already pinned) or tensors created inside it, which stay in the
// "allocated" state and cannot be reclaimed until the outer operator ends;
// then its outputs become reclaimable too.
//
// The callback is registered only while LMS is enabled (see
// c10::cuda::lms::setEnabledObserver), so operator dispatch pays nothing for
// it while LMS is off. The same source serves a patched PyTorch build (in
// libtorch_cuda) and the drop-in extension for stock wheels.

#include <ATen/core/Tensor.h>
#include <c10/macros/Export.h>
#include <c10/util/ArrayRef.h>

#include <memory>

namespace at {
struct ObserverContext;
} // namespace at

namespace at::cuda::lms {

// Registers the RecordFunction callback while LMS is on and removes it while
// LMS is off. Runs at static initialization; calling it again is harmless.
TORCH_CUDA_CPP_API void registerOperatorPinning();

// Adds (true) or removes (false) the RecordFunction callback. This is the
// observer that registerOperatorPinning() installs; it is idempotent.
TORCH_CUDA_CPP_API void setOperatorPinning(bool enabled);

// Whether the callback is currently registered.
TORCH_CUDA_CPP_API bool isOperatorPinningActive();

// Kernels launched outside the dispatcher, such as the Triton kernels of
// torch.compile, are operator boundaries of their own that RecordFunction
// never sees. Their launcher pins the storages of the launch's tensor
// arguments with LaunchPins for the launch and releases them after it: the
// storages are resident for the launch and reclaimable again afterwards, and
// a later page-out is ordered after the launch's stream.
class TORCH_CUDA_CPP_API LaunchPins {
 public:
  LaunchPins();
  LaunchPins(const LaunchPins&) = delete;
  LaunchPins& operator=(const LaunchPins&) = delete;
  ~LaunchPins();

  // Pins the storages of `tensors` (each once). When they cannot all be
  // resident, nothing stays pinned and the LMS out-of-memory error naming
  // `what` is thrown, before anything is launched.
  void pin(c10::ArrayRef<at::Tensor> tensors, const char* what);
  // Unpins; the current stream is recorded as a user of each storage.
  void release();

 private:
  std::unique_ptr<at::ObserverContext> state_;
};

} // namespace at::cuda::lms
