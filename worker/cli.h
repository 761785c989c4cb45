#pragma once
/// A small command-line parser: `--name value`, `--flag`, and short aliases.
/// Unknown options and bad numbers throw ds4::Error naming the option.

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace ds4 {

class Args {
 public:
  /// `with_value` and `flags` list the accepted long names (without "--");
  /// `aliases` maps short forms ("-p") to long names.
  Args(const std::vector<std::string>& argv, std::set<std::string> with_value, std::set<std::string> flags,
       std::map<std::string, std::string> aliases = {});

  bool has(const std::string& name) const;
  std::string str(const std::string& name, const std::string& def = "") const;
  std::string required(const std::string& name) const;
  int64_t integer(const std::string& name, int64_t def, int64_t lo, int64_t hi) const;
  double real(const std::string& name, double def, double lo, double hi) const;

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> flags_;
};

}  // namespace ds4
