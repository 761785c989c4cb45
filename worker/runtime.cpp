#include "worker/runtime.h"

#include "shared/error.h"
#include "shared/segment_socket.h"

namespace ds4 {

std::unique_ptr<const LoadedModel> attach_model(const std::string& handle, const std::string& segment_socket) {
  store::Segment seg = store::open_segment(handle, segment_socket);
  if (const auto why = seg.identity_mismatch())
    throw Error("model segment " + handle + " is not the model it names: " + *why +
                "; the supervisor rebuilds it when it loads the model (restart it, or remove the segment)");
  return bind_model(std::move(seg));
}

std::unique_ptr<const LoadedModel> bind_model(store::Segment seg) {
  Model model = Model::bind(seg.metadata(), segment_tensors(seg));
  Tokenizer tok = Tokenizer::from_gguf(seg.metadata());
  // Tensor pointers stay valid across the move: they point into the mapping.
  return std::unique_ptr<const LoadedModel>(new LoadedModel{std::move(seg), std::move(model), std::move(tok)});
}

std::unique_ptr<const LoadedModel> open_model(const std::string& gguf_path) {
  store::LoadOptions opts;
  opts.progress = store::make_progress_reporter(gguf_path);
  // A model /dev/shm cannot hold goes into a memfd of this process's own.
  const store::LoadResult r = store::load(gguf_path, opts);
  return bind_model(r.fd ? store::Segment::attach_fd(r.fd->get(), r.name) : store::Segment::attach(r.name));
}

}  // namespace ds4
