// The work bench_amx_overlap.cpp times (bench_amx_overlap_kernel.cpp, built for AMX).
#pragma once
#include <cstdint>

namespace npu_attn::bench {

enum class OverlapWork { kTiles, kVectors, kBoth };

// `steps` steps of `work`; needs a CPU with AMX-BF16 whose OS granted the tile state.
float run_overlap_steps(OverlapWork work, int64_t vectors, int64_t steps);

}  // namespace npu_attn::bench
