#pragma once
/// What a worker holds once it attached a model segment: the mapping, the
/// bound model and its tokenizer. Not movable (backends keep references).

#include <memory>
#include <string>

#include "shared/model_store.h"
#include "worker/model.h"
#include "worker/tokenizer.h"

namespace ds4 {

struct LoadedModel {
  store::Segment segment;
  Model model;
  Tokenizer tokenizer;
};

/// Attaches a ready segment read-only and binds the model in it.
std::unique_ptr<const LoadedModel> attach_model(const std::string& segment_name);

/// Loads `gguf_path` into shared memory unless a ready, matching segment
/// exists (progress on the terminal / to systemd), then attaches it.
std::unique_ptr<const LoadedModel> open_model(const std::string& gguf_path);

}  // namespace ds4
