// attnx: see common/compat.h (removed with it).
#include "common/compat.h"

// attnx's Python fake kernels hand their error's message over here before raising it
// (python/attnx/_compat.py).
extern "C" __attribute__((visibility("default"))) void attnx_note_error(const char* message) {
  attnx::compat::raised_message() = message;
}
