#pragma once
/// What a worker holds once it attached a model segment: the mapping, the
/// bound model and its tokenizer. Not movable (backends keep references).

#include <memory>
#include <string>

#include "shared/model_store.h"
#include "model/weights.h"
#include "text/tokenizer.h"

namespace ds4 {

struct LoadedModel {
  store::Segment segment;
  Model model;
  Tokenizer tokenizer;
};

/// Attaches a ready segment read-only and binds the model in it: a named one,
/// or a memfd one ("memfd:<name>") whose descriptor the supervisor serves on
/// `segment_socket` (shared/segment_socket.h). Besides the segment's own
/// checks (magic, layout version, state) it must hold the model it names
/// (Segment::identity_mismatch); ds4::Error says what is wrong otherwise.
std::unique_ptr<const LoadedModel> attach_model(const std::string& handle, const std::string& segment_socket);
/// Binds the model in an attached segment.
std::unique_ptr<const LoadedModel> bind_model(store::Segment segment);

/// Loads `gguf_path` into shared memory unless a ready, matching segment
/// exists (progress on the terminal / to systemd), then attaches it; a model
/// /dev/shm cannot hold is loaded into a memfd this process keeps.
std::unique_ptr<const LoadedModel> open_model(const std::string& gguf_path);

}  // namespace ds4
