// Keeps the cores of the compute threads out of their idle state while a step runs.
//
// Under the passive OpenMP wait policy (threads.py) a worker sleeps at the end of every parallel
// region, and a step has a few hundred of them. Waking a worker whose core went idle costs far
// more than waking one on a running core (in a VM: the vCPU left its halt), and the region waits
// for it. A warmer is a thread at SCHED_IDLE priority that polls while a step runs: its core is
// never idle, and any other thread (our worker, another process) takes the core from it at once,
// since the kernel preempts a SCHED_IDLE thread for any other. Between steps warmers sleep.

#include <torch/library.h>

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

class Warmers {
 public:
  ~Warmers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      active_.store(false, std::memory_order_relaxed);
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // At least n warmers (started once; later calls only add).
  void start(int64_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int64_t>(threads_.size()) < n) threads_.emplace_back([this] { run(); });
  }

  // Steps open and close in any order (one may run while another thread prepares the next):
  // warmers poll while any is open.
  void open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++open_;
      active_.store(true, std::memory_order_relaxed);
    }
    wake_.notify_all();
  }

  void close() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (open_ > 0 && --open_ == 0) active_.store(false, std::memory_order_relaxed);
  }

 private:
  void run() {
    sched_param param{};
    sched_setscheduler(0, SCHED_IDLE, &param);  // this thread only; a failure leaves it normal
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stop_ || active_.load(std::memory_order_relaxed); });
      if (stop_) return;
      lock.unlock();
      while (active_.load(std::memory_order_relaxed)) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      }
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<bool> active_{false};
  int64_t open_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

Warmers& warmers() {
  static Warmers w;
  return w;
}

void start(int64_t n) { warmers().start(n); }
void begin() { warmers().open(); }
void end() { warmers().close(); }
std::string isa() { return "native"; }

}  // namespace

TORCH_LIBRARY(deepinfer_warm, m) {
  m.def("start(int n) -> ()", &start);
  m.def("begin() -> ()", &begin);
  m.def("end() -> ()", &end);
  m.def("isa() -> str", &isa);
}
