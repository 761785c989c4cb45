#pragma once
// A daemon that dies of a fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT)
// says where before it goes: the signal, the faulting address and the call
// stack as "binary(+offset)" frames on stderr (the journal, under a unit),
// resolvable afterwards with `addr2line -f -C -e BINARY OFFSET`. The signal
// then takes its default action, so a core dump, the keeper's or systemd's
// restart and the exit status are what they would have been.

namespace ds4 {

/// Installs the handlers (on an alternate stack, so that a stack overflow
/// is reported too). `name` prefixes the report ("ds4-supervisor"); it must
/// outlive the process (a string literal).
void install_crash_report(const char* name);

}  // namespace ds4
