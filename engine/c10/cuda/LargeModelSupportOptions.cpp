// The settings: their values, setters and getters, and the
// PYTORCH_CUDA_ALLOC_CONF keys that set them (parseConfigOption), as
// LargeModelSupportSettingTable.h lists them.

#include <c10/cuda/LargeModelSupportInternal.h>

#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>

namespace c10::cuda::lms {

namespace detail {

namespace {

constexpr size_t kDefaultSizeThreshold = 1 * kMiB;

double parseNonNegative(std::string_view key, std::string_view value) {
  const std::string text(value);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  TORCH_CHECK(
      !text.empty() && end == text.c_str() + text.size() && v >= 0,
      "PYTORCH_CUDA_ALLOC_CONF: ",
      key,
      " expects a non-negative number, got '",
      text,
      "'");
  return v;
}

size_t parseMebibytes(std::string_view key, std::string_view value) {
  return static_cast<size_t>(parseNonNegative(key, value) * kMiB);
}

bool parseBool(std::string_view key, std::string_view value) {
  TORCH_CHECK(
      value == "True" || value == "False",
      "PYTORCH_CUDA_ALLOC_CONF: ",
      key,
      " expects True or False, got '",
      std::string(value),
      "'");
  return value == "True";
}

int parseCount(std::string_view key, std::string_view value) {
  const double v = parseNonNegative(key, value);
  TORCH_CHECK(
      v == static_cast<int>(v),
      "PYTORCH_CUDA_ALLOC_CONF: ",
      key,
      " expects a whole number, got '",
      std::string(value),
      "'");
  return static_cast<int>(v);
}

double parseSeconds(std::string_view key, std::string_view value) {
  return parseNonNegative(key, value);
}

// A path is taken as written; its setter says what is wrong with it.
std::string parsePath(std::string_view /*key*/, std::string_view value) {
  return std::string(value);
}

// The value of a device setting given as a PYTORCH_CUDA_ALLOC_CONF key: the
// limit of every device (one set for a device wins).
void setLimitOfEveryDevice(size_t bytes) {
  g_conf_limit.store(bytes);
}

// The keys of the settings, for error messages.
const std::string& settingKeys() {
  static const std::string keys = [] {
    std::string joined;
#define C10_LMS_SETTING(stem, Camel, key, ...) \
  joined += (joined.empty() ? "" : ", ") + std::string(#key);
#define C10_LMS_DEVICE_SETTING C10_LMS_SETTING
#include <c10/cuda/LargeModelSupportSettingTable.h>
    return joined;
  }();
  return keys;
}

} // namespace

std::atomic<size_t> g_size_threshold{kDefaultSizeThreshold};
std::atomic<int> g_prefetch_depth{0};
std::atomic<size_t> g_speculative_margin{0};
// Limit set through PYTORCH_CUDA_ALLOC_CONF for every device (0: default).
std::atomic<size_t> g_conf_limit{0};

// Learned swap schedule (see LargeModelSupportSchedule.h, and its policy in
// LargeModelSupportSchedule.cpp): on by default, so that LMS with defaults is
// the fast path.
std::atomic<bool> g_schedule_enabled{true};
std::atomic<int> g_lookahead_ops{0}; // 0: derived from the period
std::atomic<size_t> g_prefetch_budget{0}; // 0: derived (prefetchBudget())
// Page-ins planned by compiled graphs (pageInAhead): on by default.
std::atomic<bool> g_graph_prefetch{true};
// Recompute (the hybrid): on by default, since it drops what replays cheaply
// instead of paging it both ways; recipes are recorded once an allocation
// nears the limit (g_near_limit), so a model that fits well pays nothing.
std::atomic<bool> g_recompute{true};
std::atomic<bool> g_near_limit{false};
// Recipes for residual sums: off until the bit-identity suites have run with
// them on.
std::atomic<bool> g_residual_recipes{false};
std::atomic<bool> g_packing{true};
std::atomic<bool> g_host_placement{true};

} // namespace detail

using namespace detail;

void setLimit(c10::DeviceIndex device, size_t bytes) {
  DeviceEngine& e = engineFor(device);
  std::lock_guard<std::mutex> lock(e.mutex);
  e.user_limit = bytes;
}

size_t getLimit(c10::DeviceIndex device) {
  DeviceEngine& e = engineFor(device);
  return g_backend.load() != nullptr ? effectiveLimit(e) : limitOf(e);
}

void setSizeThreshold(size_t bytes) {
  g_size_threshold.store(bytes);
}

size_t getSizeThreshold() {
  return g_size_threshold.load();
}

void setPrefetchDepth(int depth) {
  TORCH_CHECK(
      depth >= 0,
      "LMS: prefetch depth must be >= 0, got ",
      std::to_string(depth));
  g_prefetch_depth.store(depth);
}

int getPrefetchDepth() {
  return g_prefetch_depth.load();
}

void setSpeculativeMargin(size_t bytes) {
  g_speculative_margin.store(bytes);
}

size_t getSpeculativeMargin() {
  return g_speculative_margin.load();
}

void setScheduleEnabled(bool enabled) {
  g_schedule_enabled.store(enabled);
}

bool isScheduleEnabled() {
  return g_schedule_enabled.load();
}

void setLookahead(int operators) {
  TORCH_CHECK(
      operators >= 0,
      "LMS: the lookahead must be >= 0 operators, got ",
      std::to_string(operators));
  g_lookahead_ops.store(operators);
}

int getLookahead() {
  return g_lookahead_ops.load();
}

void setPrefetchBudget(size_t bytes) {
  g_prefetch_budget.store(bytes);
}

size_t getPrefetchBudget() {
  return g_prefetch_budget.load();
}

void setGraphPrefetchEnabled(bool enabled) {
  g_graph_prefetch.store(enabled);
}

bool isGraphPrefetchEnabled() {
  return g_graph_prefetch.load();
}

void setHostLimit(size_t bytes) {
  hostPool().setLimit(bytes);
}

size_t getHostLimit() {
  return hostPool().getLimit();
}

void setHostWait(double seconds) {
  hostPool().setWait(seconds);
}

double getHostWait() {
  return hostPool().getWait();
}

void setRecomputeEnabled(bool enabled) {
  // Turning it on starts over: recipes are recorded from the next time an
  // allocation nears the limit.
  if (enabled && !g_recompute.load()) {
    g_near_limit.store(false);
  }
  g_recompute.store(enabled);
}

bool isRecomputeEnabled() {
  return g_recompute.load();
}

bool isRecordingRecipes() {
  return g_recompute.load(std::memory_order_relaxed) &&
      g_near_limit.load(std::memory_order_relaxed);
}

void setResidualRecipesEnabled(bool enabled) {
  g_residual_recipes.store(enabled);
}

bool isResidualRecipesEnabled() {
  return g_residual_recipes.load(std::memory_order_relaxed);
}

void setPackingEnabled(bool enabled) {
  g_packing.store(enabled);
}

bool isPackingEnabled() {
  return g_packing.load();
}

void setHostPlacementEnabled(bool enabled) {
  g_host_placement.store(enabled);
}

bool isHostPlacementEnabled() {
  return g_host_placement.load();
}

bool parseConfigOption(std::string_view key, std::string_view value) {
  // A branch for each setting: its key's value, read as the setting's kind
  // says (parseBool, parseMebibytes, parseCount, parseSeconds, parsePath),
  // goes to its setter.
#define C10_LMS_APPLY(conf_key, Kind, type, apply)                         \
  if (key == #conf_key) {                                                  \
    static_assert(                                                         \
        std::is_same_v<                                                    \
            decltype(parse##Kind(std::string_view(), std::string_view())), \
            type>);                                                        \
    apply(parse##Kind(key, value));                                        \
    return true;                                                           \
  }
#define C10_LMS_SETTING(                                     \
    stem, Camel, conf_key, Kind, type, setter, getter, what) \
  C10_LMS_APPLY(conf_key, Kind, type, setter)
#define C10_LMS_DEVICE_SETTING(                                           \
    stem, Camel, conf_key, Kind, type, setter, getter, what, conf_setter) \
  C10_LMS_APPLY(conf_key, Kind, type, conf_setter)
#include <c10/cuda/LargeModelSupportSettingTable.h>
#undef C10_LMS_APPLY
  return false;
}

void parseConfig(const char* conf, bool only_lms_keys, const char* source) {
  if (conf == nullptr) {
    return;
  }
  const std::string& keys = settingKeys();
  // Same syntax as the caching allocator: "key:value,key:value".
  std::string_view rest(conf);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view()
                                           : rest.substr(comma + 1);
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      TORCH_CHECK(
          !only_lms_keys || item.find_first_not_of(' ') == std::string::npos,
          source,
          ": expected key:value, got '",
          std::string(item),
          "' (keys: ",
          keys,
          ")");
      continue;
    }
    auto trim = [](std::string_view s) {
      while (!s.empty() && s.front() == ' ') {
        s.remove_prefix(1);
      }
      while (!s.empty() && s.back() == ' ') {
        s.remove_suffix(1);
      }
      return s;
    };
    const std::string_view key = trim(item.substr(0, colon));
    const bool known = parseConfigOption(key, trim(item.substr(colon + 1)));
    TORCH_CHECK(
        known || !only_lms_keys,
        source,
        ": unknown key '",
        std::string(key),
        "'; Large Model Support keys are ",
        keys);
  }
}

} // namespace c10::cuda::lms
