#pragma once
/// What a session writes into its connection's journal (conn_journal.h) and
/// reads back after a supervisor restart (conn_store.h keeps both). Pure.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "shared/protocol.h"
#include "supervisor/proxy/engine_resume.h"
#include "supervisor/proxy/job_result.h"

namespace ds4::proxy {

/// The request step: what planning chose that a second planning would not
/// choose the same way (the answer's id and time, a random seed, the room
/// the context left).
struct JournalRequest {
  std::string id;
  int64_t created = 0;
  uint64_t seed = 0;
  int32_t max_tokens = 0;
  bool forward = false;  // an exec engine's request, forwarded as it came
  bool operator==(const JournalRequest&) const = default;
};

std::string encode_request(const JournalRequest& r);
std::optional<JournalRequest> decode_request(std::string_view s);
std::string encode_token(const proto::TokenEvent& e);
std::optional<proto::TokenEvent> decode_token(std::string_view s);
std::string encode_result(const JobResult& r);
std::optional<JobResult> decode_result(std::string_view s);
/// An exec engine's stream: one change to its filter (the engine step).
std::string encode_engine_op(const EngineOp& op);
std::optional<EngineOp> decode_engine_op(std::string_view s);


}  // namespace ds4::proxy
