// Thin pybind11 binding: turns Python tensors into TensorViews, lets make_attention_params()
// validate them (the one boundary check), releases the GIL and runs the kernel.
//
// Tensors arrive either as DLPack capsules (torch, zero-copy; the capsule is borrowed, not
// consumed, so its producer still owns and frees it) or as objects with the buffer protocol
// (NumPy, zero-copy, read-only arrays allowed for inputs).
#include <dlpack/dlpack.h>
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <Eigen/Core>
#include <optional>
#include <string>

#include "attention.h"
#include "dispatch.h"
#include "heap_policy.h"
#include "system_info.h"
#include "workspace.h"

namespace py = pybind11;
using npu_attn::DType;
using npu_attn::TensorView;

namespace {

// kDLBool was added in DLPack 0.8; Debian's header (0.6) predates it, torch emits it.
constexpr uint8_t kDLBoolCode = 6;

DType dtype_from_dlpack(DLDataType t) {
  if (t.lanes != 1) return DType::kOther;
  if (t.code == kDLFloat && t.bits == 32) return DType::kFloat32;
  if (t.code == kDLFloat && t.bits == 64) return DType::kFloat64;
  if (t.code == kDLFloat && t.bits == 16) return DType::kFloat16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::kBFloat16;
  if (t.code == kDLBoolCode && t.bits == 8) return DType::kBool;
  if (t.code == kDLUInt && t.bits == 8) return DType::kUInt8;
  return DType::kOther;
}

std::string device_name(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda:" + std::to_string(d.device_id);
    default:
      return "dlpack-device-" + std::to_string(d.device_type);
  }
}

TensorView view_from_capsule(py::capsule capsule, const char* name) {
  if (std::string(capsule.name() ? capsule.name() : "") != "dltensor") {
    throw npu_attn::ArgumentError(npu_attn::ArgumentError::Kind::kType,
                                  std::string(name) + ": DLPack capsule was already consumed");
  }
  const auto* managed = capsule.get_pointer<DLManagedTensor>();
  const DLTensor& t = managed->dl_tensor;
  TensorView view;
  view.data = static_cast<char*>(t.data) + t.byte_offset;
  view.dtype = dtype_from_dlpack(t.dtype);
  view.on_cpu = t.device.device_type == kDLCPU;
  view.device = device_name(t.device);
  view.shape.assign(t.shape, t.shape + t.ndim);
  view.strides.resize(t.ndim);
  int64_t compact = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    view.strides[i] = t.strides ? t.strides[i] : compact;
    compact *= t.shape[i];
  }
  return view;
}

DType dtype_from_buffer(const py::buffer_info& info) {
  const std::string& f = info.format;
  const char code = f.empty() ? '\0' : f.back();  // skip byte-order prefixes like '<' or '='
  if (code == 'f' && info.itemsize == 4) return DType::kFloat32;
  if (code == 'd' && info.itemsize == 8) return DType::kFloat64;
  if (code == 'e' && info.itemsize == 2) return DType::kFloat16;
  if (code == '?' && info.itemsize == 1) return DType::kBool;
  if (code == 'B' && info.itemsize == 1) return DType::kUInt8;
  return DType::kOther;
}

TensorView view_from_buffer(py::buffer buffer, bool writable, const char* name) {
  py::buffer_info info;
  try {
    info = buffer.request(writable);
  } catch (py::error_already_set& e) {
    throw npu_attn::ArgumentError(
        npu_attn::ArgumentError::Kind::kValue,
        std::string(name) + (writable ? " must be a writable buffer: " : ": ") + e.what());
  }
  TensorView view;
  view.data = info.ptr;
  view.dtype = dtype_from_buffer(info);
  view.shape.assign(info.shape.begin(), info.shape.end());
  for (size_t i = 0; i < info.strides.size(); ++i) {
    if (info.strides[i] % info.itemsize != 0) {
      throw npu_attn::ArgumentError(npu_attn::ArgumentError::Kind::kValue,
                                    std::string(name) +
                                        " has a stride that is not a multiple of "
                                        "its element size");
    }
    view.strides.push_back(info.strides[i] / info.itemsize);
  }
  return view;
}

TensorView to_view(py::handle obj, bool writable, const char* name) {
  if (py::isinstance<py::capsule>(obj))
    return view_from_capsule(py::reinterpret_borrow<py::capsule>(obj), name);
  if (PyObject_CheckBuffer(obj.ptr()))
    return view_from_buffer(py::reinterpret_borrow<py::buffer>(obj), writable, name);
  throw npu_attn::ArgumentError(npu_attn::ArgumentError::Kind::kType,
                                std::string(name) +
                                    " must be a torch.Tensor or numpy.ndarray, got " +
                                    std::string(py::str(py::type::of(obj).attr("__name__"))));
}

std::optional<TensorView> to_optional_view(py::object obj, bool writable, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return to_view(obj, writable, name);
}

npu_attn::SdpaArguments collect_arguments(py::handle query, py::handle key, py::handle value,
                                          py::handle out, py::object attn_mask, py::object lse,
                                          std::optional<double> scale, bool is_causal,
                                          bool enable_gqa, std::optional<int> num_threads) {
  npu_attn::SdpaArguments args;
  args.query = to_view(query, false, "query");
  args.key = to_view(key, false, "key");
  args.value = to_view(value, false, "value");
  args.out = to_view(out, true, "out");
  args.attn_mask = to_optional_view(attn_mask, false, "attn_mask");
  args.lse = to_optional_view(lse, true, "lse");
  args.scale = scale;
  args.is_causal = is_causal;
  args.enable_gqa = enable_gqa;
  args.num_threads = num_threads ? *num_threads : npu_attn::get_num_threads();
  return args;
}

npu_attn::Isa isa_from_name(const std::string& name) {
  const auto isa = npu_attn::parse_isa(name);
  if (!isa)
    throw py::value_error("unknown kernel variant '" + name + "'; expected one of " +
                          npu_attn::isa_choices());
  return *isa;
}

npu_attn::ElementType element_from_name(const std::string& name) {
  for (int i = 0; i < npu_attn::kElementTypeCount; ++i) {
    const auto element = static_cast<npu_attn::ElementType>(i);
    if (name == npu_attn::element_type_name(element)) return element;
  }
  throw py::value_error("dtype must be 'float32', 'bfloat16' or 'float16', got '" + name + "'");
}

npu_attn::ShapeClass shape_class_from_name(const std::string& name) {
  const auto shape = npu_attn::parse_shape_class(name);
  if (!shape) {
    throw py::value_error(
        "shape_class must be 'self-attention', 'cross-attention' or 'large head dim', got '" +
        name + "'");
  }
  return *shape;
}

// The variant table as Python dicts: what each variant needs and runs, and whether it runs here.
py::list variant_table() {
  py::list rows;
  for (const npu_attn::KernelVariant& v : npu_attn::kernel_variants()) {
    py::dict row, kernels;
    for (int i = 0; i < npu_attn::kElementTypeCount; ++i)
      kernels[npu_attn::element_type_name(static_cast<npu_attn::ElementType>(i))] =
          v.forward_kernel[i];
    row["name"] = v.name;
    row["needs"] = v.needs;
    row["runnable"] = v.runs_on(npu_attn::cpu_features());
    row["forward_kernel"] = kernels;
    row["backward_from"] = v.backward_from;
    row["int8_kernel"] = v.int8_kernel;
    rows.append(row);
  }
  return rows;
}

std::vector<std::string> isa_names(const std::vector<npu_attn::Isa>& isas) {
  std::vector<std::string> names;
  for (auto isa : isas) names.emplace_back(npu_attn::isa_name(isa));
  return names;
}

void forward(py::handle query, py::handle key, py::handle value, py::handle out,
             py::object attn_mask, py::object lse, std::optional<double> scale, bool is_causal,
             bool enable_gqa, std::optional<int> num_threads, std::optional<std::string> isa) {
  const auto args = collect_arguments(query, key, value, out, attn_mask, lse, scale, is_causal,
                                      enable_gqa, num_threads);
  const npu_attn::AttentionParams params = npu_attn::make_attention_params(args);
  const std::optional<npu_attn::Isa> variant =
      isa ? std::optional<npu_attn::Isa>(isa_from_name(*isa)) : std::nullopt;
  py::gil_scoped_release no_gil;
  if (variant) {
    npu_attn::run_attention_forward(params, *variant);
  } else {
    npu_attn::run_attention_forward(params);  // the variant active for its dtype and shape
  }
}

// The lossy int8 forward (attention_int8_impl.h): the same arguments as forward().
void forward_int8(py::handle query, py::handle key, py::handle value, py::handle out,
                  py::object attn_mask, py::object lse, std::optional<double> scale, bool is_causal,
                  bool enable_gqa, std::optional<int> num_threads, std::optional<std::string> isa) {
  const auto args = collect_arguments(query, key, value, out, attn_mask, lse, scale, is_causal,
                                      enable_gqa, num_threads);
  const npu_attn::AttentionParams params = npu_attn::make_attention_params(args);
  const npu_attn::Isa variant = isa ? isa_from_name(*isa) : npu_attn::active_int8_isa();
  py::gil_scoped_release no_gil;
  npu_attn::run_attention_int8(params, variant);
}

void backward(py::handle query, py::handle key, py::handle value, py::handle out, py::handle lse,
              py::handle grad_out, py::handle grad_query, py::handle grad_key,
              py::handle grad_value, py::object attn_mask, py::object grad_lse,
              std::optional<double> scale, bool is_causal, bool enable_gqa,
              std::optional<int> num_threads, std::optional<std::string> isa) {
  npu_attn::SdpaBackwardArguments args;
  args.forward =
      collect_arguments(query, key, value, out, attn_mask, py::reinterpret_borrow<py::object>(lse),
                        scale, is_causal, enable_gqa, num_threads);
  args.grad_out = to_view(grad_out, false, "grad_out");
  args.grad_lse = to_optional_view(grad_lse, false, "grad_lse");
  args.grad_query = to_view(grad_query, true, "grad_query");
  args.grad_key = to_view(grad_key, true, "grad_key");
  args.grad_value = to_view(grad_value, true, "grad_value");
  const npu_attn::AttentionBackwardParams params = npu_attn::make_attention_backward_params(args);
  const std::optional<npu_attn::Isa> variant =
      isa ? std::optional<npu_attn::Isa>(isa_from_name(*isa)) : std::nullopt;
  py::gil_scoped_release no_gil;
  if (variant) {
    npu_attn::run_attention_backward(params, *variant);
  } else {
    npu_attn::run_attention_backward(params);
  }
}

py::dict build_info() {
  py::dict info;
  info["compiler"] = std::string(__VERSION__);
  info["openmp"] = _OPENMP;
  info["eigen"] = std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) +
                  "." + std::to_string(EIGEN_MINOR_VERSION);
  info["dlpack"] = DLPACK_VERSION;
  info["compiled_isas"] = isa_names(npu_attn::compiled_isas());
#ifdef NPU_ATTN_BUILD_TYPE
  info["build_type"] = NPU_ATTN_BUILD_TYPE;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "npu_attn C++ core (private; use the npu_attn package)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const npu_attn::ArgumentError& e) {
      PyErr_SetString(
          e.kind() == npu_attn::ArgumentError::Kind::kType ? PyExc_TypeError : PyExc_ValueError,
          e.what());
    }
  });

  m.def("forward", &forward, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"),
        py::arg("attn_mask") = py::none(), py::arg("lse") = py::none(),
        py::arg("scale") = py::none(), py::arg("is_causal") = false, py::arg("enable_gqa") = false,
        py::arg("num_threads") = py::none(), py::arg("isa") = py::none(),
        "Attention forward into `out` (and `lse`). Inputs: DLPack capsules or buffers.");

  m.def("forward_int8", &forward_int8, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("out"), py::arg("attn_mask") = py::none(), py::arg("lse") = py::none(),
        py::arg("scale") = py::none(), py::arg("is_causal") = false, py::arg("enable_gqa") = false,
        py::arg("num_threads") = py::none(), py::arg("isa") = py::none(),
        "Lossy int8 attention forward (Q K^T on 8-bit codes) into `out`; forward()'s arguments.");
  m.def("int8_isa", [] { return std::string(npu_attn::isa_name(npu_attn::active_int8_isa())); });
  m.def("default_int8_isa", [] {
    return std::string(npu_attn::isa_name(npu_attn::default_int8_isa(npu_attn::cpu_features())));
  });
  m.def(
      "set_int8_isa",
      [](const std::string& name) { npu_attn::set_active_int8_isa(isa_from_name(name)); },
      py::arg("name"), "Make `name` the variant of the int8 forward.");
  m.def("backward", &backward, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"),
        py::arg("lse"), py::arg("grad_out"), py::arg("grad_query"), py::arg("grad_key"),
        py::arg("grad_value"), py::arg("attn_mask") = py::none(), py::arg("grad_lse") = py::none(),
        py::arg("scale") = py::none(), py::arg("is_causal") = false, py::arg("enable_gqa") = false,
        py::arg("num_threads") = py::none(), py::arg("isa") = py::none(),
        "Gradients of the forward call (query, key, value, attn_mask, scale, is_causal, "
        "enable_gqa) that produced `out` and `lse`, written into grad_query/key/value.");

  m.def("get_num_threads", &npu_attn::get_num_threads);
  m.def("set_num_threads", &npu_attn::set_num_threads, py::arg("threads"));
  m.def(
      "active_isa",
      [](const std::string& dtype, const std::string& shape) {
        return std::string(npu_attn::isa_name(
            npu_attn::active_isa(element_from_name(dtype), shape_class_from_name(shape))));
      },
      py::arg("dtype") = "float32", py::arg("shape_class") = "self-attention");
  m.def(
      "set_isa",
      [](const std::string& name, std::optional<std::string> dtype,
         std::optional<std::string> shape) {
        const npu_attn::Isa isa = isa_from_name(name);
        if (shape && !dtype) throw py::value_error("shape_class needs a dtype");
        if (dtype && shape) {
          npu_attn::set_active_isa(isa, element_from_name(*dtype), shape_class_from_name(*shape));
        } else if (dtype) {
          npu_attn::set_active_isa(isa, element_from_name(*dtype));
        } else {
          npu_attn::set_active_isa(isa);
        }
      },
      py::arg("name"), py::arg("dtype") = py::none(), py::arg("shape_class") = py::none(),
      "Make `name` the active variant for `dtype` and `shape_class` (default: all).");
  m.def(
      "active_backward_isa",
      [](const std::string& dtype, const std::string& shape) {
        return std::string(npu_attn::isa_name(
            npu_attn::active_backward_isa(element_from_name(dtype), shape_class_from_name(shape))));
      },
      py::arg("dtype") = "float32", py::arg("shape_class") = "self-attention");
  m.def(
      "set_backward_isa",
      [](std::optional<std::string> name, const std::string& dtype) {
        if (name) {
          npu_attn::set_active_backward_isa(isa_from_name(*name), element_from_name(dtype));
        } else {
          npu_attn::clear_active_backward_isa(element_from_name(dtype));
        }
      },
      py::arg("name"), py::arg("dtype"),
      "Make `name` the variant of `dtype`'s backward calls; None (or set_isa(name) for every "
      "dtype): the forward's variant again.");
  m.def("shape_classes", [] {
    std::vector<std::string> names;
    for (int i = 0; i < npu_attn::kShapeClassCount; ++i)
      names.emplace_back(npu_attn::shape_class_name(static_cast<npu_attn::ShapeClass>(i)));
    return names;
  });
  m.def(
      "default_isa",
      [](const std::string& dtype) {
        return std::string(npu_attn::isa_name(npu_attn::default_isa(element_from_name(dtype))));
      },
      py::arg("dtype") = "float32", "The variant chosen by rule, before any measurement.");
  m.def("variants", &variant_table, "The compiled kernel variants (the C++ variant table).");
  m.def("runnable_isas", [] { return isa_names(npu_attn::runnable_isas()); });
  m.def("workspace_stats", [] {
    const auto s = npu_attn::workspace_stats();
    py::dict d;
    d["current_bytes"] = s.current_bytes;
    d["peak_bytes"] = s.peak_bytes;
    d["allocations"] = s.total_allocations;
    return d;
  });
  m.def("cpu_info", [] {
    const npu_attn::CpuInfo c = npu_attn::query_cpu_info();
    py::dict d;
    d["vendor"] = c.vendor;
    d["model"] = c.model;
    d["signature"] = c.signature;
    d["logical_cores"] = c.logical_cores;
    d["l1d_bytes"] = c.l1d_bytes;
    d["l2_bytes"] = c.l2_bytes;
    d["l3_bytes"] = c.l3_bytes;
    d["features"] = c.features.names();
    d["compiled_isas"] = isa_names(npu_attn::compiled_isas());
    d["runnable_isas"] = isa_names(npu_attn::runnable_isas());
    d["active_isa"] = std::string(npu_attn::isa_name(npu_attn::active_isa()));
    return d;
  });
  m.def("memory_info", [] {
    const npu_attn::MemoryInfo mem = npu_attn::query_memory_info();
    py::dict d;
    d["total_bytes"] = mem.total_bytes;
    d["available_bytes"] = mem.available_bytes;
    d["rss_bytes"] = mem.rss_bytes;
    d["peak_rss_bytes"] = mem.peak_rss_bytes;
    d["workspace_bytes"] = mem.workspace_bytes;
    d["workspace_peak_bytes"] = mem.workspace_peak_bytes;
    const npu_attn::HeapStats heap = npu_attn::heap_stats();
    d["heap_mmapped_bytes"] = heap.mmapped_bytes;
    d["heap_free_bytes"] = heap.free_bytes;
    d["heap_reuse"] = npu_attn::heap_reuse_enabled();
    return d;
  });
  m.def("heap_reuse_supported", &npu_attn::heap_reuse_supported);
  m.def("set_heap_reuse", &npu_attn::set_heap_reuse, py::arg("enabled"),
        "Large CPU blocks from the heap and freed memory kept (true), or glibc's defaults "
        "(false); returns false where the C heap is not glibc's.");
  m.def("release_free_heap", &npu_attn::release_free_heap);
  m.def("build_info", &build_info);
  m.def(
      "peak_gflops",
      [](std::optional<std::string> isa, const std::string& dtype, int threads, double seconds) {
        const npu_attn::ElementType element = element_from_name(dtype);
        const npu_attn::Isa variant = isa ? isa_from_name(*isa) : npu_attn::active_isa(element);
        py::gil_scoped_release no_gil;
        return npu_attn::measure_peak_gflops(variant, element, threads, seconds);
      },
      py::arg("isa") = py::none(), py::arg("dtype") = "float32", py::arg("threads") = 1,
      py::arg("seconds") = 0.3,
      "Measured peak GFLOP/s of the compute path variant `isa` (default: the one active for "
      "`dtype`) uses for `dtype`: fp32 FMA, vdpbf16ps or AMX tiles.");

  // Detect the CPU and choose the variants now, so a bad NPU_ATTN_ISA or
  // NPU_ATTN_DISABLE_FEATURES fails at import with a clear message.
  for (int i = 0; i < npu_attn::kElementTypeCount; ++i)
    npu_attn::active_isa(static_cast<npu_attn::ElementType>(i));
}
