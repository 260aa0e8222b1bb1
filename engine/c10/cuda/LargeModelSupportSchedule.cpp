// The learned swap schedule: AccessSchedule, which learns the repeating
// order of operators and predicts each storage's next use
// (LargeModelSupportSchedule.h), and the policy that the engine drives with
// it at operator boundaries, below.

#include <c10/cuda/LargeModelSupportSchedule.h>

#include <c10/cuda/LargeModelSupportInternal.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace c10::cuda::lms {

namespace {

// splitmix64's finalizer: every input bit affects every output bit, so
// signatures that differ in one size or distance do not collide in practice.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t combine(uint64_t seed, uint64_t value) {
  return mix(seed ^ mix(value));
}

uint64_t hashName(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL; // FNV-1a
  for (const char c : name) {
    h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  }
  return h;
}

// Candidates alive at once: each costs one comparison per operator.
constexpr size_t kMaxCandidates = 64;

} // namespace

AccessSchedule::AccessSchedule(uint64_t max_period)
    : max_period_(std::max(max_period, kMinPeriod)),
      capacity_(max_period_ + 1) {}

uint64_t AccessSchedule::key(uint64_t phase, uint64_t size, uint64_t gap) {
  return combine(combine(mix(phase), size), gap);
}

uint64_t AccessSchedule::record(
    std::string_view name,
    const Use* uses,
    size_t count) {
  if (signatures_.empty()) {
    // Allocated at the first operator, not at construction: an engine whose
    // schedule is never used pays nothing.
    signatures_.assign(capacity_, 0);
    inputs_.resize(capacity_);
  }
  const uint64_t t = ++clock_;
  Inputs& inputs = inputs_[t % capacity_];
  inputs.clear();
  for (size_t i = 0; i < count; ++i) {
    // A touch in the future cannot happen; clamp rather than wrap.
    const uint64_t distance = uses[i].touch < t ? t - uses[i].touch : 0;
    inputs.push_back(Input{distance, uses[i].size, uses[i].gap});
  }
  // Inputs arrive in address order, which changes every iteration.
  std::sort(inputs.begin(), inputs.end());
  uint64_t signature = hashName(name);
  for (const Input& in : inputs) {
    // Gaps between earlier touches are left out: they differ in the first
    // iterations (an optimizer creating its state one parameter at a time)
    // while the operators and their inputs' sizes and distances already
    // repeat. Allocation ordinals, which are structural, stay in.
    signature = combine(
        combine(combine(signature, in.distance), in.size),
        in.gap >= kBirth ? in.gap : 0);
  }
  signatures_[t % capacity_] = signature;
  if (logging_) {
    names_.resize(capacity_);
    names_[t % capacity_] = std::string(name);
  }
  if (logging_ && t >= traced_first_ && t <= traced_last_) {
    drop_report_ = "operator " + std::to_string(t) + ": " + describeOperator(t);
  }

  if (active_ && (t <= period_ || signatureAt(t - period_) != signature)) {
    if (logging_) {
      drop_report_ +=
          (drop_report_.empty() ? "" : "\n") + describeDrop(t, period_, 0);
    }
    drop();
  }
  // Advance the candidates; a mismatch ends one, and so does an input last
  // used longer ago than the candidate's period: in a steady iteration every
  // storage in use is touched at least once per iteration, so no reuse
  // distance exceeds its length. This keeps a stack of identical layers
  // (whose inputs include parameters last used an iteration ago) from being
  // taken for an iteration.
  const uint64_t farthest = inputs.empty() ? 0 : inputs.back().distance;
  size_t kept = 0;
  for (const Candidate& c : candidates_) {
    if (t > c.period && farthest <= c.period &&
        signatureAt(t - c.period) == signature) {
      candidates_[kept++] = Candidate{c.period, c.run + 1};
    } else if (logging_ && c.run >= kLoggedRun && c.period >= kLoggedRun) {
      // A long candidate that ends before it is confirmed: what keeps the
      // iteration from being learned.
      drop_report_ +=
          (drop_report_.empty() ? "" : "\n") + describeDrop(t, c.period, c.run);
    }
  }
  candidates_.resize(kept);
  seedCandidates(signature);
  if (!active_) {
    uint64_t best = 0;
    for (const Candidate& c : candidates_) {
      if (c.run >= std::max(c.period, kMinConfirm) &&
          (best == 0 || c.period < best)) {
        best = c.period;
      }
    }
    if (best != 0) {
      adopt(best);
    }
  }
  return t;
}

void AccessSchedule::seedCandidates(uint64_t signature) {
  const uint64_t t = clock_;
  Recent& recent = recent_[signature];
  for (const uint64_t at : recent.at) {
    if (at == 0 || t - at < kMinPeriod || t - at > max_period_) {
      continue;
    }
    const uint64_t period = t - at;
    const bool known = std::any_of(
        candidates_.begin(), candidates_.end(), [&](const Candidate& c) {
          return c.period == period;
        });
    if (!known && candidates_.size() < kMaxCandidates) {
      candidates_.push_back(Candidate{period, 1});
    }
  }
  std::copy_backward(recent.at, recent.at + 3, recent.at + 4);
  recent.at[0] = t;
  // Signatures that never recur (changing shapes) must not grow the map
  // without bound: forget those not seen within the longest period.
  if (recent_.size() > 4 * max_period_) {
    for (auto it = recent_.begin(); it != recent_.end();) {
      it = t - it->second.at[0] > max_period_ ? recent_.erase(it)
                                              : std::next(it);
    }
  }
}

void AccessSchedule::adopt(uint64_t period) {
  active_ = true;
  period_ = period;
  ++generation_;
  ++detections_;
  next_.clear();
  deaths_.clear();
  const uint64_t t = clock_;
  for (uint64_t u = t - period + 1; u <= t; ++u) {
    for (const Input& in : inputs_[u % capacity_]) {
      if (in.distance == 0 || in.distance > u) {
        continue; // touched in this very operator, or before the first
      }
      const uint64_t k = key((u - in.distance) % period, in.size, in.gap);
      next_[k].push_back(in.distance);
    }
  }
  for (auto& [k, distances] : next_) {
    (void)k;
    std::sort(distances.begin(), distances.end());
    distances.erase(
        std::unique(distances.begin(), distances.end()), distances.end());
  }
}

// Numbers are formatted with std::to_string, never streamed (see
// LargeModelSupport.h: std::ostream's numeric insertion crashes the drop-in).
std::string AccessSchedule::describeOperator(uint64_t t) const {
  std::string out = names_[t % capacity_] + " with inputs [";
  const Inputs& inputs = inputs_[t % capacity_];
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    out += i == 0 ? "" : ", ";
    out += "size " + std::to_string(in.size) + " last used " +
        std::to_string(in.distance) + " ops ago, ";
    out += in.gap >= kBirth ? "allocation #" + std::to_string(in.gap - kBirth)
                            : "gap " + std::to_string(in.gap);
  }
  return out + ']';
}

std::string AccessSchedule::describeDrop(
    uint64_t t,
    uint64_t period,
    uint64_t run) const {
  std::string out = "falls back at operator " + std::to_string(t) + " (phase " +
      std::to_string(t % period) + " of " +
      (run == 0 ? "the period of " : "a candidate period of ") +
      std::to_string(period) +
      (run == 0 ? "" : " after " + std::to_string(run) + " matches") +
      "): " + describeOperator(t);
  if (t > period) {
    out += "; a period earlier: " + describeOperator(t - period);
  }
  return out;
}

void AccessSchedule::drop() {
  active_ = false;
  period_ = 0;
  ++generation_;
  ++fallbacks_;
  next_.clear();
  deaths_.clear();
  // Candidates are kept: the pattern may resume after a short detour (an
  // evaluation step), and a candidate that still matches reconfirms.
}

uint64_t AccessSchedule::soonestAhead(
    const std::unordered_map<uint64_t, std::vector<uint64_t>>& table,
    uint64_t touch,
    uint64_t size,
    uint64_t gap) const {
  if (!active_) {
    return kNever;
  }
  const auto it = table.find(key(touch % period_, size, gap));
  if (it == table.end()) {
    return kNever;
  }
  const std::vector<uint64_t>& distances = it->second;
  const auto due = std::lower_bound(
      distances.begin(),
      distances.end(),
      clock_ > touch ? clock_ - touch : uint64_t{0});
  return due == distances.end() ? kNever : touch + *due;
}

uint64_t AccessSchedule::nextUse(uint64_t touch, uint64_t size, uint64_t gap)
    const {
  // Storages alike in all the schedule sees may be used again at different
  // distances: the soonest use not yet past is this storage's next one (the
  // sooner ones were the others', which have happened).
  return soonestAhead(next_, touch, size, gap);
}

void AccessSchedule::recordDeath(uint64_t touch, uint64_t size, uint64_t gap) {
  if (!active_ || touch >= clock_ || clock_ - touch > period_) {
    return; // no schedule, freed by the operator that touched it, or kept
            // longer than a period (not a pattern of the iteration)
  }
  std::vector<uint64_t>& distances = deaths_[key(touch % period_, size, gap)];
  const uint64_t d = clock_ - touch;
  const auto at = std::lower_bound(distances.begin(), distances.end(), d);
  if (at == distances.end() || *at != d) {
    distances.insert(at, d);
  }
}

uint64_t AccessSchedule::deathBeforeUse(
    uint64_t touch,
    uint64_t size,
    uint64_t gap) const {
  // A death already past (this storage outlived the others like it) is no
  // prediction, nor is one that comes after the next use.
  const uint64_t death = soonestAhead(deaths_, touch, size, gap);
  return death < nextUse(touch, size, gap) ? death : kNever;
}

void AccessSchedule::reset() {
  clock_ = 0;
  signatures_.clear();
  inputs_.clear();
  recent_.clear();
  candidates_.clear();
  active_ = false;
  period_ = 0;
  ++generation_;
  next_.clear();
  deaths_.clear();
  detections_ = 0;
  fallbacks_ = 0;
}

// ---------------------------------------------------------------------------
// The schedule's policy: what the engine does with it
// ---------------------------------------------------------------------------
//
// AccessSchedule (LargeModelSupportSchedule.h) learns the repeating order of
// operators and predicts each storage's next use. While it is active:
// - victims are the inactive storages used furthest in the future (Belady),
//   never one needed within the lookahead window if another will do;
// - at every operator boundary, storages whose next use is beyond the window
//   are paged out early, on the D2H stream, whenever less than the prefetch
//   budget is free under the limit; their memory is released once the copy
//   is done, so no compute stream waits for it (draining);
// - storages used within the window are paged in ahead, soonest first, on
//   the H2D stream, while no more than the budget of prefetched bytes waits
//   to be used; the consumer then waits only on a copy that has (almost
//   always) completed.
// Both directions run on their own streams, so they overlap each other and
// compute. Without a schedule, reclaim is least recently used and page-ins
// happen on demand on the consumer's stream.

namespace detail {

std::mutex g_schedule_mutex;

// Process-wide: an operator's inputs may live on several devices, and the
// operator clock must be one.
AccessSchedule& theSchedule() {
  static AccessSchedule* schedule = [] {
    auto* made = new AccessSchedule(); // never destroyed
    // PYTORCH_LMS_SCHEDULE_LOG=1 prints every operator that breaks the
    // learned schedule to stderr (a diagnostic, not a setting);
    // PYTORCH_LMS_SCHEDULE_LOG=FIRST-LAST also prints the operators with
    // clocks FIRST to LAST, each with its inputs.
    const char* log = std::getenv("PYTORCH_LMS_SCHEDULE_LOG");
    const std::string_view text = log != nullptr ? log : "";
    made->setLogging(!text.empty() && text != "0");
    if (const size_t dash = text.find('-'); dash != std::string_view::npos) {
      const std::string first(text.substr(0, dash));
      const std::string last(text.substr(dash + 1));
      made->setTracedOperators(
          std::strtoull(first.c_str(), nullptr, 10),
          std::strtoull(last.c_str(), nullptr, 10));
    }
    return made;
  }();
  return *schedule;
}

// Clock of the last operator the schedule recorded; stamps storages' touches
// without taking the schedule's lock.
std::atomic<uint64_t> g_op_clock{0};
// Allocations since the operator of g_op_clock began: an allocation's gap.
std::atomic<uint64_t> g_births_in_op{0};

// A use of `r` by the running operator, resident or over the bus: the
// learned schedule measures distances from the last one (see
// AccessSchedule::Use). A use for a recompute only ends what the recompute
// needed it for; a storage recomputed ahead of its own use stays kept for
// that use.
void noteUse(Record& r) {
  if (t_recompute_pins > 0) {
    if (!r.replayed_ahead) {
      r.needed_by.store(0, std::memory_order_relaxed);
    }
    return;
  }
  r.needed_by.store(0, std::memory_order_relaxed);
  const uint64_t now = g_op_clock.load(std::memory_order_relaxed);
  const uint64_t last = r.touch.load(std::memory_order_relaxed);
  if (now > last) {
    r.gap.store(now - last, std::memory_order_relaxed);
    r.touch.store(now, std::memory_order_relaxed);
  }
}

size_t prefetchBudget(size_t limit, size_t paged_in_per_iteration) {
  if (const size_t bytes = g_prefetch_budget.load(); bytes > 0) {
    return bytes;
  }
  // An eighth of the limit, up to a quarter as an iteration pages in more
  // than the limit holds. Below that, copies rarely bound the iteration, and
  // a larger budget only pages out more early (the margin it keeps free).
  // Past it, they do: the H2D stream must never wait for room, and the extra
  // early page-outs pay for themselves. A quarter was faster than an eighth
  // where iterations paged in several times the limit and slower where they
  // paged in less; half was no faster than a quarter (measured on an H100:
  // benchmarks/results/probes/2026-11-24-h100-unrecorded/prefetch-budget/).
  const double scale = std::clamp(
      static_cast<double>(paged_in_per_iteration) /
          static_cast<double>(std::max<size_t>(limit, 1)),
      1.0,
      2.0);
  return static_cast<size_t>(static_cast<double>(limit / 8) * scale);
}

void removeUpcoming(DeviceEngine& e, Record& r) {
  if (r.upcoming) {
    e.upcoming.erase(r.upcoming_at);
    r.upcoming = false;
  }
}

// Files a paged-out storage under the clock of its next use. Engine lock held.
void addUpcoming(DeviceEngine& e, Record& r) {
  if (r.upcoming || !g_schedule_enabled.load()) {
    return;
  }
  uint64_t next = AccessSchedule::kNever;
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    next = theSchedule().nextUse(r.touch.load(), r.size, r.gap.load());
  }
  if (next != AccessSchedule::kNever) {
    r.upcoming_at = e.upcoming.emplace(next, &r);
    r.upcoming = true;
  }
}

// The inactive storage to page out next, or null. With an active schedule:
// the one whose next use is furthest (storages the schedule never sees again
// first, least recently used first among equals); with `protect_until` set
// (an early page-out, which makes room ahead of need), only one whose next
// use comes after that clock, and none that the schedule expects to be freed
// unused by then: its memory comes back without a copy. (When memory is
// needed now, such a storage is the cheapest victim: one copy out, none
// back.) Without a schedule: the least recently used, and none when
// `protect_until` is set. With `cheap_ms_per_byte` (an early page-out with
// recompute on), none whose replay, as last priced, costs less than that
// per byte: paging it out early would copy what a drop frees for nothing
// (EarlyVictims drops those first). A storage recomputed ahead of use and
// not used yet is taken only when no other is left. Engine lock held.
Record* pickVictim(
    DeviceEngine& e,
    size_t threshold,
    uint64_t protect_until,
    double cheap_ms_per_byte) {
  if (g_schedule_enabled.load()) {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    const AccessSchedule& schedule = theSchedule();
    if (schedule.active()) {
      Record* best = nullptr;
      uint64_t best_next = 0;
      bool best_ahead = false;
      for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
        if (r->size < threshold) {
          continue;
        }
        if (cheap_ms_per_byte >= 0.0 && r->recomputable &&
            r->replay_ms >= 0.0 &&
            r->replay_ms < cheap_ms_per_byte * static_cast<double>(r->size)) {
          continue;
        }
        const uint64_t touch = r->touch.load();
        const uint64_t gap = r->gap.load();
        uint64_t next = schedule.nextUse(touch, r->size, gap);
        const uint64_t needed = r->needed_by.load(std::memory_order_relaxed);
        if (needed != 0) {
          if (protect_until != 0) {
            continue; // kept for a recompute: no early page-out
          }
          next = std::min(next, needed);
        }
        if (protect_until != 0 &&
            schedule.deathBeforeUse(touch, r->size, gap) <= protect_until) {
          continue;
        }
        // A storage recomputed ahead of its use goes last: taking it would
        // make that one use cost two replays.
        const bool ahead = r->replayed_ahead;
        if (best == nullptr || (best_ahead && !ahead) ||
            (ahead == best_ahead && next > best_next)) {
          best = r;
          best_next = next;
          best_ahead = ahead;
        }
      }
      if (best != nullptr && protect_until != 0 && best_next <= protect_until) {
        return nullptr;
      }
      if (best != nullptr) {
        ++e.stats.schedule_victims;
      }
      return best;
    }
  }
  if (protect_until != 0) {
    return nullptr;
  }
  for (Record* r = e.reclaim_list.head; r != nullptr; r = r->next) {
    if (r->size >= threshold) {
      return r;
    }
  }
  return nullptr;
}

namespace {

// Operators between two searches for victims to page out ahead of the
// iteration's peak after one found none (pageOutAheadOfPeak).
constexpr uint64_t kPeakRetryOps = 8;

uint64_t lookaheadOps(uint64_t period) {
  if (const int ops = g_lookahead_ops.load(); ops > 0) {
    return static_cast<uint64_t>(ops);
  }
  // An eighth of an iteration: far enough ahead for copies of the sizes one
  // layer uses to complete, near enough that prefetched storages do not
  // crowd out the allocations in between.
  return std::clamp<uint64_t>(period / 8, 4, 512);
}

// Measures the page-in bytes of each whole iteration of the schedule (from
// one boundary a period after the last to the next). Engine lock held.
void measureIteration(DeviceEngine& e, uint64_t now, uint64_t period) {
  const int64_t paged_in = e.stats.pagein_bytes;
  if (now < e.iteration_began) {
    // A clock that went back (the schedule was reset): start over.
    e.iteration_began = now;
    e.iteration_pagein_base = paged_in;
    e.pagein_last_iteration = 0;
    return;
  }
  if (now - e.iteration_began < period) {
    return;
  }
  e.pagein_last_iteration =
      static_cast<size_t>(paged_in - e.iteration_pagein_base);
  e.iteration_began = now;
  e.iteration_pagein_base = paged_in;
}

// Next uses change with the schedule: refile every paged-out storage. Engine
// lock held.
void refileUpcoming(DeviceEngine& e, uint64_t generation) {
  for (auto& [next, r] : e.upcoming) {
    (void)next;
    r->upcoming = false;
  }
  e.upcoming.clear();
  for (List* list : {&e.pagedout_list, &e.draining_list, &e.dropped_list}) {
    for (Record* r = list->head; r != nullptr; r = r->next) {
      addUpcoming(e, *r);
    }
  }
  e.upcoming_generation = generation;
}

// The victims of an early page-out, none used before `protect_until`. With
// recompute on, recompute first, as a reclaim does: the storages whose
// replay costs less than paging them (cheapDrops, best ranked first) are
// taken first, and dropped, not copied (pageOut decides again by their
// price); then the storages used furthest in the future, leaving out those
// cheap to replay. Without recompute, exactly pickVictim()'s choice.
class EarlyVictims {
  // Candidates priced for one early page-out, which picks its victims under
  // the engine lock and cannot price more then: several reclaims' worth.
  static constexpr size_t kEarlyCandidates = 4 * kPricedCandidates;

 public:
  // With `drop_first` false, no drops: only storages a drop would not take,
  // copied (what pageOutAheadOfPeak moves: a drop frees its memory at once
  // whenever it is needed, so dropping ahead of need gains nothing and drops
  // more than the peak needs).
  EarlyVictims(DeviceEngine& e, uint64_t protect_until, bool drop_first = true)
      : e_(e),
        threshold_(g_size_threshold.load()),
        protect_until_(protect_until) {
    if (!g_recompute.load() || g_recompute_hooks.load() == nullptr) {
      return;
    }
    const double per_mib = pagingCost(e, size_t{1} << 20);
    if (per_mib < 0.0) {
      return; // the bus is not measured yet: nothing is priced cheap
    }
    cheap_ms_per_byte_ = per_mib / static_cast<double>(size_t{1} << 20);
    if (drop_first) {
      drops_ = cheapDrops(e, threshold_, protect_until, kEarlyCandidates);
    }
  }

  // The next victim, or null. Engine lock held.
  Record* pick() {
    while (next_ < drops_.size()) {
      const DropCandidate& c = drops_[next_++];
      // Taken meanwhile, no longer its storage's allocation, or kept since.
      if (recordOf(*c.storage) == c.r && !c.r->busy &&
          c.r->list == &e_.reclaim_list &&
          c.r->needed_by.load(std::memory_order_relaxed) == 0) {
        return c.r;
      }
    }
    return pickVictim(e_, threshold_, protect_until_, cheap_ms_per_byte_);
  }

 private:
  DeviceEngine& e_;
  const size_t threshold_;
  const uint64_t protect_until_;
  double cheap_ms_per_byte_ = -1.0;
  // Keeps the candidates alive; destroyed with no engine lock held.
  std::vector<DropCandidate> drops_;
  size_t next_ = 0;
};

// Keeps `margin` bytes free under the limit by paging out early the storages
// used furthest in the future, none used before `protect_until` (with
// recompute on, dropping those cheap to replay first: EarlyVictims).
void pageOutEarly(
    DeviceEngine& e,
    size_t allocated,
    uint64_t protect_until,
    size_t limit,
    size_t margin) {
  if (earlyPageOutNeed(e, allocated, limit, margin) == 0) {
    return; // before pricing anything
  }
  EarlyVictims victims(e, protect_until);
  pageOutEarlyFor(e, allocated, limit, margin, [&] { return victims.pick(); });
}

// Records the demand at this operator boundary (the bytes the live storages
// would take on the device: the most allocated since the last boundary, plus
// paged out and no longer allocated) and, once a whole iteration has been
// seen, its peak. The most allocated between two boundaries, not what is
// allocated at this one: a language model's loss allocates its logits and
// their log-softmax (GPT at 1.5x an H100: about 20 GB) and frees them before
// it ends, and with drops covering the rest of the excess the demand at the
// boundaries stayed under the limit: no copy was made ahead of the peak, and
// every one was made inside an operator that needed the room, the compute
// stream waiting (4.55 GiB, 88 ms of an 826 ms iteration).
// Engine lock held.
void recordDemand(
    DeviceEngine& e,
    uint64_t now,
    uint64_t period,
    uint64_t generation,
    size_t allocated) {
  // Since the last boundary. At the first boundary of a generation it holds
  // what was allocated since whenever the schedule last looked (iteration 0,
  // say): left out.
  size_t high = e.allocated_high.exchange(0, std::memory_order_relaxed);
  if (e.demand_generation != generation || now < e.demand_began) {
    high = 0;
    e.demand_generation = generation;
    e.demand_began = now;
    e.demand_max = 0;
    e.peak_bytes = 0;
    e.peak_retry = 0;
  }
  if (now - e.demand_began >= period) {
    e.peak_bytes = e.demand_max;
    e.peak_phase = e.demand_max_phase;
    e.demand_began = now;
    e.demand_max = 0;
  }
  const auto off =
      static_cast<size_t>(std::max<int64_t>(e.stats.pagedout_bytes.current, 0));
  const size_t demand = std::max(allocated, high) +
      (off > e.draining_bytes ? off - e.draining_bytes : 0);
  if (demand > e.demand_max) {
    e.demand_max = demand;
    e.demand_max_phase = now % period;
  }
}

// Pages out early, from the start of the iteration, what must be off the
// device at its peak of demand: storages whose next use comes after the peak,
// furthest first, until the bytes off the device cover the peak's excess over
// the limit (pageOutEarly() still keeps the budget's room free as the peak
// nears). pageOutEarly() alone makes room only as the limit nears, so the
// D2H stream idled through the first part of a forward pass and then bounded
// the rest of it; the same storages leave earlier now, while compute runs (the
// victims are those Belady's choice takes at the peak: at any clock before
// it, the storages used furthest in the future that are still resident).
// The copies queued at once stay within the budget, so that a storage is
// not held on the device waiting for its turn longer than the budget takes
// to copy. Memory that dies before the peak is never paged out for it.
void pageOutAheadOfPeak(
    DeviceEngine& e,
    size_t allocated,
    uint64_t now,
    uint64_t period,
    uint64_t generation,
    size_t limit,
    size_t budget) {
  uint64_t peak_clock = 0;
  size_t wanted = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    recordDemand(e, now, period, generation, allocated);
    if (e.peak_bytes == 0 || now < e.peak_retry) {
      return;
    }
    const uint64_t ahead = (e.peak_phase + period - now % period) % period;
    const size_t must = e.peak_bytes > limit ? e.peak_bytes - limit : 0;
    const auto off = static_cast<size_t>(
        std::max<int64_t>(e.stats.pagedout_bytes.current, 0));
    if (ahead == 0 || must <= off || e.draining_bytes >= budget) {
      return;
    }
    peak_clock = now + ahead;
    wanted = std::min(must - off, budget - e.draining_bytes);
  }
  EarlyVictims victims(e, peak_clock, /*drop_first=*/false);
  size_t bytes = 0;
  const int64_t made =
      pageOutVictims(e, wanted, [&] { return victims.pick(); }, bytes);
  std::lock_guard<std::mutex> lock(e.mutex);
  e.stats.peak_pageout_count += made;
  e.stats.peak_pageout_bytes += static_cast<int64_t>(bytes);
  if (bytes < wanted) {
    // Nothing resident is used after the peak (yet): a search is a pass over
    // the reclaim list, so the next one waits for a few operators to add
    // storages to it.
    e.peak_retry = now + std::clamp<uint64_t>(period / 32, 1, kPeakRetryOps);
  }
}

// What the schedule does at an operator boundary for one device.
void scheduleTick(DeviceEngine& e) {
  drainPageOuts(e, 0);
  uint64_t now = 0;
  uint64_t period = 0;
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    const AccessSchedule& schedule = theSchedule();
    if (!schedule.active()) {
      return;
    }
    now = schedule.now();
    period = schedule.period();
    generation = schedule.generation();
  }
  const size_t limit = effectiveLimit(e);
  size_t budget = 0;
  {
    std::lock_guard<std::mutex> lock(e.mutex);
    if (e.upcoming_generation != generation) {
      refileUpcoming(e, generation);
    }
    measureIteration(e, now, period);
    budget = prefetchBudget(limit, e.pagein_last_iteration);
  }
  const uint64_t window = lookaheadOps(period);
  prefetchUpcoming(e, now, window, budget);
  // Early page-outs keep their device memory until drained: both read the
  // bytes allocated after the page-ins above.
  const size_t allocated = backend().allocatedBytes(e.device);
  pageOutEarly(e, allocated, now + window, limit, budget);
  pageOutAheadOfPeak(e, allocated, now, period, generation, limit, budget);
}

} // namespace

} // namespace detail

using namespace detail;

void resetSchedule() {
  std::lock_guard<std::mutex> lock(g_schedule_mutex);
  theSchedule().reset();
  g_op_clock.store(0);
}

void beginOperator(
    std::string_view name,
    c10::ArrayRef<c10::StorageImpl*> inputs) {
  if (!isEnabled() || !g_schedule_enabled.load()) {
    return;
  }
  c10::SmallVector<AccessSchedule::Use, 16> uses;
  DeviceEngine* device_engine = nullptr;
  for (c10::StorageImpl* storage : inputs) {
    if (Record* r = recordOf(*storage)) {
      uses.push_back(
          AccessSchedule::Use{r->touch.load(), r->size, r->gap.load()});
      device_engine = r->engine;
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_schedule_mutex);
    g_op_clock.store(theSchedule().record(name, uses.data(), uses.size()));
    g_births_in_op.store(0);
    if (theSchedule().logging()) {
      if (const std::string report = theSchedule().takeDropReport();
          !report.empty()) {
        std::fprintf(
            stderr,
            "Large Model Support: the swap schedule: %s\n",
            report.c_str());
      }
    }
  }
  if (device_engine != nullptr) {
    scheduleTick(*device_engine);
    return;
  }
  // No managed input says where the operator runs: serve every device that
  // has LMS storages (usually the one).
  std::vector<DeviceEngine*> engines;
  {
    std::lock_guard<std::mutex> lock(g_engines_mutex);
    engines = g_engines;
  }
  for (DeviceEngine* e : engines) {
    if (e == nullptr) {
      continue;
    }
    bool managed = false;
    {
      std::lock_guard<std::mutex> lock(e->mutex);
      managed = e->stats.managed_bytes.current > 0;
    }
    if (managed) {
      scheduleTick(*e);
    }
  }
}

} // namespace c10::cuda::lms
