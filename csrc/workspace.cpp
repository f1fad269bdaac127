#include "workspace.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace npu_attn {
namespace {

constexpr std::size_t kAlignment = 64;  // one cache line, one AVX-512 register

std::atomic<int64_t> g_current_bytes{0};
std::atomic<int64_t> g_peak_bytes{0};
std::atomic<int64_t> g_allocations{0};

void record_peak(int64_t now) {
  int64_t peak = g_peak_bytes.load(std::memory_order_relaxed);
  while (now > peak && !g_peak_bytes.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

std::size_t rounded_bytes(int64_t count) {
  const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(float);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

}  // namespace

float* workspace_alloc_floats(int64_t count) {
  if (count <= 0) return nullptr;
  const std::size_t bytes = rounded_bytes(count);
  void* ptr = std::aligned_alloc(kAlignment, bytes);
  if (ptr == nullptr) throw std::bad_alloc();
  const int64_t now =
      g_current_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed) +
      static_cast<int64_t>(bytes);
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  record_peak(now);
  return static_cast<float*>(ptr);
}

void workspace_free_floats(float* ptr, int64_t count) {
  if (ptr == nullptr) return;
  std::free(ptr);
  g_current_bytes.fetch_sub(static_cast<int64_t>(rounded_bytes(count)), std::memory_order_relaxed);
}

WorkspaceBuffer::WorkspaceBuffer(int64_t floats)
    : data_(workspace_alloc_floats(floats)), count_(floats) {}

WorkspaceBuffer::~WorkspaceBuffer() {
  workspace_free_floats(data_, count_);
}

float* WorkspaceBuffer::data() const {
  return data_;
}

WorkspaceStats workspace_stats() {
  return {g_current_bytes.load(), g_peak_bytes.load(), g_allocations.load()};
}

void workspace_reset_peak() {
  g_peak_bytes.store(g_current_bytes.load());
}

}  // namespace npu_attn
