// Minimal test harness shared by the simgpu tests: no third-party framework
// is available on every machine these run on (the GPU host has no network).
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace simgpu_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

struct Register {
  Register(const char* name, std::function<void()> fn) {
    cases().push_back({name, std::move(fn)});
  }
};

// Thrown by CHECK so a failing case stops at its first broken expectation.
struct Failure {
  std::string what;
};

inline int run_all() {
  int passed = 0;
  int failed = 0;
  for (const Case& c : cases()) {
    try {
      c.fn();
      ++passed;
      std::printf("PASS %s\n", c.name);
    } catch (const Failure& f) {
      ++failed;
      std::printf("FAIL %s: %s\n", c.name, f.what.c_str());
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: exception: %s\n", c.name, e.what());
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

} // namespace simgpu_test

#define SIMGPU_CONCAT2(a, b) a##b
#define SIMGPU_CONCAT(a, b) SIMGPU_CONCAT2(a, b)
#define TEST_CASE(name)                                                  \
  static void name();                                                    \
  static ::simgpu_test::Register SIMGPU_CONCAT(reg_, name)(#name, name); \
  static void name()

#define CHECK(cond)                                                \
  do {                                                             \
    if (!(cond)) {                                                 \
      throw ::simgpu_test::Failure{                                \
          std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
          ": CHECK(" #cond ") failed"};                            \
    }                                                              \
  } while (0)

// Expects a CUDA call to return `expected`; shows both names otherwise.
#define CHECK_CUDA_EQ(call, expected)                                      \
  do {                                                                     \
    cudaError_t _got = (call);                                             \
    if (_got != (expected)) {                                              \
      throw ::simgpu_test::Failure{                                        \
          std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " +  \
          #call + " returned " + cudaGetErrorName(_got) + ", expected " +  \
          cudaGetErrorName(expected) + " (" + simgpu_last_error_detail() + \
          ")"};                                                            \
    }                                                                      \
  } while (0)

#define CHECK_CUDA(call) CHECK_CUDA_EQ(call, cudaSuccess)
