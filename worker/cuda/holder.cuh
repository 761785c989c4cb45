#pragma once
// The holder's protocol, both sides. A client connects to the holder's Unix
// socket and reads one line of JSON, the description of the image; the
// image's POSIX fd rides on that message (SCM_RIGHTS). Then the holder closes
// the connection. Included only by worker/cuda/*.cu.
//
// Description: {"ev":"weights", "version": kImageLayoutVersion,
//   "model_key": ..., "segment": ..., "device_uuid": 32 hex digits,
//   "bytes": allocation size, "image_bytes": layout total,
//   "layout_hash": 16 hex digits, "pid": holder pid,
//   "device_free", "device_total": the device's memory when it answered,
//   bytes (absent when CUDA could not say)}

#include <string>

#include <nlohmann/json.hpp>

namespace ds4::cuda {

struct HolderOffer {
  nlohmann::json desc;
  int fd = -1;  // owned by the receiver
};

/// Connects to `socket_path` and receives the offer, waiting at most
/// `timeout_ms` for each step. Throws ds4::Error saying what failed (no
/// socket, nobody listening, no fd, bad description).
HolderOffer ask_holder(const std::string& socket_path, int timeout_ms);

/// 16 hex digits.
std::string hex64(uint64_t v);

}  // namespace ds4::cuda
