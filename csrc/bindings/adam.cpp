// FusedAdam bindings: adam_grad_norm and adam_step (kernels in csrc/kernels/adam.cu). Both work on the
// flat buffers of a ParameterWorkspace and never wait for the device.
#include "common.h"
#include "adam.h"

namespace lsmini {
namespace {

void check_flat(const at::Tensor& t, const char* op, const char* name) {
  check_cuda(t, op, name);
  LSMINI_CHECK(t.dim() == 1, op, ": ", name, " must be a flat 1-D buffer, got ", t.dim(), " dims");
  LSMINI_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

const float* opt_scale(const std::optional<at::Tensor>& scale, const at::Tensor& ref, const char* op) {
  if (!scale.has_value()) return nullptr;
  const at::Tensor& s = *scale;
  check_cuda(s, op, "scale");
  check_same_device(s, ref, op, "scale", "the buffers");
  check_dtype(s, at::kFloat, op, "scale");
  LSMINI_CHECK(s.numel() == 1, op, ": scale must hold one element, got ", s.numel());
  return s.data_ptr<float>();
}

void check_ctrl(const at::Tensor& ctrl, const at::Tensor& ref, const char* op) {
  check_cuda(ctrl, op, "ctrl");
  check_same_device(ctrl, ref, op, "ctrl", "the buffers");
  check_dtype(ctrl, at::kFloat, op, "ctrl");
  LSMINI_CHECK(ctrl.is_contiguous() && ctrl.numel() >= kAdamCtrlSize, op,
               ": ctrl must be a contiguous float32 tensor of ", kAdamCtrlSize, " elements, got ", ctrl.numel(),
               ctrl.is_contiguous() ? "" : " (not contiguous)");
}

// Writes ctrl = {skip, grad multiplier, norm, clip coefficient} from the first lengths[i] elements of each
// gradient buffer grads[i] (all on one device, any of float32/float16/bfloat16).
void adam_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<int64_t>& lengths, double inv_scale,
                    const std::optional<at::Tensor>& scale, double max_norm, bool check_overflow, at::Tensor ctrl) {
  const char* op = "adam_grad_norm";
  LSMINI_CHECK(!grads.empty(), op, ": grads must hold at least one buffer");
  LSMINI_CHECK(grads.size() == lengths.size(), op, ": grads and lengths must have the same length, got ", grads.size(),
              " and ", lengths.size());
  check_ctrl(ctrl, grads[0], op);
  for (size_t i = 0; i < grads.size(); ++i) {
    check_flat(grads[i], op, "grads[i]");
    check_same_device(grads[i], ctrl, op, "grads[i]", "ctrl");
    check_float_dtype(grads[i], op, "grads[i]");
    LSMINI_CHECK(lengths[i] >= 0 && lengths[i] <= grads[i].numel(), op, ": lengths[", i, "] must be in [0, ",
                grads[i].numel(), "], got ", lengths[i]);
  }
  const float* scale_ptr = opt_scale(scale, ctrl, op);
  LSMINI_CHECK(inv_scale > 0 && std::isfinite(inv_scale), op, ": inv_scale must be finite and > 0, got ", inv_scale);
  c10::cuda::CUDAGuard guard(ctrl.device());
  const cudaStream_t stream = current_stream();

  int64_t total = 0;
  std::vector<int> blocks(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    blocks[i] = adam_grad_sumsq_num_blocks(lengths[i]);
    total += blocks[i];
  }
  at::Tensor partials = at::empty({2 * (total > 0 ? total : 1)}, ctrl.options());
  float2* part = reinterpret_cast<float2*>(partials.data_ptr<float>());
  int64_t off = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    dispatch_float(grads[i].scalar_type(), op, [&](auto tag) {
      using scalar_t = decltype(tag);
      check_launch(launch_adam_grad_sumsq(kptr<scalar_t>(grads[i]), lengths[i], static_cast<float>(inv_scale),
                                          scale_ptr, part + off, stream),
                   op);
    });
    off += blocks[i];
  }
  check_launch(launch_adam_grad_norm_finalize(part, static_cast<int>(total), static_cast<float>(inv_scale), scale_ptr,
                                              static_cast<float>(max_norm), check_overflow ? 1 : 0,
                                              ctrl.data_ptr<float>(), stream),
               op);
}

// One Adam(W) step over the segments of one flat buffer. steps: int32 [2, >= groups]; row `parity` holds
// the counts before this step; when update_steps, row 1 - parity receives the counts after it. lr_device
// (float64 [>= groups], optional): learning rates read on the device instead of `lr` (a graph replay).
void adam_step(at::Tensor param, const at::Tensor& grad, const std::optional<at::Tensor>& master, at::Tensor exp_avg,
               at::Tensor exp_avg_sq, const std::vector<int64_t>& seg_begin, const std::vector<int64_t>& seg_end,
               const std::vector<int64_t>& seg_group, const std::vector<double>& lr, const std::vector<double>& beta1,
               const std::vector<double>& beta2, const std::vector<double>& eps,
               const std::vector<double>& weight_decay, bool adam_w_mode, at::Tensor steps, int64_t parity,
               bool update_steps, const std::optional<at::Tensor>& lr_device, double inv_scale,
               const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& ctrl) {
  const char* op = "adam_step";
  check_flat(param, op, "param");
  check_float_dtype(param, op, "param");
  const int64_t n = param.numel();
  check_flat(grad, op, "grad");
  check_same_device(grad, param, op, "grad", "param");
  check_dtype(grad, param.scalar_type(), op, "grad");
  check_shape(grad, {n}, op, "grad");
  for (const auto* t : {&exp_avg, &exp_avg_sq}) {
    const char* name = t == &exp_avg ? "exp_avg" : "exp_avg_sq";
    check_flat(*t, op, name);
    check_same_device(*t, param, op, name, "param");
    check_dtype(*t, at::kFloat, op, name);
    check_shape(*t, {n}, op, name);
  }
  const bool lowp = param.scalar_type() != at::kFloat;
  LSMINI_CHECK(master.has_value() == lowp, op, ": master must be ",
              lowp ? "an fp32 buffer for " : "None for ", param.scalar_type(), " parameters",
              lowp ? " (the weights the update works on)" : " (they are updated in place)");
  if (master) {
    check_flat(*master, op, "master");
    check_same_device(*master, param, op, "master", "param");
    check_dtype(*master, at::kFloat, op, "master");
    check_shape(*master, {n}, op, "master");
  }

  const size_t groups = lr.size();
  LSMINI_CHECK(groups >= 1 && groups <= size_t(kAdamMaxGroups), op, ": the number of param groups must be in [1, ",
              kAdamMaxGroups, "], got ", groups);
  LSMINI_CHECK(beta1.size() == groups && beta2.size() == groups && eps.size() == groups &&
                  weight_decay.size() == groups,
              op, ": lr, beta1, beta2, eps and weight_decay must have one entry per group (", groups, "), got ",
              beta1.size(), ", ", beta2.size(), ", ", eps.size(), ", ", weight_decay.size());
  const size_t segs = seg_begin.size();
  LSMINI_CHECK(seg_end.size() == segs && seg_group.size() == segs, op,
              ": seg_begin, seg_end and seg_group must have the same length, got ", segs, ", ", seg_end.size(), ", ",
              seg_group.size());
  LSMINI_CHECK(segs <= size_t(kAdamMaxGroups), op, ": at most ", kAdamMaxGroups, " segments per buffer, got ", segs);

  AdamStepArgs args{};
  args.num_groups = static_cast<int32_t>(groups);
  args.num_segments = static_cast<int32_t>(segs);
  args.adam_w_mode = adam_w_mode ? 1 : 0;
  for (size_t g = 0; g < groups; ++g) {
    LSMINI_CHECK(lr[g] >= 0, op, ": lr of group ", g, " must be >= 0, got ", lr[g]);
    LSMINI_CHECK(beta1[g] >= 0 && beta1[g] < 1, op, ": beta1 of group ", g, " must be in [0, 1), got ", beta1[g]);
    LSMINI_CHECK(beta2[g] >= 0 && beta2[g] < 1, op, ": beta2 of group ", g, " must be in [0, 1), got ", beta2[g]);
    LSMINI_CHECK(eps[g] >= 0, op, ": eps of group ", g, " must be >= 0, got ", eps[g]);
    LSMINI_CHECK(weight_decay[g] >= 0, op, ": weight_decay of group ", g, " must be >= 0, got ", weight_decay[g]);
    args.group[g] = AdamGroupHyper{lr[g], beta1[g], beta2[g], eps[g], weight_decay[g]};
  }
  for (size_t s = 0; s < segs; ++s) {
    LSMINI_CHECK(seg_begin[s] >= 0 && seg_begin[s] <= seg_end[s] && seg_end[s] <= n, op, ": segment ", s, " [",
                seg_begin[s], ", ", seg_end[s], ") must lie within [0, ", n, ")");
    LSMINI_CHECK(seg_group[s] >= 0 && seg_group[s] < int64_t(groups), op, ": segment ", s, " names group ",
                seg_group[s], ", but there are ", groups, " groups");
    args.segment[s] = AdamSegment{seg_begin[s], seg_end[s], static_cast<int32_t>(seg_group[s])};
  }

  check_cuda(steps, op, "steps");
  check_same_device(steps, param, op, "steps", "param");
  check_dtype(steps, at::kInt, op, "steps");
  LSMINI_CHECK(steps.dim() == 2 && steps.size(0) == 2 && steps.size(1) >= int64_t(groups) && steps.is_contiguous(), op,
              ": steps must be a contiguous int32 tensor [2, >= ", groups, "], got shape ", steps.sizes());
  LSMINI_CHECK(parity == 0 || parity == 1, op, ": parity must be 0 or 1, got ", parity);
  int32_t* step_rows = steps.data_ptr<int32_t>();
  const int32_t* step_in = step_rows + parity * steps.size(1);
  int32_t* step_out = update_steps ? step_rows + (1 - parity) * steps.size(1) : nullptr;

  const double* lr_ptr = nullptr;
  if (lr_device) {
    check_cuda(*lr_device, op, "lr_device");
    check_same_device(*lr_device, param, op, "lr_device", "param");
    check_dtype(*lr_device, at::kDouble, op, "lr_device");
    LSMINI_CHECK(lr_device->dim() == 1 && lr_device->size(0) >= int64_t(groups) && lr_device->is_contiguous(), op,
                ": lr_device must be a contiguous float64 tensor [>= ", groups, "], got shape ", lr_device->sizes());
    lr_ptr = lr_device->data_ptr<double>();
  }
  const float* scale_ptr = opt_scale(scale, param, op);
  LSMINI_CHECK(inv_scale > 0 && std::isfinite(inv_scale), op, ": inv_scale must be finite and > 0, got ", inv_scale);
  const float* ctrl_ptr = nullptr;
  if (ctrl) {
    check_ctrl(*ctrl, param, op);
    ctrl_ptr = ctrl->data_ptr<float>();
  }

  c10::cuda::CUDAGuard guard(param.device());
  float* master_ptr = master ? master->data_ptr<float>() : nullptr;
  dispatch_float(param.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    check_launch(launch_adam_step(kptr<scalar_t>(param), kptr<scalar_t>(grad), master_ptr, exp_avg.data_ptr<float>(),
                                  exp_avg_sq.data_ptr<float>(), args, step_in, step_out, lr_ptr,
                                  static_cast<float>(inv_scale), scale_ptr, ctrl_ptr, current_stream()),
                 op);
  });
}

void register_adam(pybind11::module_& m) {
  m.def("adam_grad_norm", &adam_grad_norm,
        "Norm / overflow pass of FusedAdam: writes ctrl = (skip, grad multiplier, norm, clip coefficient)",
        pybind11::arg("grads"), pybind11::arg("lengths"), pybind11::arg("inv_scale"), pybind11::arg("scale"),
        pybind11::arg("max_norm"), pybind11::arg("check_overflow"), pybind11::arg("ctrl"));
  m.def("adam_step", &adam_step, "One fused Adam(W) step over the segments of one flat buffer", pybind11::arg("param"),
        pybind11::arg("grad"), pybind11::arg("master"), pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"),
        pybind11::arg("seg_begin"), pybind11::arg("seg_end"), pybind11::arg("seg_group"), pybind11::arg("lr"),
        pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"),
        pybind11::arg("adam_w_mode"), pybind11::arg("steps"), pybind11::arg("parity"), pybind11::arg("update_steps"),
        pybind11::arg("lr_device"), pybind11::arg("inv_scale"), pybind11::arg("scale"), pybind11::arg("ctrl"));
  m.def("adam_bulk_available", &adam_bulk_available,
        "True when adam_step on the current device can stream through the bulk copy engine (compute capability "
        ">= 9.0)");
  m.def("set_adam_bulk", &set_adam_bulk,
        "Process-wide: whether vectorised adam_step launches use the bulk-copy kernel where available (default "
        "True); returns the previous setting",
        pybind11::arg("enabled"));
}

}  // namespace

LSMINI_REGISTER_OPS(register_adam);

}  // namespace lsmini
