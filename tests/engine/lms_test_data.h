#pragma once

// Contents the engine tests write into storages and check after page-outs
// and page-ins: a pseudo-random pattern per seed, so that any byte moved to
// the wrong place or lost shows up.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lms_test {

// SplitMix64: a cheap, well-mixed 64-bit hash.
inline uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The words of `bytes` bytes of the pattern of `seed`.
inline std::vector<uint64_t> pattern(size_t bytes, uint64_t seed) {
  std::vector<uint64_t> words((bytes + 7) / 8);
  for (size_t i = 0; i < words.size(); ++i) {
    words[i] = splitmix(seed * 0x100000001b3ULL + i);
  }
  return words;
}

} // namespace lms_test
