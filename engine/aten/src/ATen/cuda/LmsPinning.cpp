// Large Model Support is CUDA-only; ROCm builds, which compile a hipified
// copy of this file, leave it out.
#ifndef USE_ROCM

#include <ATen/cuda/LmsPinning.h>
#include <ATen/cuda/LmsRecipes.h>

#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
// Frees cuBLAS's cached workspaces (engine::setWorkspaceReleaser). Where
// the release has ATen/cuda/CUDAContextLight.h, it has this function (2.6 and
// 2.11 declare it there; 1.13 has neither, and its packs leave the
// workspaces in place). Declared here rather than through that header, which
// needs the cuBLAS, cuSPARSE and cuSOLVER headers.
#if __has_include(<ATen/cuda/CUDAContextLight.h>)
namespace at::cuda {
void clearCublasWorkspaces();
} // namespace at::cuda
#define LMS_HAVE_CLEAR_CUBLAS_WORKSPACES 1
#endif
#include <c10/core/StorageImpl.h>
#include <c10/cuda/LargeModelSupport.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace at::cuda::lms {

namespace {

namespace engine = c10::cuda::lms;

// Depth of FUNCTION-scope records on this thread. Only the outermost one
// pins: see LmsPinning.h for why nested operators need no pins of their own.
thread_local int t_depth = 0;
// engine::outOfMemoryErrorsRaised() when the outermost operator started.
thread_local uint64_t t_oom_at_start = 0;
// The depth at which operators capture their arguments for recipes besides
// the outermost: 2 (what autocast calls) while the outermost operator runs
// under autocast, else none (see LmsRecipes.h).
thread_local int t_capture_depth = 0;

// One storage pinned by an operator. The inputs the callback sees are
// destroyed right after the start callbacks run, so the storage is kept alive
// here until the end callback unpins it. `context` identifies the LMS
// allocation that was pinned: if the operator replaces the storage's memory
// (resize_ of an out= argument, set_), the pinned allocation is gone with the
// old DataPtr and the new one must not be unpinned.
struct PinnedStorage {
  c10::intrusive_ptr<c10::StorageImpl> storage;
  void* context;
};

struct PinnedStorages final : at::ObserverContext {
  c10::SmallVector<PinnedStorage, 8> pinned;
  // Inputs that stayed paged out because a pin failed (host placement off):
  // the operator reads and writes their host copies in place.
  c10::SmallVector<c10::intrusive_ptr<c10::StorageImpl>, 2> on_host;
  // The operator's arguments, when its outputs get recipes (recompute).
  recipes::CapturePtr capture;
};

using StorageList = c10::SmallVector<c10::StorageImpl*, 16>;

void collectTensor(const at::Tensor& tensor, StorageList& out) {
  if (!tensor.defined()) {
    return;
  }
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  // Sparse tensors have no storage of their own; their index and value
  // tensors do. Read through the impls: calling operators here would
  // re-enter the dispatcher from inside a RecordFunction callback.
  switch (tensor.layout()) {
    case c10::kSparse: {
      auto* sparse = static_cast<at::SparseTensorImpl*>(impl);
      collectTensor(sparse->indices(), out);
      collectTensor(sparse->values(), out);
      return;
    }
    case c10::kSparseCsr:
    case c10::kSparseCsc:
    case c10::kSparseBsr:
    case c10::kSparseBsc: {
      auto* compressed = static_cast<at::SparseCsrTensorImpl*>(impl);
      collectTensor(compressed->compressed_indices(), out);
      collectTensor(compressed->plain_indices(), out);
      collectTensor(compressed->values(), out);
      return;
    }
    default:
      break;
  }
  // unsafe_storage(): storage() throws for tensors without accessible
  // storage (functional and fake tensors, wrapper subclasses).
  c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage != nullptr && storage->device_type() == c10::DeviceType::CUDA) {
    out.push_back(storage);
  }
}

// Finds the storages of every tensor among an operator's inputs: tensors,
// optional tensors (None or a tensor), and lists, tuples and dicts of them,
// recursively. Script objects are not searched: a module's attributes are
// not operator inputs, and pinning a whole model per operator would defeat
// LMS. (In a patched build, raw data access pages such storages in.)
void collect(const c10::IValue& value, StorageList& out) {
  if (value.isTensor()) {
    collectTensor(value.toTensor(), out);
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      collect(element, out);
    }
  } else if (value.isTuple()) {
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      collect(element, out);
    }
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) {
      collect(item.key(), out);
      collect(item.value(), out);
    }
  }
}

void unpinAll(c10::SmallVector<PinnedStorage, 8>& pinned) {
  for (PinnedStorage& entry : pinned) {
    c10::StorageImpl& storage = *entry.storage;
    try {
      // The operator may have replaced the storage's memory (see
      // PinnedStorage), or raw access may have released the pin's allocation
      // already; only the allocation that was pinned is unpinned.
      if (storage._mutable_data_ptr_no_checks().get_context() ==
              entry.context &&
          engine::getState(storage) == engine::StorageState::Active) {
        engine::unpin(storage);
      }
    } catch (const std::exception& e) {
      // Keep unpinning the others: a storage left pinned is never reclaimed,
      // which wastes memory but loses nothing.
      TORCH_WARN(
          "Large Model Support: could not unpin an operator input of ",
          std::to_string(storage.nbytes()),
          " bytes; it stays resident. ",
          e.what());
    }
  }
  pinned.clear();
}

// Only dispatcher operators are operator boundaries. Other FUNCTION-scope
// records are named ranges (RECORD_FUNCTION): the autograd engine wraps every
// backward node in "autograd::engine::evaluate_function: ..." with no
// inputs, and counting it as the outermost operator would leave the
// operators inside the node, which read the saved activations, unpinned.
//
// LMS's own operators (namespace lms::, e.g. lms::page_in_ahead, which
// compiled graphs call to say what they use next) are not boundaries either:
// pinning their inputs would page in at once what they ask to page in ahead.
bool isOperator(const at::RecordFunction& fn) {
  const auto& name = fn.operator_name();
  return name.has_value() && name->name.rfind("lms::", 0) != 0;
}

std::string mib(size_t bytes) {
  char text[32];
  std::snprintf(
      text,
      sizeof(text),
      "%.2f MiB",
      static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

// The error the operator raises when its inputs cannot all be resident: what
// did not fit, and what to change. A failure that is not a lack of memory (a
// CUDA error, say) is passed on as it is.
std::exception_ptr pinError(
    const char* what,
    const StorageList& storages,
    std::exception_ptr cause) {
  try {
    std::rethrow_exception(cause);
  } catch (const c10::OutOfMemoryError& e) {
    size_t bytes = 0;
    for (const c10::StorageImpl* storage : storages) {
      bytes += storage->nbytes();
    }
    try {
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          false,
          "Large Model Support: the inputs of ",
          what,
          " (",
          std::to_string(storages.size()),
          " storages, ",
          mib(bytes),
          ") cannot all be resident on the device at once. ",
          e.what_without_backtrace(),
          " For an optimizer step, foreach=False updates one parameter per "
          "operator instead of all of them at once.");
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
    return std::current_exception();
  }
  return cause;
}

c10::DeviceIndex deviceOf(const StorageList& storages) {
  for (const c10::StorageImpl* storage : storages) {
    return storage->device().index();
  }
  return -1;
}

// Tells the engine's learned swap schedule that an operator starts. The
// schedule only steers copies, so a failure here must not fail the operator.
void noteOperator(const char* name, const StorageList& storages) {
  try {
    engine::beginOperator(
        name,
        c10::ArrayRef<c10::StorageImpl*>(storages.data(), storages.size()));
  } catch (const std::exception& e) {
    TORCH_WARN_ONCE(
        "Large Model Support: the swap schedule could not act at ",
        name,
        "; storages are paged in on demand. ",
        e.what());
  }
}

// Starts counting the outermost operator's working set, and packs it when it
// is expected to need most of the device (engine::beginWorkingSet). Packing
// only places memory, so a failure here must not fail the operator.
void beginWorkingSet(const char* name, const StorageList& storages) {
  try {
    engine::beginWorkingSet(
        name,
        c10::ArrayRef<c10::StorageImpl*>(storages.data(), storages.size()));
  } catch (const std::exception& e) {
    TORCH_WARN_ONCE(
        "Large Model Support: could not make room for the working set of ",
        name,
        "; its inputs stay where they are. ",
        e.what());
  }
}

// Pins the storages of every input of the outermost operator on this thread.
//
// An input the device cannot hold beside the others stays in its host copy,
// pinned there by the engine (host placement, on by default): the operator
// runs on it over the bus, and nothing fails. When a pin fails all the same
// (host placement off, a copy that failed), RecordFunction would only log an
// exception thrown here, and the operator would run on inputs that are not
// where their DataPtrs say. Instead the operator keeps what could be pinned,
// the inputs left out keep pointing at their host copies (valid device
// addresses under unified addressing), and the engine raises the
// out-of-memory error at the operator's first allocation, before any kernel
// writes an output. An operator that allocates nothing runs on the host
// copies, slowly but correctly.
// Before an operator writes a storage that a dropped storage's recipe reads,
// that storage is recomputed (see LmsRecipes.h). When it cannot be, the
// operator must not run: its first allocation raises the error (a
// RecordFunction callback cannot).
void recomputeBeforeWrites(const at::RecordFunction& fn) {
  try {
    recipes::beforeWrites(fn);
  } catch (...) {
    StorageList storages;
    for (const c10::IValue& input : fn.inputs()) {
      collect(input, storages);
    }
    engine::setPendingError(deviceOf(storages), std::current_exception());
  }
}

// The context of an operator that pins nothing but whose arguments may be a
// recipe; null when they are not.
std::unique_ptr<at::ObserverContext> captureOnly(const at::RecordFunction& fn) {
  recipes::CapturePtr capture = recipes::capture(fn);
  if (capture == nullptr) {
    return nullptr;
  }
  auto context = std::make_unique<PinnedStorages>();
  context->capture = std::move(capture);
  return context;
}

// An operator inside the outermost one (or replayed for a recompute): no
// pins, but its arguments may be a recipe, and what it writes is guarded.
std::unique_ptr<at::ObserverContext> enterNested(const at::RecordFunction& fn) {
  recomputeBeforeWrites(fn);
  if (t_depth != t_capture_depth && !recipes::isCopy(fn)) {
    return nullptr;
  }
  return captureOnly(fn);
}

std::unique_ptr<at::ObserverContext> pinInputs(const at::RecordFunction& fn) {
  if (!isOperator(fn)) {
    return nullptr;
  }
  // Counted before anything can throw: the end callback runs (and
  // decrements) whenever the start callback ran, even if it threw. A replay
  // (recompute) is nested in whatever needed the storage, also when that was
  // no operator.
  if (t_depth++ > 0 || recipes::replaying()) {
    return enterNested(fn);
  }
  t_oom_at_start = engine::outOfMemoryErrorsRaised();
  t_capture_depth = recipes::autocastActive() ? 2 : 0;
  StorageList storages;
  for (const c10::IValue& input : fn.inputs()) {
    collect(input, storages);
  }
  // Views, in-place arguments and repeated inputs share storages: pin each
  // storage once.
  std::sort(storages.begin(), storages.end());
  storages.erase(std::unique(storages.begin(), storages.end()), storages.end());
  // Every outermost operator is a step of the schedule's clock, also one
  // without managed inputs: the clock must not depend on what is managed.
  noteOperator(fn.name(), storages);
  beginWorkingSet(fn.name(), storages);
  if (storages.empty()) {
    // Nothing to pin, but its outputs may still have a recipe (a dropout of
    // a broadcast row, an embedding of small indices).
    return captureOnly(fn);
  }
  recomputeBeforeWrites(fn);
  // Smallest first: when the inputs cannot all be resident at once, the
  // engine leaves each one it finds no room for in its host copy (host
  // placement), so the ones left there are the largest, and no more of them
  // than the device cannot hold. An operator reads an input over the bus at
  // some cost per byte; leaving the largest there leaves the fewest, and the
  // choice does not depend on which inputs happened to be resident.
  std::stable_sort(
      storages.begin(),
      storages.end(),
      [](const c10::StorageImpl* a, const c10::StorageImpl* b) {
        return a->nbytes() < b->nbytes();
      });
  if (engine::isRecomputeEnabled()) {
    // Dropped inputs first: their replays then have the room that the
    // page-ins of the others would take.
    std::stable_partition(
        storages.begin(), storages.end(), [](c10::StorageImpl* storage) {
          return engine::getState(*storage) == engine::StorageState::Dropped;
        });
  }

  auto context = std::make_unique<PinnedStorages>();
  context->pinned.reserve(storages.size());
  std::exception_ptr failure;
  for (c10::StorageImpl* storage : storages) {
    // After a failure, a storage that is still paged out would need room
    // that is not there: it stays on the host. Resident ones are still
    // pinned, which allocates nothing.
    if (failure == nullptr ||
        engine::getState(*storage) != engine::StorageState::PagedOut) {
      try {
        engine::pin(*storage);
        // pin() ignores storages LMS does not manage (small, allocated with
        // LMS off, not adoptable); those need no unpin.
        const c10::DataPtr& data_ptr = storage->_mutable_data_ptr_no_checks();
        if (engine::isManaged(data_ptr)) {
          context->pinned.push_back(PinnedStorage{
              c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage),
              data_ptr.get_context()});
        }
        continue;
      } catch (...) {
        if (failure == nullptr) {
          failure = std::current_exception();
        }
      }
    }
    try {
      engine::beginHostUse(*storage);
      context->on_host.push_back(
          c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage));
    } catch (const std::exception& e) {
      TORCH_WARN(
          "Large Model Support: could not order ",
          fn.name(),
          " after the page-out of an input: ",
          e.what());
    }
  }
  if (failure != nullptr) {
    engine::setPendingError(
        deviceOf(storages), pinError(fn.name(), storages, failure));
  } else {
    // After the pins, so that its timing leaves out their page-ins.
    context->capture = recipes::capture(fn);
  }
  if (context->pinned.empty() && context->on_host.empty() &&
      context->capture == nullptr) {
    return nullptr;
  }
  return context;
}

// Outputs of operators nested in the running outermost one on this thread.
// Weak: a temporary the outer operator frees must not be kept alive.
thread_local std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>
    t_nested_outputs;

void releaseOutput(c10::StorageImpl& storage, const at::RecordFunction& fn) {
  try {
    engine::releaseOutput(storage);
  } catch (const std::exception& e) {
    // It stays resident: memory is wasted, nothing is lost.
    TORCH_WARN(
        "Large Model Support: an output of ",
        fn.name(),
        " stays resident: ",
        e.what());
  }
}

// When the outermost operator ends, what it and the operators inside it
// allocated and did not free becomes reclaimable: its outputs, and tensors an
// inner operator made that outlive the outer one (a cuDNN RNN's reserve space
// inside aten::lstm, saved for backward, which no later forward operator
// reads). Until then the outer operator may still be using them unpinned.
void releaseOutputs(const at::RecordFunction& fn, bool outermost) {
  StorageList storages;
  for (const c10::IValue& output : fn.outputs()) {
    collect(output, storages);
  }
  if (!outermost) {
    for (c10::StorageImpl* storage : storages) {
      if (engine::isManaged(storage->_mutable_data_ptr_no_checks())) {
        t_nested_outputs.emplace_back(
            c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage));
      }
    }
    return;
  }
  for (c10::StorageImpl* storage : storages) {
    releaseOutput(*storage, fn);
  }
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> nested;
  nested.swap(t_nested_outputs);
  for (const auto& weak : nested) {
    if (c10::intrusive_ptr<c10::StorageImpl> storage = weak.lock()) {
      releaseOutput(*storage, fn);
    }
  }
}

// An operator that ends normally although LMS raised an out-of-memory error
// inside it caught the error and went on another way: cuDNN, for one, then
// runs an algorithm with a smaller workspace, whose results can differ in the
// last bits from those of a run with more memory. Said once per operator,
// with the error's verdict: whether the operator's working set passes the cap
// (no placement fits it) or the allocator's mapped memory had no room beside
// the tensors (by how much the cap would have to grow).
void warnIfOutOfMemoryWasCaught(const at::RecordFunction& fn) {
  if (engine::outOfMemoryErrorsRaised() == t_oom_at_start ||
      std::uncaught_exceptions() > 0) {
    return;
  }
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  std::string name = fn.name();
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert(name).second) {
      return;
    }
  }
  char request[32];
  std::snprintf(
      request,
      sizeof(request),
      "%.2f MiB",
      static_cast<double>(engine::lastOutOfMemoryRequest()) / (1024 * 1024));
  const std::string verdict = engine::lastOutOfMemoryVerdict();
  TORCH_WARN(
      "Large Model Support: ",
      name,
      " caught an out-of-memory error raised inside it (no room could be "
      "made for ",
      request,
      ") and went on another way. ",
      verdict.empty() ? std::string() : verdict + " ",
      "Libraries such as cuDNN then run an "
      "algorithm that needs less memory, whose results can differ in the "
      "last bits from a run with more memory. Give the operator more room (a "
      "higher memory cap or LMS limit, a smaller batch) for the same "
      "numbers.");
}

void unpinInputs(const at::RecordFunction& fn, at::ObserverContext* context) {
  if (isOperator(fn) && t_depth > 0) {
    releaseOutputs(fn, /*outermost=*/t_depth == 1 && !recipes::replaying());
  }
  if (context != nullptr) {
    auto* storages = static_cast<PinnedStorages*>(context);
    if (storages->capture != nullptr) {
      try {
        recipes::record(fn, *storages->capture);
      } catch (const std::exception& e) {
        // Recipes only save copies: the outputs are paged out instead.
        TORCH_WARN_ONCE(
            "Large Model Support: could not record how to recompute the "
            "outputs of ",
            fn.name(),
            "; they are paged out instead. ",
            e.what());
      }
      storages->capture.reset();
    }
  }
  if (isOperator(fn) && t_depth > 0 && --t_depth == 0 &&
      !recipes::replaying()) {
    engine::endWorkingSet(fn.name());
    if (engine::hasPendingError()) {
      // The operator allocated nothing through LMS after its pin failed, so
      // it ran on the host copies of the inputs left out.
      engine::clearPendingError();
      TORCH_WARN_ONCE(
          "Large Model Support: the inputs of ",
          fn.name(),
          " did not all fit on the device; it ran on the host copies of "
          "those left out, over the bus. Give the operator more room (a "
          "higher limit or memory cap, a smaller batch) if this is slow.");
    }
    warnIfOutOfMemoryWasCaught(fn);
  }
  if (context != nullptr) {
    auto* storages = static_cast<PinnedStorages*>(context);
    unpinAll(storages->pinned);
    for (const auto& storage : storages->on_host) {
      try {
        engine::endHostUse(*storage);
      } catch (const std::exception& e) {
        TORCH_WARN(
            "Large Model Support: could not order later page-ins after ",
            fn.name(),
            ": ",
            e.what());
      }
    }
    storages->on_host.clear();
  }
}

std::mutex& handleMutex() {
  static std::mutex mutex;
  return mutex;
}

// Guarded by handleMutex().
at::CallbackHandle g_handle = at::INVALID_CALLBACK_HANDLE;

// Installs the observer when libtorch_cuda (or the extension) is loaded, so
// pinning follows LMS however it is enabled: torch.cuda.set_enabled_lms() or
// PYTORCH_CUDA_ALLOC_CONF=lms:True.
const bool g_registered = [] {
  registerOperatorPinning();
  return true;
}();

} // namespace

LaunchPins::LaunchPins() = default;

LaunchPins::~LaunchPins() {
  release();
}

void LaunchPins::pin(c10::ArrayRef<at::Tensor> tensors, const char* what) {
  TORCH_CHECK(state_ == nullptr, "LaunchPins: pin() called twice");
  StorageList storages;
  for (const at::Tensor& tensor : tensors) {
    collectTensor(tensor, storages);
  }
  std::sort(storages.begin(), storages.end());
  storages.erase(std::unique(storages.begin(), storages.end()), storages.end());
  // A compiled kernel launch is an operator of the schedule: compiled code
  // runs its kernels in the same order every iteration too.
  noteOperator(what, storages);
  auto state = std::make_unique<PinnedStorages>();
  try {
    for (c10::StorageImpl* storage : storages) {
      engine::pin(*storage);
      const c10::DataPtr& data_ptr = storage->_mutable_data_ptr_no_checks();
      if (engine::isManaged(data_ptr)) {
        state->pinned.push_back(PinnedStorage{
            c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage),
            data_ptr.get_context()});
      }
    }
  } catch (...) {
    // Nothing has been launched yet: release what was pinned and raise the
    // LMS message from here, where the caller sees it.
    unpinAll(state->pinned);
    std::rethrow_exception(pinError(what, storages, std::current_exception()));
  }
  state_ = std::move(state);
}

void LaunchPins::release() {
  if (state_ != nullptr) {
    unpinAll(static_cast<PinnedStorages*>(state_.get())->pinned);
    state_.reset();
  }
}

void registerOperatorPinning() {
  recipes::installHooks();
#ifdef LMS_HAVE_CLEAR_CUBLAS_WORKSPACES
  // cuBLAS allocates them again at its next call (getCurrentCUDABlasHandle
  // sets the handle's workspace on every call).
  engine::setWorkspaceReleaser(&at::cuda::clearCublasWorkspaces);
#endif
  engine::setEnabledObserver(&setOperatorPinning);
}

void setOperatorPinning(bool enabled) {
  std::lock_guard<std::mutex> lock(handleMutex());
  if (enabled && g_handle == at::INVALID_CALLBACK_HANDLE) {
    // BACKWARD_FUNCTION records wrap whole autograd nodes; the operators a
    // node runs are FUNCTION records of their own and pin their inputs
    // (saved activations) themselves, so only FUNCTION scope is observed.
    g_handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&pinInputs, &unpinInputs)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION}));
  } else if (!enabled && g_handle != at::INVALID_CALLBACK_HANDLE) {
    // Records already started keep their own copy of the callbacks, so
    // every pin taken so far is still matched by an unpin.
    at::removeCallback(g_handle);
    g_handle = at::INVALID_CALLBACK_HANDLE;
  }
}

bool isOperatorPinningActive() {
  std::lock_guard<std::mutex> lock(handleMutex());
  return g_handle != at::INVALID_CALLBACK_HANDLE;
}

} // namespace at::cuda::lms

#endif // USE_ROCM
