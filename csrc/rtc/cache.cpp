// attnx: the run-time compiled kernels' disk cache (cache.h).
#include "rtc/cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include "rtc/sha256.h"

namespace attnx::rtc {

namespace {

constexpr std::string_view kMagic = "attnx-rtc-entry 1\n";

std::string errno_text() {
  return std::strerror(errno);
}

// Reads the whole file `fd` refers to.
bool read_all(int fd, std::string& out) {
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) return true;
    out.append(buffer, static_cast<size_t>(n));
  }
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// The value of the header line "<field> <value>\n" at `at` of `text`, advancing `at`; nullopt where the
// line is not that field's.
std::optional<std::string_view> field(std::string_view text, size_t& at, std::string_view name) {
  const size_t end = text.find('\n', at);
  if (end == std::string_view::npos) return std::nullopt;
  std::string_view line = text.substr(at, end - at);
  if (line.size() <= name.size() || line.substr(0, name.size()) != name || line[name.size()] != ' ') {
    return std::nullopt;
  }
  at = end + 1;
  return line.substr(name.size() + 1);
}

}  // namespace

std::string prepare_cache_dir(const std::string& dir) {
  if (dir.empty() || dir[0] != '/') return "'" + dir + "' is not an absolute path";
  // Create the missing folders from the top, each private to the user.
  for (size_t slash = dir.find('/', 1);; slash = dir.find('/', slash + 1)) {
    const std::string part = dir.substr(0, slash);
    if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) {
      return "cannot create " + part + ": " + errno_text();
    }
    if (slash == std::string::npos) break;
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return "cannot read " + dir + ": " + errno_text();
  if (!S_ISDIR(st.st_mode)) return dir + " is not a folder";
  if (st.st_uid != ::geteuid()) {
    return dir + " belongs to another user (uid " + std::to_string(st.st_uid) + "; this process runs as " +
           std::to_string(::geteuid()) + ")";
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return dir + " is writable by other users (mode " + std::to_string((st.st_mode >> 6) & 7) +
           std::to_string((st.st_mode >> 3) & 7) + std::to_string(st.st_mode & 7) + "; chmod 700 it)";
  }
  return "";
}

DiskCache::DiskCache(std::string dir, uint64_t max_bytes)
    : dir_(std::move(dir)), max_bytes_(max_bytes), refusal_(prepare_cache_dir(dir_)) {}

std::optional<KernelImage> DiskCache::load(const std::string& key) const {
  if (!usable()) return std::nullopt;
  const std::string file = path(key);
  const int fd = ::open(file.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  const bool read = read_all(fd, text);
  ::close(fd);
  const std::string_view view = text;
  size_t at = kMagic.size();
  const bool magic = read && view.substr(0, kMagic.size()) == kMagic;
  const auto stored_key = magic ? field(view, at, "key") : std::nullopt;
  const auto name = stored_key ? field(view, at, "name") : std::nullopt;
  const auto hash = name ? field(view, at, "sha256") : std::nullopt;
  if (hash && at < view.size() && view[at] == '\n' && *stored_key == key) {
    const std::string_view image = view.substr(at + 1);
    if (sha256_hex(image) == *hash) {
      ::utimensat(AT_FDCWD, file.c_str(), nullptr, 0);  // used now: evicted last
      return KernelImage{std::string(*name), std::string(image)};
    }
  }
  ::unlink(file.c_str());  // not an entry of this key as written: compiled again
  return std::nullopt;
}

bool DiskCache::store(const std::string& key, const KernelImage& kernel) const {
  if (!usable()) return false;
  static std::atomic<uint64_t> counter{0};
  const std::string temp = dir_ + "/.tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) +
                           "-" + std::to_string(std::random_device{}());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  std::string head(kMagic);
  head += "key " + key + "\nname " + kernel.lowered + "\nsha256 " + sha256_hex(kernel.image) + "\n\n";
  const bool written = write_all(fd, head) && write_all(fd, kernel.image);
  const bool closed = ::close(fd) == 0;
  if (!written || !closed || ::rename(temp.c_str(), path(key).c_str()) != 0) {
    ::unlink(temp.c_str());
    return false;
  }
  evict();
  return true;
}

namespace {

struct Entry {
  std::string name;
  int64_t bytes;
  int64_t used;  // mtime in ns: load() touches an entry it returns
};

// The entries in `dir`: its regular files named *.kernel (not the temporary files of writes under way).
std::vector<Entry> entries(const std::string& dir) {
  std::vector<Entry> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  const std::string_view suffix = DiskCache::kSuffix;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    struct stat st;
    if (name.size() > suffix.size() && name.substr(name.size() - suffix.size()) == suffix &&
        ::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
      out.push_back({std::string(name), st.st_size, st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec});
    }
  }
  ::closedir(d);
  return out;
}

}  // namespace

DiskCache::Usage DiskCache::usage() const {
  Usage usage;
  if (!usable()) return usage;
  for (const Entry& e : entries(dir_)) {
    ++usage.entries;
    usage.bytes += e.bytes;
  }
  return usage;
}

void DiskCache::evict() const {
  std::vector<Entry> all = entries(dir_);
  uint64_t total = 0;
  for (const Entry& e : all) total += static_cast<uint64_t>(e.bytes);
  if (total <= max_bytes_) return;
  std::sort(all.begin(), all.end(), [](const Entry& a, const Entry& b) { return a.used < b.used; });
  for (const Entry& e : all) {
    if (total <= max_bytes_) break;
    if (::unlink((dir_ + "/" + e.name).c_str()) == 0) total -= static_cast<uint64_t>(e.bytes);
  }
}

}  // namespace attnx::rtc
