#pragma once

// A small test harness for the LMS engine suites: tests register themselves,
// checks record failures with file and line, a test can skip with a reason,
// and the run ends with the line "N passed, N failed, N skipped".
//
// Usage: TEST_CASE(name) { CHECK(...); REQUIRE(...); SKIP("why"); }
// Command line: [--list] [--filter SUBSTRING]...

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace lms_test {

struct TestCase {
  const char* name;
  std::function<void()> body;
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> body) {
    registry().push_back({name, std::move(body)});
  }
};

struct Skipped {
  std::string reason;
};

struct FatalFailure {};

inline int& failures_in_test() {
  static int n = 0;
  return n;
}

inline void fail(const char* file, int line, const std::string& what) {
  ++failures_in_test();
  std::fprintf(stderr, "  %s:%d: FAILED: %s\n", file, line, what.c_str());
}

template <typename A, typename B>
std::string describe(const char* expr, const A& a, const B& b) {
  std::ostringstream os;
  os << expr << " (" << a << " vs " << b << ")";
  return os.str();
}

inline int run(int argc, char** argv) {
  std::vector<std::string> filters;
  bool list = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--list") == 0) {
      list = true;
    } else if (std::strcmp(argv[i], "--filter") == 0 && i + 1 < argc) {
      filters.emplace_back(argv[++i]);
    } else {
      std::fprintf(
          stderr, "usage: %s [--list] [--filter SUBSTRING]...\n", argv[0]);
      return 2;
    }
  }
  int passed = 0;
  int failed = 0;
  int skipped = 0;
  for (const TestCase& t : registry()) {
    if (!filters.empty()) {
      bool match = false;
      for (const auto& f : filters) {
        match = match || std::string(t.name).find(f) != std::string::npos;
      }
      if (!match) {
        continue;
      }
    }
    if (list) {
      std::printf("%s\n", t.name);
      continue;
    }
    std::printf("[ RUN  ] %s\n", t.name);
    std::fflush(stdout);
    failures_in_test() = 0;
    const auto start = std::chrono::steady_clock::now();
    std::string skip_reason;
    try {
      t.body();
    } catch (const Skipped& s) {
      skip_reason = s.reason;
    } catch (const FatalFailure&) {
      // already reported
    } catch (const std::exception& e) {
      fail(t.name, 0, std::string("unexpected exception: ") + e.what());
    } catch (...) {
      fail(t.name, 0, "unexpected non-standard exception");
    }
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start)
                          .count();
    if (!skip_reason.empty()) {
      ++skipped;
      std::printf("[ SKIP ] %s: %s\n", t.name, skip_reason.c_str());
    } else if (failures_in_test() == 0) {
      ++passed;
      std::printf("[  OK  ] %s (%.0f ms)\n", t.name, ms);
    } else {
      ++failed;
      std::printf("[ FAIL ] %s (%.0f ms)\n", t.name, ms);
    }
    std::fflush(stdout);
  }
  if (!list) {
    std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  }
  return failed == 0 ? 0 : 1;
}

} // namespace lms_test

#define LMS_TEST_CAT2(a, b) a##b
#define LMS_TEST_CAT(a, b) LMS_TEST_CAT2(a, b)

#define TEST_CASE(name)                                        \
  static void LMS_TEST_CAT(test_, name)();                     \
  static ::lms_test::Registrar LMS_TEST_CAT(registrar_, name)( \
      #name, &LMS_TEST_CAT(test_, name));                      \
  static void LMS_TEST_CAT(test_, name)()

#define CHECK(cond)                                \
  do {                                             \
    if (!(cond)) {                                 \
      ::lms_test::fail(__FILE__, __LINE__, #cond); \
    }                                              \
  } while (0)

#define CHECK_EQ(a, b)                                         \
  do {                                                         \
    const auto& lms_a_ = (a);                                  \
    const auto& lms_b_ = (b);                                  \
    if (!(lms_a_ == lms_b_)) {                                 \
      ::lms_test::fail(                                        \
          __FILE__,                                            \
          __LINE__,                                            \
          ::lms_test::describe(#a " == " #b, lms_a_, lms_b_)); \
    }                                                          \
  } while (0)

#define CHECK_LE(a, b)                                         \
  do {                                                         \
    const auto& lms_a_ = (a);                                  \
    const auto& lms_b_ = (b);                                  \
    if (!(lms_a_ <= lms_b_)) {                                 \
      ::lms_test::fail(                                        \
          __FILE__,                                            \
          __LINE__,                                            \
          ::lms_test::describe(#a " <= " #b, lms_a_, lms_b_)); \
    }                                                          \
  } while (0)

#define REQUIRE(cond)                              \
  do {                                             \
    if (!(cond)) {                                 \
      ::lms_test::fail(__FILE__, __LINE__, #cond); \
      throw ::lms_test::FatalFailure{};            \
    }                                              \
  } while (0)

#define CHECK_THROWS_AS(expr, type, needle)                                \
  do {                                                                     \
    bool lms_thrown_ = false;                                              \
    try {                                                                  \
      (void)(expr);                                                        \
    } catch (const type& e) {                                              \
      lms_thrown_ = true;                                                  \
      if (std::string(e.what()).find(needle) == std::string::npos) {       \
        ::lms_test::fail(                                                  \
            __FILE__,                                                      \
            __LINE__,                                                      \
            std::string("message lacks '") + (needle) + "': " + e.what()); \
      }                                                                    \
    }                                                                      \
    if (!lms_thrown_) {                                                    \
      ::lms_test::fail(__FILE__, __LINE__, #expr " did not throw " #type); \
    }                                                                      \
  } while (0)

#define SKIP(reason)          \
  throw ::lms_test::Skipped { \
    reason                    \
  }

#define LMS_TEST_MAIN()                 \
  int main(int argc, char** argv) {     \
    return ::lms_test::run(argc, argv); \
  }
