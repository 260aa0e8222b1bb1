// Recompute instead of paging (setRecomputeEnabled): a reclaim first drops
// the storages whose replay is cheap, best bytes per millisecond of replay
// and furthest next use first (cheapDrops), and pages out only what is left;
// any other victim with a recipe is dropped when replaying it costs less
// than paging it out and back in (dropInstead). A dropped storage is
// recomputed when it is used, through the hooks of the layer that records
// recipes (RecomputeHooks), or, with the learned schedule, ahead of that use
// (recomputeAhead).

#include <c10/cuda/LargeModelSupportInternal.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

namespace c10::cuda::lms {

namespace detail {

std::atomic<const RecomputeHooks*> g_recompute_hooks{nullptr};

// Pins made for a recompute's replay on this thread (pinForRecompute): uses
// the program does not make, which the learned schedule must not see.
thread_local int t_recompute_pins = 0;

// Replays of dropped storages running on this thread (rematerialize): what
// they allocate is no allocation of the running operator, whose ordinals
// identify its outputs in the learned schedule.
thread_local int t_replays = 0;

namespace {

// Set while this thread recomputes a storage ahead of its use
// (recomputeAhead), the dropped inputs of its recipe included: fillDropped
// counts those replays as ahead of use.
thread_local int t_ahead = 0;

} // namespace

// Drops a victim instead of copying it out, when it has a recipe and
// recomputing it costs less than paging it out and back in (pagingCost():
// the copies at the measured bandwidth, as far as they make streams wait;
// before any copy was timed, victims are paged out: that measures it). Its
// memory goes back to the allocator in the order of every stream that used it,
// and its DataPtr holds no address until it is recomputed. The victim is busy
// and on no list; the engine lock is not held. Returns false, nothing changed,
// when the victim is to be paged out.
bool dropInstead(DeviceEngine& e, Record& r, StorageRef& keep_alive) {
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  if (isRecomputeLogEnabled() && hooks != nullptr && g_recompute.load()) {
    std::fprintf(
        stderr,
        "LMS recompute: victim of %zu bytes: %s\n",
        r.size,
        !r.recomputable       ? "no recipe"
            : r.graph_owned   ? "graph memory"
            : r.draining      ? "draining"
            : !r.stream_known ? "stream unknown"
                              : "has a recipe");
  }
  if (!r.recomputable || hooks == nullptr || !g_recompute.load() ||
      r.graph_owned || r.draining || !r.stream_known ||
      r.device_ptr == nullptr) {
    return false;
  }
  const double paging = pagingCost(e, r.size);
  if (paging < 0.0) {
    return false;
  }
  StorageRef storage = r.owner.lock();
  if (!storage) {
    return false;
  }
  c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  if (dp.get_context() != &r || dp.get_deleter() != &deleteRecord) {
    return false;
  }
  const double cost = hooks->cost_ms(*storage);
  const bool drop = cost >= 0.0 && cost < paging && hooks->retain(*storage);
  if (isRecomputeLogEnabled()) {
    std::fprintf(
        stderr,
        "LMS recompute: %zu bytes: recompute %.3f ms, paging %.3f ms (stall "
        "share %.2f): %s\n",
        r.size,
        cost,
        paging,
        stallShare(e),
        drop ? "dropped" : "paged out");
  }
  if (!drop) {
    return false;
  }
  DeviceScope guard(e.device);
  releaseDeviceMemory(e, r, /*in_deleter=*/false);
  r.dropped = true;
  const c10::Device device = dp.device();
  void* ctx = dp.release_context();
  dp = c10::DataPtr(nullptr, ctx, &deleteRecord, device);
  keep_alive = std::move(storage);
  return true;
}

namespace {

// A replay is priced at no less than this many milliseconds: one kernel
// launch. It keeps the ratio of bytes to milliseconds finite.
constexpr double kLeastReplayMs = 0.005;

// The rank of dropping `bytes` whose replay takes `ms`, next used
// `distance` operators from now: bytes freed per millisecond of replay,
// times the distance (the memory is free for longer, and a replay far ahead
// of its use can be made ahead of it). As DTR and Capuchin rank evictions.
double dropScore(size_t bytes, double ms, uint64_t distance) {
  return static_cast<double>(bytes) * static_cast<double>(distance) /
      std::max(ms, kLeastReplayMs);
}

} // namespace

// The storages a reclaim drops before it pages anything out, best first,
// among the `count` candidates that ranked best by their last price:
// inactive, resident storages with a recipe whose replay costs less than
// paging them out and back in (pagingCost), ranked by dropScore(). The
// distance is to the next use the learned schedule predicts (twice the
// period for one it predicts none for), and without a schedule the time
// since the last use (least recently used first, as DTR's staleness).
// Storages kept for a recompute (needed_by) are left out: dropping an input
// of a dropped storage's recipe would make the chain of replays longer.
// With `protect_until` set (an early page-out, which makes room ahead of
// need), only storages the active schedule next uses after that clock, and
// none without an active schedule. Empty when recompute is off, when no
// hooks are installed, and before any copy was timed (victims are then paged
// out: that measures the bus). The engine lock is not held.
std::vector<DropCandidate> cheapDrops(
    DeviceEngine& e,
    size_t threshold,
    uint64_t protect_until,
    size_t count) {
  std::vector<DropCandidate> out;
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  if (hooks == nullptr || !g_recompute.load()) {
    return out;
  }
  struct Seen {
    Record* r;
    uint64_t distance;
    double guess; // by the last price, unpriced first
  };
  std::vector<Seen> seen;
  std::vector<uint64_t> distances;
  // Released after the engine lock: a last reference runs the deleter.
  std::vector<StorageRef> passed;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    std::unique_lock<std::mutex> schedule_lock(
        g_schedule_mutex, std::defer_lock);
    const AccessSchedule* schedule = nullptr;
    uint64_t now = g_op_clock.load(std::memory_order_relaxed);
    if (g_schedule_enabled.load()) {
      schedule_lock.lock();
      if (theSchedule().active()) {
        schedule = &theSchedule();
        now = schedule->now();
      } else {
        schedule_lock.unlock();
      }
    }
    if (protect_until != 0 && schedule == nullptr) {
      return out;
    }
    for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
      if (!r->recomputable || r->busy || r->size < threshold ||
          r->graph_owned || r->draining || !r->stream_known ||
          r->device_ptr == nullptr ||
          r->needed_by.load(std::memory_order_relaxed) != 0) {
        continue;
      }
      const uint64_t touch = r->touch.load(std::memory_order_relaxed);
      uint64_t distance = 1;
      if (schedule != nullptr) {
        const uint64_t next = schedule->nextUse(touch, r->size, r->gap.load());
        if (protect_until != 0 && next <= protect_until) {
          continue; // used within the window: no early drop
        }
        distance = next == AccessSchedule::kNever ? 2 * schedule->period()
            : next > now                          ? next - now
                                                  : 1;
      } else if (now > touch) {
        distance = now - touch + 1;
      }
      seen.push_back(Seen{r, std::max<uint64_t>(distance, 1), r->replay_ms});
    }
    const size_t priced = std::min(seen.size(), count);
    std::partial_sort(
        seen.begin(),
        seen.begin() + static_cast<std::ptrdiff_t>(priced),
        seen.end(),
        [](const Seen& a, const Seen& b) {
          // Never priced: first, so that every candidate gets a price.
          const double sa = a.guess < 0.0
              ? std::numeric_limits<double>::infinity()
              : dropScore(a.r->size, a.guess, a.distance);
          const double sb = b.guess < 0.0
              ? std::numeric_limits<double>::infinity()
              : dropScore(b.r->size, b.guess, b.distance);
          return sa > sb;
        });
    seen.resize(priced);
    for (const Seen& c : seen) {
      StorageRef storage = c.r->owner.lock();
      if (!storage || recordOf(*storage) != c.r) {
        passed.push_back(std::move(storage));
        continue;
      }
      out.push_back(DropCandidate{c.r, std::move(storage), 0.0});
      distances.push_back(c.distance);
    }
  }
  // Priced outside the engine lock: the recipes read their inputs' states.
  size_t kept = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    DropCandidate& c = out[i];
    const size_t size = c.storage->nbytes();
    const double paging = pagingCost(e, size);
    if (paging < 0.0) {
      out.clear(); // the bus is not measured yet
      return out;
    }
    const double cost = hooks->cost_ms(*c.storage);
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      if (recordOf(*c.storage) != c.r) {
        continue;
      }
      c.r->replay_ms = cost;
    }
    if (isRecomputeLogEnabled()) {
      std::fprintf(
          stderr,
          "LMS recompute: candidate of %zu bytes, next use in %llu "
          "operators: recompute %.3f ms, paging %.3f ms: %s\n",
          size,
          static_cast<unsigned long long>(distances[i]),
          cost,
          paging,
          cost >= 0.0 && cost < paging ? "drop first" : "not first");
    }
    if (cost < 0.0 || cost >= paging) {
      continue;
    }
    c.score = dropScore(size, cost, distances[i]);
    if (kept != i) {
      out[kept] = std::move(c);
    }
    ++kept;
  }
  out.resize(kept);
  std::stable_sort(
      out.begin(),
      out.end(),
      [](const DropCandidate& a, const DropCandidate& b) {
        return a.score > b.score;
      });
  return out;
}

namespace {

// Serializes recomputes: a replay may recompute its own inputs first (the
// same thread, again), and two threads must not both recompute one storage.
std::recursive_mutex g_recompute_mutex;

// Recomputes a dropped storage (RecomputeHooks::recompute) on the current
// stream, timing the replay there. Returns the storage's record after it: a
// new one when the storage was dropped, `r` otherwise.
Record* rematerialize(c10::StorageImpl& storage, Record* r) {
  DeviceEngine& e = *r->engine;
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy; });
    if (r->state != State::Dropped) {
      return r;
    }
  }
  const std::lock_guard<std::recursive_mutex> serial(g_recompute_mutex);
  r = recordOf(storage);
  if (r == nullptr) {
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (r->state != State::Dropped) {
      return r; // another thread recomputed it meanwhile
    }
  }
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  const size_t size = r->size;
  TORCH_CHECK(
      hooks != nullptr,
      "LMS: a storage of ",
      std::to_string(size),
      " bytes was dropped to be recomputed, but no recompute hooks are "
      "installed any more");
  const cudaStream_t stream = currentStream(e.device);
  TORCH_CHECK(
      !isCapturing(stream),
      "LMS: a storage of ",
      std::to_string(size),
      " bytes was dropped to be recomputed, and CUDA graph capture is "
      "underway on the current stream; a recompute cannot be captured. Run "
      "the captured region once before capturing so its inputs are "
      "resident, or turn recompute off (torch.cuda.set_recompute_lms(False)).");
  DeviceScope guard(e.device);
  cudaEvent_t start = e.events.get(/*timing=*/true);
  C10_CUDA_CHECK(cudaEventRecord(start, stream));
  ++t_replays;
  try {
    hooks->recompute(storage);
  } catch (...) {
    --t_replays;
    e.events.put(start);
    throw;
  }
  --t_replays;
  cudaEvent_t end = e.events.get(/*timing=*/true);
  C10_CUDA_CHECK(cudaEventRecord(end, stream));
  addTiming(e, Timed::Recompute, start, end, size);
  Record* now = recordOf(storage);
  TORCH_CHECK(
      now != nullptr && now != r,
      "LMS: recomputing a dropped storage of ",
      std::to_string(size),
      " bytes did not fill it");
  return now;
}

// A dropped storage's chain for a replay ahead of use: the dropped storages
// its replay recomputes (itself, and dropped inputs of recipes, recursively)
// and their bytes, and whether every other input is resident now.
struct AheadChain {
  bool ready = true; // no input paged out, busy, or with its copy running
  bool too_deep = false; // dropped inputs deeper than kAheadDepth
  int replays = 0;
  size_t bytes = 0;
  std::vector<StorageRef> dropped_inputs; // recomputed with it
};

// Walks the recipe of dropped `storage` (at `depth` below the storage to be
// recomputed ahead) into `chain`. Stops at the first input that is not
// ready. The engine lock is not held: the hooks read the recipes.
void walkChain(
    DeviceEngine& e,
    const RecomputeHooks& hooks,
    c10::StorageImpl& storage,
    int depth,
    AheadChain& chain) {
  ++chain.replays;
  chain.bytes += storage.nbytes();
  std::vector<StorageRef> inputs; // destroyed after every lock is released
  hooks.inputs(storage, inputs);
  for (const StorageRef& input : inputs) {
    Record* r = recordOf(*input);
    if (r == nullptr || r->engine != &e) {
      continue;
    }
    bool dropped = false;
    {
      std::lock_guard<std::mutex> lock(e.mutex);
      if (r->busy || r->on_host ||
          (r->state == State::PagedOut && !r->draining)) {
        // Its replay would page it in on the compute stream: that is the
        // wait a replay ahead of use is to avoid. A page-in ahead of use
        // (prefetchRecipeInputs) is under way or comes next.
        chain.ready = false;
        return;
      }
      dropped = r->state == State::Dropped;
      if (!dropped && r->device_ready != nullptr) {
        const cudaError_t err = cudaEventQuery(r->device_ready);
        if (err == cudaErrorNotReady) {
          (void)cudaGetLastError(); // not an error: clear the sticky state
          chain.ready = false; // paged in ahead, the copy still running
          return;
        }
        C10_CUDA_CHECK(err);
      }
    }
    if (dropped) {
      if (depth >= kAheadDepth) {
        chain.too_deep = true;
        return;
      }
      chain.dropped_inputs.push_back(input);
      walkChain(e, hooks, *input, depth + 1, chain);
      if (!chain.ready || chain.too_deep) {
        return;
      }
    }
  }
}

// Keeps the allocator's failure path from reclaiming for a replay ahead of
// use (see t_no_reclaim): it takes only memory that is free.
// Keeps `storage`, just recomputed ahead of use for a recipe that reads it,
// for its own next use when that comes by operator clock `horizon`.
void keepUntilUse(
    DeviceEngine& e,
    c10::StorageImpl& storage,
    uint64_t horizon) {
  Record* r = recordOf(storage);
  if (r == nullptr || r->engine != &e) {
    return;
  }
  std::lock_guard<std::mutex> lock(e.mutex);
  if (r->state != State::Inactive || r->needed_by.load() != 0) {
    return;
  }
  uint64_t next = AccessSchedule::kNever;
  {
    std::lock_guard<std::mutex> schedule_lock(g_schedule_mutex);
    if (theSchedule().active()) {
      next = theSchedule().nextUse(r->touch.load(), r->size, r->gap.load());
    }
  }
  if (next != AccessSchedule::kNever && next <= horizon) {
    r->needed_by.store(next, std::memory_order_relaxed);
  }
}

class NoReclaimForReplay {
 public:
  NoReclaimForReplay() : previous_(t_no_reclaim) {
    t_no_reclaim = true;
    ++t_ahead;
  }
  ~NoReclaimForReplay() {
    --t_ahead;
    t_no_reclaim = previous_;
  }
  NoReclaimForReplay(const NoReclaimForReplay&) = delete;
  NoReclaimForReplay& operator=(const NoReclaimForReplay&) = delete;

 private:
  const bool previous_;
};

} // namespace

// Recomputes dropped `storage`, next used at operator clock `next`, now,
// ahead of that use, when every input of its recipe is resident with its
// copy done, its dropped inputs (no deeper than kAheadDepth) are recomputed
// with it, the chain is at most `replays_left` replays (which it then takes
// from), its bytes fit under the limit without reclaiming anything, and the
// bytes brought back ahead of use and not used yet (page-ins and replays)
// stay within `budget`, the room early page-outs keep free for them. The
// result is inactive and reclaimable, but kept for its use (needed_by): no
// early page-out or cheap drop takes it before then, so it is not replayed
// twice for one use. So is a dropped input recomputed with it whose own next
// use comes by operator clock `horizon` (the schedule's window): a backward
// pass uses the input of a layer's recipe right after the layer's output.
//
// The replay runs on the current stream, at the operator boundary the
// schedule acts at, which is where operator-boundary pinning may run
// operators (as a recompute on demand from pin() does). Not a side stream:
// the replay's operators would each have to be ordered after the compute
// stream's use of their inputs and before the consumer's use of their
// outputs, and the caching allocator told of every stream that used the
// memory they allocate and free (their temporaries too), all from inside an
// operator's pinning callback. What the replay ahead of use gains on the
// compute stream: its inputs were paged in on the H2D stream while the
// operators before ran, and it never waits for them, nor makes the
// consumer's pins page them in on demand.
// The engine lock is not held.
Ahead recomputeAhead(
    DeviceEngine& e,
    c10::StorageImpl& storage,
    uint64_t next,
    uint64_t horizon,
    size_t budget,
    int& replays_left) {
  const RecomputeHooks* hooks = g_recompute_hooks.load();
  if (hooks == nullptr || hooks->inputs == nullptr || !g_recompute.load()) {
    return Ahead::Never;
  }
  const cudaStream_t stream = currentStream(e.device);
  if (isCapturing(stream)) {
    return Ahead::Never; // a replay cannot be captured
  }
  {
    Record* r = recordOf(storage);
    if (r == nullptr || r->engine != &e) {
      return Ahead::Never;
    }
    std::lock_guard<std::mutex> lock(e.mutex);
    if (r->busy || r->state != State::Dropped) {
      return Ahead::Never;
    }
  }
  AheadChain chain;
  walkChain(e, *hooks, storage, 0, chain);
  if (chain.too_deep) {
    return Ahead::Never; // left to the recompute on demand
  }
  if (!chain.ready || chain.replays > replays_left) {
    return Ahead::NotYet;
  }
  if (backend().allocatedBytes(e.device) + chain.bytes > effectiveLimit(e)) {
    return Ahead::NotYet;
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.prefetched_bytes + storage.nbytes() > budget) {
      return Ahead::NotYet;
    }
  }
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return Ahead::Never;
  }
  replays_left -= chain.replays;
  try {
    const NoReclaimForReplay scope;
    r = rematerialize(storage, r);
  } catch (const std::exception& error) {
    // Speculative: the storage stays dropped, recomputed when used.
    TORCH_WARN_ONCE(
        "Large Model Support: a recompute ahead of use failed; dropped "
        "storages are recomputed when used. ",
        error.what());
    return Ahead::Never;
  }
  if (r == nullptr) {
    return Ahead::Never;
  }
  for (const StorageRef& input : chain.dropped_inputs) {
    keepUntilUse(e, *input, horizon);
  }
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (r->state != State::Allocated || r->pins != 0 || r->busy ||
        r->list != nullptr) {
      return Ahead::Replayed; // already used or freed meanwhile
    }
    r->needed_by.store(next, std::memory_order_relaxed);
    r->replayed_ahead = true;
    e.prefetched_bytes += r->size;
    leave(e, *r);
    enter(e, *r, State::Inactive);
    e.reclaim_list.push_back(r);
    // Under the lock, as unpin() arms it: a pin on another thread disarms.
    arm(storage, true);
  }
  return Ahead::Replayed;
}

// Recomputes the storage if it was dropped and returns its record, not busy
// and not dropped, with its engine's lock taken in `lock`; null when the
// storage holds no LMS allocation any more. A reclaim on another thread may
// drop it again before the lock is taken: then it is recomputed again.
Record* settledResident(
    c10::StorageImpl& storage,
    Record* r,
    std::unique_lock<std::mutex>& lock) {
  for (;;) {
    r = rematerialize(storage, r);
    if (r == nullptr) {
      return nullptr;
    }
    lock = std::unique_lock<std::mutex>(r->engine->mutex);
    r->engine->settled.wait(lock, [&] { return !r->busy; });
    if (r->state != State::Dropped) {
      return r;
    }
    lock.unlock();
  }
}

} // namespace detail

using namespace detail;

bool isRecomputeLogEnabled() {
  static const bool on = isFlagSet("PYTORCH_LMS_RECOMPUTE_LOG");
  return on;
}

void pinForRecompute(c10::StorageImpl& storage) {
  ++t_recompute_pins;
  struct Leave {
    ~Leave() {
      --t_recompute_pins;
    }
  } leave_scope;
  pin(storage);
}

void setRecomputeHooks(const RecomputeHooks* hooks) {
  g_recompute_hooks.store(hooks);
}

void setRecomputable(c10::StorageImpl& storage, bool recomputable) {
  Record* r = recordOf(storage);
  if (r == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(r->engine->mutex);
  r->recomputable = recomputable;
}

void* fillDropped(c10::StorageImpl& dropped, c10::StorageImpl& fresh) {
  Record* r = recordOf(dropped);
  Record* f = recordOf(fresh);
  TORCH_CHECK(
      r != nullptr && f != nullptr && r->engine == f->engine,
      "LMS: fillDropped() needs two LMS storages of one device");
  TORCH_CHECK(
      dropped.nbytes() == fresh.nbytes() && r->size == f->size,
      "LMS: a recompute produced ",
      std::to_string(fresh.nbytes()),
      " bytes for a dropped storage of ",
      std::to_string(dropped.nbytes()),
      " bytes");
  DeviceEngine& e = *r->engine;
  {
    std::unique_lock<std::mutex> lock(e.mutex);
    e.settled.wait(lock, [&] { return !r->busy && !f->busy; });
    TORCH_CHECK(
        r->state == State::Dropped,
        "LMS: fillDropped() of a storage that is not dropped (state ",
        toString(publicState(r->state)),
        ")");
    TORCH_CHECK(
        f->state == State::Allocated && f->pins == 0,
        "LMS: a recompute's result is in use elsewhere (state ",
        toString(publicState(f->state)),
        ")");
    e.dropped_list.remove(r);
    removeUpcoming(e, *r);
    leave(e, *r);
    enter(e, *r, State::Allocated);
    clearFresh(e, *f);
    // The storage keeps its place in the learned schedule.
    f->touch.store(r->touch.load());
    f->gap.store(r->gap.load());
    r->moved = true;
    r->recomputable = false;
    ++e.stats.recompute_count;
    e.stats.recompute_bytes += sz(*r);
    if (t_ahead > 0) {
      ++e.stats.recompute_ahead_count;
      e.stats.recompute_ahead_bytes += sz(*r);
    }
  }
  std::swap(
      dropped._mutable_data_ptr_no_checks(),
      fresh._mutable_data_ptr_no_checks());
  rememberOwner(*f, dropped);
  rememberOwner(*r, fresh);
  return f;
}

} // namespace c10::cuda::lms
