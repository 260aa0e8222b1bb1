// Operator working sets (beginWorkingSet and endWorkingSet; the API says
// why): what each operator allocates inside itself, learned per name and
// size of inputs, and packing an operator whose expected working set leaves
// the limit too little room for the pages it would occupy partly.

#include <c10/cuda/LargeModelSupportInternal.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace c10::cuda::lms {

namespace detail {

// The working set of the outermost operator running on this thread.
thread_local WorkingSet t_working_set;

namespace {

// Room of the limit that an operator's expected working set, with what
// cannot be paged out, must leave for it not to be packed (beginWorkingSet):
// ten of the allocator's 20 MiB pages, what partly used pages can take,
// whatever the limit. The operator's own blocks land among storages that are
// paged out while it runs, and the pages they share stay mapped: under a
// 358 MiB cap a cuDNN LSTM whose working set was under three quarters of the
// limit ran out of memory inside itself with 118 MiB of its pages free
// (stress seed 395; seed 52, a DenseNet convolution, alike) when packing
// waited for three quarters of the limit. Above the margin, a pack costs
// more than it can save: paging out everything undoes the learned schedule
// (GPT at 2x an H200's cap: one pack an iteration made it 75% slower, 0.700
// against 0.400 s, and it trained without).
constexpr size_t kPackMarginBytes = 200 * kMiB;
// An operator not seen before, or not with inputs of this size, is expected
// to allocate at least this many times the bytes of its inputs (a backward
// operator's gradients are about as large as its inputs, and it needs room to
// place them). A share per byte learned at other sizes is no floor: cuDNN
// picks another algorithm, with another workspace, for another shape (stress
// seed 301: a convolution backward that had allocated 1.6 times its inputs at
// one size took 2.8 times at the next, and was not weighed).
constexpr size_t kUnseenInsidePerInput = 2;
// Room the allocator's layout must leave an operator beyond what it is
// expected to need before packing is skipped (packIfTight), per block it
// allocated inside itself: the 20 MiB page each block may leave partly used
// where it ends (a convolution backward allocates its gradients and cuDNN's
// workspace; the simulated-GPU test
// an_operator_of_several_blocks_is_spared_a_page_for_each shows three blocks
// landing in the holes of three cached segments, whose free rest the fourth
// cannot use).
constexpr size_t kPackSpareBytes = 20 * kMiB;
// Blocks counted for that room at most: ten pages, the band in which an
// operator is tight at all (kPackMarginBytes).
constexpr size_t kPackSpareBlocks = kPackMarginBytes / kPackSpareBytes;

// PYTORCH_LMS_PACK_LOG leaves out what operators with fewer input and inside
// bytes than this measured: too small to make a working set tight.
constexpr size_t kPackLogBytes = 8 * kMiB;

std::atomic<WorkspaceReleaser> g_workspace_releaser{nullptr};

std::atomic<uint64_t> g_working_set_serial{0};

// What operators of one name allocated inside themselves, learned from every
// run: the most for each size of inputs seen (an iteration repeats its calls,
// and one name serves many: the matmul that makes a language model's logits
// allocates several times its inputs, the model's other matmuls about as
// much as theirs), and
// for inputs of a size not seen yet the most per byte of input (at least 1 MiB
// of input counted, so that an operator with tiny inputs does not scale up
// without bound).
struct Footprint {
  double inside_per_input = 0.0;
  std::unordered_map<size_t, size_t> inside_by_input;
  // The most blocks of kPackBlockBytes or more one call allocated.
  size_t blocks = 0;
};
// Input sizes remembered per operator name: models whose shapes change every
// step (a mixture of experts) fall back to the per-byte share past it.
constexpr size_t kFootprintSizes = 256;

std::mutex g_footprint_mutex;
std::unordered_map<std::string, Footprint> g_footprints;
// The most any operator allocated inside itself: what an operator not seen
// yet may need.
// Written under g_footprint_mutex, read without it.
std::atomic<size_t> g_largest_inside{0};
// The most any operator name allocated per byte of input: with
// g_largest_inside, a bound on every operator's expectation that
// packIfTight reads without the lock.
std::atomic<double> g_largest_inside_per_input{0.0};

// What an operator is expected to allocate inside itself.
struct Expectation {
  size_t inside = 0;
  // Whether an operator of its name ran with inputs of that size before;
  // otherwise `inside` is a bound.
  bool measured = false;
  // The most blocks of kPackBlockBytes or more that a call of its name
  // allocated (at least 1: an operator not seen yet, or one of small blocks,
  // counts one).
  size_t blocks = 1;
};

// What an operator about to pin `pinned` bytes of inputs is expected to
// allocate inside itself.
Expectation expectedInside(std::string_view name, size_t pinned) {
  const double input = static_cast<double>(std::max(pinned, kMiB));
  std::lock_guard<std::mutex> lock(g_footprint_mutex);
  const auto it = g_footprints.find(std::string(name));
  if (it == g_footprints.end()) {
    return {std::max(kUnseenInsidePerInput * pinned, g_largest_inside.load())};
  }
  const Footprint& footprint = it->second;
  const size_t blocks = std::max<size_t>(footprint.blocks, 1);
  if (const auto same = footprint.inside_by_input.find(pinned);
      same != footprint.inside_by_input.end()) {
    return {same->second, true, blocks};
  }
  const size_t scaled = static_cast<size_t>(footprint.inside_per_input * input);
  return {std::max(scaled, kUnseenInsidePerInput * pinned), false, blocks};
}

// `bytes` in MiB, for the diagnostic logs.
double inMiB(size_t bytes) {
  return static_cast<double>(bytes) / static_cast<double>(kMiB);
}

// PYTORCH_LMS_PACK_LOG=1 prints, for every operator whose expected working
// set is tight, what packIfTight weighed and decided, to stderr (a
// diagnostic, not a setting).
bool isPackLogEnabled() {
  static const bool on = isFlagSet("PYTORCH_LMS_PACK_LOG");
  return on;
}

// The memory an operator about to pin `inputs` finds mapped beside it as the
// allocator's memory lies now, once on-demand paging has put every other
// reclaimable storage out: what stays mapped (each segment, or page of an
// expandable segment, in which a block of an input or of anything not
// reclaimable lies, and whatever the layout does not show: the small pool,
// other streams, private pools) and the inputs still to be paged in.
// SIZE_MAX when the allocator cannot show its layout: then only packing is
// sure to make the room.
size_t mappedBesideInputs(
    DeviceEngine& e,
    c10::ArrayRef<c10::StorageImpl*> inputs) {
  const std::vector<SegmentMap> maps =
      backend().segments(e.device, currentStream(e.device));
  if (maps.empty()) {
    return SIZE_MAX;
  }
  std::unordered_map<uintptr_t, Record*> movable;
  size_t paged_in_later = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    movable = residentReclaimable(e);
    for (c10::StorageImpl* storage : inputs) {
      Record* r = recordOf(*storage);
      if (r == nullptr || r->engine != &e) {
        continue; // unmanaged, or another device's memory
      }
      if (r->device_ptr != nullptr) {
        movable.erase(reinterpret_cast<uintptr_t>(r->device_ptr));
      } else {
        paged_in_later += r->size;
      }
    }
  }
  size_t shown = 0;
  size_t stays = 0;
  for (const SegmentMap& map : maps) {
    std::vector<bool> held(map.blocks.size(), false);
    uintptr_t address = map.base;
    for (size_t i = 0; i < map.blocks.size(); ++i) {
      const auto [size, allocated] = map.blocks[i];
      held[i] = allocated && movable.count(address) == 0;
      address += size;
      shown += size;
    }
    stays += mappedBytesHeld(map, held);
  }
  const size_t reserved = backend().reservedBytes(e.device);
  const size_t unshown = reserved > shown ? reserved - shown : 0;
  return stays + unshown + paged_in_later;
}

// Frees libraries' cached workspaces for an operator judged tight on `e`'s
// device (setWorkspaceReleaser), and counts it. Returns whether it did.
bool releaseWorkspaces(DeviceEngine& e) {
  const WorkspaceReleaser release = g_workspace_releaser.load();
  if (release == nullptr) {
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(g_engines_mutex);
    if (std::count_if(g_engines.begin(), g_engines.end(), [](auto* engine) {
          return engine != nullptr;
        }) > 1) {
      return false;
    }
  }
  release();
  std::lock_guard<std::mutex> lock(e.mutex);
  ++e.stats.workspace_releases;
  return true;
}

// Packs the operator about to pin `inputs` (`pinned` bytes) when its
// expected working set leaves too little of the limit for the pages it
// occupies partly (see beginWorkingSet in the header).
void packIfTight(
    DeviceEngine& e,
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs,
    size_t pinned) {
  const size_t limit = effectiveLimit(e);
  // What cannot be paged out: unmanaged and small allocations, and storages
  // pinned or just allocated by running operators.
  auto notReclaimable = [&] {
    const size_t allocated = backend().allocatedBytes(e.device);
    std::lock_guard<std::mutex> lock(e.mutex);
    const auto inactive = static_cast<size_t>(
        std::max<int64_t>(e.stats.inactive_bytes.current, 0));
    return allocated > inactive ? allocated - inactive : 0;
  };
  size_t fixed = notReclaimable();
  auto tight = [&](size_t inside) {
    return fixed + pinned + inside + kPackMarginBytes > limit;
  };
  // Most operators are far from tight even at the largest expectation any
  // operator has: they need neither the lock nor the name's footprint.
  const auto largest_scaled = static_cast<size_t>(
      g_largest_inside_per_input.load() *
      static_cast<double>(std::max(pinned, kMiB)));
  if (!tight(std::max(
          {kUnseenInsidePerInput * pinned,
           g_largest_inside.load(),
           largest_scaled}))) {
    return;
  }
  const auto [inside, measured, blocks] = expectedInside(name, pinned);
  if (!tight(inside)) {
    return;
  }
  // Packing makes room for what an operator allocates beside its inputs. One
  // that allocates nothing (an optimizer's in-place foreach step) has its
  // inputs paged in on demand, each where it fits; one whose inputs, inside
  // bytes and what cannot be paged out pass the allocator's cap fits under
  // no placement. For either a pack would only cost a round of page-outs
  // (GPT at 4x an H100's cap: the optimizer's three in-place steps, every
  // iteration). Only a figure measured at this size of inputs says so; a
  // bound does not.
  const bool allocates = !measured || inside > 0;
  // Libraries' cached workspaces are among what cannot be paged out until
  // they are freed, and where they lie they keep pages mapped: an operator
  // that allocates has them freed before it is weighed, so that its blocks
  // can take their room, packed or not (stress seed 218, a cuDNN LSTM not
  // packed: 2.63 MiB short with a cuBLAS workspace in the middle), and they
  // do not make it look as if no placement could fit it (seed 302, a
  // convolution backward: 66 MiB of cuBLAS workspaces took it past the cap
  // by 23 MiB, so it was not packed, and cuDNN's workspace failed).
  if (allocates && releaseWorkspaces(e)) {
    fixed = notReclaimable();
  }
  const size_t capacity = backend().capacityBytes(e.device);
  const size_t wall = capacity == SIZE_MAX ? limit : std::max(capacity, limit);
  const bool futile =
      !allocates || (measured && fixed + pinned + inside > wall);
  // The operator fits beside its inputs where they lie, with a page to
  // spare for each block it allocates: on-demand paging makes its room, and
  // nothing moves ahead.
  const size_t spare = kPackSpareBytes * std::min(blocks, kPackSpareBlocks);
  const size_t beside = futile ? SIZE_MAX : mappedBesideInputs(e, inputs);
  const bool pack =
      !futile && (beside == SIZE_MAX || beside + inside + spare > limit);
  if (isPackLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS pack: %s %.*s: inputs %.1f MiB, expected inside %.1f MiB "
        "in %zu block%s, not reclaimable %.1f MiB, mapped beside the inputs "
        "%.1f MiB, limit %.1f MiB\n",
        pack ? "packed" : (futile ? "cannot help" : "not packed"),
        static_cast<int>(name.size()),
        name.data(),
        inMiB(pinned),
        inMiB(inside),
        blocks,
        blocks == 1 ? "" : "s",
        inMiB(fixed),
        beside == SIZE_MAX ? -1.0 : inMiB(beside),
        inMiB(limit));
  }
  if (!pack) {
    return;
  }
  const size_t freed =
      reclaim(e, std::numeric_limits<size_t>::max(), Trigger::Pack);
  // Returning the cache synchronizes the device, but without it the freed
  // blocks that other streams used stay out of the allocator's free lists
  // until their events are polled, and the page-ins fill the holes of the
  // ranges the operator's inputs kept mapped (the simulated-GPU test
  // an_operator_expected_to_need_most_of_the_device_is_packed_first shows
  // it). Emptied, the allocator maps the inputs anew side by side.
  backend().releaseCachedMemory(e.device);
  std::lock_guard<std::mutex> lock(e.mutex);
  ++e.stats.pack_count;
  e.stats.pack_bytes += static_cast<int64_t>(freed);
}

} // namespace

} // namespace detail

using namespace detail;

size_t mappedBytesHeld(const SegmentMap& map, const std::vector<bool>& held) {
  TORCH_CHECK(
      held.size() == map.blocks.size(),
      "Large Model Support: mappedBytesHeld got ",
      held.size(),
      " flags for ",
      map.blocks.size(),
      " blocks; pass one flag per block");
  size_t total = 0;
  for (const auto& block : map.blocks) {
    total += block.first;
  }
  const size_t page = map.page_bytes > 0 ? map.page_bytes : total;
  if (page == 0) {
    return 0;
  }
  std::vector<bool> mapped((total + page - 1) / page, false);
  size_t offset = 0;
  for (size_t b = 0; b < map.blocks.size(); ++b) {
    const size_t size = map.blocks[b].first;
    if (held[b] && size > 0) {
      for (size_t i = offset / page; i <= (offset + size - 1) / page; ++i) {
        mapped[i] = true;
      }
    }
    offset += size;
  }
  size_t bytes = 0;
  for (size_t i = 0; i < mapped.size(); ++i) {
    if (mapped[i]) {
      bytes += std::min(page, total - i * page);
    }
  }
  return bytes;
}

void beginWorkingSet(
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs) {
  WorkingSet& ws = t_working_set;
  ws = WorkingSet{};
  if (!isEnabled() || g_backend.load() == nullptr) {
    return;
  }
  DeviceEngine* e = nullptr;
  size_t pinned = 0;
  for (c10::StorageImpl* storage : inputs) {
    if (Record* r = recordOf(*storage)) {
      pinned += r->size;
      e = r->engine;
    }
  }
  if (e == nullptr) {
    return; // no managed input says which device it runs on
  }
  ws.active = true;
  ws.device = e->device;
  ws.name = name;
  ws.serial = ++g_working_set_serial;
  ws.pinned = pinned;
  DeviceScope guard(e->device);
  // A captured graph bakes in addresses: nothing may move during a capture.
  if (!g_packing.load() || isCapturing(currentStream(e->device))) {
    return;
  }
  packIfTight(*e, name, inputs, pinned);
}

void endWorkingSet(std::string_view name) {
  WorkingSet& ws = t_working_set;
  if (!ws.active) {
    return;
  }
  ws.active = false;
  const double per_input = static_cast<double>(ws.inside_peak) /
      static_cast<double>(std::max(ws.pinned, kMiB));
  // What the figure of this size was before (SIZE_MAX: none), for the log.
  size_t before = SIZE_MAX;
  {
    std::lock_guard<std::mutex> lock(g_footprint_mutex);
    Footprint& footprint = g_footprints[std::string(name)];
    footprint.inside_per_input =
        std::max(footprint.inside_per_input, per_input);
    footprint.blocks = std::max(footprint.blocks, ws.blocks);
    if (const auto same = footprint.inside_by_input.find(ws.pinned);
        same != footprint.inside_by_input.end()) {
      before = same->second;
      same->second = std::max(same->second, ws.inside_peak);
    } else if (footprint.inside_by_input.size() < kFootprintSizes) {
      footprint.inside_by_input.emplace(ws.pinned, ws.inside_peak);
    }
    g_largest_inside.store(std::max(g_largest_inside.load(), ws.inside_peak));
    g_largest_inside_per_input.store(
        std::max(g_largest_inside_per_input.load(), per_input));
  }
  // The log's other half: what operators measured, the first time at a size
  // and whenever they allocate a page more than the figure packIfTight read,
  // so that an expectation can be checked against what came. Operators under
  // kPackLogBytes in all are left out.
  const bool first = before == SIZE_MAX;
  if (isPackLogEnabled() && ws.pinned + ws.inside_peak >= kPackLogBytes &&
      (first || ws.inside_peak > before + kPackSpareBytes)) {
    char was[48] = "first at this size";
    if (!first) {
      std::snprintf(was, sizeof(was), "was %.1f MiB", inMiB(before));
    }
    std::fprintf(
        stderr,
        "LMS pack: measured %.*s: inputs %.1f MiB, inside %.1f MiB (%s)\n",
        static_cast<int>(name.size()),
        name.data(),
        inMiB(ws.pinned),
        inMiB(ws.inside_peak),
        was);
  }
}

void setWorkspaceReleaser(WorkspaceReleaser releaser) {
  g_workspace_releaser.store(releaser);
}

} // namespace c10::cuda::lms
