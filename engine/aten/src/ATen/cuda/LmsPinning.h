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
// "allocated" state and cannot be reclaimed.
//
// The callback is registered only while LMS is enabled (see
// c10::cuda::lms::setEnabledObserver), so operator dispatch pays nothing for
// it while LMS is off. The same source serves a patched PyTorch build (in
// libtorch_cuda) and the drop-in extension for stock wheels.

#include <c10/macros/Export.h>

namespace at::cuda::lms {

// Registers the RecordFunction callback while LMS is on and removes it while
// LMS is off. Runs at static initialization; calling it again is harmless.
TORCH_CUDA_CPP_API void registerOperatorPinning();

// Adds (true) or removes (false) the RecordFunction callback. This is the
// observer that registerOperatorPinning() installs; it is idempotent.
TORCH_CUDA_CPP_API void setOperatorPinning(bool enabled);

// Whether the callback is currently registered.
TORCH_CUDA_CPP_API bool isOperatorPinningActive();

} // namespace at::cuda::lms
