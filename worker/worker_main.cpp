// ds4-worker: runs the engine on a model in shared memory.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <systemd/sd-daemon.h>

#include "shared/crash_report.h"
#include "shared/error.h"
#include "shared/log.h"
#include "worker/commands.h"

static const char* kUsage =
    "usage: ds4-worker COMMAND [options]\n"
    "  run    --model FILE -p TEXT -n N [--temp T] [--seed S] [--top-k K] [--top-p P] [--min-p P]\n"
    "         [--context N] [--threads T] [--device auto|cpu|cuda:N] [--json]   one-shot generation\n"
    "         [--router-gaps]  with --json on a mixture of experts: each position's smallest\n"
    "                          margin (nats) between a chosen expert and the best unchosen one\n"
    "  bench  --model FILE [-p 128] [-n 128] [-r 3] [-d 0] [--context N] [--threads T] [--device auto|cpu|cuda:N]\n"
    "                                                 prompt and generation speed, one JSON line\n"
    "  perplexity --model FILE -f TEXT [--context N (512)] [--chunks N] [--threads T] [--device D] [--kv-cache K]\n"
    "         the text's perplexity in chunks of N tokens, the second half of each scored, as llama-perplexity\n"
    "         [--save-logits OUT]  also save each scored position's log-probs (n_vocab x 2 bytes each)\n"
    "         [--kl-divergence BASE]  KL divergence, same top and PPL against BASE (a --save-logits file\n"
    "                                 of the same text, context and vocabulary; -f may be left out)\n"
    "         [--json]  the figures as one JSON line on stdout, the chunks' lines on stderr\n"
    "         (--ctx is another name for --context, in every command)\n"
    "  serve  (--segment SEGMENT | --model FILE) --socket PATH [--context N] [--slots N]\n"
    "         [--threads T] [--device auto|cpu|cuda:N] [--id N] the worker daemon\n"
    "         [--busy-poll-us U]  poll U us once idle before sleeping (default 0, or $DS4_BUSY_POLL_US)\n"
    "         [--batch B]  prompt tokens per step, a long prompt in chunks (default 256, or $DS4_PREFILL_CHUNK)\n"
    "  engine --port P --command TEMPLATE [--context N] [--slots N] [--threads T] [--model FILE] [--id N]\n"
    "         [--start-timeout MS]  an external OpenAI-compatible server as the worker ({ctx} {port} ...)\n"
    "  hold   (--segment SEGMENT | --model FILE) [--device cuda:N] [--socket PATH]\n"
    "                                                 keep the weights on a GPU for the workers\n"
    "  SEGMENT (serve, hold, bench): a shared-memory segment's name (ds4-model-..., in /dev/shm),\n"
    "         or memfd:NAME for a model the supervisor keeps in a memfd (when /dev/shm cannot\n"
    "         hold it, or model.backing: memfd): its descriptor comes from the supervisor's socket\n"
    "         [--segment-socket PATH] (default $DS4_SEGMENT_SOCKET, else\n"
    "         $XDG_RUNTIME_DIR/ds4/segments.sock). No supervisor there: the worker exits with an\n"
    "         error at once; one that does not answer: after 10 s\n"
    "  GPU weights (run, bench, serve): --gpu-weights auto|holder|copy|host-mapped\n"
    "         [--holder-socket PATH]  (default $XDG_RUNTIME_DIR/ds4/holder-cudaN.sock)\n"
    "  KV cache (run, bench, serve): --kv-cache f16|q8_0  how K and V are kept (q8_0: 53% of f16's\n"
    "         memory; default f16, or for serve $DS4_KV_CACHE)\n"
    "  MoE experts on the host (run, bench, serve): --host-experts N  the first N layers' experts\n"
    "         are computed by the CPU from shared memory (bench: a list N,M,... measures each rung;\n"
    "         default $DS4_HOST_EXPERTS); [--holder-experts M] the holder's image lacks the first M\n"
    "         layers' (default N, or $DS4_HOLDER_EXPERTS); hold --host-experts M holds that image\n"
    "  capabilities (or --capabilities)  what this build runs, one JSON line: its backends\n"
    "         (cpu, cuda), weight types and KV cache types\n"
    "  load   --model FILE [--force]                  load into shared memory, print the segment\n"
    "  unload (--model FILE | --segment NAME)         remove a model's segment\n"
    "  tokenize --model FILE (-p TEXT | --file F | --lines F) [--special] [--escape] [--no-bos]\n"
    "         print the token ids (--special: control tokens' texts are tokens; --lines: one\n"
    "         JSON string a line, one line of ids each)\n";

int main(int argc, char** argv) {
  if (argc >= 2 && !std::strcmp(argv[1], "--capabilities")) argv[1] = const_cast<char*>("capabilities");
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  ds4::install_crash_report("ds4-worker");
  ds4::log::set_identifier("ds4-worker");
  try {
    if (cmd == "run") return ds4::cmd_run(args);
    if (cmd == "bench") return ds4::cmd_bench(args);
    if (cmd == "perplexity") return ds4::cmd_perplexity(args);
    if (cmd == "serve") return ds4::cmd_serve(args);
    if (cmd == "engine") return ds4::cmd_engine(args);
    if (cmd == "hold") return ds4::cmd_hold(args);
    if (cmd == "capabilities") return ds4::cmd_capabilities(args);
    if (cmd == "load") return ds4::cmd_load(args);
    if (cmd == "unload") return ds4::cmd_unload(args);
    if (cmd == "tokenize") return ds4::cmd_tokenize(args);
    std::fprintf(stderr, "ds4-worker: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return 2;
  } catch (const ds4::DoesNotFit& e) {
    ds4::log::error(cmd + ": " + e.what());
    sd_notify(0, (std::string("STATUS=error: ") + e.what()).c_str());
    return ds4::kExitDoesNotFit;  // the supervisor goes one rung down
  } catch (const ds4::Error& e) {
    ds4::log::error(cmd + ": " + e.what());
    // The supervisor (or systemctl status) shows why the worker failed.
    sd_notify(0, (std::string("STATUS=error: ") + e.what()).c_str());
    return 1;
  } catch (const std::exception& e) {
    ds4::log::error(cmd + ": unexpected error: " + e.what());
    return 1;
  }
}
