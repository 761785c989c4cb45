#pragma once
/// The ds4-worker subcommands. Each takes its arguments (after the
/// subcommand name) and returns the exit status; errors propagate as ds4::Error.

#include <string>
#include <vector>

namespace ds4 {

int cmd_run(const std::vector<std::string>& args);
int cmd_bench(const std::vector<std::string>& args);
/// `perplexity`: a text's perplexity, --save-logits and --kl-divergence
/// against a base, as llama-perplexity (worker/perplexity.h).
int cmd_perplexity(const std::vector<std::string>& args);
int cmd_serve(const std::vector<std::string>& args);
/// `engine`: runs an external OpenAI-compatible server as the worker (exec_engine.h).
int cmd_engine(const std::vector<std::string>& args);
/// `hold`: keeps a model's weights on one GPU for the workers (CUDA builds).
int cmd_hold(const std::vector<std::string>& args);
/// `capabilities` (or `--capabilities`): one JSON line saying what this
/// build runs: {"backends":["cpu","cuda"],"weight_types":[...],"kv_cache":[...]}.
/// The supervisor asks it before it plans (supervisor/worker_capabilities.h).
int cmd_capabilities(const std::vector<std::string>& args);
int cmd_load(const std::vector<std::string>& args);
int cmd_unload(const std::vector<std::string>& args);
/// `tokenize`: prints a model's token ids for a text (worker/tokenize_command.cpp).
int cmd_tokenize(const std::vector<std::string>& args);

}  // namespace ds4
