// A small tracked allocator for kernel workspaces.
//
// Kernels get their scratch memory here so that the DeviceManager can report how many bytes
// attention holds right now and at peak. Functions are defined out of line in workspace.cpp
// (compiled without ISA flags) so the per-ISA kernels can call them safely.
#pragma once

#include <cstddef>
#include <cstdint>

namespace npu_attn {

struct WorkspaceStats {
  int64_t current_bytes;
  int64_t peak_bytes;
  int64_t total_allocations;
};

// 64-byte aligned; returns nullptr only for size 0. Throws std::bad_alloc on failure.
float* workspace_alloc_floats(int64_t count);
void workspace_free_floats(float* ptr, int64_t count);

// One workspace allocation owned by a scope: freed on every exit, including when a later
// allocation of the same kernel call throws. Members are out of line (workspace.cpp): inline
// ones would be weak symbols shared by the per-ISA kernel objects.
class WorkspaceBuffer {
 public:
  explicit WorkspaceBuffer(int64_t floats);
  ~WorkspaceBuffer();
  WorkspaceBuffer(const WorkspaceBuffer&) = delete;
  WorkspaceBuffer& operator=(const WorkspaceBuffer&) = delete;
  float* data() const;

 private:
  float* data_;
  int64_t count_;
};

WorkspaceStats workspace_stats();
void workspace_reset_peak();

}  // namespace npu_attn
