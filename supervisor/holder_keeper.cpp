#include "supervisor/holder_keeper.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "shared/error.h"
#include "shared/fd_passing.h"
#include "shared/log.h"
#include "shared/spawn.h"

namespace ds4::sup {

namespace {

using Clock = std::chrono::steady_clock;

/// A connection to the holder's socket, its reads and writes bounded by
/// `timeout` (0: unbounded); -1 when nobody listens there.
int connect_holder(const std::string& path, std::chrono::milliseconds timeout = {}) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return -1;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (timeout.count() > 0) {
    timeval tv{};
    tv.tv_sec = timeout.count() / 1000;
    tv.tv_usec = (timeout.count() % 1000) * 1000;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool socket_answers(const std::string& path) {
  const int fd = connect_holder(path);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

}  // namespace

std::optional<GpuMemory> ask_holder_memory(const std::string& socket, std::chrono::milliseconds timeout) {
  const int fd = connect_holder(socket, timeout);
  if (fd < 0) return std::nullopt;
  std::string line;
  const auto until = Clock::now() + timeout;
  char buf[4096];
  while (line.find('\n') == std::string::npos && line.size() < 64 * 1024 && Clock::now() < until) {
    int image = -1;
    const ssize_t n = recv_with_fd(fd, buf, sizeof buf, image);
    if (image >= 0) ::close(image);  // the weights' descriptor: not ours to keep
    if (n <= 0) break;
    line.append(buf, size_t(n));
  }
  ::close(fd);
  const size_t nl = line.find('\n');
  if (nl == std::string::npos) return std::nullopt;
  const nlohmann::json d = nlohmann::json::parse(line.substr(0, nl), nullptr, false);
  if (!d.is_object() || !d.contains("device_free") || !d["device_free"].is_number_unsigned() ||
      !d.contains("device_total") || !d["device_total"].is_number_unsigned())
    return std::nullopt;
  return GpuMemory{d["device_free"].get<uint64_t>(), d["device_total"].get<uint64_t>()};
}

bool nvidia_driver_present() {
  std::error_code ec;
  return std::filesystem::exists("/proc/driver/nvidia/version", ec) || std::filesystem::exists("/dev/nvidiactl", ec);
}

HolderKeeper::HolderKeeper(asio::io_context& io, HolderSettings settings)
    : io_(io), s_(std::move(settings)), timer_(io) {}

HolderKeeper::~HolderKeeper() { stop(); }

void HolderKeeper::spawn() {
  std::vector<std::string> args = {s_.worker_binary, "hold", "--segment", s_.segment,
                                   "--device", "cuda:" + std::to_string(s_.device), "--socket", s_.socket};
  if (!s_.segment_socket.empty()) {
    args.push_back("--segment-socket");
    args.push_back(s_.segment_socket);
  }
  if (s_.host_experts > 0) {
    args.push_back("--host-experts");
    args.push_back(std::to_string(s_.host_experts));
  }
  SpawnOptions o;
  o.argv = std::move(args);
  o.env = environment_without({"NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID"});
  o.new_process_group = true;
  o.parent_death_signal = SIGTERM;
  pid_t pid = -1;
  try {
    pid = ds4::spawn(o);
  } catch (const Error& e) {
    last_exit_ = e.what();
    return;
  }
  pid_ = pid;
  ready_ = false;
  started_at_ = Clock::now();
  settle_by_ = started_at_ + s_.ready_timeout;
  log::info("started the GPU weights holder for cuda:" + std::to_string(s_.device) + " (pid " + std::to_string(pid) +
                ", segment " + s_.segment + ", socket " + s_.socket + ")",
            {{"DS4_EVENT", "holder_start"}, {"DS4_PID", std::to_string(pid)}, {"DS4_SEGMENT", s_.segment}});
}

bool HolderKeeper::wait_ready() {
  while (Clock::now() < settle_by_) {
    if (const auto st = pid_ > 0 ? try_wait(pid_) : std::nullopt) {
      reap(*st);
      return false;
    }
    if (socket_answers(s_.socket)) {
      became_ready();
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  log::warn("GPU weights holder not ready after " + std::to_string(s_.ready_timeout.count()) +
            " ms; workers copy the weights until it is");
  return false;
}

void HolderKeeper::became_ready() {
  ready_ = true;
  backoff_ = std::chrono::seconds(1);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started_at_).count();
  log::info("GPU weights holder ready in " + std::to_string(ms) + " ms (pid " + std::to_string(pid_) +
                "): workers map its weights",
            {{"DS4_EVENT", "holder_ready"}, {"DS4_PID", std::to_string(pid_)}});
}

void HolderKeeper::settle() {
  if (auto f = std::exchange(settled_, nullptr)) f();
}

void HolderKeeper::reap(const ExitStatus& status) {
  last_exit_ = status.describe();
  pid_ = -1;
  ready_ = false;
  if (stopping_) return;
  if (status.exited() && status.code == ds4::kExitNothingToHold) {
    not_needed_ = true;
    log::info("no GPU weights holder for cuda:" + std::to_string(s_.device) +
                  ": an integrated GPU, whose workers read the weights in place",
              {{"DS4_EVENT", "holder_not_needed"}});
    return;
  }
  log::warn("GPU weights holder " + last_exit_ + "; workers that mapped its weights keep them, new ones copy until it is back",
            {{"DS4_EVENT", "holder_exit"}, {"DS4_REASON", last_exit_}});
}

void HolderKeeper::start() {
  stopping_ = false;
  not_needed_ = false;
  spawn();
  if (pid_ > 0) wait_ready();
  if (!not_needed_) watch();
}

void HolderKeeper::start_async(std::function<void()> settled) {
  stopping_ = false;
  not_needed_ = false;
  settled_ = std::move(settled);
  spawn();
  if (pid_ <= 0) {  // fork failed: nothing to wait for, retried with backoff
    asio::post(io_, [this] { settle(); });
    return restart_later();
  }
  watch();
}

void HolderKeeper::watch() {
  // Often while a start waits for it to answer, then twice a second.
  timer_.expires_after(std::chrono::milliseconds(settled_ ? 20 : 500));
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || stopping_) return;
    if (pid_ > 0) {
      if (const auto st = try_wait(pid_)) {
        reap(*st);
        settle();
      } else if (!ready_ && socket_answers(s_.socket)) {
        became_ready();
        settle();
      } else if (!ready_ && settled_ && Clock::now() >= settle_by_) {
        log::warn("GPU weights holder not ready after " + std::to_string(s_.ready_timeout.count()) +
                  " ms; workers copy the weights until it is");
        settle();
      }
    }
    if (not_needed_) return;
    // Gone (now, or already while start() waited for it): restart after a
    // backoff that grows while it keeps dying.
    if (pid_ <= 0) return restart_later();
    watch();
  });
}

void HolderKeeper::restart_later() {
  timer_.expires_after(backoff_);
  backoff_ = std::min<std::chrono::milliseconds>(backoff_ * 2, std::chrono::minutes(1));
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || stopping_) return;
    ++restarts_;
    spawn();
    watch();
  });
}

void HolderKeeper::change_segment(const std::string& segment, std::function<void()> settled) {
  change_image(segment, s_.host_experts, std::move(settled));
}

void HolderKeeper::change_image(const std::string& segment, uint32_t host_experts, std::function<void()> settled) {
  if (segment == s_.segment && host_experts == s_.host_experts) {
    asio::post(io_, std::move(settled));
    return;
  }
  stop();
  s_.segment = segment;
  s_.host_experts = host_experts;
  start_async(std::move(settled));
}

void HolderKeeper::stop() {
  stopping_ = true;
  settled_ = nullptr;  // a start that waits for it is called off
  timer_.cancel();
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  std::optional<ExitStatus> st;
  while (!(st = try_wait(pid_))) {
    if (Clock::now() > deadline) {
      ::kill(pid_, SIGKILL);
      st = wait_for(pid_);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  last_exit_ = st ? st->describe() : "gone";
  pid_ = -1;
  ready_ = false;
}

std::optional<GpuMemory> HolderKeeper::device_memory() const {
  if (!ready_ || pid_ <= 0) return std::nullopt;
  return ask_holder_memory(s_.socket, std::chrono::milliseconds(500));
}

nlohmann::json HolderKeeper::status() const {
  return {{"device", "cuda:" + std::to_string(s_.device)},
          {"pid", pid_ > 0 ? nlohmann::json(pid_) : nlohmann::json(nullptr)},
          {"state", ready_ ? "ready" : pid_ > 0 ? "starting" : not_needed_ ? "not_needed" : "stopped"},
          {"socket", s_.socket},
          {"segment", s_.segment},
          {"restarts", restarts_},
          {"last_exit", last_exit_.empty() ? nlohmann::json(nullptr) : nlohmann::json(last_exit_)}};
}

}  // namespace ds4::sup
