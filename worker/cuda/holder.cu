// The weights holder of one GPU and the client side of its protocol
// (holder.cuh): one VMM image, its fd handed out over a Unix socket.
#include "worker/cuda/holder.cuh"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "shared/bytes.h"
#include "shared/fd_passing.h"
#include "shared/log.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/weights.cuh"

namespace ds4 {
namespace cuda {
namespace {

std::string errno_text() { return std::strerror(errno); }

/// A file descriptor closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(o.release());
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

sockaddr_un unix_address(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof a.sun_path)
    throw Error("socket path '" + path + "' is empty or longer than " + std::to_string(sizeof a.sun_path - 1) +
                " bytes");
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return a;
}

void set_timeouts(int fd, int timeout_ms) {
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/// A connected stream socket to `path`, or -1 with errno set.
int connect_unix(const std::string& path, int timeout_ms) {
  const sockaddr_un a = unix_address(path);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  set_timeouts(fd, timeout_ms);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

/// Sends `line` with `fd` attached to its first byte.
bool send_line_with_fd(int sock, const std::string& line, int fd) {
  ssize_t n = send_with_fd(sock, line, fd);
  if (n < 0) return false;
  // The rest (a description is a few hundred bytes, so rarely any) without the fd.
  for (size_t done = size_t(n); done < line.size(); done += size_t(n)) {
    n = ::send(sock, line.data() + done, line.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
  }
  return true;
}

}  // namespace

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

HolderOffer ask_holder(const std::string& socket_path, int timeout_ms) {
  Fd sock(connect_unix(socket_path, timeout_ms));
  if (sock.get() < 0) throw Error("cannot connect to " + socket_path + ": " + errno_text());
  constexpr size_t kMaxLine = 64 * 1024;  // a description is a few hundred bytes
  std::string line;
  Fd image;
  char buf[4096];
  while (line.find('\n') == std::string::npos) {
    int fd = image.release();  // the first descriptor stays; later ones are closed
    const ssize_t n = recv_with_fd(sock.get(), buf, sizeof buf, fd);
    image.reset(fd);
    if (n < 0) throw Error("no answer from the holder at " + socket_path + ": " + errno_text());
    if (n == 0) break;
    line.append(buf, size_t(n));
    if (line.size() > kMaxLine) throw Error("the holder at " + socket_path + " sent more than 64 KiB");
  }
  if (image.get() < 0) throw Error("the holder at " + socket_path + " sent no file descriptor");
  HolderOffer offer;
  try {
    offer.desc = nlohmann::json::parse(line.substr(0, line.find('\n')));
  } catch (const nlohmann::json::exception& e) {
    throw Error("the holder at " + socket_path + " sent a bad description: " + e.what());
  }
  if (!offer.desc.is_object() || offer.desc.value("ev", "") != "weights")
    throw Error("the holder at " + socket_path + " sent something other than a weights description");
  offer.fd = image.release();
  return offer;
}

}  // namespace cuda

CudaWeightSource parse_cuda_weight_source(const std::string& s) {
  if (s == "auto") return CudaWeightSource::automatic;
  if (s == "holder") return CudaWeightSource::holder;
  if (s == "copy") return CudaWeightSource::copy;
  if (s == "host-mapped") return CudaWeightSource::host_mapped;
  throw Error("gpu weights '" + s + "': expected auto, holder, copy or host-mapped");
}

const char* cuda_weight_source_name(CudaWeightSource w) {
  switch (w) {
    case CudaWeightSource::automatic: return "auto";
    case CudaWeightSource::holder: return "holder";
    case CudaWeightSource::copy: return "copy";
    case CudaWeightSource::host_mapped: return "host-mapped";
  }
  return "auto";
}

CudaWeightSource resolve_weight_source(CudaWeightSource asked, bool integrated_gpu, bool holder_socket_exists) {
  if (asked != CudaWeightSource::automatic) return asked;
  if (integrated_gpu) return CudaWeightSource::host_mapped;
  return holder_socket_exists ? CudaWeightSource::holder : CudaWeightSource::copy;
}

std::string default_holder_socket(int device_index) {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  const std::string dir = xdg && *xdg ? std::string(xdg) + "/ds4" : "/tmp/ds4-" + std::to_string(getuid());
  return dir + "/holder-cuda" + std::to_string(device_index) + ".sock";
}

std::string holder_model_key(const store::Segment& segment) {
  const store::Identity id = segment.identity();
  return segment.name() + ":" + cuda::hex64(id.header_hash) + ":" + std::to_string(id.size) + ":" +
         std::to_string(id.mtime_ns);
}

struct CudaHolder::Impl {
  const Model& model;
  int device = 0;
  std::string socket_path, model_key, segment, device_name;
  cuda::ImageLayout layout;
  int host_expert_layers = 0;  // the first layers whose experts it does not hold
  std::unique_ptr<cuda::VmmAllocation> image;
  cuda::Fd image_fd, listener, stop_event;
  nlohmann::json desc;  // sent to every client, with the device's free memory of the moment

  void answer(int client);
};

CudaHolder::CudaHolder(const Model& model, int device, const std::string& socket_path, const std::string& model_key,
                       const std::string& segment_name, int host_expert_layers)
    : impl_(new Impl{model, device, socket_path, model_key, segment_name, {}, {}, 0, {}, {}, {}, {}, {}}) {
  Impl& m = *impl_;
  // A holder that still answers keeps its socket: two holders of one GPU would hold two copies.
  if (const int probe = cuda::connect_unix(socket_path, 500); probe >= 0) {
    ::close(probe);
    throw Error("a holder already answers on " + socket_path);
  }
  DS4_CUDA_CHECK(cudaSetDevice(device));
  DS4_CUDA_CHECK(cudaFree(nullptr));  // the primary context, for the driver's VMM calls
  cudaDeviceProp prop{};
  DS4_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  m.device_name = prop.name;
  m.host_expert_layers = host_expert_layers;
  m.layout = cuda::ImageLayout::of(model.w(), host_expert_layers);
  m.image = cuda::VmmAllocation::create(device, m.layout.total);
  cudaStream_t s = nullptr;
  DS4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  try {
    cuda::fill_image(m.layout, m.image->ptr(), s);
  } catch (...) {
    cudaStreamDestroy(s);
    throw;
  }
  cudaStreamDestroy(s);
  m.image_fd.reset(m.image->export_fd());
  m.desc = nlohmann::json{{"ev", "weights"},
                          {"version", cuda::kImageLayoutVersion},
                          {"model_key", model_key},
                          {"segment", segment_name},
                          {"model", model.hp().name},
                          {"device_uuid", cuda::device_uuid(device)},
                          {"bytes", m.image->size()},
                          {"image_bytes", m.layout.total},
                          {"layout_hash", cuda::hex64(m.layout.hash)},
                          {"host_expert_layers", host_expert_layers},
                          {"pid", int64_t(getpid())}};

  // The socket's folder (the runtime dir's ds4/), private to the user.
  if (const size_t slash = socket_path.rfind('/'); slash != std::string::npos && slash > 0)
    ::mkdir(socket_path.substr(0, slash).c_str(), 0700);
  const sockaddr_un a = cuda::unix_address(socket_path);
  m.listener.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (m.listener.get() < 0) throw Error("cannot create a socket: " + cuda::errno_text());
  ::unlink(socket_path.c_str());  // left by a holder that died
  if (::bind(m.listener.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 ||
      ::listen(m.listener.get(), 64) != 0)
    throw Error("cannot listen on " + socket_path + ": " + cuda::errno_text());
  ::chmod(socket_path.c_str(), 0600);
  m.stop_event.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (m.stop_event.get() < 0) throw Error("eventfd failed: " + cuda::errno_text());
}

CudaHolder::~CudaHolder() {
  if (impl_ && impl_->listener.get() >= 0) ::unlink(impl_->socket_path.c_str());
}

std::string CudaHolder::status() const {
  const Impl& m = *impl_;
  return "holding " + format_bytes(m.image->size()) + " of weights of " + (m.model.hp().name.empty() ? m.segment : m.model.hp().name) +
         (m.host_expert_layers > 0
              ? " without the experts of the first " + std::to_string(m.host_expert_layers) + " layers"
              : std::string()) +
         " on cuda:" + std::to_string(m.device) + " (" + m.device_name + "), socket " + m.socket_path;
}

void CudaHolder::Impl::answer(int client) {
  cuda::set_timeouts(client, 1000);
  // The device's memory as it is now: the supervisor asks before it starts a
  // worker that has no figure of its own yet, to pick the rung that fits.
  nlohmann::json d = desc;
  size_t free = 0, total = 0;
  if (cudaSetDevice(device) == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess) {
    d["device_free"] = uint64_t(free);
    d["device_total"] = uint64_t(total);
  } else {
    cudaGetLastError();  // not sticky: the offer itself does not depend on it
  }
  // A client that left first (EPIPE, ECONNRESET: a probe, a worker killed
  // while asking) is no news.
  if (!cuda::send_line_with_fd(client, d.dump() + "\n", image_fd.get()) && errno != EPIPE && errno != ECONNRESET)
    log::warn("holder: cannot answer a client on " + socket_path + ": " + cuda::errno_text() + ", ignoring");
}

void CudaHolder::serve() {
  Impl& m = *impl_;
  for (;;) {
    pollfd p[2] = {{m.listener.get(), POLLIN, 0}, {m.stop_event.get(), POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      throw Error("poll failed: " + cuda::errno_text());
    }
    if (p[1].revents) return;
    if (!(p[0].revents & POLLIN)) continue;
    cuda::Fd client(::accept4(m.listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (client.get() >= 0) m.answer(client.get());
  }
}

void CudaHolder::stop() {
  const uint64_t one = 1;
  if (::write(impl_->stop_event.get(), &one, sizeof one) < 0) {
    // Only fails when the counter would overflow: a stop is already pending.
  }
}

}  // namespace ds4
