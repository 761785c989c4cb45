// GGUF reader and writer: the real model, every value type, and every defect
// the reader must refuse with a message that names the place.

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shared/error.h"
#include "shared/gguf.h"
#include "shared/gguf_writer.h"

using namespace ds4;
using namespace ds4::gguf;

namespace {

const std::string kStories = std::string(DS4_SHARED_MODELS) + "/stories260K.gguf";

// Builds GGUF bytes field by field, so tests can write what the Writer refuses to.
struct Raw {
  std::vector<uint8_t> b;
  template <class T>
  Raw& put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof v);
    return *this;
  }
  Raw& str(std::string_view s) {
    put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Raw& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    b.insert(b.end(), {'G', 'G', 'U', 'F'});
    return put<uint32_t>(version).put<uint64_t>(n_tensors).put<uint64_t>(n_kv);
  }
  Raw& kv_u32(std::string_view key, uint32_t v) { return str(key).put<uint32_t>(4).put<uint32_t>(v); }
  Raw& tensor(std::string_view name, std::vector<uint64_t> dims, uint32_t type, uint64_t offset) {
    str(name).put<uint32_t>(uint32_t(dims.size()));
    for (uint64_t d : dims) put<uint64_t>(d);
    return put<uint32_t>(type).put<uint64_t>(offset);
  }
  Raw& pad(uint64_t align = 32) {
    while (b.size() % align) b.push_back(0);
    return *this;
  }
  Raw& zeros(uint64_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

// The reader's message for `bytes`, or "" when it parses.
std::string parse_error(const std::vector<uint8_t>& bytes, ParseOptions opts = {}) {
  try {
    File::parse(bytes, "m.gguf", opts);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string temp_path(const std::string& leaf) {
  return (std::filesystem::temp_directory_path() / ("ds4-test-" + std::to_string(::getpid()) + "-" + leaf)).string();
}

// A small valid file: metadata of several types and two tensors.
Writer small_writer() {
  Writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 2);
  w.set_f32_array("tokenizer.ggml.scores", {0.5f, -1.0f, 2.0f});
  w.set_string_array("tokenizer.ggml.tokens", {"<unk>", "a", "bc"});
  std::vector<uint8_t> a(4 * 8);
  for (size_t i = 0; i < a.size(); ++i) a[i] = uint8_t(i);
  w.add_tensor("a", {8}, GgmlType::F32, a);
  w.add_tensor("b", {4, 2}, GgmlType::F16, std::vector<uint8_t>(16, 7));
  return w;
}

}  // namespace

TEST_CASE("gguf: parses stories260K") {
  const File f = File::open(kStories);
  CHECK(f.version() == 3);
  CHECK(f.metadata().size() == 19);
  CHECK(f.tensors().size() == 48);
  CHECK(f.alignment() == 32);
  CHECK(f.data_offset() % 32 == 0);
  CHECK(f.header_bytes() <= f.data_offset());
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_int("llama.block_count") == 5);
  CHECK(f.get_int("llama.embedding_length") == 64);
  CHECK(f.get_float("llama.attention.layer_norm_rms_epsilon").value() == doctest::Approx(1e-5));
  const auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  REQUIRE(tokens);
  CHECK(tokens->size() == 512);
  CHECK(f.get_float_array("tokenizer.ggml.scores")->size() == 512);
  CHECK(f.get_int_array("tokenizer.ggml.token_type")->size() == 512);
  CHECK(f.get_int("tokenizer.ggml.bos_token_id") == 1);
  CHECK_FALSE(f.get_string("no.such.key"));
  for (const TensorInfo& t : f.tensors()) {
    CHECK(t.type == GgmlType::F32);
    CHECK(t.n_bytes == t.n_elements * 4);
    CHECK(f.tensor_data(t).size() == t.n_bytes);
  }
  const TensorInfo* emb = f.find_tensor("token_embd.weight");
  REQUIRE(emb);
  CHECK(emb->dims == std::vector<uint64_t>{64, 512});
  const TensorInfo* out = f.find_tensor("output.weight");
  REQUIRE(out);
  const auto a = f.tensor_data(*emb), b = f.tensor_data(*out);
  CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);  // SOURCES.md: a bit-identical copy
}

TEST_CASE("gguf: header blob parses without its tensor data") {
  const File f = File::open(kStories);
  const auto blob = f.bytes().first(f.data_offset());
  ParseOptions lax;
  lax.check_tensor_data = false;
  const File meta = File::parse(blob, "blob", lax);
  CHECK(meta.tensors().size() == 48);
  CHECK(meta.metadata().size() == 19);
  CHECK_THROWS_WITH_AS(meta.tensor_data(meta.tensors()[0]), doctest::Contains("not inside the parsed bytes"), Error);
  CHECK_THROWS_WITH_AS(File::parse(blob, "blob"), doctest::Contains("runs past end of file"), Error);
}

TEST_CASE("gguf: writer round-trips every value type") {
  Writer w;
  w.set("u8", make_uint(ValueType::UINT8, 200));
  w.set("i8", make_int(ValueType::INT8, -100));
  w.set("u16", make_uint(ValueType::UINT16, 60000));
  w.set("i16", make_int(ValueType::INT16, -30000));
  w.set_u32("u32", 4000000000u);
  w.set_i32("i32", -2000000000);
  w.set_f32("f32", 1.5f);
  w.set_bool("bool", true);
  w.set_string("string", std::string("h\0llo", 5));
  w.set_u64("u64", UINT64_MAX);
  w.set_i64("i64", INT64_MIN);
  w.set_f64("f64", 0.1);
  w.set_i32_array("ints", {1, -2, 3});
  w.set_string_array("strings", {"x", "", "yz"});
  w.set("empty", make_array(ValueType::UINT8, {}));
  w.set("nested", make_array(ValueType::ARRAY, {make_array(ValueType::INT64, {make_int(ValueType::INT64, -7)}),
                                                make_array(ValueType::STRING, {make_string("deep")})}));
  w.set_u32("u32", 4000000001u);  // replaces in place
  w.set_u32("general.alignment", 64);
  w.add_tensor("f32", {3}, GgmlType::F32, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  w.add_tensor("q8", {32, 2}, GgmlType::Q8_0, std::vector<uint8_t>(68, 0x5a));
  w.add_tensor_generated("q4k", {256}, GgmlType::Q4_K, [](uint8_t* out, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) out[i] = uint8_t(i * 3);
  });
  const std::vector<uint8_t> bytes = w.to_bytes();
  const File f = File::parse(bytes, "round-trip");

  CHECK(f.version() == 3);
  CHECK(f.metadata().size() == 17);
  CHECK(f.find("u8")->type == ValueType::UINT8);
  CHECK(f.find("u8")->u == 200);
  CHECK(f.find("i8")->i == -100);
  CHECK(f.find("u16")->u == 60000);
  CHECK(f.find("i16")->i == -30000);
  CHECK(f.get_int("u32") == 4000000001LL);
  CHECK(f.get_int("i32") == -2000000000);
  CHECK(f.get_float("f32") == 1.5);
  CHECK(f.get_bool("bool") == true);
  CHECK(f.get_string("string") == std::string("h\0llo", 5));
  CHECK(f.find("u64")->u == UINT64_MAX);
  CHECK(f.get_int("i64") == INT64_MIN);
  CHECK(f.get_float("f64") == 0.1);
  CHECK(f.get_int_array("ints") == std::vector<int64_t>{1, -2, 3});
  CHECK(f.get_string_array("strings") == std::vector<std::string>{"x", "", "yz"});
  CHECK(f.find("empty")->array.empty());
  const Value* nested = f.find("nested");
  REQUIRE(nested);
  CHECK(nested->elem_type == ValueType::ARRAY);
  REQUIRE(nested->array.size() == 2);
  CHECK(nested->array[0].array.at(0).i == -7);
  CHECK(nested->array[1].array.at(0).str == "deep");

  CHECK(f.alignment() == 64);
  CHECK(f.data_offset() % 64 == 0);
  CHECK(bytes.size() % 64 == 0);
  REQUIRE(f.tensors().size() == 3);
  for (const TensorInfo& t : f.tensors()) CHECK(t.offset % 64 == 0);
  CHECK(f.tensor_data(*f.find_tensor("f32"))[11] == 12);
  CHECK(f.find_tensor("q8")->n_bytes == 68);
  const auto q4k = f.tensor_data(*f.find_tensor("q4k"));
  REQUIRE(q4k.size() == 144);
  CHECK(q4k[10] == 30);

  // write() streams the same bytes to disk.
  const std::string path = temp_path("roundtrip.gguf");
  w.write(path);
  const File g = File::open(path);
  CHECK(std::vector<uint8_t>(g.bytes().begin(), g.bytes().end()) == bytes);
  std::filesystem::remove(path);
}

TEST_CASE("gguf: writer refuses inconsistent tensors") {
  Writer w;
  CHECK_THROWS_WITH_AS(w.add_tensor("t", {4}, GgmlType::F32, std::vector<uint8_t>(15)),
                       doctest::Contains("'t' has 15 bytes"), Error);
  CHECK_THROWS_WITH_AS(w.add_tensor("q", {31}, GgmlType::Q8_0, {}), doctest::Contains("block size 32"), Error);
  w.add_tensor("t", {4}, GgmlType::F32, std::vector<uint8_t>(16));
  CHECK_THROWS_WITH_AS(w.add_tensor("t", {4}, GgmlType::F32, std::vector<uint8_t>(16)),
                       doctest::Contains("duplicate tensor 't'"), Error);
  CHECK_THROWS_AS(w.write("/nonexistent-dir/x.gguf"), Error);
}

TEST_CASE("gguf: the writer replaces only a regular file, and writes through a symlink") {
  const Writer w = small_writer();
  // /dev/null was renamed over (a regular file then) when ds4-mkmodel ran as root.
  CHECK_THROWS_WITH_AS(w.write("/dev/null"), "/dev/null is not a regular file: a model is written to a new file or over a regular one",
                       Error);
  CHECK(std::filesystem::is_character_file("/dev/null"));
  const auto dir = std::filesystem::temp_directory_path() / ("ds4-writer-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "folder");
  CHECK_THROWS_WITH_AS(w.write((dir / "folder").string()), doctest::Contains("is not a regular file"), Error);
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(w.write((dir / "fifo").string()), doctest::Contains("is not a regular file"), Error);
  // Read as a model: refused at once (opening it waited for a writer).
  CHECK_THROWS_WITH_AS(File::open((dir / "fifo").string()), ((dir / "fifo").string() + ": not a regular file").c_str(), Error);
  // More than the disk holds: refused before a byte is written (it used to fill the disk).
  Writer huge = small_writer();
  huge.add_tensor_generated("big", {uint64_t(1) << 50}, GgmlType::F32, [](uint8_t*, uint64_t) { FAIL("generated"); });
  CHECK_THROWS_WITH_AS(huge.write((dir / "huge.gguf").string()), doctest::Contains("MB free"), Error);
  CHECK(std::filesystem::is_empty(dir / "folder"));
  CHECK_FALSE(std::filesystem::exists(dir / "huge.gguf"));
  std::filesystem::create_symlink(dir / "real.gguf", dir / "link.gguf");
  w.write((dir / "link.gguf").string());
  CHECK(std::filesystem::is_symlink(dir / "link.gguf"));  // still a link, to the model
  CHECK(File::open((dir / "real.gguf").string()).tensors().size() == 2);
  std::filesystem::remove_all(dir);
}

TEST_CASE("gguf: version 2 parses, 1 and 4 are refused") {
  std::vector<uint8_t> bytes = small_writer().to_bytes();
  bytes[4] = 2;
  const File f = File::parse(bytes, "v2.gguf");
  CHECK(f.version() == 2);
  CHECK(f.tensors().size() == 2);
  bytes[4] = 1;
  CHECK(parse_error(bytes) == "m.gguf: offset 4: GGUF version 1 is not supported (expected 2 or 3; convert the file "
                              "with a current llama.cpp)");
  bytes[4] = 4;
  CHECK(parse_error(bytes) == "m.gguf: offset 4: unsupported GGUF version 4 (expected 2 or 3)");
}

TEST_CASE("gguf: truncation at every byte offset is an error, never a crash") {
  const std::vector<uint8_t> bytes = small_writer().to_bytes();
  const File whole = File::parse(bytes, "whole");
  uint64_t data_end = 0;
  for (const TensorInfo& t : whole.tensors()) data_end = std::max(data_end, whole.data_offset() + t.offset + t.n_bytes);
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + long(n));
    const std::string err = parse_error(cut);
    if (n < data_end) {
      INFO("cut at ", n);
      CHECK(err.rfind("m.gguf: offset ", 0) == 0);
    } else {
      CHECK(err == "");  // only the final padding is missing
    }
  }
}

TEST_CASE("gguf: typed getters name the key and both types") {
  const std::vector<uint8_t> bytes = small_writer().to_bytes();
  const File f = File::parse(bytes, "m.gguf");
  CHECK_THROWS_WITH_AS(f.get_string("llama.block_count"),
                       "m.gguf: key 'llama.block_count': expected string, got uint32", Error);
  CHECK_THROWS_WITH_AS(f.get_int("general.architecture"),
                       "m.gguf: key 'general.architecture': expected an integer, got string", Error);
  CHECK_THROWS_WITH_AS(f.get_bool("llama.block_count"), "m.gguf: key 'llama.block_count': expected bool, got uint32",
                       Error);
  CHECK_THROWS_WITH_AS(f.get_float("general.architecture"), doctest::Contains("expected a number, got string"), Error);
  CHECK_THROWS_WITH_AS(f.get_string_array("tokenizer.ggml.scores"),
                       "m.gguf: key 'tokenizer.ggml.scores': expected array of string, got array of float32", Error);
  CHECK_THROWS_WITH_AS(f.get_int_array("tokenizer.ggml.tokens"),
                       "m.gguf: key 'tokenizer.ggml.tokens': expected array of integers, got array of string", Error);
  CHECK_THROWS_WITH_AS(f.get_float_array("llama.block_count"), doctest::Contains("got uint32"), Error);
  CHECK(f.get_float("llama.block_count") == 2.0);

  Writer w;
  w.set_u64("big", UINT64_MAX);
  const auto b2 = w.to_bytes();
  const File g = File::parse(b2, "m.gguf");
  CHECK_THROWS_WITH_AS(g.get_int("big"), doctest::Contains("key 'big': 18446744073709551615 does not fit int64"),
                       Error);
}

TEST_CASE("gguf: open names the path") {
  CHECK_THROWS_WITH_AS(File::open("/nonexistent/m.gguf"), "/nonexistent/m.gguf: cannot open: No such file or directory",
                       Error);
  CHECK_THROWS_WITH_AS(File::open("/tmp"), "/tmp: not a regular file", Error);
  const std::string empty = temp_path("empty.gguf");
  std::ofstream(empty).close();
  CHECK_THROWS_WITH_AS(File::open(empty), doctest::Contains((empty + ": offset 0: file ends inside the magic").c_str()), Error);
  std::filesystem::remove(empty);
}

TEST_CASE("gguf: defects in the header and metadata name the place") {
  SUBCASE("bad magic") {
    std::vector<uint8_t> b = small_writer().to_bytes();
    b[0] = 'X';
    CHECK(parse_error(b) == "m.gguf: offset 0: bad magic: expected 'GGUF' (47 47 55 46), this is not a GGUF file");
  }
  SUBCASE("metadata count larger than the file") {
    Raw r;
    r.header(0, 1000000);
    CHECK(parse_error(r.b) == "m.gguf: offset 16: metadata count 1000000 cannot fit in the 0 bytes left (size 24)");
  }
  SUBCASE("tensor count larger than the file") {
    Raw r;
    r.header(UINT64_MAX, 0).zeros(40);
    CHECK(parse_error(r.b) == "m.gguf: offset 24: tensor count 18446744073709551615 cannot fit in the 40 bytes left "
                              "(size 64)");
  }
  SUBCASE("key length past end of file") {
    Raw r;
    r.header(0, 1).put<uint64_t>(9999999).zeros(10);
    CHECK(parse_error(r.b) == "m.gguf: offset 24: metadata key 0: string length 9999999 runs past end of file "
                              "(size 42)");
  }
  SUBCASE("string value past end of file") {
    Raw r;
    r.header(0, 1).str("k").put<uint32_t>(8).put<uint64_t>(UINT64_MAX);
    CHECK(parse_error(r.b) == "m.gguf: offset 37: metadata key 0 'k': string length 18446744073709551615 runs past "
                              "end of file (size 45)");
  }
  SUBCASE("array length past end of file") {
    Raw r;
    r.header(0, 1).str("arr").put<uint32_t>(9).put<uint32_t>(4).put<uint64_t>(1u << 30).zeros(16);
    CHECK(parse_error(r.b) == "m.gguf: offset 43: metadata key 0 'arr': array of 1073741824 uint32 elements runs "
                              "past end of file (size 67)");
  }
  SUBCASE("unknown value type") {
    Raw r;
    r.header(0, 1).str("k").put<uint32_t>(13).zeros(8);
    CHECK(parse_error(r.b) == "m.gguf: offset 33: metadata key 0 'k': unknown value type 13 (expected 0..12)");
  }
  SUBCASE("unknown array element type") {
    Raw r;
    r.header(0, 1).str("k").put<uint32_t>(9).put<uint32_t>(77).put<uint64_t>(1).zeros(8);
    CHECK(parse_error(r.b) == "m.gguf: offset 37: metadata key 0 'k' element: unknown value type 77 (expected 0..12)");
  }
  SUBCASE("arrays nested too deep") {
    Raw r;
    r.header(0, 1).str("k").put<uint32_t>(9);
    for (int i = 0; i < 20; ++i) r.put<uint32_t>(9).put<uint64_t>(1);
    r.put<uint32_t>(0).put<uint64_t>(0);
    CHECK(parse_error(r.b).find("arrays nested deeper than 8 levels") != std::string::npos);
  }
  SUBCASE("truncated value") {
    Raw r;
    r.header(0, 1).str("k").put<uint32_t>(10).zeros(3);
    CHECK(parse_error(r.b) == "m.gguf: offset 37: file ends inside metadata key 0 'k': need 8 bytes, 3 left (size 40)");
  }
  SUBCASE("duplicate key") {
    Raw r;
    r.header(0, 2).kv_u32("general.alignment", 32).kv_u32("general.alignment", 64);
    CHECK(parse_error(r.b) == "m.gguf: offset 57: metadata key 1 'general.alignment': duplicate key");
  }
  SUBCASE("alignment not a power of two") {
    Raw r;
    r.header(0, 1).kv_u32("general.alignment", 48);
    CHECK(parse_error(r.b) == "m.gguf: key 'general.alignment': 48 is not a power of two up to 2^30");
  }
  SUBCASE("alignment zero") {
    Raw r;
    r.header(0, 1).kv_u32("general.alignment", 0);
    CHECK(parse_error(r.b) == "m.gguf: key 'general.alignment': expected a positive integer, got uint32");
  }
  SUBCASE("alignment of the wrong type") {
    Raw r;
    r.header(0, 1).str("general.alignment").put<uint32_t>(8).str("32");
    CHECK(parse_error(r.b) == "m.gguf: key 'general.alignment': expected a positive integer, got string");
  }
}

TEST_CASE("gguf: defects in the tensor directory name the tensor") {
  // Directory of one or two tensors starting at offset 24 (no metadata), then data.
  auto file = [](auto&& add_tensors, uint64_t data_bytes) {
    Raw r;
    add_tensors(r);
    r.pad();
    r.zeros(data_bytes);
    return r.b;
  };
  SUBCASE("n_dims 0") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {}, 0, 0); }, 32);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': n_dims 0 (expected 1..4)");
  }
  SUBCASE("n_dims 5") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {1, 1, 1, 1, 1}, 0, 0); }, 32);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': n_dims 5 (expected 1..4)");
  }
  SUBCASE("zero dimension") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {4, 0}, 0, 0); }, 32);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': dimension 1 is 0 (expected >= 1)");
  }
  SUBCASE("element count overflows") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {1ull << 32, 1ull << 32}, 0, 0); }, 32);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': element count overflows 64 bits at dimension 1");
  }
  SUBCASE("byte size overflows") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {1ull << 62}, 0, 0); }, 32);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': byte size overflows 64 bits");
  }
  SUBCASE("unknown ggml type") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {4}, 4, 0); }, 32);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': unknown ggml type 4");
  }
  SUBCASE("ne[0] not a multiple of the block size") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {31, 2}, 8, 0); }, 96);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': ne[0] = 31 is not a multiple of the Q8_0 block size 32");
  }
  SUBCASE("offset not aligned") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {4}, 0, 8); }, 64);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 't': data offset 8 is not a multiple of the alignment 32");
  }
  SUBCASE("data past end of file") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("blk.0.attn_q.weight", {1000}, 0, 32); }, 100);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 'blk.0.attn_q.weight': data [128, 4128) runs past end of file "
                            "(size 196)");
  }
  SUBCASE("data offset overflows") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {4}, 0, UINT64_MAX - 31); }, 32);
    CHECK(parse_error(b).find("m.gguf: offset 24: tensor 't': data offset 18446744073709551584 + size 16 overflows") ==
          0);
  }
  SUBCASE("overlapping tensors") {
    const auto b = file([](Raw& r) { r.header(2, 0).tensor("a", {16}, 0, 0).tensor("b", {4}, 0, 32); }, 96);
    CHECK(parse_error(b) == "m.gguf: offset 57: tensor 'b': data [128, 144) overlaps tensor 'a' [96, 160)");
  }
  SUBCASE("duplicate tensor name") {
    const auto b = file([](Raw& r) { r.header(2, 0).tensor("a", {4}, 0, 0).tensor("a", {4}, 0, 32); }, 64);
    CHECK(parse_error(b) == "m.gguf: offset 57: tensor 'a': duplicate tensor name");
  }
  SUBCASE("name too long") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor(std::string(300, 'x'), {4}, 0, 0); }, 32);
    CHECK(parse_error(b) == "m.gguf: offset 24: tensor 0 name: length 300 exceeds the limit of 255 bytes");
  }
  SUBCASE("truncated directory") {
    Raw r;
    r.header(1, 0).str("t").put<uint32_t>(4).put<uint64_t>(4).put<uint64_t>(4).put<uint64_t>(4);
    CHECK(parse_error(r.b) == "m.gguf: offset 61: file ends inside tensor 't' dimension 3: need 8 bytes, 0 left "
                              "(size 61)");
  }
  SUBCASE("the reader accepts any known type; computing it is not its business") {
    const auto b = file([](Raw& r) { r.header(1, 0).tensor("t", {256}, uint32_t(GgmlType::Q4_K), 0); }, 160);
    CHECK(parse_error(b) == "");
  }
}
