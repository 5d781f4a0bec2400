// The flag protocol and the copies of the shared-memory transport ([Note: shared-memory
// exchange] in overlap/transport/shm.py): ranks on one host post their bytes into their own
// segment and raise a sequence word; peers wait for the word and read the bytes in place.
//
// - post_flag: a release store of a sequence word (every byte written before it is visible to a
//   peer that sees the word);
// - load_flag: an acquire load;
// - wait_flag: wait until a word reaches a target, spinning briefly, then yielding, then sleeping
//   in short naps (a busy core is given back to compute), and giving up with a status when the
//   peer raised its abort word, its process is gone, or the deadline passed. Never hangs.
// - copy_bytes: a parallel memcpy between two contiguous byte tensors (shared segments and
//   private buffers alike), in chunks large enough to amortise a task.
// The sums are kernels/reduce.py's `sum_rows` (csrc/reduce.cpp), reading the peers' rows in place.
//
// Registered into the same torch.ops.overlap_cpu namespace as quantize.cpp (a fragment).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <signal.h>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OVERLAP_PAUSE() _mm_pause()
#else
#define OVERLAP_PAUSE() ((void)0)
#endif

namespace {

constexpr int64_t kChunkBytes = 1 << 20;  // a task of the parallel copy: 1 MiB
constexpr int kSpins = 2000;              // ~ tens of microseconds of pause before yielding
constexpr int kYields = 50;               // then give the core away this many times before napping
constexpr auto kNap = std::chrono::microseconds(50);
constexpr auto kCheckEvery = std::chrono::milliseconds(2);  // the peer's abort word and pid

int64_t* word(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.numel() >= 1,
              "overlap shm: a flag is a CPU int64 tensor");
  return t.data_ptr<int64_t>();
}

void post_flag(const at::Tensor& flag, int64_t value) { __atomic_store_n(word(flag), value, __ATOMIC_RELEASE); }

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
// peer's process is gone.
int64_t wait_flag(const at::Tensor& flag, int64_t target, const at::Tensor& abort, int64_t pid, double timeout_s) {
  const int64_t* w = word(flag);
  const int64_t* a = word(abort);
  if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target) return 0;
  for (int i = 0; i < kSpins; ++i) {
    OVERLAP_PAUSE();
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target) return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
  auto next_check = start;
  for (int64_t round = 0;; ++round) {
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target) return 0;
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_check) {
      if (__atomic_load_n(a, __ATOMIC_ACQUIRE) != 0) return 2;
      if (pid > 0 && !alive(pid)) return 3;
      if (now >= deadline) return 1;
      next_check = now + kCheckEvery;
    }
    if (round < kYields) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kNap);
    }
  }
}

void copy_bytes(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() && src.is_contiguous(),
              "overlap shm copy_bytes: contiguous CPU tensors");
  const int64_t nbytes = src.numel() * src.element_size();
  TORCH_CHECK(dst.numel() * dst.element_size() == nbytes, "overlap shm copy_bytes: sizes differ");
  auto* d = static_cast<char*>(dst.data_ptr());
  const auto* s = static_cast<const char*>(src.data_ptr());
  const int64_t chunks = (nbytes + kChunkBytes - 1) / kChunkBytes;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t from = begin * kChunkBytes;
    const int64_t to = std::min(nbytes, end * kChunkBytes);
    std::memcpy(d + from, s + from, static_cast<size_t>(to - from));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap_cpu, m) {
  m.def("shm_post_flag(Tensor(a!) flag, int value) -> ()", &post_flag);
  m.def("shm_load_flag(Tensor flag) -> int", &load_flag);
  m.def("shm_wait_flag(Tensor flag, int target, Tensor abort, int pid, float timeout_s) -> int", &wait_flag);
  m.def("shm_copy_bytes(Tensor(a!) dst, Tensor src) -> ()", &copy_bytes);
}
