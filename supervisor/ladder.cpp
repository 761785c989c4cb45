#include "supervisor/ladder.h"

#include <algorithm>

namespace ds4::sup {

std::string Rung::text() const {
  std::string t = "context " + std::to_string(context);
  const bool kv = kv_cache != "f16";
  if (kv) t += " with a " + kv_cache + " KV cache";
  if (host_experts > 0)
    t += (kv ? " and" : " with") + std::string(" the experts of ") + std::to_string(host_experts) + " layers on the host";
  return t;
}

std::vector<Rung> ladder_rungs(const std::vector<uint32_t>& contexts, const std::vector<std::string>& kv,
                               const std::vector<uint32_t>& offload) {
  const std::vector<std::string> kvs = kv.empty() ? std::vector<std::string>{"f16"} : kv;
  const std::vector<uint32_t> offs = offload.empty() ? std::vector<uint32_t>{0} : offload;
  std::vector<Rung> out;
  for (size_t i = 0; i < contexts.size(); ++i) {
    if (i > 0) {
      out.push_back({contexts[i], offs.back(), kvs.back()});
      continue;
    }
    for (const std::string& k : kvs) out.push_back({contexts[0], offs.front(), k});
    for (size_t o = 1; o < offs.size(); ++o) out.push_back({contexts[0], offs[o], kvs.back()});
  }
  return out;
}

bool has_expert_rungs(const std::vector<Rung>& ladder) {
  return std::any_of(ladder.begin(), ladder.end(), [](const Rung& r) { return r.host_experts > 0; });
}

bool has_kv_rungs(const std::vector<Rung>& ladder) {
  return std::any_of(ladder.begin(), ladder.end(), [](const Rung& r) { return r.kv_cache != "f16"; });
}

std::optional<size_t> find_rung(const std::vector<Rung>& ladder, uint32_t context, uint32_t host_experts,
                                const std::string& kv_cache) {
  for (size_t i = 0; i < ladder.size(); ++i)
    if (ladder[i].context == context && ladder[i].host_experts == host_experts && ladder[i].kv_cache == kv_cache)
      return i;
  return std::nullopt;
}

}  // namespace ds4::sup
