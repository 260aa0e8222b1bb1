#pragma once

// Learned swap schedule for Large Model Support (LMS).
//
// A training loop runs the same operators on storages of the same sizes in
// the same order every iteration. AccessSchedule learns that order from the
// operator boundaries LMS already sees (the outermost operator pins its
// inputs) and answers one question for the engine: when will a storage be
// used next? With that the engine pages out the storage used furthest in the
// future (Belady's choice) instead of the least recently used one, pages
// storages out right after their last use before a long gap, and pages them
// back in ahead of their next use on a copy stream of their own.
//
// Storages are identified without addresses, which change every iteration:
// each storage carries the operator clock of its last touch (its allocation,
// its last pin, or its last use over the bus by an operator whose inputs did
// not all fit) and the gap before that touch (the distance from the touch
// before it, or, for an allocation, its ordinal among the allocations of its
// operator). An operator's signature hashes its name and, for each managed
// input, the input's size, its distance from the last touch and, for an
// allocation, its ordinal (not the gap between two earlier touches: it
// differs in the first iterations, while an optimizer creates its state one
// parameter at a time, although the loop already repeats; the gap still
// identifies storages in the predictions below).
// These are the same in every iteration of a steady training loop, also for
// parameters (touched once per iteration by the forward, backward and
// optimizer operators) and activations (allocated by one operator and read by
// later ones), so the stream of signatures repeats with the iteration's
// length in operators: the period. The gap tells apart storages of one size
// that one operator touches and that are used next at different times (the
// inputs of an operator that were last used by different operators, the
// outputs of one operator).
//
// Period detection: every recurrence of a signature proposes its distance as
// a candidate period; a candidate survives while each new signature equals
// the one a period earlier and no input was last used more than a period
// ago (in a steady loop every storage is used once per iteration at least,
// so a layer of a stack of identical layers, whose parameters were last used
// an iteration ago, is not an iteration). A candidate P is confirmed once P
// operators in a row (and at least kMinConfirm) matched: two whole iterations
// were identical. Then the last period becomes the schedule: for the storage
// touched at phase q (clock mod P) with size s after gap g, the next use is
// the soonest of the distances d with which operators of the period used a
// storage of size s touched at phase q after gap g that is not yet past
// (storages alike in all the schedule sees can be used again at different
// distances: once the sooner use has passed, the later one is still
// predicted, so such a storage is never taken for one never used again).
// While the schedule is active every
// operator is checked against the one a period earlier; the first mismatch
// (other shapes, an eval step, a changed model) drops the schedule, counts a
// fallback, and LMS is reactive (least recently used) until a period is
// confirmed again.
//
// AccessSchedule does no locking and knows nothing of CUDA; the engine owns
// one and serializes calls to it.

#include <c10/cuda/CUDAMacros.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace c10::cuda::lms {

class C10_CUDA_API AccessSchedule {
 public:
  // A next use that the schedule does not know (no schedule, or no use of
  // such a storage in the period): the furthest possible.
  static constexpr uint64_t kNever = UINT64_MAX;
  // A period must be confirmed by at least this many matching operators, so
  // that a few repeated operators (the layers of a uniform stack) are not
  // taken for an iteration.
  static constexpr uint64_t kMinConfirm = 16;
  static constexpr uint64_t kMinPeriod = 2;
  static constexpr uint64_t kDefaultMaxPeriod = uint64_t{1} << 16;
  // With logging on, candidates of at least this period that end after at
  // least this many matches are reported as well.
  static constexpr uint64_t kLoggedRun = 256;

  // Gaps of allocations: kBirth + the allocation's ordinal in its operator,
  // apart from any distance between operators.
  static constexpr uint64_t kBirth = uint64_t{1} << 62;

  // A managed input of an operator: the clock of its last touch, its size,
  // and the gap before that touch.
  struct Use {
    uint64_t touch;
    uint64_t size;
    uint64_t gap;
  };

  explicit AccessSchedule(uint64_t max_period = kDefaultMaxPeriod);

  // Records the next operator and returns its clock (1 for the first).
  // `name` is the operator's name; `uses` its managed inputs, in any order.
  uint64_t record(std::string_view name, const Use* uses, size_t count);

  // Clock of the last recorded operator (0 before the first).
  uint64_t now() const {
    return clock_;
  }
  bool active() const {
    return active_;
  }
  // Operators per iteration of the active schedule (0 when none).
  uint64_t period() const {
    return active_ ? period_ : 0;
  }
  // Bumped whenever the schedule is adopted or dropped: next-use times
  // computed under another generation are stale.
  uint64_t generation() const {
    return generation_;
  }
  int64_t detections() const {
    return detections_;
  }
  int64_t fallbacks() const {
    return fallbacks_;
  }

  // Clock of the next use of a storage of `size` bytes last touched at clock
  // `touch` after `gap`: the soonest use of such a storage in the period that
  // is not yet past; kNever when no schedule is active, when the period uses
  // no such storage again, or when every such use has passed unseen.
  uint64_t nextUse(uint64_t touch, uint64_t size, uint64_t gap) const;

  // A storage of `size` bytes last touched at clock `touch` after `gap` is
  // freed now. While a schedule is active, the schedule remembers how long
  // after such a touch storages like it die: an early page-out of a storage
  // that dies before the memory is needed costs a copy and saves nothing.
  void recordDeath(uint64_t touch, uint64_t size, uint64_t gap);

  // Clock at which a storage of `size` bytes last touched at clock `touch`
  // after `gap` is expected to be freed before any further use: the soonest
  // death of such a storage in the active schedule that is not yet past and
  // comes before its next use; kNever when none is known.
  uint64_t deathBeforeUse(uint64_t touch, uint64_t size, uint64_t gap) const;

  // Forgets everything learned, and the statistics.
  void reset();

  // With logging on, every operator that drops the active schedule (or ends
  // a long candidate period before it is confirmed) leaves a one-line report
  // (its name and inputs, and those of the operator a period earlier) for the
  // engine to print: what breaks a steady state is then visible without a
  // debugger. Off by default: it keeps operator names.
  void setLogging(bool on) {
    logging_ = on;
  }
  bool logging() const {
    return logging_;
  }
  // With logging on, operators with clocks in [first, last] are reported as
  // well, each with its inputs (to see what a period is made of).
  void setTracedOperators(uint64_t first, uint64_t last) {
    traced_first_ = first;
    traced_last_ = last;
  }
  // The report of the last drop since the previous call ("" when none).
  std::string takeDropReport() {
    return std::move(drop_report_);
  }

 private:
  struct Candidate {
    uint64_t period;
    uint64_t run; // operators in a row equal to the one a period earlier
  };
  struct Recent {
    uint64_t at[4] = {0, 0, 0, 0}; // last clocks of a signature, newest first
  };
  struct Input {
    uint64_t distance; // from the last touch
    uint64_t size;
    uint64_t gap; // before the last touch
    bool operator<(const Input& o) const {
      if (distance != o.distance) {
        return distance < o.distance;
      }
      return size != o.size ? size < o.size : gap < o.gap;
    }
  };
  using Inputs = std::vector<Input>;

  uint64_t signatureAt(uint64_t clock) const {
    return signatures_[clock % capacity_];
  }
  void seedCandidates(uint64_t signature);
  void adopt(uint64_t period);
  void drop();
  static uint64_t key(uint64_t phase, uint64_t size, uint64_t gap);
  // The clock of the soonest distance in `table` for such a storage that is
  // not yet past; kNever when there is none (or no active schedule).
  uint64_t soonestAhead(
      const std::unordered_map<uint64_t, std::vector<uint64_t>>& table,
      uint64_t touch,
      uint64_t size,
      uint64_t gap) const;
  // The operator at `t` against the one `period` earlier; `run`: the matches
  // of a candidate that ends there (0 for the active schedule).
  std::string describeDrop(uint64_t t, uint64_t period, uint64_t run) const;
  // The name and inputs of the operator at `t`.
  std::string describeOperator(uint64_t t) const;

  uint64_t max_period_;
  uint64_t capacity_; // ring size: max_period_ + 1
  uint64_t clock_ = 0;
  std::vector<uint64_t> signatures_;
  std::vector<Inputs> inputs_;
  std::unordered_map<uint64_t, Recent> recent_;
  std::vector<Candidate> candidates_;
  bool active_ = false;
  uint64_t period_ = 0;
  uint64_t generation_ = 0;
  // key(phase of the touch, size, gap) -> the distances to the next uses of
  // such storages in the period, ascending, without repeats.
  std::unordered_map<uint64_t, std::vector<uint64_t>> next_;
  // The same key -> the distances from such a touch to such storages' deaths
  // seen since the schedule was adopted, ascending, without repeats.
  std::unordered_map<uint64_t, std::vector<uint64_t>> deaths_;
  int64_t detections_ = 0;
  int64_t fallbacks_ = 0;
  bool logging_ = false;
  uint64_t traced_first_ = 1;
  uint64_t traced_last_ = 0;
  std::vector<std::string> names_; // ring of operator names, when logging
  std::string drop_report_;
};

} // namespace c10::cuda::lms
