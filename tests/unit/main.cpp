// ds4_unit_tests: doctest's runner, and what ds4's ctest entries add to it.
//
// A case held back by a decorator of skip.h says why in its description;
// after doctest's summary the runner names each such reason once, with the
// number of cases it holds back (chosen by the run's filters or not).
//
// --skipped-exit=N (an option of ds4's; doctest ignores options it does not
// know): when no case ran and some were held back for a reason, exit N.
// ctest's SKIP_RETURN_CODE then shows the entry as Skipped, where doctest
// alone would have passed it without running anything (unit_cuda on a
// machine without a GPU).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "skip.h"

namespace ds4::test {

namespace {

/// The reasons given, each stored once: a case's description points into it.
const char* keep(const std::string& reason) {
  static std::set<std::string> reasons;
  return reasons.insert(reason).first->c_str();
}

}  // namespace

void needs::fill(doctest::detail::TestCase& tc) const {
  if (suite) tc.m_test_suite = suite;
  if (missing.empty()) return;
  tc.m_skip = true;
  tc.m_description = keep(missing);
}

needs needs_file(const std::string& path, const std::string& how) {
  if (std::filesystem::exists(path)) return {};
  return {nullptr, "no " + path + " (" + how + ")"};
}

}  // namespace ds4::test

namespace {

struct Tally {
  int ran = 0;
  std::map<std::string, int> held_back;  // reason -> cases
};
Tally& tally() {
  static Tally t;
  return t;
}

/// Counts the cases that run, and those a decorator held back, by reason.
struct SkipListener : doctest::IReporter {
  explicit SkipListener(const doctest::ContextOptions&) {}
  void test_case_start(const doctest::TestCaseData&) override { ++tally().ran; }
  void test_case_skipped(const doctest::TestCaseData& tc) override {
    if (tc.m_skip && tc.m_description) ++tally().held_back[tc.m_description];
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
};
REGISTER_LISTENER("ds4_skips", 1, SkipListener);

/// The value of --skipped-exit=N, or -1.
int skipped_exit(int argc, char** argv) {
  constexpr const char kOption[] = "--skipped-exit=";
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], kOption, sizeof kOption - 1) == 0) return std::atoi(argv[i] + sizeof kOption - 1);
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;
  const Tally& t = tally();
  for (const auto& [reason, cases] : t.held_back)
    std::printf("[ds4] %d case%s cannot run here: %s\n", cases, cases == 1 ? "" : "s", reason.c_str());
  const int skip_code = skipped_exit(argc, argv);
  if (rc == 0 && skip_code >= 0 && t.ran == 0 && !t.held_back.empty()) return skip_code;
  return rc;
}
