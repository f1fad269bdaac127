// Helpers for reading variants.def with X-macros: NPU_ATTN_IF_<arch>(code) keeps `code` only
// where variants of that arch are compiled (CMake defines NPU_ATTN_X86 on x86-64, NPU_ATTN_ARM64 on
// AArch64).
#pragma once

#define NPU_ATTN_IF_ANY(...) __VA_ARGS__
#if defined(NPU_ATTN_X86)
#define NPU_ATTN_IF_X86(...) __VA_ARGS__
#else
#define NPU_ATTN_IF_X86(...)
#endif
#if defined(NPU_ATTN_ARM64)
#define NPU_ATTN_IF_ARM64(...) __VA_ARGS__
#else
#define NPU_ATTN_IF_ARM64(...)
#endif
