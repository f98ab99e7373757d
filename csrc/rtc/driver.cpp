// attnx: the CUDA driver, opened at run time (driver.h).
#include "rtc/driver.h"

#include <dlfcn.h>

#include <stdexcept>

namespace attnx::rtc {

std::string Driver::error(const char* what, Result result) const {
  const char* text = nullptr;
  if (GetErrorString != nullptr && GetErrorString(result, &text) == 0 && text != nullptr) {
    return std::string("attnx: ") + what + ": " + text;
  }
  return std::string("attnx: ") + what + ": CUresult " + std::to_string(result);
}

void Driver::check(Result result, const char* what) const {
  if (result != 0) throw std::runtime_error(error(what, result));
}

namespace {

template <typename F>
void bind(void* handle, F& fn, const char* name) {
  fn = reinterpret_cast<F>(::dlsym(handle, name));
  if (fn == nullptr) {
    throw std::runtime_error(std::string("attnx: libcuda.so.1 has no ") + name + " (not a CUDA driver)");
  }
}

Driver open_driver() {
  void* handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // kept open for the process
  if (handle == nullptr) {
    const char* why = ::dlerror();
    throw std::runtime_error(std::string("attnx: no CUDA driver: libcuda.so.1 cannot be opened (") +
                             (why ? why : "unknown error") +
                             "); the run-time compiled CUDA kernels need an NVIDIA driver");
  }
  Driver d{};
  bind(handle, d.Init, "cuInit");
  bind(handle, d.DriverGetVersion, "cuDriverGetVersion");
  bind(handle, d.GetErrorString, "cuGetErrorString");
  bind(handle, d.DeviceGet, "cuDeviceGet");
  bind(handle, d.DeviceGetAttribute, "cuDeviceGetAttribute");
  bind(handle, d.CtxGetCurrent, "cuCtxGetCurrent");
  bind(handle, d.CtxGetDevice, "cuCtxGetDevice");
  bind(handle, d.ModuleLoadData, "cuModuleLoadData");
  bind(handle, d.ModuleGetFunction, "cuModuleGetFunction");
  bind(handle, d.FuncSetAttribute, "cuFuncSetAttribute");
  bind(handle, d.LaunchKernel, "cuLaunchKernel");
  d.check(d.Init(0), "the CUDA driver does not initialise (cuInit)");
  d.check(d.DriverGetVersion(&d.version), "cuDriverGetVersion");
  return d;
}

}  // namespace

const Driver& driver() {
  static const Driver opened = open_driver();  // a failure is thrown again at the next call
  return opened;
}

}  // namespace attnx::rtc
