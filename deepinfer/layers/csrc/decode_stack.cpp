// A Llama-family decoder stack run for a step of decodes and short spans in one call from Python.
//
// At batch-1 decode a layer's arithmetic is a few tens of microseconds, and running its dozen
// ops from Python (module calls, attribute lookups, checks, views, one dispatch per op) costs
// about as much again. Here the layers are a list built once at load, and a step walks it in
// C++: every op is the same registered op the Python layers call (norms, rotary and K/V store,
// paged decode attention, each linear's own kernel), called through the dispatcher, in the same
// order on the same inputs, so the hidden states are the same bits. The one difference is where
// a layer's residual add goes: with the next layer's norm in one pass (``add_rms_norm``, whose
// sum is rounded as torch's add rounds it).
//
// A linear is whatever op its module names: ``op(x, *args)`` with ``args`` bound at load (the
// quantized kernel with its codes and scales, the batch-rows kernel with its packed weight, ...),
// called boxed; the stack needs no knowledge of weight formats.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

c10::OperatorHandle find_op(const std::string& qualified) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "");
}

// A registered op run on rows x: op(x, *args).
struct BoundOp {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;

  // spec: (qualified op name, tuple of the arguments after x)
  static BoundOp from(const c10::IValue& spec) {
    const auto& parts = spec.toTupleRef().elements();
    TORCH_CHECK(parts.size() == 2, "a linear is (op name, args)");
    const auto& args = parts[1].toTupleRef().elements();
    return {find_op(parts[0].toStringRef()), std::vector<c10::IValue>(args.begin(), args.end())};
  }

  at::Tensor operator()(const at::Tensor& x) const {
    torch::jit::Stack stack;
    stack.reserve(args.size() + 1);
    stack.emplace_back(x);
    stack.insert(stack.end(), args.begin(), args.end());
    op.callBoxed(&stack);
    return std::move(stack[0]).toTensor();
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> q_norm, k_norm;  // per-head RMSNorm of q and k (Qwen3)
  at::Tensor k_cache, v_cache;  // the layer's pages in the runner's pool
  BoundOp qkv, o, gate_up, down;
  int64_t heads, kv_heads;
  std::optional<int64_t> window;
};

using NormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNormFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RotateStoreFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                         at::Tensor&, at::Tensor&, const at::Tensor&);
using DecodeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            std::optional<int64_t>, double);
using SpanFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                          int64_t, std::optional<int64_t>, double);
using SiluMulFn = at::Tensor(const at::Tensor&);

struct DecodeStack : torch::CustomClassHolder {
  // cos / sin: the rotary tables every layer shares; eps and scale: the model's
  DecodeStack(at::Tensor cos, at::Tensor sin, double eps, int64_t head_dim, double scale)
      : cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), head_dim_(head_dim), scale_(scale),
        norm_(find_op("deepinfer_ops::rms_norm").typed<NormFn>()),
        add_norm_(find_op("deepinfer_ops::add_rms_norm").typed<AddNormFn>()),
        rotate_store_(find_op("deepinfer_ops::rotate_store").typed<RotateStoreFn>()),
        decode_(find_op("deepinfer_attention::paged_decode").typed<DecodeFn>()),
        span_(find_op("deepinfer_attention::paged_span").typed<SpanFn>()),
        silu_mul_(find_op("deepinfer_ops::silu_mul").typed<SiluMulFn>()) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor k_cache, at::Tensor v_cache, c10::IValue qkv,
                 c10::IValue o, c10::IValue gate_up, c10::IValue down, int64_t heads, int64_t kv_heads,
                 std::optional<int64_t> window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k are normed together");
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
                       std::move(k_cache), std::move(v_cache), BoundOp::from(qkv), BoundOp::from(o),
                       BoundOp::from(gate_up), BoundOp::from(down), heads, kv_heads, window});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, hidden]: the step's embedded tokens, the decodes first (``pages`` ... ``kv_lo`` their
  // page tables, when there are any), then short spans of other sequences (a verify span, a
  // short prefill tail), span i being ``spans[5i:5i+5]`` = (first row, rows, kv_len, kv_start,
  // kv_lo) over ``span_pages[i]`` -> the last layer's output (before the final norm); writes
  // each layer's new K/V into its caches.
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor slots, int64_t num_decodes,
                 std::optional<at::Tensor> pages, std::optional<at::Tensor> kv_lens, std::optional<at::Tensor> kv_start,
                 std::optional<at::Tensor> kv_lo, std::vector<int64_t> spans, std::vector<at::Tensor> span_pages) {
    const int64_t L = num_layers(), T = x.size(0);
    TORCH_CHECK(L > 0, "a stack of no layers");
    TORCH_CHECK(spans.size() == 5 * span_pages.size(), "five numbers per span");
    TORCH_CHECK(num_decodes == 0 || (pages && kv_lens), "decodes need their page tables");
    const Step step{num_decodes, pages, kv_lens, kv_start, kv_lo, spans, span_pages};
    positions = positions.contiguous();
    slots = slots.contiguous();
    at::Tensor h = norm_.call(x.contiguous(), layers_[0].input_norm, eps_);
    for (int64_t i = 0; i < L; ++i) {
      Layer& layer = layers_[i];
      const at::Tensor heads = layer.qkv(h).view({T, -1, head_dim_});
      at::Tensor q = heads.narrow(1, 0, layer.heads), k = heads.narrow(1, layer.heads, layer.kv_heads);
      if (layer.q_norm) {
        q = head_norm(q, *layer.q_norm);
        k = head_norm(k, *layer.k_norm);
      }
      std::tie(q, k) = rotate_store_.call(q, k, heads.narrow(1, layer.heads + layer.kv_heads, layer.kv_heads), cos_,
                                          sin_, positions, layer.k_cache, layer.v_cache, slots);
      const at::Tensor attn = attention(step, q, layer.k_cache, layer.v_cache, layer.window);
      std::tie(x, h) = add_norm_.call(x, layer.o(attn.reshape({T, -1})), layer.post_norm, eps_);
      const at::Tensor mlp = layer.down(silu_mul(layer.gate_up(h)));
      if (i + 1 < L)
        std::tie(x, h) = add_norm_.call(x, mlp, layers_[i + 1].input_norm, eps_);
      else
        x = x + mlp;
    }
    return x;
  }

 private:
  struct Step {  // what attention reads of the step's batch
    int64_t num_decodes;
    const std::optional<at::Tensor>& pages;
    const std::optional<at::Tensor>& kv_lens;
    const std::optional<at::Tensor>& kv_start;
    const std::optional<at::Tensor>& kv_lo;
    const std::vector<int64_t>& spans;
    const std::vector<at::Tensor>& span_pages;
  };

  // Every row's attention as attention.paged_attention computes it: the decodes by the decode
  // kernel, each span's rows by its span variant (a decode's bits at each position).
  at::Tensor attention(const Step& step, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       std::optional<int64_t> window) const {
    const int64_t T = q.size(0), nd = step.num_decodes;
    auto decodes = [&](const at::Tensor& rows) {
      return decode_.call(rows.contiguous(), k_cache, v_cache, *step.pages, *step.kv_lens, step.kv_start, step.kv_lo,
                          window, scale_);
    };
    if (nd == T) return decodes(q);  // decodes only: no output buffer to copy them into
    at::Tensor out = at::empty({T, q.size(1), v_cache.size(-1)}, q.options());
    if (nd) out.narrow(0, 0, nd).copy_(decodes(q.narrow(0, 0, nd)));
    for (size_t s = 0; s < step.span_pages.size(); ++s) {
      const int64_t* span = step.spans.data() + 5 * s;
      out.narrow(0, span[0], span[1]).copy_(span_.call(q.narrow(0, span[0], span[1]).contiguous(), k_cache, v_cache,
                                                        step.span_pages[s], span[2], span[3], span[4], window,
                                                        scale_));
    }
    return out;
  }

  // RMSNorm of each head of x [T, heads, D], as RMSNorm.forward runs it on a 3-D input
  at::Tensor head_norm(const at::Tensor& x, const at::Tensor& w) const {
    return norm_.call(x.reshape({-1, x.size(2)}).contiguous(), w, eps_).view(x.sizes());
  }

  // silu(gate) * up as native_ops.silu_mul computes it: our op for bf16, torch's ops for float32
  // (the bits transformers' float32 reference has)
  at::Tensor silu_mul(const at::Tensor& gate_up) const {
    if (gate_up.scalar_type() == at::kBFloat16) return silu_mul_.call(gate_up);
    const auto halves = gate_up.chunk(2, -1);
    return at::silu(halves[0]) * halves[1];
  }

  at::Tensor cos_, sin_;
  double eps_;
  int64_t head_dim_;
  double scale_;
  std::vector<Layer> layers_;
  c10::TypedOperatorHandle<NormFn> norm_;
  c10::TypedOperatorHandle<AddNormFn> add_norm_;
  c10::TypedOperatorHandle<RotateStoreFn> rotate_store_;
  c10::TypedOperatorHandle<DecodeFn> decode_;
  c10::TypedOperatorHandle<SpanFn> span_;
  c10::TypedOperatorHandle<SiluMulFn> silu_mul_;
};

std::string isa() { return "cpu"; }

}  // namespace

TORCH_LIBRARY(deepinfer_stack, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<at::Tensor, at::Tensor, double, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("run", &DecodeStack::run);
  m.def("isa() -> str", &isa);
}
