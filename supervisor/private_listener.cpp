#include "supervisor/private_listener.h"

#include <sys/stat.h>
#include <unistd.h>

#include "shared/error.h"

namespace ds4::sup {

PrivateListener::PrivateListener(asio::io_context& io, std::string path, const std::string& what)
    : acceptor_(io), path_(std::move(path)) {
  ::unlink(path_.c_str());
  try {
    acceptor_.open();
    const mode_t old = ::umask(0177);
    boost::system::error_code ec;
    acceptor_.bind(asio::local::stream_protocol::endpoint(path_), ec);
    ::umask(old);
    if (ec) throw boost::system::system_error(ec);
    acceptor_.listen();
  } catch (const boost::system::system_error& e) {
    throw Error("cannot listen on the " + what + " socket " + path_ + ": " + e.code().message());
  }
}

PrivateListener::~PrivateListener() { close(); }

void PrivateListener::close() {
  if (!acceptor_.is_open()) return;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  ::unlink(path_.c_str());
}

}  // namespace ds4::sup
