// attnx: the disk cache of the run-time compiled kernels (compiler.h). Its entries are code the GPU runs,
// so the folder must be the user's own and writable by no one else: created 0700 where missing, refused
// (with the reason, and no cache) where another user owns it or group or others may write it. Each entry
// carries its key and a SHA-256 of its image, checked before use: an entry that does not match (corrupted,
// truncated, renamed) is removed and compiled again. Entries are written to a private temporary file and
// renamed into place, so processes compiling the same kernel at once never see half an entry; past a size
// bound the least recently used are removed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace attnx::rtc {

// One compiled kernel: the name NVRTC lowered its name expression to (what the driver looks up) and the
// image the driver loads: a cubin, or PTX (text) for a GPU newer than NVRTC knows, which the driver compiles.
struct KernelImage {
  std::string lowered;
  std::string image;
};

class DiskCache {
 public:
  // The cache in `dir`, kept to about `max_bytes`; refusal() says why it cannot be used.
  DiskCache(std::string dir, uint64_t max_bytes);

  const std::string& dir() const { return dir_; }
  const std::string& refusal() const { return refusal_; }
  bool usable() const { return refusal_.empty(); }

  // The entry of `key`, verified; nullopt where there is none or it does not verify (then it is removed).
  std::optional<KernelImage> load(const std::string& key) const;
  // Writes the entry of `key`; false where it could not (a full disk: the kernel still runs).
  bool store(const std::string& key, const KernelImage& kernel) const;

  struct Usage {
    int64_t entries = 0;
    int64_t bytes = 0;
  };
  Usage usage() const;

  static constexpr const char* kSuffix = ".kernel";

 private:
  std::string path(const std::string& key) const { return dir_ + "/" + key + kSuffix; }
  void evict() const;

  std::string dir_;
  uint64_t max_bytes_;
  std::string refusal_;
};

// Why `dir` may not hold kernels ("" when it may): after creating it 0700 (and its missing parents) where
// it does not exist.
std::string prepare_cache_dir(const std::string& dir);

}  // namespace attnx::rtc
