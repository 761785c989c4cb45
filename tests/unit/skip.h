#pragma once
// Cases that cannot run on this machine are reported as skipped, never as
// passed. doctest fixes a case's skip decorator when the case registers,
// before main, so the condition is evaluated then, once. The reason goes into
// the case's description; the runner (main.cpp) names each reason after
// doctest's summary, and --skipped-exit turns a run in which nothing ran into
// ctest's "Skipped".
#include <doctest/doctest.h>

#include <string>

namespace ds4::test {

/// Decorator: `TEST_CASE("name" * needs{"cuda", why_not})`. The case joins the
/// test suite `suite` (unless null), so that one ctest entry runs those cases
/// and the others leave them out; it is skipped, saying `missing`, when
/// `missing` is not empty.
struct needs {
  const char* suite = nullptr;
  std::string missing;

  void fill(doctest::detail::TestCase& tc) const;
};

/// A case that reads `path`: skipped when the file is absent, saying so and
/// `how` it is made.
needs needs_file(const std::string& path, const std::string& how);

}  // namespace ds4::test
