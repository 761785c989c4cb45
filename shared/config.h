#pragma once
/// config/ds4.yaml: the typed configuration, its loader and validator.
///
/// Every key has a default (the member initialisers below, the same as the
/// comments in config/ds4.yaml); a file with only model.path works, and an
/// empty or missing file gives all defaults. Loading validates everything
/// before anything starts and throws one ds4::Error listing every problem,
/// one per line, each as `file:line:column: what is wrong`, e.g.
///   config/ds4.yaml:12:3: unknown key 'ladderr' (did you mean 'ladder'?)
///   config/ds4.yaml:20:12: workers.reserve: expected a size like 4GiB, got 'lots'
///
/// Units. Sizes: a plain integer is bytes; B; KiB, MiB, GiB, TiB are powers
/// of 1024; kB/KB, MB, GB, TB are powers of 1000 (as disks and `free --si`
/// count); a bare K, M, G or T is rejected as ambiguous. Fractions are allowed
/// (`1.5GiB`). Durations: ms, s, m, h (`500ms`, `30s`, `10m`, `1.5h`); a bare
/// `0` means zero. Size units are case-insensitive; duration units are
/// lower-case.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ds4 {

/// Context sizes a worker takes (tokens per slot): the ladder's rungs and
/// ds4-worker's --context.
inline constexpr std::int64_t kMinContext = 16;
inline constexpr std::int64_t kMaxContext = 16 * 1024 * 1024;

using Bytes = std::uint64_t;
using Duration = std::chrono::milliseconds;

struct ListenAddress {
  std::string host = "127.0.0.1";  // an IPv4 or IPv6 literal (IPv6 without brackets)
  std::uint16_t port = 8080;       // 0 = any free port (tests)
  bool is_loopback() const;
  std::string str() const;         // "127.0.0.1:8080", "[::1]:8080"
  bool operator==(const ListenAddress&) const = default;
};

/// What holds the loaded model: a named segment in /dev/shm, or a memfd the
/// supervisor keeps (when /dev/shm is too small for the model).
enum class ModelBacking { automatic, shm, memfd };

struct ModelConfig {
  std::filesystem::path path;  // absolute once loaded; empty = none configured
  std::string name;            // served at /v1/models; defaults to path's stem
  ModelBacking backing = ModelBacking::automatic;
  /// Exec engines load the file themselves: the supervisor maps it and keeps
  /// its pages resident (MADV_WILLNEED + mlock, else re-touched now and
  /// then), so an engine's restart reads no disk. nullopt = auto: on for
  /// workers.engine exec, off for native workers (their segment is resident).
  std::optional<bool> keep_resident;
  /// The loader puts the segment in 2 MiB pages (MADV_COLLAPSE, behind the
  /// copy): CPU decoding streams them up to 1.4x faster. Off: 4 KiB pages
  /// unless the machine gives larger ones itself; a load from the page cache
  /// is then quicker (the collapse copies each page again).
  bool huge_pages = true;
  bool operator==(const ModelConfig&) const = default;
};

struct QueueConfig {
  std::uint32_t max_waiting = 256;  // more waiting → 503 with Retry-After
  Duration max_wait = std::chrono::minutes(10);
  bool operator==(const QueueConfig&) const = default;
};

/// Limits on everything a client controls.
struct LimitsConfig {
  Bytes max_header_bytes = 64 * 1024;             // request line + headers
  Bytes max_body_bytes = 16 * 1024 * 1024;        // more → 413
  Duration request_timeout = std::chrono::minutes(30);  // whole request, queueing included
  Duration header_timeout = std::chrono::seconds(30);   // to receive the headers
  Duration body_timeout = std::chrono::seconds(30);     // to receive the body, once the headers are in
  std::uint32_t max_connections = 512;
  std::uint32_t max_tokens_per_request = 32768;   // prompt + generated
  bool allow_insecure_bind = false;  // serve a non-loopback address without api keys
  bool operator==(const LimitsConfig&) const = default;
};

struct ProxyConfig {
  ListenAddress listen;
  std::filesystem::path api_keys_file;  // absolute once loaded; empty = no auth
  QueueConfig queue;
  LimitsConfig limits;
  /// How long the proxy's thread keeps polling after its last ready event
  /// before it sleeps: a reply that comes meanwhile skips a wake-up. nullopt
  /// = auto (busy_poll_for()).
  std::optional<std::chrono::microseconds> busy_poll;
  /// Responses API answers kept for previous_response_id (the most recent
  /// ones); 0 = none kept (such a request is then a 400).
  std::uint32_t responses_store = 256;
  bool operator==(const ProxyConfig&) const = default;
};

enum class WorkerBackend { automatic, systemd, process };
enum class WorkerEngine { native, exec };

/// A busy poll (proxy.busy_poll, workers.busy_poll): the configured one, or
/// for auto 100us on a machine with 8 or more cores and none on a smaller one
/// (where the spin would take the CPU the worker and the clients need).
std::chrono::microseconds busy_poll_for(const std::optional<std::chrono::microseconds>& setting);

struct Device {
  enum class Kind { automatic, cpu, cuda };
  Kind kind = Kind::automatic;
  int index = 0;            // cuda:N
  std::string str() const;  // "auto", "cpu", "cuda:0"
  bool operator==(const Device&) const = default;
};

struct WorkersConfig {
  WorkerBackend backend = WorkerBackend::automatic;
  std::uint32_t count = 1;
  Device device;
  std::uint32_t slots = 2;    // concurrent sequences per worker
  std::uint32_t threads = 0;  // CPU threads; 0 = all cores
  /// The most prompt tokens one engine step takes (ds4-worker serve --batch):
  /// a long prompt is prefilled in chunks this size, each step also
  /// advancing every generating slot by a token. Smaller: shorter stalls
  /// of the running streams while a long prompt arrives, slower prefill.
  std::uint32_t prefill_chunk = 256;
  /// How long a worker's thread keeps polling its sockets once idle, before
  /// it sleeps: the next request then skips a wake-up. nullopt = auto
  /// (busy_poll_for()).
  std::optional<std::chrono::microseconds> busy_poll;
  std::vector<std::uint32_t> ladder = {32768, 16384, 8192, 4096, 2048};  // tokens per slot, descending (agents send 15-30K-token prompts)
  /// A mixture-of-experts model on a GPU: the expert rungs, each the number
  /// of layers (the first ones) whose experts stay on the host and are
  /// computed by the CPU, ascending. The memory policy walks them at the
  /// largest context before it shrinks the context: OOM or low GPU headroom
  /// at [0, 4, 8] moves 0 -> 4 -> 8, then context down with 8; a step up
  /// retraces that path. The GPU holder keeps only what the last rung keeps
  /// on the device. Ignored (with a note) for a dense model or CPU workers.
  std::vector<std::uint32_t> moe_offload = {0};
  /// How workers keep their KV cache, as rungs from the most memory to the
  /// least: "f16", "q8_0" (53% of f16's memory, values rounded to 8 bits per
  /// 32-value block). [f16, q8_0]: at the largest context the memory policy
  /// first moves to a q8_0 cache, then (a mixture of experts on a GPU) walks
  /// the expert rungs, then shrinks the context with the last of each; a step
  /// up retraces that path. A single value (`kv_cache: q8_0`) is one rung.
  std::vector<std::string> kv_cache = {"f16"};
  Bytes memory_max = 0;       // systemd MemoryMax= per worker; 0 = none
  Bytes reserve = Bytes(1) << 30;  // kept free when choosing a rung
  WorkerEngine engine = WorkerEngine::native;
  /// engine: exec — the command line of an OpenAI-compatible server, with
  /// {ctx}, {port}, {slots}, {threads}, {model} substituted. Split on blanks
  /// (no shell); {port} is required.
  std::string exec_command;
  /// engine: exec — what the engine takes besides its weights and KV cache
  /// (compute buffers, logits, runtime), for the memory plan of each rung.
  Bytes exec_overhead = Bytes(512) << 20;
  bool operator==(const WorkersConfig&) const = default;
};

struct HeadroomConfig {
  Bytes min_available = Bytes(1) << 30;  // MemAvailable (or GPU free) below this …
  Duration for_ = std::chrono::seconds(10);  // … this long → drain, one rung down
  Duration step_up_after = std::chrono::minutes(30);  // 0 = never
  double psi = 0;  // PSI memory some avg10 (%) above this counts as low headroom; 0 = not used
  bool operator==(const HeadroomConfig&) const = default;
};

struct RestartConfig {
  Duration backoff_initial = std::chrono::seconds(1);  // after the first quick retry
  Duration backoff_max = std::chrono::seconds(60);
  /// A worker that stayed ready this long and then died is a fault, not a
  /// crash loop: it is restarted at once, whatever happened before.
  Duration healthy_after = std::chrono::seconds(3);
  /// A ready worker whose heartbeat is older than this, or whose socket has
  /// not answered for this long, is hung: killed and restarted at its
  /// context. 0 = never (at least 500ms otherwise).
  Duration hang_timeout = std::chrono::seconds(30);
  /// A worker not ready this long after its start is hung there: killed and
  /// started again at its context (as ds4-worker@.service's TimeoutStartSec,
  /// for child-process workers too). 0 = never (at least 1s otherwise).
  Duration start_timeout = std::chrono::minutes(5);
  /// A draining worker still busy after this is stopped anyway (its requests
  /// resume on another worker).
  Duration drain_deadline = std::chrono::seconds(30);
  bool operator==(const RestartConfig&) const = default;
};

enum class GpuWeights { device, host_mapped };

struct GpuConfig {
  GpuWeights weights = GpuWeights::device;
  bool operator==(const GpuConfig&) const = default;
};

/// What the status page (GET /status, `ds4ctl status`) keeps in memory.
struct StatusConfig {
  Duration sample_every = std::chrono::seconds(5);  // headroom, queue, tokens/s, latency: one sample each
  Duration history = std::chrono::hours(1);         // samples kept (history / sample_every of them)
  std::uint32_t events_kept = 2000;                 // decisions kept (those of the last day shown)
  bool operator==(const StatusConfig&) const = default;
};

struct Config {
  ModelConfig model;
  ProxyConfig proxy;
  WorkersConfig workers;
  HeadroomConfig headroom;
  RestartConfig restart;
  GpuConfig gpu;
  StatusConfig status;

  std::filesystem::path file;  // what was loaded, as given; empty for built-in defaults
  bool file_found = false;     // false: the file did not exist, all defaults

  /// Equal settings; `file` and `file_found` are not compared.
  bool operator==(const Config& other) const;
};

struct LoadOptions {
  /// The machine's memory for checks such as reserve < MemTotal;
  /// 0 = read MemTotal from /proc/meminfo.
  Bytes mem_total = 0;
  /// model.path, when set, must name a file (the supervisor's loads; a
  /// test's config may name one that is not there).
  bool model_file_must_exist = false;
};

/// model.keep_resident as it applies: auto is on for exec engines only.
inline bool keep_resident(const Config& c) {
  return c.model.keep_resident.value_or(c.workers.engine == WorkerEngine::exec);
}

/// Reads and validates `file`. A missing file gives the defaults (file_found
/// false); relative paths in it are resolved against its folder.
/// Throws ds4::Error with every problem found, one per line.
Config load_config(const std::filesystem::path& file, const LoadOptions& options = {});

/// The same for YAML text, reported and resolved as if it were `file`.
Config parse_config(const std::string& yaml, const std::filesystem::path& file,
                    const LoadOptions& options = {});

/// What changed between two configs, for reload: which parts can be applied in
/// place and which need a worker drained and restarted.
struct ConfigChanges {
  std::vector<std::string> keys;  // dotted names of every changed key, e.g. "workers.slots"
  bool model = false;             // model.path: new weights, every worker restarts
  bool worker_settings = false;   // what a running worker was started with → drain + restart each
  bool worker_count = false;      // only start or stop the difference
  bool listen = false;            // proxy.listen: rebind
  bool in_place = false;          // the rest (queue, limits, keys, headroom, restart, model.name)

  bool any() const { return !keys.empty(); }
  bool changed(std::string_view key) const;
};

ConfigChanges diff(const Config& before, const Config& after);

/// "4GiB", "512MiB", "1.5GiB" (binary units; exact where possible).
std::string format_size(Bytes bytes);
/// "10m", "30s", "500ms", "1h".
std::string format_duration(Duration d);
/// The unit syntax described at the top; nullopt with `why` set when invalid.
std::optional<Bytes> parse_size(std::string_view text, std::string* why = nullptr);
std::optional<Duration> parse_duration(std::string_view text, std::string* why = nullptr);
/// Levenshtein distance, for "did you mean" suggestions.
std::size_t edit_distance(std::string_view a, std::string_view b);
/// MemTotal from /proc/meminfo in bytes; 0 if it cannot be read.
Bytes read_mem_total();

}  // namespace ds4
