// Recycled host buffers for the large outputs of the CPU transports: the shared-memory
// reduce-scatter's sums from 32 MiB up (overlap/transport/shm_segments.py, `RECYCLED_BYTES`).
//
// [Note: recycled outputs]
// glibc serves a block of 32 MiB or more with mmap whatever the thresholds are set to (32 MiB is
// the largest M_MMAP_THRESHOLD it accepts on 64-bit), and unmaps it when it is freed, so a
// reduce-scatter output of that size is fresh memory at every call: every page faults and is
// zeroed by the kernel at first touch. Measured on a 2-core AMD EPYC VM: writing 32 MiB into a
// fresh tensor 8.7-9.8 ms, into one written before 1.9-2.1 ms. A pooled output is a tensor whose
// storage's deleter hands the buffer back here instead of freeing it; the next request of the
// same size takes it back, its pages mapped already, as CUDA's caching allocator keeps freed
// blocks for the next request.
//
// The pool never holds more than the most bytes that were lent at once: a buffer handed back
// stays only while idle plus lent bytes fit that high-water mark, and a new buffer first evicts
// idle ones of other sizes until they fit, so pooling never raises the process's peak. A
// buffer is freed, never reused, while any view of its tensor is alive (the deleter runs when
// the storage is freed). The pool is process-wide and never destroyed: a deleter may run at exit.
//
// Registered into the same torch.ops.overlap_cpu namespace as quantize.cpp (a fragment).
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

namespace {

constexpr int64_t kPage = 4096;  // buffers are page aligned, sizes rounded up to whole pages

struct Pool {
  std::mutex mu;
  std::multimap<int64_t, void*> idle;  // size in bytes -> buffer
  int64_t idle_bytes = 0;
  int64_t lent_bytes = 0;
  int64_t peak_lent = 0;
};

Pool& pool() {
  static Pool* p = new Pool();  // leaked on purpose: deleters may run after static destructors
  return *p;
}

// Free idle buffers, largest first, while idle plus lent bytes exceed the high-water mark. Under mu.
std::vector<void*> evict_locked(Pool& p) {
  std::vector<void*> dropped;
  while (!p.idle.empty() && p.idle_bytes + p.lent_bytes > p.peak_lent) {
    auto last = std::prev(p.idle.end());
    p.idle_bytes -= last->first;
    dropped.push_back(last->second);
    p.idle.erase(last);
  }
  return dropped;
}

void give_back(void* buffer, int64_t size) {
  Pool& p = pool();
  std::vector<void*> dropped;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.lent_bytes -= size;
    p.idle.emplace(size, buffer);
    p.idle_bytes += size;
    dropped = evict_locked(p);
  }
  for (void* b : dropped) std::free(b);
}

// An uninitialised one-dimensional tensor of `numel` elements of `dtype`, from the pool.
at::Tensor pooled_empty(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "overlap pool: a negative size");
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t size = std::max<int64_t>(kPage, (nbytes + kPage - 1) / kPage * kPage);
  Pool& p = pool();
  void* buffer = nullptr;
  std::vector<void*> dropped;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    auto hit = p.idle.find(size);
    if (hit != p.idle.end()) {
      buffer = hit->second;
      p.idle.erase(hit);
      p.idle_bytes -= size;
    }
    p.lent_bytes += size;
    p.peak_lent = std::max(p.peak_lent, p.lent_bytes);
    if (buffer == nullptr) dropped = evict_locked(p);
  }
  for (void* b : dropped) std::free(b);
  if (buffer == nullptr) buffer = std::aligned_alloc(kPage, static_cast<size_t>(size));
  if (buffer == nullptr) {
    std::lock_guard<std::mutex> lock(pool().mu);
    pool().lent_bytes -= size;
    TORCH_CHECK(false, "overlap pool: out of host memory allocating ", size, " bytes");
  }
  auto deleter = [size](void* b) { give_back(b, size); };
  return at::from_blob(buffer, {numel}, deleter, at::TensorOptions().dtype(dtype));
}

// (idle bytes, lent bytes, the most bytes lent at once)
std::vector<int64_t> pool_stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  return {p.idle_bytes, p.lent_bytes, p.peak_lent};
}

// Free every idle buffer and forget the high-water mark (down to what is lent now); the bytes freed.
int64_t pool_release() {
  Pool& p = pool();
  std::vector<void*> dropped;
  int64_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    for (auto& [size, buffer] : p.idle) dropped.push_back(buffer);
    freed = p.idle_bytes;
    p.idle.clear();
    p.idle_bytes = 0;
    p.peak_lent = p.lent_bytes;
  }
  for (void* b : dropped) std::free(b);
  return freed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap_cpu, m) {
  m.def("pool_empty(int numel, ScalarType dtype) -> Tensor", &pooled_empty);
  m.def("pool_stats() -> int[]", &pool_stats);
  m.def("pool_release() -> int", &pool_release);
}
