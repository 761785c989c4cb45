#include "shared/crash_report.h"

#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <cstdint>
#include <initializer_list>

namespace ds4 {
namespace {

const char* g_name = "ds4";

// Async-signal-safe output: write(2) of fixed text and of numbers formatted by hand.
void put(const char* s) {
  const size_t n = ::strlen(s);
  ssize_t r = ::write(STDERR_FILENO, s, n);
  (void)r;
}

void put_number(uintptr_t v, unsigned base) {
  char buf[24];
  int n = 0;
  do {
    const unsigned d = unsigned(v % base);
    buf[n++] = char(d < 10 ? '0' + d : 'a' + d - 10);
    v /= base;
  } while (v > 0 && n < int(sizeof buf));
  char out[26];
  int o = 0;
  if (base == 16) out[o++] = '0', out[o++] = 'x';
  while (n > 0) out[o++] = buf[--n];
  ssize_t r = ::write(STDERR_FILENO, out, size_t(o));
  (void)r;
}

void on_fault(int sig, siginfo_t* info, void*) {
  put(g_name);
  put(": crashed: signal ");
  put_number(uintptr_t(sig), 10);
  put(" (");
  put(sigabbrev_np(sig) ? sigabbrev_np(sig) : "?");
  put(")");
  if (info && info->si_code <= 0) {  // sent (kill, raise, abort): no faulting address
    put(" sent by pid ");
    put_number(uintptr_t(info->si_pid), 10);
  } else if (info) {
    put(" at address ");
    put_number(reinterpret_cast<uintptr_t>(info->si_addr), 16);
  }
  put("; call stack (addr2line -f -C -e BINARY +OFFSET):\n");
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  // The default action now: the same death, core and status as without us.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

void install_crash_report(const char* name) {
  g_name = name;
  // backtrace() loads libgcc on its first call, which is not safe in a
  // handler: call it once here.
  void* warm[1];
  ::backtrace(warm, 1);
  static char alt_stack[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  ::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) ::sigaction(s, &sa, nullptr);
}

}  // namespace ds4
