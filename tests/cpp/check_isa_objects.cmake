# Checks the per-ISA kernel objects (run by ctest as isa_objects_are_self_contained).
#  1. No weak or unique global symbols are *defined*: such symbols (inline functions, template
#     instantiations) are merged by the linker across translation units, so an AVX-512 copy
#     could end up being called from the scalar variant on a machine without AVX-512.
#  2. The scalar object uses no ymm/zmm registers; the avx2 and avx_vnni objects use no zmm
#     registers; the VNNI objects contain vpdpbusd; the emulated AMX and VNNI kernels
#     (tests/cpp/amx_emulation.h, vnni_emulation.h) contain no real tile or VNNI instruction,
#     which an intrinsic the emulation does not replace would leave behind; the neon (AArch64)
#     object has 4-lane vector FMAs.
# OBJECTS is a list of "isa=path/to/object.o" entries.
foreach(entry ${OBJECTS})
  string(REGEX MATCH "^([a-z0-9_]+)=(.*)$" _ "${entry}")
  set(isa "${CMAKE_MATCH_1}")
  set(object "${CMAKE_MATCH_2}")
  execute_process(COMMAND ${NM} --defined-only ${object} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${object}")
  endif()
  string(REGEX MATCHALL "[^\n]* [WVu] [^\n]*" weak "${symbols}")
  # The exception-personality data word is not code; it is the same in every object.
  list(FILTER weak EXCLUDE REGEX "DW\\.ref\\.__gxx_personality_v0")
  if(weak)
    message(FATAL_ERROR "${isa}: object defines weak/unique symbols that the linker may merge "
                        "across ISA variants:\n${weak}")
  endif()
  execute_process(COMMAND ${OBJDUMP} -d --no-show-raw-insn ${object} OUTPUT_VARIABLE asm)
  if(isa STREQUAL "scalar" AND asm MATCHES "%[yz]mm")
    message(FATAL_ERROR "scalar: object contains AVX (ymm/zmm) instructions")
  endif()
  if(isa MATCHES "^(avx2|avx_vnni|vnni_emulated|amx_int8_emulated)$" AND asm MATCHES "%zmm")
    message(FATAL_ERROR "${isa}: object contains AVX-512 (zmm) instructions")
  endif()
  if(isa MATCHES "^(avx_vnni|avx512_vnni)$" AND NOT asm MATCHES "vpdpbusd")
    message(FATAL_ERROR "${isa}: object contains no vpdpbusd; were the flags applied?")
  endif()
  if(isa MATCHES "^(vnni_emulated|amx_int8_emulated)$" AND asm MATCHES "(vpdpbusd|vpdpwssd)")
    message(FATAL_ERROR "${isa}: object contains real VNNI instructions")
  endif()
  if(isa STREQUAL "amx_int8_emulated" AND asm MATCHES "(%tmm|ldtilecfg|tilerelease)")
    message(FATAL_ERROR "amx_int8_emulated: object contains real AMX instructions")
  endif()
  if(isa STREQUAL "amx_int8" AND NOT asm MATCHES "tdpbssd")
    message(FATAL_ERROR "amx_int8: object contains no tdpbssd; were the flags applied?")
  endif()
  if(isa STREQUAL "amx_emulated" AND asm MATCHES "(%tmm|ldtilecfg|sttilecfg|tilerelease)")
    message(FATAL_ERROR "amx_emulated: object contains real AMX instructions")
  endif()
  if(isa STREQUAL "neon" AND NOT asm MATCHES "fmla[ \t]+v[0-9]+\\.4s")
    message(FATAL_ERROR "neon: object contains no 4-lane vector FMA; were the flags applied?")
  endif()
  if(isa MATCHES "^(avx512|avx512_bf16|amx_emulated)$" AND NOT asm MATCHES "%zmm")
    message(FATAL_ERROR "avx512: object contains no zmm instructions; were the flags applied?")
  endif()
  message(STATUS "${isa}: ok (${object})")
endforeach()
