// The one registration file of the cpu/ kernels: every torch.ops.pagedrs_cpu.* schema (written
// tensors marked `(a!)`), bound to its CPU implementation (declared in cpu_kernels.h, each
// checking its tensors before it reads them), and the torch.classes.pagedrs_cpu.DecoderStack
// class. Built with the kernels by python/pagedrs/kernels/cpu.py.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_kernels.h"

TORCH_LIBRARY(pagedrs_cpu, m) {
  // paged_attention.cpp
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor context_lens, float scale, int sliding_window, float softcap, Tensor? sinks=None) -> ()");
  m.def("fp8_as_float(Tensor x) -> Tensor");
  // sampling.cpp
  m.def("logprob_stats(Tensor logits, Tensor token_ids, int num_top, Tensor(a!) logprobs, Tensor(b!) ranks, "
        "Tensor(c!) top_ids, Tensor(d!) top_logprobs) -> ()");
  m.def("sample_from_rows(Tensor logits, Tensor temperature, Tensor min_p, Tensor top_p, Tensor uniforms, "
        "Tensor(a!) token_ids) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()");
  m.def("argmax_rows(Tensor logits, Tensor(a!) token_ids) -> ()");
  // quant_matmul.cpp
  m.def("quant_matmul(Tensor x, Tensor weight, int ggml_type, int in_features) -> Tensor");
  m.def("embedding_rows(Tensor weight, Tensor token_ids, int ggml_type, int in_features) -> Tensor");
  m.def("int8_activation_path() -> str", &pagedrs_cpu::int8_activation_path);  // no tensors: any device
  m.def("int8_panel_prefetch_bytes() -> int", &pagedrs_cpu::int8_panel_prefetch_bytes);
  m.def("pack_int8_panels(Tensor weight, int ggml_type, int in_features) -> Tensor");
  m.def("int8_panel_rows() -> int", &pagedrs_cpu::int8_panel_rows);
  m.def("pack_scales_first(Tensor weight, int ggml_type, int in_features) -> Tensor");
  m.def("scales_first_rows() -> bool", &pagedrs_cpu::scales_first_rows);
  // moe.cpp
  m.def("fused_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, int gate_up_type, "
        "Tensor down, int down_type, int intermediate_size, int activation, Tensor? gate_up_bias=None, "
        "Tensor? down_bias=None, float alpha=0., float limit=0.) -> Tensor");
  // decoder_stack.cpp: a class, its methods' schemas inferred from their C++ signatures
  m.class_<pagedrs_cpu::DecoderStack>("DecoderStack")
      .def(torch::init(&pagedrs_cpu::make_decoder_stack))
      .def("add_layer", &pagedrs_cpu::DecoderStack::add_layer)
      .def("set_experts", &pagedrs_cpu::DecoderStack::set_experts)
      .def("num_layers", &pagedrs_cpu::DecoderStack::num_layers)
      .def("set_final_norm", &pagedrs_cpu::DecoderStack::set_final_norm)
      .def("set_head", &pagedrs_cpu::DecoderStack::set_head)
      .def("set_embedding", &pagedrs_cpu::DecoderStack::set_embedding)
      .def("set_one_region", &pagedrs_cpu::DecoderStack::set_one_region)
      .def("one_region_steps", &pagedrs_cpu::DecoderStack::one_region_steps)
      .def("forward", &pagedrs_cpu::DecoderStack::forward)
      .def("set_lora", &pagedrs_cpu::DecoderStack::set_lora)
      .def("set_lora_rows", &pagedrs_cpu::DecoderStack::set_lora_rows);
}

TORCH_LIBRARY_IMPL(pagedrs_cpu, CPU, m) {
  m.impl("paged_attention", &pagedrs_cpu::paged_attention);
  m.impl("fp8_as_float", &pagedrs_cpu::fp8_as_float);
  m.impl("logprob_stats", &pagedrs_cpu::logprob_stats);
  m.impl("sample_from_rows", &pagedrs_cpu::sample_from_rows);
  m.impl("apply_token_bitmask", &pagedrs_cpu::apply_token_bitmask);
  m.impl("argmax_rows", &pagedrs_cpu::argmax_rows);
  m.impl("quant_matmul", &pagedrs_cpu::quant_matmul);
  m.impl("embedding_rows", &pagedrs_cpu::embedding_rows);
  m.impl("pack_int8_panels", &pagedrs_cpu::pack_int8_panels);
  m.impl("pack_scales_first", &pagedrs_cpu::pack_scales_first);
  m.impl("fused_experts", &pagedrs_cpu::fused_experts);
}
