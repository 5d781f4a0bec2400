// The flag protocol and the copies of the shared-memory transport ([Note: shared-memory
// exchange] in overlap/transport/shm.py): ranks on one host post their bytes into their own
// segment and raise a sequence word; peers wait for the word and read the bytes in place.
//
// - post_flag: a store of a sequence word (every byte written before it is visible to a peer
//   that sees the word), then a futex wake of the word's sleepers when its segment counts any;
// - load_flag: an acquire load;
// - wait_flag: wait until a word reaches a target ([Note: shared-memory waits]), giving up with
//   a status when the peer raised its abort word, its process is gone, or the deadline passed.
//   Never hangs.
// - copy_bytes: a parallel memcpy between two contiguous byte tensors (shared segments and
//   private buffers alike), in chunks large enough to amortise a task.
// - post_copy: an all-gather's post: the shard copied into the ring and into this rank's row of
//   the output in one pass, each block written twice while it is in cache.
// The sums are kernels/reduce.py's `sum_rows` (csrc/reduce.cpp), reading the peers' rows in place.
//
// [Note: shared-memory waits]
// Ranks of one host often share few cores with each other and with other work: a waiting rank
// that spins takes the core its peer needs to post. A wait goes through three stages:
// - it spins for spin_s (a peer running on another core posts within microseconds);
// - it yields its core for yield_s: it stays runnable, so a post needs no system call, and a
//   peer (or anything else) waiting for this core runs first;
// - it sleeps on a futex on the word's low 32 bits (a sequence word changes them at every post),
//   counted in a sleepers word of the word's segment so that a post makes the wake-up system
//   call only when someone sleeps. Count and word are both sequentially consistent: either the
//   poster sees the sleeper counted, or the sleeper sees the new value before it sleeps. A sleep
//   lasts at most kCheckEvery, after which the peer's abort word, its process and the deadline
//   are checked, so a lost wake-up costs time, never a hang.
// Measured at two ranks on two loaded cores (load average 3), 4 KiB all-gathers back to back:
// sleeping at once 158 us a call (median), spinning 100 us then sleeping 50 us median but 443 us
// at p90, yielding 1 ms first 124 us median and 146 us p90.
//
// Registered into the same torch.ops.overlap_cpu namespace as quantize.cpp (a fragment).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <signal.h>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define OVERLAP_FUTEX 1
#else
#define OVERLAP_FUTEX 0
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OVERLAP_PAUSE() _mm_pause()
#else
#define OVERLAP_PAUSE() ((void)0)
#endif

namespace {

constexpr int64_t kChunkBytes = 1 << 20;  // a task of the parallel copy: 1 MiB
constexpr int64_t kBlockBytes = 1 << 16;  // post_copy writes each 64 KiB block twice while in L1/L2
constexpr auto kCheckEvery = std::chrono::milliseconds(2);  // the peer's abort word and pid

int64_t* word(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.numel() >= 1,
              "overlap shm: a flag is a CPU int64 tensor");
  return t.data_ptr<int64_t>();
}

// The futex word of a sequence word: its low 32 bits (the first four bytes on little-endian).
uint32_t* futex_word(int64_t* w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return reinterpret_cast<uint32_t*>(w) + 1;
#else
  return reinterpret_cast<uint32_t*>(w);
#endif
}

void wake(int64_t* w) {
#if OVERLAP_FUTEX
  syscall(SYS_futex, futex_word(w), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)w;
#endif
}

// Sleep while the word's low 32 bits are `seen`, at most `nap` (spurious returns are fine).
void sleep_on(int64_t* w, int64_t seen, std::chrono::nanoseconds nap) {
#if OVERLAP_FUTEX
  timespec ts{static_cast<time_t>(nap.count() / 1000000000), static_cast<long>(nap.count() % 1000000000)};
  syscall(SYS_futex, futex_word(w), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
#else
  (void)w, (void)seen;
  std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(nap, std::chrono::microseconds(50)));
#endif
}

void post_flag(const at::Tensor& flag, int64_t value, const at::Tensor& sleepers) {
  int64_t* w = word(flag);
  __atomic_store_n(w, value, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(word(sleepers), __ATOMIC_SEQ_CST) > 0) wake(w);
}

int64_t load_flag(const at::Tensor& flag) { return __atomic_load_n(word(flag), __ATOMIC_ACQUIRE); }

// Whether process `pid` runs (or sleeps, or is stopped): not gone, and not a zombie its parent
// has yet to reap (kill() still succeeds on one).
bool alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: trust kill()
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": the state follows the name
  return close == nullptr || close[1] == '\0' || (close[2] != 'Z' && close[2] != 'X');
}

// 0: the word reached `target`; 1: the deadline passed; 2: the peer raised its abort word; 3: the
// peer's process is gone. `sleepers`: the count of peers asleep on the word (or its kind).
int64_t wait_flag(const at::Tensor& flag, int64_t target, const at::Tensor& abort, int64_t pid, double timeout_s,
                  const at::Tensor& sleepers, double spin_s, double yield_s) {
  int64_t* w = word(flag);
  const int64_t* a = word(abort);
  int64_t* count = word(sleepers);
  if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target) return 0;
  const auto start = std::chrono::steady_clock::now();
  const auto spin_end = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(spin_s));
  while (std::chrono::steady_clock::now() < spin_end) {
    for (int i = 0; i < 64; ++i) {
      OVERLAP_PAUSE();
      if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target) return 0;
    }
  }
  const auto yield_end = spin_end + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                        std::chrono::duration<double>(yield_s));
  while (std::chrono::steady_clock::now() < yield_end) {
    std::this_thread::yield();
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target) return 0;
  }
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
  auto next_check = start;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_check) {
      if (__atomic_load_n(a, __ATOMIC_ACQUIRE) != 0) return 2;
      if (pid > 0 && !alive(pid)) return 3;
      if (now >= deadline) return 1;
      next_check = now + kCheckEvery;
    }
    __atomic_add_fetch(count, 1, __ATOMIC_SEQ_CST);
    const int64_t seen = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    if (seen < target) sleep_on(w, seen, std::min<std::chrono::nanoseconds>(next_check - now, kCheckEvery));
    __atomic_sub_fetch(count, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target) return 0;
    if (__atomic_load_n(a, __ATOMIC_ACQUIRE) != 0) return 2;
  }
}

void check_bytes(const at::Tensor& t, int64_t nbytes, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() * t.element_size() == nbytes,
              "overlap shm ", what, ": contiguous CPU tensors of one size in bytes");
}

void copy_bytes(const at::Tensor& dst, const at::Tensor& src) {
  const int64_t nbytes = src.numel() * src.element_size();
  check_bytes(src, nbytes, "copy_bytes");
  check_bytes(dst, nbytes, "copy_bytes");
  auto* d = static_cast<char*>(dst.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  const int64_t chunks = (nbytes + kChunkBytes - 1) / kChunkBytes;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t from = begin * kChunkBytes;
    const int64_t to = std::min(nbytes, end * kChunkBytes);
    std::memcpy(d + from, s + from, static_cast<size_t>(to - from));
  });
}

void post_copy(const at::Tensor& ring, const at::Tensor& row, const at::Tensor& src) {
  const int64_t nbytes = src.numel() * src.element_size();
  check_bytes(src, nbytes, "post_copy");
  check_bytes(ring, nbytes, "post_copy");
  check_bytes(row, nbytes, "post_copy");
  auto* r = static_cast<char*>(ring.data_ptr());
  auto* o = static_cast<char*>(row.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  const int64_t blocks = (nbytes + kBlockBytes - 1) / kBlockBytes;
  at::parallel_for(0, blocks, kChunkBytes / kBlockBytes, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t from = b * kBlockBytes;
      const auto len = static_cast<size_t>(std::min(nbytes, from + kBlockBytes) - from);
      std::memcpy(r + from, s + from, len);
      std::memcpy(o + from, s + from, len);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap_cpu, m) {
  m.def("shm_post_flag(Tensor(a!) flag, int value, Tensor sleepers) -> ()", &post_flag);
  m.def("shm_load_flag(Tensor flag) -> int", &load_flag);
  m.def("shm_wait_flag(Tensor flag, int target, Tensor abort, int pid, float timeout_s, Tensor(a!) sleepers, "
        "float spin_s, float yield_s) -> int",
        &wait_flag);
  m.def("shm_copy_bytes(Tensor(a!) dst, Tensor src) -> ()", &copy_bytes);
  m.def("shm_post_copy(Tensor(a!) ring, Tensor(a!) row, Tensor src) -> ()", &post_copy);
}
