// L3 page files read straight into their L1 pages and checked there, many files per call, on the
// caller's thread without the GIL (torch ops run without it). Per file: open, one preadv of
// header + payload (scattered into one page of every buffer) + tag + one byte past the end (must
// stay unread), the header compared byte for byte with the one the caller expects, XXH3-128 over
// header and payload while the page is still in the CPU cache, the tag compared, mtime set (the
// LRU recency) where asked and a minute old. The first file that fails any step ends the call: the caller takes the
// leading run and sends the failed file down its precise (Python) path, which counts and
// quarantines. ``LayerReads`` reads the same files a layer group at a time. XXH3 is the xxHash
// library the Python ``xxhash`` package loads; ``bind_xxh3`` resolves its symbols once (no second
// copy of the hash in this tree).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

struct Hash128 {  // XXH128_hash_t
  uint64_t low64, high64;
};

struct Xxh3 {
  void* (*create)() = nullptr;
  int (*release)(void*) = nullptr;
  int (*reset)(void*) = nullptr;
  int (*update)(void*, const void*, size_t) = nullptr;
  Hash128 (*digest)(const void*) = nullptr;
};

Xxh3 g_xxh3;

bool bind_xxh3(const std::string& library) {
  void* h = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) return false;
  Xxh3 x;
  x.create = reinterpret_cast<void* (*)()>(dlsym(h, "XXH3_createState"));
  x.release = reinterpret_cast<int (*)(void*)>(dlsym(h, "XXH3_freeState"));
  x.reset = reinterpret_cast<int (*)(void*)>(dlsym(h, "XXH3_128bits_reset"));
  x.update = reinterpret_cast<int (*)(void*, const void*, size_t)>(dlsym(h, "XXH3_128bits_update"));
  x.digest = reinterpret_cast<Hash128 (*)(const void*)>(dlsym(h, "XXH3_128bits_digest"));
  if (!x.create || !x.release || !x.reset || !x.update || !x.digest) return false;
  g_xxh3 = x;
  return true;
}

void canonical(Hash128 h, uint8_t out[16]) {  // XXH128_canonicalFromHash: big-endian high, low
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<uint8_t>(h.high64 >> (56 - 8 * i));
    out[8 + i] = static_cast<uint8_t>(h.low64 >> (56 - 8 * i));
  }
}

struct Slices {  // where page p of each buffer lies
  std::vector<uint8_t*> base;
  std::vector<size_t> nbytes;
};

Slices buffer_slices(const std::vector<at::Tensor>& buffers) {
  Slices s;
  for (const auto& b : buffers) {
    TORCH_CHECK(b.device().is_cpu() && b.is_contiguous() && b.dim() >= 1, "CPU contiguous buffers only");
    s.base.push_back(static_cast<uint8_t*>(b.data_ptr()));
    s.nbytes.push_back(static_cast<size_t>(b.stride(0) * b.element_size()));
  }
  return s;
}

// mtime = now (the LRU recency DiskStore reads back after a restart; best effort, as its _touch),
// unless it is already less than kTouchEvery seconds old: a file read again and again (a hot
// prefix) then costs an fstat, not an inode update and its journal write per load.
constexpr time_t kTouchEvery = 60;

void touch(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || time(nullptr) - st.st_mtime >= kTouchEvery) futimens(fd, nullptr);
}

// One file into page ``page`` of the buffers; true if it read whole, and header and tag match.
bool read_one(const char* path, const uint8_t* head, size_t hlen, const Slices& s, int64_t page,
              bool touch_it, void* state, std::vector<uint8_t>& got_head, std::vector<iovec>& iov) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  got_head.resize(hlen);
  uint8_t tag[16], past[1];
  iov.clear();
  iov.push_back({got_head.data(), hlen});
  size_t want = hlen + sizeof(tag);
  for (size_t j = 0; j < s.base.size(); ++j) {
    iov.push_back({s.base[j] + page * s.nbytes[j], s.nbytes[j]});
    want += s.nbytes[j];
  }
  iov.push_back({tag, sizeof(tag)});
  iov.push_back({past, sizeof(past)});
  bool ok = preadv(fd, iov.data(), static_cast<int>(iov.size()), 0) == static_cast<ssize_t>(want) &&
            std::memcmp(got_head.data(), head, hlen) == 0;
  if (ok) {
    g_xxh3.reset(state);
    for (size_t k = 0; k + 2 < iov.size(); ++k) g_xxh3.update(state, iov[k].iov_base, iov[k].iov_len);
    uint8_t digest[16];
    canonical(g_xxh3.digest(state), digest);
    ok = std::memcmp(digest, tag, sizeof(tag)) == 0;
  }
  if (ok && touch_it) touch(fd);
  close(fd);
  return ok;
}

// Files ``paths`` (expected headers: ``heads`` bytes [offsets[i], offsets[i+1])) into page
// ``pages[i]`` of every buffer. -> how many leading files were read and checked.
int64_t read_pages(std::vector<std::string> paths, at::Tensor heads, at::Tensor offsets,
                   std::vector<at::Tensor> buffers, at::Tensor pages, bool touch) {
  TORCH_CHECK(g_xxh3.create != nullptr, "bind_xxh3 first");
  const auto n = static_cast<int64_t>(paths.size());
  TORCH_CHECK(pages.numel() == n && offsets.numel() == n + 1, "one page and header per path");
  TORCH_CHECK(static_cast<int64_t>(buffers.size()) + 3 <= IOV_MAX, "too many buffers for one preadv");
  TORCH_CHECK(heads.dtype() == at::kByte && heads.is_contiguous(), "heads: contiguous uint8");
  const auto hc = heads.contiguous();
  const auto oc = offsets.to(at::kLong).contiguous();
  const auto pc = pages.to(at::kLong).contiguous();
  const uint8_t* h = hc.data_ptr<uint8_t>();
  const int64_t* off = oc.data_ptr<int64_t>();
  const int64_t* pg = pc.data_ptr<int64_t>();
  const Slices s = buffer_slices(buffers);
  for (const auto& b : buffers) {
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(pg[i] >= 0 && pg[i] < b.size(0), "page out of range");
  }
  void* state = g_xxh3.create();
  TORCH_CHECK(state != nullptr, "XXH3_createState failed");
  std::vector<uint8_t> got_head;
  std::vector<iovec> iov;
  int64_t i = 0;
  for (; i < n; ++i) {
    if (!read_one(paths[i].c_str(), h + off[i], static_cast<size_t>(off[i + 1] - off[i]), s, pg[i],
                  touch, state, got_head, iov)) {
      break;
    }
  }
  g_xxh3.release(state);
  return i;
}

// Page files read in pieces, a layer group at a time (layer_stream.py), on the caller's thread
// without the GIL: each file opened and its header compared at construction, its tag started;
// every ``read`` lands the next bytes of each payload (one preadv per file) in their pages and
// updates the tags, in file order; ``finish`` reads and compares the tags. The first file that
// fails a step ends the run (``live``: the leading files still good): the files after it are
// not read further. From a cold disk, a blocking read per file would leave the device one request
// at a time per reader (the forward waited on it for layer 0): every file's header and first piece
// (``first`` bytes) are asked for at once (``POSIX_FADV_WILLNEED``) before the headers are read,
// and a read that reaches the end of what was asked for asks for the next kAhead pieces of its
// size of every file, layer order (the kernel's own readahead, of each file in turn, does not
// start on pages a hint brought in). Pieces may differ in size (layer_stream.py's _pieces).
constexpr int64_t kAhead = 4;  // pieces asked for per hint

struct LayerReads : torch::CustomClassHolder {
  std::vector<int> fds;
  std::vector<void*> states;
  std::vector<size_t> hlens;
  int64_t payload_len = 0, consumed = 0, live = 0;
  int64_t hinted = 0;  // payload bytes asked for so far

  LayerReads(std::vector<std::string> paths, at::Tensor heads, at::Tensor offsets, int64_t payload, int64_t first) {
    TORCH_CHECK(g_xxh3.create != nullptr, "bind_xxh3 first");
    const auto n = static_cast<int64_t>(paths.size());
    TORCH_CHECK(offsets.numel() == n + 1 && heads.dtype() == at::kByte && heads.is_contiguous(),
                "one contiguous uint8 header per path");
    const auto oc = offsets.to(at::kLong).contiguous();
    const int64_t* off = oc.data_ptr<int64_t>();
    const uint8_t* h = heads.data_ptr<uint8_t>();
    payload_len = payload;
    hinted = first;
    std::vector<int> opened;
    for (int64_t i = 0; i < n; ++i) {
      const int fd = open(paths[i].c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      posix_fadvise(fd, 0, static_cast<off_t>(off[i + 1] - off[i] + first), POSIX_FADV_WILLNEED);
      opened.push_back(fd);
    }
    std::vector<uint8_t> got;
    for (size_t i = 0; i < opened.size(); ++i) {
      const size_t hlen = static_cast<size_t>(off[i + 1] - off[i]);
      const int fd = opened[i];
      got.resize(hlen);
      void* state = fds.size() == i ? g_xxh3.create() : nullptr;  // none after a failed file
      if (state == nullptr || pread(fd, got.data(), hlen, 0) != static_cast<ssize_t>(hlen) ||
          std::memcmp(got.data(), h + off[i], hlen) != 0) {
        if (state != nullptr) g_xxh3.release(state);
        close(fd);
        continue;
      }
      g_xxh3.reset(state);
      g_xxh3.update(state, got.data(), hlen);
      fds.push_back(fd);
      states.push_back(state);
      hlens.push_back(hlen);
    }
    live = static_cast<int64_t>(fds.size());
  }
  ~LayerReads() override { release(); }

  int64_t opened() const { return live; }

  // The next payload bytes of file i (its page pages[i] of every buffer) for the live files.
  int64_t read(std::vector<at::Tensor> buffers, at::Tensor pages, int64_t offset) {
    TORCH_CHECK(offset == consumed, "pieces must be read in file order");
    TORCH_CHECK(static_cast<int64_t>(buffers.size()) <= IOV_MAX, "too many buffers for one preadv");
    const Slices s = buffer_slices(buffers);
    const auto pc = pages.to(at::kLong).contiguous();
    const int64_t* pg = pc.data_ptr<int64_t>();
    TORCH_CHECK(pc.numel() >= live, "a page per live file");
    size_t width = 0;
    for (size_t j = 0; j < s.base.size(); ++j) {
      for (int64_t i = 0; i < live; ++i) TORCH_CHECK(pg[i] >= 0 && pg[i] < buffers[j].size(0), "page out of range");
      width += s.nbytes[j];
    }
    TORCH_CHECK(consumed + static_cast<int64_t>(width) <= payload_len, "reads past the payload");
    const int64_t end = consumed + static_cast<int64_t>(width);
    std::vector<iovec> iov(s.base.size());
    for (int64_t i = 0; i < live; ++i) {
      for (size_t j = 0; j < s.base.size(); ++j) iov[j] = {s.base[j] + pg[i] * s.nbytes[j], s.nbytes[j]};
      const off_t at = static_cast<off_t>(hlens[i] + consumed);
      if (preadv(fds[i], iov.data(), static_cast<int>(iov.size()), at) != static_cast<ssize_t>(width)) {
        live = i;
        break;
      }
      for (const iovec& v : iov) g_xxh3.update(states[i], v.iov_base, v.iov_len);
    }
    consumed += static_cast<int64_t>(width);
    // Asked for after this piece's reads, not before: a hint's readahead fills the device queue,
    // and a read behind it (this piece's, which the forward waits for) would queue behind it.
    if (width > 0 && end >= hinted) {  // the next piece not asked for yet: the next kAhead of this size
      const int64_t at = std::max(hinted, end);
      const int64_t len = std::min<int64_t>(end + kAhead * static_cast<int64_t>(width), payload_len) - at;
      for (int64_t i = 0; len > 0 && i < live; ++i)
        posix_fadvise(fds[i], static_cast<off_t>(hlens[i] + at), static_cast<off_t>(len), POSIX_FADV_WILLNEED);
      hinted = at + std::max<int64_t>(len, 0);
    }
    return live;
  }

  // Tags of the live files checked (each file must end right after its tag), mtimes set where
  // ``touch``, every file closed. -> the leading files read whole and intact (0 if the payloads
  // were not all read).
  int64_t finish(bool touch_it) {
    if (consumed != payload_len) live = 0;
    for (int64_t i = 0; i < live; ++i) {
      uint8_t tag[16], past[1], digest[16];
      iovec iov[2] = {{tag, sizeof(tag)}, {past, sizeof(past)}};
      const off_t at = static_cast<off_t>(hlens[i] + payload_len);
      canonical(g_xxh3.digest(states[i]), digest);
      if (preadv(fds[i], iov, 2, at) != static_cast<ssize_t>(sizeof(tag)) ||
          std::memcmp(digest, tag, sizeof(tag)) != 0) {
        live = i;
        break;
      }
      if (touch_it) touch(fds[i]);
    }
    release();
    return live;
  }

  void release() {
    for (int fd : fds) close(fd);
    for (void* st : states) g_xxh3.release(st);
    fds.clear();
    states.clear();
  }
};

bool bind(std::string library) { return bind_xxh3(library); }

}  // namespace

TORCH_LIBRARY(deepinfer_kv_reads, m) {
  m.def("bind_xxh3(str library) -> bool", &bind);
  m.def("read_pages(str[] paths, Tensor heads, Tensor offsets, Tensor(a!)[] buffers, Tensor pages, "
        "bool touch) -> int", &read_pages);
  m.def("isa() -> str", [] { return std::string("scalar"); });
  m.class_<LayerReads>("LayerReads")
      .def(torch::init<std::vector<std::string>, at::Tensor, at::Tensor, int64_t, int64_t>())
      .def("opened", &LayerReads::opened)
      .def("read", &LayerReads::read)
      .def("finish", &LayerReads::finish);
}
