#include "supervisor/keeper.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <string_view>

#include "shared/config.h"
#include "shared/error.h"
#include "shared/log.h"
#include "shared/notify_socket.h"
#include "shared/spawn.h"
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
  std::unique_ptr<NotifySocket> notify_;
  std::string notify_error_;
  std::vector<Stored> store_;
  bool store_full_said_ = false;
  pid_t child_ = -1;
};

bool Keeper::open_notify() {
  try {
    // Abstract: no file to remove. Descriptors of a connection come two at a
    // time; a burst of them is queued here while the keeper sleeps.
    notify_ = std::make_unique<NotifySocket>("@ds4-keeper-" + std::to_string(::getpid()), 4 << 20);
    return true;
  } catch (const Error& e) {
    notify_error_ = e.what();
    return false;
  }
}

pid_t Keeper::spawn() {
  // What the child gets: the port first, then the store.
  SpawnOptions o;
  std::string names;
  if (listener_ >= 0) {
    o.keep_fds.push_back(listener_);
    names = "ds4-listen";
  }
  for (const Stored& s : store_) {
    o.keep_fds.push_back(s.fd);
    names += (names.empty() ? "" : ":") + s.name;
  }
  o.env = environment_without({"NOTIFY_SOCKET", "LISTEN_*", kKeeperEnv, kFdStoreMaxEnv});
  o.env->push_back("NOTIFY_SOCKET=" + notify_->address());
  o.env->push_back(std::string(kKeeperEnv) + "=" + std::to_string(::getpid()));
  o.env->push_back(std::string(kFdStoreMaxEnv) + "=" + std::to_string(kStoreMax));
  o.env->push_back("LISTEN_FDS=" + std::to_string(o.keep_fds.size()));
  o.env->push_back("LISTEN_FDNAMES=" + names);
  o.set_listen_pid = true;
  // This very binary, by its name (exec of /proc/self/exe would name the process "exe").
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  o.argv = argv_;
  if (!o.argv.empty()) o.argv[0] = ec ? "/proc/self/exe" : self;
  o.parent_death_signal = SIGKILL;  // no supervisor without its keeper
  o.new_process_group = true;       // a terminal's Ctrl-C reaches the keeper only, which passes it on once
  return ds4::spawn(o);
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
  while (std::optional<NotifyMessage> m = notify_->receive()) {
    const std::optional<std::string> name = m->value("FDNAME");
    if (m->pid == child_ && child_ > 0 && name && !name->empty()) {
      if (m->has("FDSTOREREMOVE=1")) unstore(*name);
      if (m->has("FDSTORE=1")) store(*name, m->fds);
    }
    for (int fd : m->fds)
      if (fd >= 0) ::close(fd);
  }
}

int Keeper::run() {
  if (!open_notify()) {
    log::warn("ds4-supervisor's keeper: " + notify_error_ + "; running the supervisor without it");
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
  for (;;) {
    pollfd p[2] = {{sfd, POLLIN, 0}, {notify_->fd(), POLLIN, 0}};
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
      int wait_status = 0;
      pid_t done;
      while ((done = ::waitpid(-1, &wait_status, WNOHANG)) > 0) {  // adopted workers too
        if (done != child_) continue;
        const ExitStatus status = ExitStatus::from_wait_status(wait_status);
        on_notify();  // what it stored just before it died
        child_ = -1;
        if (!status.signalled() || stopping) return status.exited() ? status.code : 128 + status.signal;
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
                      std::to_string(status.signal) + " (" + strsignal(status.signal) +
                      "); its keeper starts it again with the port and " + std::to_string(store_.size()) +
                      " kept descriptors",
                  {{"DS4_EVENT", "supervisor_restart"}, {"DS4_SIGNAL", std::to_string(status.signal)}});
        ::usleep(useconds_t(std::chrono::microseconds(kRestartDelay).count()));
        on_notify();
        child_ = spawn();
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
