// attnx: the CUDA driver, opened at run time (driver.h).
#include "rtc/driver.h"

#include <dlfcn.h>

#include <stdexcept>

namespace attnx::rtc {

namespace {

using CUresult = int;

struct Driver {
  CUresult (*Init)(unsigned);
  CUresult (*DriverGetVersion)(int*);
  CUresult (*GetErrorString)(CUresult, const char**);
  int version = 0;
};

std::string result_text(const Driver& d, CUresult result) {
  const char* text = nullptr;
  if (d.GetErrorString != nullptr && d.GetErrorString(result, &text) == 0 && text != nullptr) return text;
  return "CUresult " + std::to_string(result);
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
  d.Init = reinterpret_cast<decltype(d.Init)>(::dlsym(handle, "cuInit"));
  d.DriverGetVersion = reinterpret_cast<decltype(d.DriverGetVersion)>(::dlsym(handle, "cuDriverGetVersion"));
  d.GetErrorString = reinterpret_cast<decltype(d.GetErrorString)>(::dlsym(handle, "cuGetErrorString"));
  if (d.Init == nullptr || d.DriverGetVersion == nullptr) {
    throw std::runtime_error("attnx: libcuda.so.1 lacks cuInit or cuDriverGetVersion (not a CUDA driver)");
  }
  if (const CUresult result = d.Init(0); result != 0) {
    throw std::runtime_error("attnx: the CUDA driver does not initialise: " + result_text(d, result));
  }
  if (const CUresult result = d.DriverGetVersion(&d.version); result != 0) {
    throw std::runtime_error("attnx: cuDriverGetVersion failed: " + result_text(d, result));
  }
  return d;
}

}  // namespace

int driver_version() {
  static const Driver driver = open_driver();  // a failure is thrown again at the next call
  return driver.version;
}

}  // namespace attnx::rtc
