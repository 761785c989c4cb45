#include "supervisor/keeper.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <string_view>

#include "shared/child_signals.h"
#include "shared/config.h"
#include "shared/error.h"
#include "shared/log.h"
#include "supervisor/paths.h"

namespace ds4::sup {

namespace {

// As the shipped unit: 4 segments and 2 for each of 512 connections.
constexpr size_t kStoreMax = 1028;
constexpr auto kRestartDelay = std::chrono::milliseconds(100);
constexpr int kBurst = 5;                      // restarts …
constexpr auto kBurstWindow = std::chrono::seconds(10);  // … within this, then give up

struct Stored {
  std::string name;
  int fd = -1;
};

// The public port, bound as ds4-supervisor.socket would; -1 when it cannot
// be (the supervisor then binds it itself and says why it cannot).
int bind_listener(const ListenAddress& a) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family = AF_INET;
  if (auto* v4 = reinterpret_cast<sockaddr_in*>(&ss); ::inet_pton(AF_INET, a.host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(a.port);
    len = sizeof(sockaddr_in);
  } else if (auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss); ::inet_pton(AF_INET6, a.host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = family = AF_INET6;
    v6->sin6_port = htons(a.port);
    len = sizeof(sockaddr_in6);
  } else {
    return -1;
  }
  // A supervisor killed with its keeper a moment ago may still hold the port
  // while it dies: wait for that, briefly.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) == 0 && ::listen(fd, 4096) == 0) return fd;
    const int err = errno;
    ::close(fd);
    if (err != EADDRINUSE || std::chrono::steady_clock::now() >= until) return -1;
    ::usleep(20000);
  }
}

class Keeper {
 public:
  Keeper(std::vector<std::string> argv, int listener) : argv_(std::move(argv)), listener_(listener) {}
  int run();

 private:
  bool open_notify();
  pid_t spawn();
  void on_notify();
  void store(const std::string& name, std::vector<int>& fds);
  void unstore(const std::string& name);

  std::vector<std::string> argv_;
  int listener_;
  int notify_ = -1;
  std::string notify_name_;
  std::vector<Stored> store_;
  bool store_full_said_ = false;
  pid_t child_ = -1;
};

bool Keeper::open_notify() {
  notify_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (notify_ < 0) return false;
  notify_name_ = "ds4-keeper-" + std::to_string(::getpid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, notify_name_.data(), notify_name_.size());  // abstract: no file to remove
  const socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + notify_name_.size());
  const int one = 1;
  // Descriptors of a connection come two at a time; a burst of them is
  // queued here while the keeper sleeps.
  const int buf = 4 << 20;
  ::setsockopt(notify_, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  return ::bind(notify_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
         ::setsockopt(notify_, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) == 0;
}

pid_t Keeper::spawn() {
  // What the child gets, prepared before fork: the port first, then the store.
  std::vector<int> fds;
  std::string names;
  if (listener_ >= 0) {
    fds.push_back(listener_);
    names = "ds4-listen";
  }
  for (const Stored& s : store_) {
    fds.push_back(s.fd);
    names += (names.empty() ? "" : ":") + s.name;
  }
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view v(*e);
    if (v.starts_with("NOTIFY_SOCKET=") || v.starts_with("LISTEN_") || v.starts_with(kKeeperEnv) ||
        v.starts_with(kFdStoreMaxEnv))
      continue;
    env.emplace_back(v);
  }
  env.push_back("NOTIFY_SOCKET=@" + notify_name_);
  env.push_back(std::string(kKeeperEnv) + "=" + std::to_string(::getpid()));
  env.push_back(std::string(kFdStoreMaxEnv) + "=" + std::to_string(kStoreMax));
  env.push_back("LISTEN_FDS=" + std::to_string(fds.size()));
  env.push_back("LISTEN_FDNAMES=" + names);
  env.push_back("LISTEN_PID=");  // its pid, written in the child
  const size_t pid_slot = env.size() - 1;
  std::vector<char*> args, envp;
  for (auto& a : argv_) args.push_back(a.data());
  args.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  char pid_text[48] = "LISTEN_PID=";
  // This very binary, by its name (exec of /proc/self/exe would name the process "exe").
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  const char* exe = ec ? "/proc/self/exe" : self.c_str();
  const pid_t parent = ::getpid();

  ChildSignals signals;
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  // Child: only async-signal-safe calls from here.
  ChildSignals::reset_in_child();
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no supervisor without its keeper
  if (::getppid() != parent) ::_exit(127);
  ::setpgid(0, 0);  // a terminal's Ctrl-C reaches the keeper only, which passes it on once
  // The passed descriptors to 3, 4, ...: first above the range, then down.
  const int top = 3 + int(fds.size());
  for (int& fd : fds) {
    const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, top);
    if (moved < 0) ::_exit(126);
    fd = moved;
  }
  for (size_t i = 0; i < fds.size(); ++i)
    if (::dup2(fds[i], 3 + int(i)) < 0) ::_exit(126);
  ::syscall(SYS_close_range, unsigned(top), ~0u, CLOSE_RANGE_CLOEXEC);
  // LISTEN_PID=<pid>, without snprintf.
  char digits[24];
  int n = 0;
  for (pid_t p = ::getpid(); p > 0; p /= 10) digits[n++] = char('0' + p % 10);
  size_t at = std::strlen(pid_text);
  while (n > 0) pid_text[at++] = digits[--n];
  pid_text[at] = '\0';
  envp[pid_slot] = pid_text;
  ChildSignals::unblock_all_in_child();
  ::execve(exe, args.data(), envp.data());
  ::_exit(127);
}

void Keeper::store(const std::string& name, std::vector<int>& fds) {
  for (int& fd : fds) {
    if (store_.size() >= kStoreMax) {
      if (!store_full_said_)
        log::warn("ds4-supervisor's keeper: its fd store is full (" + std::to_string(kStoreMax) + "), dropping '" + name +
                  "', ignoring");
      store_full_said_ = true;
      ::close(fd);
    } else {
      store_.push_back({name, fd});
    }
    fd = -1;
  }
}

void Keeper::unstore(const std::string& name) {
  std::erase_if(store_, [&](const Stored& s) {
    if (s.name != name) return false;
    ::close(s.fd);
    return true;
  });
  store_full_said_ = false;
}

// One sd_notify datagram: FDSTORE=1 / FDSTOREREMOVE=1 with FDNAME=, from the
// supervisor only (its credentials); READY=1, STATUS= and the rest need
// nothing from the keeper.
void Keeper::on_notify() {
  for (;;) {
    char text[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred)) + CMSG_SPACE(sizeof(int) * 253)];
    iovec iov{text, sizeof text - 1};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control;
    mh.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(notify_, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) return;
    std::vector<int> fds;
    pid_t sender = -1;
    for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
      if (cm->cmsg_level != SOL_SOCKET) continue;
      if (cm->cmsg_type == SCM_CREDENTIALS) {
        ucred c;
        std::memcpy(&c, CMSG_DATA(cm), sizeof c);
        sender = c.pid;
      } else if (cm->cmsg_type == SCM_RIGHTS) {
        const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
          fds.push_back(fd);
        }
      }
    }
    std::string name;
    bool add = false, remove = false;
    if (sender == child_ && child_ > 0) {
      const std::string_view body(text, size_t(n));
      size_t at = 0;
      while (at < body.size()) {
        size_t end = body.find('\n', at);
        if (end == std::string_view::npos) end = body.size();
        const std::string_view line = body.substr(at, end - at);
        if (line == "FDSTORE=1") add = true;
        else if (line == "FDSTOREREMOVE=1") remove = true;
        else if (line.starts_with("FDNAME=")) name = std::string(line.substr(7));
        at = end + 1;
      }
    }
    if (remove && !name.empty()) unstore(name);
    if (add && !name.empty()) store(name, fds);
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
}

int Keeper::run() {
  if (!open_notify()) {
    log::warn(std::string("ds4-supervisor's keeper: no notify socket (") + std::strerror(errno) +
              "); running the supervisor without it");
    return -1;
  }
  // Workers outlive a killed supervisor: they become the keeper's to reap.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  sigset_t mask;
  sigemptyset(&mask);
  for (int s : {SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT}) sigaddset(&mask, s);
  ::sigprocmask(SIG_BLOCK, &mask, nullptr);
  const int sfd = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) throw Error(std::string("ds4-supervisor's keeper: signalfd: ") + std::strerror(errno));
  std::deque<std::chrono::steady_clock::time_point> restarts;
  bool stopping = false;
  child_ = spawn();
  if (child_ < 0) throw Error(std::string("cannot start the supervisor: fork: ") + std::strerror(errno));
  for (;;) {
    pollfd p[2] = {{sfd, POLLIN, 0}, {notify_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0 && errno != EINTR) throw Error(std::string("poll: ") + std::strerror(errno));
    if (p[1].revents & POLLIN) on_notify();
    signalfd_siginfo si;
    while (::read(sfd, &si, sizeof si) == ssize_t(sizeof si)) {
      if (si.ssi_signo != SIGCHLD) {
        if (si.ssi_signo != SIGHUP && !stopping) {  // a stop, not a crash, ends the supervisor now
          stopping = true;
          // The port closes as the supervisor's own acceptor does: new
          // connections are refused while it finishes the ones in flight.
          if (listener_ >= 0) ::close(listener_);
          listener_ = -1;
        }
        if (child_ > 0) ::kill(child_, int(si.ssi_signo));
        continue;
      }
      int status = 0;
      pid_t done;
      while ((done = ::waitpid(-1, &status, WNOHANG)) > 0) {
        if (done != child_) continue;
        on_notify();  // what it stored just before it died
        child_ = -1;
        if (!WIFSIGNALED(status) || stopping) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        const auto now = std::chrono::steady_clock::now();
        while (!restarts.empty() && now - restarts.front() > kBurstWindow) restarts.pop_front();
        if (int(restarts.size()) >= kBurst) {
          log::error("the supervisor was killed " + std::to_string(kBurst + 1) + " times within " +
                         std::to_string(kBurstWindow.count()) + " s; its keeper gives up",
                     {{"DS4_EVENT", "supervisor_restart_limit"}});
          return 1;
        }
        restarts.push_back(now);
        log::warn("the supervisor (pid " + std::to_string(done) + ") was killed by signal " +
                      std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) +
                      "); its keeper starts it again with the port and " + std::to_string(store_.size()) +
                      " kept descriptors",
                  {{"DS4_EVENT", "supervisor_restart"}, {"DS4_SIGNAL", std::to_string(WTERMSIG(status))}});
        ::usleep(useconds_t(std::chrono::microseconds(kRestartDelay).count()));
        on_notify();
        child_ = spawn();
        if (child_ < 0) throw Error(std::string("cannot start the supervisor again: fork: ") + std::strerror(errno));
      }
    }
  }
}

}  // namespace

bool under_keeper() {
  const char* k = std::getenv(kKeeperEnv);
  return k && *k && std::atol(k) == long(::getppid());
}

int run_keeper(const std::vector<std::string>& argv, const std::string& config_path, bool config_given) {
  // The runtime folder's lock is the keeper's: a second supervisor names the
  // pid people see. A config that does not load leaves the port to the
  // supervisor, which then says what is wrong.
  const std::string dir = runtime_dir();
  ensure_private_dir(dir);
  RuntimeDirLock lock(dir);
  int listener = -1;
  try {
    const Config c = load_config(config_path);
    if (c.file_found || !config_given) listener = bind_listener(c.proxy.listen);
  } catch (const Error&) {
  }
  Keeper k(argv, listener);
  const int rc = k.run();
  if (rc >= 0) return rc;
  // No keeper after all: the supervisor runs in this process.
  if (listener >= 0) ::close(listener);
  return -1;
}

}  // namespace ds4::sup
