// The one forward driver of the three forward kernel families (in the shape of flash-attention's
// kernel traits): the loop that every family runs, written once, and a small traits struct per
// family that fills it in.
//
//   threads = min(num_threads, tasks at the family's finest query split)
//   plan    = Family::make_plan(p, threads)          every blocking rule of the family, named
//   allocate the pack buffer (pairs_per_chunk pairs) and per-thread scratch, outside OpenMP
//   parallel:
//     ws = Family::enter_thread(...)                 carve this thread's scratch (AMX: tiles on)
//     for each chunk of (batch, kv-head) pairs:
//       omp for static:  Family::pack(pair, key tile)            pack K/V of the chunk's pairs
//       omp for dynamic: Family::run(task) for every (pair, q-head of its GQA group, query tile)
//     (where a pair has one task, that task packs it instead: no phase 1)
//     Family::leave_thread(ws)                       (AMX: tiles released)
//
// A family (TiledFamily<T> in attention_forward_impl.h, Bf16PairFamily in
// attention_forward_bf16_impl.h, AmxFamily in attention_forward_amx_impl.h) provides:
//   static constexpr int64_t kThreadClampQueries;  queries per task at its finest split
//   typedef ... Plan;      has a member `ForwardSchedule schedule` (below)
//   typedef ... Scratch;   one thread's view of its scratch floats
//   static Plan make_plan(const AttentionParams&, int threads);
//   static Scratch enter_thread(const AttentionParams&, const Plan&, float* scratch);
//   static void leave_thread(Scratch&);
//   static void pack(const AttentionParams&, const Plan&, int64_t pair, int64_t key_tile,
//                    float* pair_pack);         // pair_pack: schedule.pair_floats of the pair
//   static void run(const AttentionParams&, const Plan&, const QueryTask&,
//                   const float* pair_pack, Scratch&);
//
// Compiled once per ISA like every kernel header (the including translation unit defines
// NPU_ATTN_VEC_BYTES and its -m flags): anonymous namespace, no std:: templates, so no symbol
// can be shared (and silently merged by the linker) between the ISA variants; the ctest
// isa_objects_are_self_contained checks the object files for that.
#pragma once

#ifndef NPU_ATTN_VEC_BYTES
#error "define NPU_ATTN_VEC_BYTES before including forward_driver_impl.h"
#endif

#include <omp.h>

#include <cstdint>

#include "../attention_params.h"
#include "../workspace.h"
#include "vec_impl.h"

namespace npu_attn {
namespace {

// Per-thread scratch starts on its own 64-byte cache line (16 floats): no false sharing between
// threads, and every thread's buffers have the same alignment.
constexpr int64_t kScratchAlignFloats = 16;

// What the driver needs of a family's plan. Sizes are in 4-byte units (floats, or 32-bit words
// of two bfloat16 values; one tracked float allocation holds either).
struct ForwardSchedule {
  int64_t block_q;          // queries per task
  int64_t pack_tiles;       // pack items per (batch, kv-head) pair; 0: nothing to pack
  int64_t pair_floats;      // packed K/V of one pair
  int64_t pairs_per_chunk;  // pairs packed (then computed) per round of the chunk loop
  int64_t scratch_floats;   // one thread's scratch (rounded up to kScratchAlignFloats here)
};

// Pairs per chunk: as many as fit in `budget_bytes` of packed K/V (fewer barriers for short
// sequences, bounded memory for long ones), at least one; all of them when nothing is packed.
int64_t pairs_per_pack_budget(const AttentionParams& p, int64_t pair_floats, int64_t budget_bytes) {
  const int64_t pairs = p.batch * p.heads_kv;
  if (pair_floats == 0) return pairs;
  const int64_t budget_floats = budget_bytes / static_cast<int64_t>(sizeof(float));
  return max_i64(1, min_i64(pairs, budget_floats / pair_floats));
}

// ---------------------------------------------------------------- tasks
struct QueryTile {
  int64_t batch, head, q0, rows, vecs;  // vecs = ceil(rows / kLanes)
};

// Task `index` of a chunk of (batch, kv-head) pairs starting at pair `first`: every
// (pair, q-head of its GQA group, query tile of block_q) is one task. `local` is the pair's
// position in the chunk (where its packed K/V live).
struct QueryTask {
  QueryTile tile;
  int64_t local;
  int64_t hkv;
};

QueryTask query_task(const AttentionParams& p, int64_t first, int64_t index, int64_t q_tiles,
                     int64_t block_q) {
  const int64_t group = p.heads_q / p.heads_kv;
  QueryTask t{};
  t.local = index / (group * q_tiles);
  const int64_t rest = index % (group * q_tiles);
  const int64_t pair = first + t.local;
  t.hkv = pair % p.heads_kv;
  t.tile.batch = pair / p.heads_kv;
  t.tile.head = t.hkv * group + rest / q_tiles;
  t.tile.q0 = (rest % q_tiles) * block_q;
  t.tile.rows = min_i64(block_q, p.len_q - t.tile.q0);
  t.tile.vecs = ceil_div(t.tile.rows, kLanes);
  return t;
}

// No more threads than tasks could exist if every head's queries were split into tasks of
// `clamp_queries` (the plans may choose bigger tiles; their choice depends on this count).
int forward_threads(const AttentionParams& p, int64_t clamp_queries) {
  const int64_t max_tasks = p.batch * p.heads_q * ceil_div(p.len_q, clamp_queries);
  return static_cast<int>(min_i64(max_i64(p.num_threads, 1), max_tasks));
}

// ---------------------------------------------------------------- the driver
template <typename Family>
void run_forward(const AttentionParams& p) {
  if (p.batch == 0 || p.heads_q == 0 || p.len_q == 0) return;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t pairs = p.batch * p.heads_kv;
  const int threads = forward_threads(p, Family::kThreadClampQueries);
  const typename Family::Plan plan = Family::make_plan(p, threads);
  const ForwardSchedule& s = plan.schedule;
  const int64_t q_tiles = ceil_div(p.len_q, s.block_q);

  // All workspace is allocated here, outside the parallel region, so an allocation failure
  // surfaces as std::bad_alloc to the caller instead of terminating inside OpenMP.
  const int64_t per_thread = round_up(s.scratch_floats, kScratchAlignFloats);
  const WorkspaceBuffer packed_buffer(s.pairs_per_chunk * s.pair_floats);
  const WorkspaceBuffer scratch_buffer(per_thread * threads);
  float* packed = packed_buffer.data();
  float* scratch = scratch_buffer.data();

  // A pair that only one task reads (no GQA group, one query tile: short sequences) is packed by
  // that task: no barrier between the phases, and the packed rows are in the core's own cache
  // when the task reads them instead of in whichever core packed them.
  const bool pack_in_task = group * q_tiles == 1;

#pragma omp parallel num_threads(threads)
  {
    typename Family::Scratch ws =
        Family::enter_thread(p, plan, scratch + per_thread * omp_get_thread_num());
    for (int64_t first = 0; first < pairs; first += s.pairs_per_chunk) {
      const int64_t chunk_pairs = min_i64(s.pairs_per_chunk, pairs - first);
      // Phase 1: pack the K and V rows of the chunk's pairs, one (pair, key tile) per item.
      if (!pack_in_task) {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunk_pairs * s.pack_tiles; ++item) {
          const int64_t local = item / s.pack_tiles;
          Family::pack(p, plan, first + local, item % s.pack_tiles, packed + local * s.pair_floats);
        }
      }
      // Phase 2: every (pair, q-head of its group, query tile) is an independent task.
#pragma omp for schedule(dynamic, 1)
      for (int64_t index = 0; index < chunk_pairs * group * q_tiles; ++index) {
        const QueryTask task = query_task(p, first, index, q_tiles, s.block_q);
        float* pair_pack = packed + task.local * s.pair_floats;
        if (pack_in_task)
          for (int64_t tile = 0; tile < s.pack_tiles; ++tile)
            Family::pack(p, plan, first + task.local, tile, pair_pack);
        Family::run(p, plan, task, pair_pack, ws);
      }
    }
    Family::leave_thread(ws);
  }
}

}  // namespace
}  // namespace npu_attn
