#include <c10/cuda/LargeModelSupportSchedule.h>

#include <algorithm>

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

} // namespace c10::cuda::lms
