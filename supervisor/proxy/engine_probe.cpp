#include "supervisor/proxy/engine_probe.h"

namespace ds4::proxy {

namespace asio = boost::asio;

std::shared_ptr<EngineCall> fetch_whole(asio::io_context& io, int port, const EngineRequest& req,
                                        const EngineLimits& limits, std::function<void(EngineReply)> done) {
  auto reply = std::make_shared<EngineReply>();
  EngineCall::Handler h;
  h.head = [reply](int status, const std::string&, bool) { reply->status = status; };
  h.data = [reply, limits](std::string_view bytes) {
    if (reply->body.size() + bytes.size() <= limits.max_body_bytes) reply->body.append(bytes);
  };
  h.done = [reply, done] { done(std::move(*reply)); };
  h.broken = [done](const std::string& why, bool replay) { done({0, "", why, replay}); };
  return EngineCall::start(io, port, req, limits, std::move(h));
}

namespace {

struct Probe : std::enable_shared_from_this<Probe> {
  Probe(asio::io_context& io, int port, EngineLimits limits, std::chrono::milliseconds timeout,
        std::function<void(EngineCaps)> done)
      : io(io), port(port), limits(limits), timeout(timeout), timer(io), done(std::move(done)) {
    caps.probed = true;
  }
  asio::io_context& io;
  int port;
  EngineLimits limits;
  std::chrono::milliseconds timeout;
  asio::steady_timer timer;
  std::function<void(EngineCaps)> done;
  EngineCaps caps;
  std::vector<int32_t> ids;
  std::shared_ptr<EngineCall> call;
  int step = 0;
  bool over = false;

  void send(const EngineRequest& req) {
    auto self = shared_from_this();
    timer.expires_after(timeout);
    timer.async_wait([self](const boost::system::error_code& ec) {
      if (ec || self->over) return;
      if (self->call) self->call->cancel();
      self->on_reply({0, "", "no answer within the probe's timeout", false});
    });
    call = fetch_whole(io, port, req, limits, [self](EngineReply r) { self->on_reply(std::move(r)); });
  }
  void on_reply(EngineReply r) {
    if (over) return;
    timer.cancel();
    const bool ok = r.status == 200;
    switch (step++) {
      case 0:
        if (ok) {
          if (auto t = read_tokens(r.body)) caps.tokenize = true, ids = *t;
        }
        return send(probe_template_request());
      case 1:
        caps.apply_template = ok && read_prompt(r.body).has_value();
        if (!caps.tokenize) return end();
        return send(probe_ids_request(ids));
      default:
        caps.token_ids = ok && stream_has_ids(r.body);
        return end();
    }
  }
  void end() {
    over = true;
    call.reset();
    auto d = std::move(done);
    d(caps);
  }
};

}  // namespace

void probe_engine(asio::io_context& io, int port, const EngineLimits& limits, std::chrono::milliseconds timeout,
                  std::function<void(EngineCaps)> done) {
  auto p = std::make_shared<Probe>(io, port, limits, timeout, std::move(done));
  p->send(probe_tokenize_request());
}

}  // namespace ds4::proxy
