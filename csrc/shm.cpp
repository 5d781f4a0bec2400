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
// - What a post writes where peers read it (the ring, this rank's row of an output in the ring)
//   is written with streaming stores ([Note: streaming posts]).
// - post, post_gather: a whole post (descriptor, posted word; an all-gather's copies first), and
//   pull_gather, pull_reduce: a whole pull (every peer's post waited for, its descriptor checked,
//   its bytes copied or summed in place, the consumed words raised), each one call from Python:
//   a call through torch.ops and the Python around it cost more than a 1 MiB copy in cache.
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
// [Note: streaming posts]
// A post rewrites bytes its peers read at the previous post through the same place (the ring
// starts over at its first free offset, an output reuses the slot a peer has just consumed), so
// each of their lines sits in the peer core's caches. An ordinary store must first take every
// such line from the peer (invalidate its copy, one round trip a line): measured on a 2-core
// AMD EPYC VM, writing 512 KiB that the other core had just read took 230 us against 16 us
// where it had not, 14 times memcpy, with 4 MiB read in between on that core 240 us, 64 MiB 87 us;
// it was most of a 1 MiB all-gather's own work (280 us a call, the post 220 of it). Streaming
// (non-temporal) stores write whole lines without reading them: 23 us either way. Their bytes
// leave the writer's cache (a peer reads them from memory: 42 against 32 us for 512 KiB) and they
// are weakly ordered: a fence orders them before the posted word's store. How much the ordinary
// store pays depends on where the host places the two cores and changes over time: 1 MiB
// all-gathers back to back went from 260 to 66 us a call where it paid 230 us for 512 KiB, and
// from 68 to 91 us where it paid 50 us (the peer's read from memory then costs more than the
// post saves).
//
// Registered into the same torch.ops.overlap_cpu namespace as quantize.cpp (a fragment).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>
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
#include <vector>

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

void post_word(int64_t* w, int64_t value, const int64_t* sleepers) {
  __atomic_store_n(w, value, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST) > 0) wake(w);
}

void post_flag(const at::Tensor& flag, int64_t value, const at::Tensor& sleepers) {
  post_word(word(flag), value, word(sleepers));
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
// peer's process is gone. `count`: the peers asleep on the word (or its kind).
int64_t wait_word(int64_t* w, int64_t target, const int64_t* a, int64_t pid, double timeout_s, int64_t* count,
                  double spin_s, double yield_s) {
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

int64_t wait_flag(const at::Tensor& flag, int64_t target, const at::Tensor& abort, int64_t pid, double timeout_s,
                  const at::Tensor& sleepers, double spin_s, double yield_s) {
  return wait_word(word(flag), target, word(abort), pid, timeout_s, word(sleepers), spin_s, yield_s);
}

void check_bytes(const at::Tensor& t, int64_t nbytes, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() * t.element_size() == nbytes,
              "overlap shm ", what, ": contiguous CPU tensors of one size in bytes");
}

// A parallel memcpy of `nbytes` from `s` to `d`.
void copy_raw(char* d, const char* s, int64_t nbytes) {
  const int64_t chunks = (nbytes + kChunkBytes - 1) / kChunkBytes;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t from = begin * kChunkBytes;
    const int64_t to = std::min(nbytes, end * kChunkBytes);
    std::memcpy(d + from, s + from, static_cast<size_t>(to - from));
  });
}

// `n` bytes from `s` to `d` in streaming stores where the platform has them ([Note: streaming
// posts]); the caller fences (`stream_fence`) before anything that publishes them.
void stream_raw(char* d, const char* s, size_t n) {
#if defined(__x86_64__)
  const size_t head = std::min(n, static_cast<size_t>(-reinterpret_cast<uintptr_t>(d) & 15));
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
#else
  std::memcpy(d, s, n);
#endif
}

// Streaming stores (of every thread of the copy) ordered before the stores that follow.
void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// A parallel `stream_raw`: what a post writes where peers read it.
void post_raw(char* d, const char* s, int64_t nbytes) {
  const int64_t chunks = (nbytes + kChunkBytes - 1) / kChunkBytes;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t from = begin * kChunkBytes;
    stream_raw(d + from, s + from, static_cast<size_t>(std::min(nbytes, end * kChunkBytes) - from));
    stream_fence();
  });
  stream_fence();
}

// `s` copied into both `r` (streamed: peers read it) and `o`, each block read once while it is in cache.
void copy_twice_raw(char* r, char* o, const char* s, int64_t nbytes) {
  const int64_t blocks = (nbytes + kBlockBytes - 1) / kBlockBytes;
  at::parallel_for(0, blocks, kChunkBytes / kBlockBytes, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t from = b * kBlockBytes;
      const auto len = static_cast<size_t>(std::min(nbytes, from + kBlockBytes) - from);
      std::memcpy(o + from, s + from, len);
      stream_raw(r + from, s + from, len);
    }
    stream_fence();
  });
  stream_fence();
}

void copy_bytes(const at::Tensor& dst, const at::Tensor& src) {
  const int64_t nbytes = src.numel() * src.element_size();
  check_bytes(src, nbytes, "copy_bytes");
  check_bytes(dst, nbytes, "copy_bytes");
  copy_raw(static_cast<char*>(dst.data_ptr()), static_cast<const char*>(src.data_ptr()), nbytes);
}

void post_copy(const at::Tensor& ring, const at::Tensor& row, const at::Tensor& src) {
  const int64_t nbytes = src.numel() * src.element_size();
  check_bytes(src, nbytes, "post_copy");
  check_bytes(ring, nbytes, "post_copy");
  check_bytes(row, nbytes, "post_copy");
  copy_twice_raw(static_cast<char*>(ring.data_ptr()), static_cast<char*>(row.data_ptr()),
                 static_cast<const char*>(src.data_ptr()), nbytes);
}

// ---------------------------------------------------------------- whole posts and pulls
// A segment is one uint8 tensor over its mapping: the header's int64 words, then the ring. The
// word offsets are shm.py's (_POSTED, _ABORT, ...; `shm_header_layout` lets it check them).
constexpr int64_t kPosted = 0, kAbort = 8, kConsumed = 16, kDesc = 128;
constexpr int64_t kSleepersPosted = 1, kSleepersOther = 2;
constexpr int64_t kNumDescriptors = 256, kHeaderBytes = 8192;

struct Segment {
  int64_t* words;
  char* ring;
  int64_t ring_bytes;
};

Segment segment(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() > kHeaderBytes,
              "overlap shm: a segment is a contiguous CPU uint8 tensor past its header");
  auto* base = static_cast<char*>(t.data_ptr());
  return {reinterpret_cast<int64_t*>(base), base + kHeaderBytes, t.numel() - kHeaderBytes};
}

char* bytes_of(const at::Tensor& t, int64_t nbytes, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() * t.element_size() >= nbytes, "overlap shm ",
              what, ": a contiguous CPU tensor of at least ", nbytes, " bytes");
  return static_cast<char*>(t.data_ptr());
}

// The descriptor of collective `seq` (number, ring offset, bytes), then the posted word raised.
void publish(const Segment& mine, int64_t seq, int64_t start, int64_t nbytes) {
  TORCH_CHECK(0 <= start && start + nbytes <= mine.ring_bytes, "overlap shm: a post past the ring's end");
  int64_t* d = mine.words + kDesc + 3 * (seq % kNumDescriptors);
  d[0] = seq, d[1] = start, d[2] = nbytes;  // visible before the posted word (its store is seq_cst)
  post_word(mine.words + kPosted, seq, mine.words + kSleepersPosted);
}

void post(const at::Tensor& seg, int64_t seq, int64_t start, int64_t nbytes) {
  publish(segment(seg), seq, start, nbytes);
}

// An all-gather's post: `src` into the ring at `start` and into row `rank` of `out`, then published.
void post_gather(const at::Tensor& seg, int64_t seq, int64_t start, const at::Tensor& out, int64_t rank,
                 const at::Tensor& src) {
  const Segment mine = segment(seg);
  const int64_t nbytes = src.numel() * src.element_size();
  check_bytes(src, nbytes, "post_gather");
  char* row = bytes_of(out, (rank + 1) * nbytes, "post_gather") + rank * nbytes;
  TORCH_CHECK(0 <= start && start + nbytes <= mine.ring_bytes, "overlap shm: a post past the ring's end");
  const auto* from = static_cast<const char*>(src.data_ptr());
  if (row == mine.ring + start) {  // the output lives in the ring (`output`): its row is the post
    post_raw(row, from, nbytes);
  } else {
    copy_twice_raw(mine.ring + start, row, from, nbytes);
  }
  publish(mine, seq, start, nbytes);
}

// How a pull ended: {0} done; {1|2|3, peer} wait_word's status waiting for `peer`; {4, peer, seq,
// nbytes} the peer's descriptor is another collective's. The last element: nanoseconds in waits.
using Outcome = std::vector<int64_t>;

struct Pull {
  std::vector<Segment> segs;
  int64_t rank, seq, nbytes;
  at::IntArrayRef pids;
  double timeout_s, spin_s, yield_s;
  int64_t waited_ns = 0;

  // Wait for `peer`'s post of `seq` and check its descriptor; its bytes, or nullptr with `why` set.
  const char* region(int64_t peer, Outcome& why) {
    const Segment& s = segs[peer];
    if (peer != rank) {
      const auto t0 = std::chrono::steady_clock::now();
      const int64_t status = wait_word(s.words + kPosted, seq, s.words + kAbort, pids[peer], timeout_s,
                                       s.words + kSleepersPosted, spin_s, yield_s);
      waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      if (status != 0) {
        why = {status, peer, 0, 0};
        return nullptr;
      }
    }
    const int64_t* d = s.words + kDesc + 3 * (seq % kNumDescriptors);
    const int64_t seen = __atomic_load_n(d, __ATOMIC_ACQUIRE), start = d[1], size = d[2];
    if (seen != seq || size != nbytes || start < 0 || start + size > s.ring_bytes) {
      why = {4, peer, seen, size};
      return nullptr;
    }
    return s.ring + start;
  }

  // Every peer's post consumed: raised in this rank's header.
  Outcome consumed() {
    const Segment& mine = segs[rank];
    for (int64_t p = 0; p < static_cast<int64_t>(segs.size()); ++p)
      if (p != rank) post_word(mine.words + kConsumed + p, seq, mine.words + kSleepersOther);
    return {0, waited_ns};
  }

  Outcome failed(Outcome why) {
    why.push_back(waited_ns);
    return why;
  }
};

Pull make_pull(at::TensorList segs, int64_t rank, int64_t seq, int64_t nbytes, at::IntArrayRef pids,
               double timeout_s, double spin_s, double yield_s) {
  TORCH_CHECK(0 <= rank && rank < static_cast<int64_t>(segs.size()) && pids.size() == segs.size(),
              "overlap shm: one segment and one pid per rank");
  Pull pull{{}, rank, seq, nbytes, pids, timeout_s, spin_s, yield_s};
  for (const auto& t : segs) pull.segs.push_back(segment(t));
  return pull;
}

// An all-gather's wait: every peer's shard copied from its ring into its row of `out`, peer by
// peer as each posts (this rank's row was written at the post).
Outcome pull_gather(at::TensorList segs, int64_t rank, int64_t seq, const at::Tensor& out, at::IntArrayRef pids,
                    double timeout_s, double spin_s, double yield_s) {
  const auto world = static_cast<int64_t>(segs.size());
  const int64_t nbytes = out.numel() * out.element_size() / std::max<int64_t>(world, 1);
  char* rows = bytes_of(out, world * nbytes, "pull_gather");
  Pull pull = make_pull(segs, rank, seq, nbytes, pids, timeout_s, spin_s, yield_s);
  Outcome why;
  for (int64_t p = 0; p < world; ++p) {
    if (p == rank) continue;
    const char* region = pull.region(p, why);
    if (region == nullptr) return pull.failed(why);
    copy_raw(rows + p * nbytes, region, nbytes);
  }
  return pull.consumed();
}

// A reduce-scatter's wait: row `rank` of every rank's post of `nbytes` (own included), summed in
// rank order into `out` with its first `divide_numel` elements divided by `divisor` (the
// overlap_cpu::sum_rows kernel, csrc/reduce.cpp: bitwise gloo's sum).
Outcome pull_reduce(at::TensorList segs, int64_t rank, int64_t seq, int64_t nbytes, const at::Tensor& out,
                    at::IntArrayRef pids, double timeout_s, double spin_s, double yield_s, int64_t divide_numel,
                    double divisor) {
  const auto world = static_cast<int64_t>(segs.size());
  const int64_t row_bytes = out.numel() * out.element_size();
  TORCH_CHECK(out.is_contiguous() && world * row_bytes == nbytes, "overlap shm pull_reduce: out is one row of the post");
  Pull pull = make_pull(segs, rank, seq, nbytes, pids, timeout_s, spin_s, yield_s);
  std::vector<at::Tensor> rows;
  Outcome why;
  for (int64_t p = 0; p < world; ++p) {
    const char* region = pull.region(p, why);
    if (region == nullptr) return pull.failed(why);
    rows.push_back(at::from_blob(const_cast<char*>(region) + rank * row_bytes, {out.numel()}, out.options()));
  }
  static const auto sum_rows = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("overlap_cpu::sum_rows", "")
                                   .typed<void(at::TensorList, const at::Tensor&, int64_t, double)>();
  sum_rows.call(rows, out, divide_numel, divisor);
  return pull.consumed();
}

// `numel` elements of `dtype` at `start` of this rank's ring: an all-gather's output that peers
// read their rows of in place. `live[slot]` is 1 until the tensor's storage is freed, so the ring
// reuses the bytes only once the caller dropped every view of them; the deleter holds the
// segment (its mapping) and `live` until then.
at::Tensor output(const at::Tensor& seg, int64_t start, int64_t numel, at::ScalarType dtype, const at::Tensor& live,
                  int64_t slot) {
  const Segment mine = segment(seg);
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(0 <= start && start + nbytes <= mine.ring_bytes, "overlap shm: an output past the ring's end");
  TORCH_CHECK(0 <= slot && slot < live.numel(), "overlap shm: no such output slot");
  int64_t* flag = word(live) + slot;
  __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  auto deleter = [seg, live, flag](void*) { __atomic_store_n(flag, 0, __ATOMIC_RELEASE); };
  return at::from_blob(mine.ring + start, {numel}, deleter, at::TensorOptions().dtype(dtype));
}

std::vector<int64_t> header_layout() {
  return {kPosted, kAbort, kConsumed, kDesc, kSleepersPosted, kSleepersOther, kNumDescriptors, kHeaderBytes};
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
  m.def("shm_post(Tensor(a!) segment, int seq, int start, int nbytes) -> ()", &post);
  m.def("shm_post_gather(Tensor(a!) segment, int seq, int start, Tensor(a!) out, int rank, Tensor src) -> ()",
        &post_gather);
  m.def("shm_pull_gather(Tensor(a!)[] segments, int rank, int seq, Tensor(a!) out, int[] pids, float timeout_s, "
        "float spin_s, float yield_s) -> int[]",
        &pull_gather);
  m.def("shm_pull_reduce(Tensor(a!)[] segments, int rank, int seq, int nbytes, Tensor(a!) out, int[] pids, "
        "float timeout_s, float spin_s, float yield_s, int divide_numel, float divisor) -> int[]",
        &pull_reduce);
  m.def("shm_output(Tensor segment, int start, int numel, ScalarType dtype, Tensor(a!) live, int slot) -> Tensor",
        &output);
  m.def("shm_header_layout() -> int[]", &header_layout);
}
