#include "heap_policy.h"

#include <atomic>
#include <climits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

// Sanitizers replace malloc; their allocators ignore mallopt and report no mallinfo.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define NPU_ATTN_FOREIGN_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define NPU_ATTN_FOREIGN_MALLOC 1
#endif
#endif

#if defined(__GLIBC__) && !defined(NPU_ATTN_FOREIGN_MALLOC)
#define NPU_ATTN_GLIBC_HEAP 1
#endif

namespace npu_attn {
namespace {

std::atomic<bool> g_heap_reuse{false};

#if defined(NPU_ATTN_GLIBC_HEAP)
constexpr int kDefaultMmapMax = 65536;  // glibc's DEFAULT_MMAP_MAX
// Turning reuse off cannot restore glibc's start-up state: any mallopt call ends glibc's own
// adjustment of its thresholds for good. Glibc raises the mmap threshold to the largest freed
// mmapped block, up to DEFAULT_MMAP_THRESHOLD_MAX (32 MiB on 64-bit), and the trim threshold to
// twice that; a diffusion process gets there within its first step (it frees 21-31 MB float32
// activations). Off therefore sets those steady-state values: code run with reuse off gets
// (near enough) the thresholds it would have in a process that never called this.
constexpr int kSteadyMmapThreshold = 32 << 20;
constexpr int kSteadyTrimThreshold = 2 * kSteadyMmapThreshold;
#endif

}  // namespace

bool heap_reuse_supported() {
#if defined(NPU_ATTN_GLIBC_HEAP)
  return true;
#else
  return false;
#endif
}

bool set_heap_reuse(bool enabled) {
#if defined(NPU_ATTN_GLIBC_HEAP)
  if (enabled) {
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);
  } else {
    if (!g_heap_reuse.load()) return true;  // never on: glibc's own policy stays untouched
    mallopt(M_MMAP_MAX, kDefaultMmapMax);
    mallopt(M_MMAP_THRESHOLD, kSteadyMmapThreshold);
    mallopt(M_TRIM_THRESHOLD, kSteadyTrimThreshold);
    malloc_trim(0);
  }
  g_heap_reuse.store(enabled);
  return true;
#else
  (void)enabled;
  return false;
#endif
}

bool heap_reuse_enabled() {
  return g_heap_reuse.load();
}

bool release_free_heap() {
#if defined(NPU_ATTN_GLIBC_HEAP)
  malloc_trim(0);
  return true;
#else
  return false;
#endif
}

HeapStats heap_stats() {
  HeapStats s;
#if defined(NPU_ATTN_GLIBC_HEAP)
#if __GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
#else
  const struct mallinfo info = mallinfo();  // int fields: wrap above 2 GiB
#endif
  s.mmapped_bytes = static_cast<int64_t>(info.hblkhd);
  s.free_bytes = static_cast<int64_t>(info.fordblks);
#endif
  return s;
}

}  // namespace npu_attn
