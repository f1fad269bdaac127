// How this process's C heap treats large blocks: the CPU half of the DeviceManager's memory
// policy. A diffusion step allocates and frees tens of megabytes per layer (an SD-1.5 UNet's
// feed-forward at 512px: 84 MB in float32). glibc serves blocks that large with mmap and unmaps
// them when freed, so every step maps fresh pages and takes a page fault (and a zeroed page) per
// 4 KiB on first touch: 1.5% of a frozen float32 SD-1.5 step on a 2-core Zen 4. With heap
// reuse on, large blocks come from the heap and freed memory stays in the process for the next
// step, as a caching allocator would keep it on an accelerator.
#pragma once

#include <cstdint>

namespace npu_attn {

// Whether this build can change the policy: glibc's malloc, not replaced by a sanitizer's.
bool heap_reuse_supported();

// On: large blocks from the heap, freed memory kept (mallopt M_MMAP_MAX = 0 and
// M_TRIM_THRESHOLD = its maximum). Off after on: mmap for blocks above 32 MiB and trim above
// 64 MiB (glibc's own thresholds once a process has freed large blocks; see heap_policy.cpp),
// and the kept free memory returned to the OS. Off while not on changes nothing. Returns
// false, changing nothing, where heap_reuse_supported() is false.
bool set_heap_reuse(bool enabled);
bool heap_reuse_enabled();

// Return the heap's free memory to the OS (malloc_trim); false where unsupported.
bool release_free_heap();

struct HeapStats {
  int64_t mmapped_bytes = 0;  // live blocks served by mmap
  int64_t free_bytes = 0;     // freed memory the heap keeps for reuse
};
// Zero where unsupported.
HeapStats heap_stats();

}  // namespace npu_attn
