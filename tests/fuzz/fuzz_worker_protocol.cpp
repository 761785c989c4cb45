// libFuzzer entry for the worker's token protocol (shared/protocol.h): any
// line, read as a request (first byte even) or as an event (odd), must parse
// or throw ds4::Error, never anything else. What parses is written back with
// the protocol's own writers and must read back the same, id included: the
// hand-written fast path and the general JSON path agree on every line the
// writers make.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "shared/error.h"
#include "shared/protocol.h"

namespace {

using namespace ds4::proto;

void require(bool ok) {
  if (!ok) std::abort();
}

void request(std::string_view line) {
  Request r;
  try {
    r = parse_request(line);
  } catch (const ds4::Error&) {
    return;
  }
  if (r.op == Request::Op::cancel) {
    const Request back = parse_request(cancel_line(r.id));
    require(back.op == Request::Op::cancel && back.id == r.id);
  } else if (r.op == Request::Op::generate) {
    const Request back = parse_request(to_line(r.generate, r.id));
    require(back.op == Request::Op::generate && back.id == r.id && back.generate == r.generate);
  }
}

void event(std::string_view line) {
  Event e;
  try {
    e = parse_event(line);
  } catch (const ds4::Error&) {
    return;
  }
  if (e.kind == Event::Kind::token) {
    const Event back = parse_event(token_line(e.token, e.id));
    require(back.kind == Event::Kind::token && back.id == e.id && back.token.index == e.token.index &&
            back.token.token == e.token.token && back.token.top == e.token.top &&
            (back.token.logprob == e.token.logprob || (e.token.logprob != e.token.logprob && back.token.logprob != back.token.logprob)));
  } else if (e.kind == Event::Kind::done) {
    const Event back = parse_event(done_line(e.reason, e.timings, e.id));
    require(back.kind == Event::Kind::done && back.id == e.id && back.reason == e.reason &&
            back.timings.prompt_n == e.timings.prompt_n && back.timings.cache_n == e.timings.cache_n &&
            back.timings.predicted_n == e.timings.predicted_n && back.timings.prompt_ms == e.timings.prompt_ms &&
            back.timings.predicted_ms == e.timings.predicted_ms);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view line(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) request(line);
  else event(line);
  return 0;
}
