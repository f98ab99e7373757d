// attnx: the Metal library of attnx's kernels and what every MPS op needs to encode one of them on torch's
// MPS stream. Objective-C++: included by csrc/mps/*.mm only (compiled on macOS only).
#pragma once

#import <Metal/Metal.h>

#include <ATen/core/Tensor.h>

#include "mps/metal_plan.h"

namespace attnx::mps {

// The compute pipeline of the kernel instantiated under `name` (metal_plan.h builds the names). The library
// is compiled from the embedded sources at the first call in the process; pipelines are cached by name.
id<MTLComputePipelineState> pipeline(const char* name);

// Where a tensor's first element lives: its storage's MTLBuffer and the byte offset of its storage offset.
// Kernels index from there through the strides they are given, so views are read in place.
struct BufferRef {
  id<MTLBuffer> buffer;
  NSUInteger offset;
};
BufferRef buffer_ref(const at::Tensor& t);

// Checks that `pso` runs launch.threads threads per threadgroup and that the threadgroup memory it declares
// is what the plan expects. Call before dispatch_sync: nothing may throw inside the block.
void check_launch(id<MTLComputePipelineState> pso, const Launch& launch, const char* op);

// Encodes one launch of `pso` into torch's live compute encoder on its current MPS stream (coalesced with
// torch's own kernels; never created or ended here): buffers[i] bound at index i for i < num_buffers, then
// the `params_size` bytes at `params` at index num_buffers. Nothing here throws: call it after every check
// (an exception inside the stream's dispatch_sync block would end the process).
void encode(id<MTLComputePipelineState> pso, const Launch& launch, const BufferRef* buffers, int num_buffers,
            const void* params, size_t params_size);

}  // namespace attnx::mps
