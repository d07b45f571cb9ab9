// The OS threads over which the fiber executor (cuda_cpu_fibers.h) spreads a grid's CTAs: the
// launching thread and num_threads - 1 persistent helpers, one launch at a time.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cuda_shim {

class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  // Calls cta(i) for i in [0, total), on the caller and the pool's threads; rethrows the first
  // exception after every participant has stopped.
  void run(long long total, const std::function<void(long long)>& cta) {
    std::lock_guard<std::mutex> one_launch_at_a_time(launch_mutex_);
    const int helpers = std::min<long long>(num_helpers_, total - 1);
    if (helpers <= 0) {
      for (long long i = 0; i < total; ++i) cta(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &cta;
      total_ = total;
      next_.store(0);
      error_ = nullptr;
      active_ = helpers;
      wanted_ = helpers;
      ++generation_;
      while (static_cast<int>(threads_.size()) < helpers) {
        threads_.emplace_back([this, id = static_cast<int>(threads_.size())] { serve(id); });
      }
    }
    start_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [this] { return active_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  void set_num_threads(int n) {
    std::lock_guard<std::mutex> lock(launch_mutex_);
    num_helpers_ = std::max(0, n - 1);
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    start_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  Pool() : num_helpers_(std::max(1u, std::thread::hardware_concurrency()) - 1) {}

  void work() {
    for (long long i; (i = next_.fetch_add(1)) < total_;) {
      try {
        (*job_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(total_);  // hand out no more CTAs
      }
    }
  }

  void serve(int id) {
    unsigned long long seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, [&] { return stopping_ || (generation_ != seen && id < wanted_); });
        if (stopping_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_ == 0) finished_.notify_one();
    }
  }

  std::mutex launch_mutex_, mutex_;
  std::condition_variable start_, finished_;
  std::vector<std::thread> threads_;
  const std::function<void(long long)>* job_ = nullptr;
  long long total_ = 0;
  std::atomic<long long> next_{0};
  std::exception_ptr error_;
  int num_helpers_;
  int active_ = 0, wanted_ = 0;
  unsigned long long generation_ = 0;
  bool stopping_ = false;
};

}  // namespace cuda_shim
