// attnx: the CPU run functions of attnx::attention and attnx::attention_backward (cpu/attention.cpp,
// cpu/attention_backward.cpp), for the registrations that serve PyTorch's own ops with them (csrc/pytorch/).
#pragma once

#include "common/attention.h"

namespace attnx {

// Writes pb.out and pb.lse through their strides.
void run_attention_cpu(AttentionProblem& pb);

// Writes pb.grad_query, pb.grad_key, pb.grad_value (and the mask's gradient when pb.grad_attn_mask).
void run_attention_backward_cpu(AttentionBackwardProblem& pb);

}  // namespace attnx
