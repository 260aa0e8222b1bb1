#pragma once

// Recipes for Large Model Support's recompute (the hybrid of paging and
// recomputing, c10::cuda::lms::setRecomputeEnabled).
//
// At operator boundaries, operator-boundary pinning (LmsPinning.cpp) records
// for each LMS-managed output of a pure operator how to make it again: the
// operator, its arguments (tensors by weak reference and version), the
// dispatch keys in force, and the operator's measured device time. The
// engine asks these recipes, through c10::cuda::lms::RecomputeHooks, whether
// a victim is cheaper to recompute than to page out, keeps a dropped
// storage's inputs alive, and has the storage recomputed when an operator
// pins it: the operator is replayed on its inputs (themselves resident,
// paged in or recomputed) and the result takes the storage's place.
//
// Correct by construction:
// * Only operators on an allow-list of pure, deterministic functions
//   (convolution, matrix products, pointwise operators whose backward reads
//   their inputs, layer and group normalization, pooling, embedding) whose
//   schema writes no argument and returns no alias: same inputs, same bits.
//   Batch normalization in training mode writes only its running
//   statistics, which do not shape its output: a replay runs on copies of
//   them, so they change once (evaluation mode is no recipe).
//   Their tensor arguments are ones autograd saves anyway, so keeping them
//   alive for a dropped storage costs no memory.
// * Random operators on the list (dropout) save the state of the device's
//   default CUDA generator (seed and Philox offset) when they start; a replay
//   sets the generator to it, draws the same numbers, and sets it back.
// * A recipe is valid while its inputs and its output have the versions
//   they had when it was recorded: an in-place write to either (through any
//   view: views share the version counter) invalidates it, as it does
//   autograd's saved tensors. The exception: an outermost in-place ReLU
//   (aten::relu_) that writes exactly the output, at the version its recipe
//   produced, becomes a step of the recipe, replayed after the operator.
//   Writes that bypass version counters (`tensor.data`, raw pointers in
//   custom kernels) are not seen, the same contract autograd has.
// * An operator that writes an input of a dropped storage's recipe first has
//   the dropped storage recomputed, and its recipe invalidated.
// * A storage whose recipe inputs a running operator pins is not dropped.
// * Recipes are taken at the outermost operator, whose outputs are what the
//   program sees; operators nested deeper can run below autograd, where an
//   in-place write does not bump the version counter. Under autocast, the
//   recipe of an operator autocast casts for is the operator autocast calls
//   with its casted arguments, one level down and still above autograd (the
//   outer one would replay with the autocast state of the moment of the
//   replay). An operator with a CUDA kernel and no autocast kernel runs on
//   its arguments as given, and is its own recipe under autocast too.

#include <ATen/record_function.h>
#include <c10/core/Device.h>
#include <c10/macros/Export.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace at::cuda::lms::recipes {

// What an operator's start left for its end: the arguments of a recipe
// candidate and its start event.
struct Capture;

struct CaptureDeleter {
  void operator()(Capture* capture) const;
};
using CapturePtr = std::unique_ptr<Capture, CaptureDeleter>;

// At an operator's start (any depth): captures its arguments when it is on
// the allow-list and recompute is on; null otherwise.
CapturePtr capture(const at::RecordFunction& fn);

// Whether the operator copies a tensor into a storage of its own
// (aten::_to_copy, aten::clone), which is captured at whatever depth it
// runs: aten::to, reshape and contiguous call it, and autocast casts inside
// the operator it casts for, below the depth other recipes are captured at.
// A copy of a recipe's output derives its recipe from the source's.
bool isCopy(const at::RecordFunction& fn);

// At its end: records a recipe for each LMS-managed output that aliases no
// input, for storages that have none yet (the innermost operator wins).
void record(const at::RecordFunction& fn, Capture& capture);

// At an operator's start, before its inputs are pinned: when the operator
// writes (by its schema) an argument on which a dropped storage's recipe
// depends, the dropped storage is recomputed now and its recipe invalidated.
// Nothing while a recipe is replayed: a replay writes only what it allocates.
void beforeWrites(const at::RecordFunction& fn);

// Installs the engine's recompute hooks (from registerOperatorPinning).
void installHooks();

// True while a recipe is being replayed on this thread: the replayed
// operators are not operator boundaries of the schedule.
bool replaying();

// Whether autocast for CUDA is in force for the operator being dispatched:
// its recipe is then the operator autocast calls (one level down).
bool autocastActive();

// What recompute did on one device, per operator of the recipes: outputs
// dropped and recomputed, and their bytes, since the last reset.
struct OperatorCounts {
  int64_t drops = 0;
  int64_t drop_bytes = 0;
  int64_t recomputes = 0;
  int64_t recompute_bytes = 0;
};
TORCH_CUDA_CPP_API std::map<std::string, OperatorCounts> operatorCounts(
    c10::DeviceIndex device);
TORCH_CUDA_CPP_API void resetOperatorCounts(c10::DeviceIndex device);

} // namespace at::cuda::lms::recipes
