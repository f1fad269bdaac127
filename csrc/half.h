// IEEE binary16 (torch.float16) as this compiler spells it, shared by the kernels and the
// test-only reference.
#pragma once

namespace npu_attn {

#if defined(__aarch64__) && defined(__cplusplus) && !defined(__clang__) && __GNUC__ < 13
// GCC before 13 has no _Float16 in C++ on AArch64; its __fp16 is the same format (storage
// only: arithmetic promotes to float, which is all the kernels do with it).
typedef __fp16 Half;
#else
typedef _Float16 Half;
#endif

}  // namespace npu_attn
