// Calibration: amax -> scales for each granularity (worked by hand), the scales file's exact
// round trip, and one test per class of malformed file, each checked for the file and field named.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "mjolnir/calibrate.h"
#include "mjolnir/error.h"
#include "test_seed.h"

namespace mjolnir {
namespace {

using Json = nlohmann::json;
constexpr float kFloatMin = std::numeric_limits<float>::min();

using testing::expect_error;

// A file path in a fresh temporary directory, removed with the fixture.
class TempDir {
 public:
  TempDir() {
    std::random_device entropy;
    dir_ = std::filesystem::temp_directory_path() /
           ("mjolnir_test_calibrate_" + std::to_string(entropy()));
    std::filesystem::create_directories(dir_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  std::filesystem::path file(const std::string& name) const { return dir_ / name; }

 private:
  std::filesystem::path dir_;
};

// --- scales_from_amax, worked by hand ------------------------------------------------------------

// amax [Hk = 2, D = 4]: head 0 = {112, 448, 0, 224}, head 1 all zero. fp8_e4m3's max is 448.
const std::vector<float> kAmax{112, 448, 0, 224, 0, 0, 0, 0};

TEST(ScalesFromAmax, Tensor) {
  EXPECT_EQ(scales_from_amax(kAmax, Format::fp8_e4m3, ScaleGranularity::tensor, 2, 4),
            std::vector<float>{1.0f});  // 448 / 448
  EXPECT_EQ(scales_from_amax(kAmax, Format::fp8_e4m3, ScaleGranularity::tensor, 2, 4, 2.0),
            std::vector<float>{2.0f});  // 448 / 448 * 2
}

TEST(ScalesFromAmax, HeadWithAZeroHead) {
  // Head 1 never saw a non-zero value: its scale is FLT_MIN, positive and normal.
  EXPECT_EQ(scales_from_amax(kAmax, Format::fp8_e4m3, ScaleGranularity::head, 2, 4),
            (std::vector<float>{1.0f, kFloatMin}));
}

TEST(ScalesFromAmax, Channel) {
  EXPECT_EQ(scales_from_amax(kAmax, Format::fp8_e4m3, ScaleGranularity::channel, 2, 4, 0.5),
            (std::vector<float>{0.125f, 0.5f, kFloatMin, 0.25f, kFloatMin, kFloatMin, kFloatMin,
                                kFloatMin}));
}

TEST(ScalesFromAmax, EachFormatsMaximum) {
  const std::vector<float> amax{3, 1.5f};  // Hk = 1, D = 2
  // fp4_e2m1 max 6: 3 / 6; e2m3 max 7.5; e3m2 max 28; nvfp4 6 * 448 = 2688; fp16 65504.
  EXPECT_EQ(scales_from_amax(amax, Format::fp4_e2m1, ScaleGranularity::channel, 1, 2),
            (std::vector<float>{0.5f, 0.25f}));
  EXPECT_EQ(scales_from_amax(amax, Format::fp6_e2m3, ScaleGranularity::tensor, 1, 2),
            std::vector<float>{0.4f});
  EXPECT_EQ(scales_from_amax(std::vector<float>{7, 14}, Format::fp6_e3m2, ScaleGranularity::channel,
                             1, 2),
            (std::vector<float>{0.25f, 0.5f}));
  EXPECT_EQ(scales_from_amax(std::vector<float>{2688, 1344}, Format::nvfp4,
                             ScaleGranularity::channel, 1, 2),
            (std::vector<float>{1.0f, 0.5f}));
  EXPECT_EQ(
      scales_from_amax(std::vector<float>{65504, 0}, Format::fp16, ScaleGranularity::head, 1, 2),
      std::vector<float>{1.0f});
  EXPECT_EQ(scales_from_amax(std::vector<float>{57344 * 4.0f, 0}, Format::fp8_e5m2,
                             ScaleGranularity::head, 1, 2),
            std::vector<float>{4.0f});
}

TEST(ScalesFromAmax, RejectsBadArguments) {
  expect_error([] { scales_from_amax(kAmax, Format::fp8_e4m3, ScaleGranularity::head, 2, 8); },
               "amax: 8 values, expected 2 heads x 8 channels = 16");
  std::vector<float> negative = kAmax;
  negative[3] = -1;
  expect_error([&] { scales_from_amax(negative, Format::fp8_e4m3, ScaleGranularity::head, 2, 4); },
               "amax[3]: -1 is not a finite non-negative maximum");
  std::vector<float> nan = kAmax;
  nan[6] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { scales_from_amax(nan, Format::fp8_e4m3, ScaleGranularity::head, 2, 4); },
               "amax[6]:");
  expect_error([] { scales_from_amax(kAmax, Format::fp8_e4m3, ScaleGranularity::head, 2, 4, 0.0); },
               "headroom: 0 is not a positive finite factor");
  expect_error([] { scales_from_amax({}, Format::fp8_e4m3, ScaleGranularity::head, 0, 4); },
               "num_kv_heads: 0");
  expect_error([] { scales_from_amax({}, Format::fp8_e4m3, ScaleGranularity::head, 1, 0); },
               "head_dim: 0");
  expect_error(
      [] { scales_from_amax(kAmax, Format::fp8_e4m3, static_cast<ScaleGranularity>(7), 2, 4); },
      "granularity: 7");
}

// --- the scales file -----------------------------------------------------------------------------

// Random positive finite floats over the whole exponent range (subnormals, FLT_MIN and FLT_MAX
// included), the values a shortest-decimal writer is most likely to get wrong.
std::vector<float> awkward_floats(std::size_t count, std::mt19937_64& rng) {
  std::vector<float> values{kFloatMin,
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            0.1f,
                            1.0f / 3.0f,
                            16777217.0f,
                            3.4028233e38f};
  std::uniform_int_distribution<std::uint32_t> bits(1, 0x7F7FFFFF);  // positive finite patterns
  while (values.size() < count) values.push_back(std::bit_cast<float>(bits(rng)));
  values.resize(count);
  return values;
}

ScalesFile sample_file(std::mt19937_64& rng) {
  ScalesFile scales;
  scales.format = Format::fp6_e3m2;
  scales.granularity = ScaleGranularity::channel;
  scales.num_kv_heads = 4;
  scales.head_dim = 64;
  scales.headroom = 1.0 / 3.0;
  for (int layer = 0; layer < 3; ++layer) {
    scales.layers.push_back({awkward_floats(256, rng), awkward_floats(256, rng)});
  }
  return scales;
}

// Fresh per run, printed; MJOLNIR_TEST_SEED replays one.
std::uint64_t seed() { return testing::test_seed(); }

void expect_bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(a[i]), std::bit_cast<std::uint32_t>(b[i]))
        << "value " << i << ": wrote " << a[i] << ", read " << b[i];
  }
}

TEST(ScalesFile, RoundTripIsExact) {
  std::mt19937_64 rng(seed());
  const TempDir dir;
  for (int trial = 0; trial < 20; ++trial) {
    const ScalesFile written = sample_file(rng);
    const auto path = dir.file("scales.json");
    write_scales_file(written, path);
    const ScalesFile read = read_scales_file(path);
    EXPECT_EQ(read.format, written.format);
    EXPECT_EQ(read.granularity, written.granularity);
    EXPECT_EQ(read.num_kv_heads, written.num_kv_heads);
    EXPECT_EQ(read.head_dim, written.head_dim);
    EXPECT_EQ(read.headroom, written.headroom);
    ASSERT_EQ(read.layers.size(), written.layers.size());
    for (std::size_t layer = 0; layer < read.layers.size(); ++layer) {
      expect_bit_equal(read.layers[layer].k_scale, written.layers[layer].k_scale);
      expect_bit_equal(read.layers[layer].v_scale, written.layers[layer].v_scale);
    }
  }
}

TEST(ScalesFile, WrittenFileIsTheDocumentedJson) {
  ScalesFile scales;
  scales.format = Format::fp8_e4m3;
  scales.granularity = ScaleGranularity::head;
  scales.num_kv_heads = 2;
  scales.head_dim = 32;
  scales.layers = {{{0.5f, 0.1f}, {2.0f, 3.0f}}};
  const TempDir dir;
  write_scales_file(scales, dir.file("s.json"));
  std::ifstream file(dir.file("s.json"));
  const Json json = Json::parse(file);
  EXPECT_EQ(json["mjolnir_scales_version"], 1);
  EXPECT_EQ(json["format"], "fp8_e4m3");
  EXPECT_EQ(json["granularity"], "head");
  EXPECT_EQ(json["num_kv_heads"], 2);
  EXPECT_EQ(json["head_dim"], 32);
  EXPECT_EQ(json["headroom"], 1.0);
  EXPECT_EQ(json["layers"][0]["k_scale"][1].get<double>(), 0.1);  // shortest form of 0.1f
  EXPECT_EQ(json["layers"][0]["v_scale"][1].get<double>(), 3.0);
}

TEST(ScalesFile, WriteRejectsAnInconsistentFileAndWritesNothing) {
  const TempDir dir;
  ScalesFile scales;
  scales.format = Format::fp8_e4m3;
  scales.granularity = ScaleGranularity::head;
  scales.num_kv_heads = 2;
  scales.head_dim = 32;
  scales.layers = {{{0.5f, 0.25f}, {1.0f}}};
  const auto path = dir.file("bad.json");
  expect_error([&] { write_scales_file(scales, path); }, path.string() + ": layers[0].v_scale: ",
               "1 values, expected 2 for granularity head with 2 heads");
  EXPECT_FALSE(std::filesystem::exists(path));
  scales.layers = {{{0.5f, -0.25f}, {1.0f, 1.0f}}};
  expect_error([&] { write_scales_file(scales, path); },
               path.string() + ": layers[0].k_scale[1]: ", "-0.25 is not a positive finite scale");
  scales.layers.clear();
  expect_error([&] { write_scales_file(scales, path); }, path.string() + ": layers: is empty");
  scales.layers = {{{0.5f, 0.5f}, {1.0f, 1.0f}}};
  const auto unwritable = dir.file("no_such_dir") / "s.json";
  expect_error([&] { write_scales_file(scales, unwritable); }, unwritable.string() + ": ",
               "cannot be opened for writing");
}

// --- malformed files
// ------------------------------------------------------------------------------

// A valid document for Hk = 2, D = 4, per-channel scales, two layers.
Json valid_document() {
  const std::vector<float> eight(8, 0.5f);
  return Json{{"mjolnir_scales_version", 1},
              {"format", "fp8_e4m3"},
              {"granularity", "channel"},
              {"num_kv_heads", 2},
              {"head_dim", 4},
              {"headroom", 1.25},
              {"layers", Json::array({Json{{"k_scale", eight}, {"v_scale", eight}},
                                      Json{{"k_scale", eight}, {"v_scale", eight}}})}};
}

// Parses `document` as the file "m.json" and expects an error naming it, then `field`.
void expect_malformed(const Json& document, const std::string& field,
                      std::string_view detail = "") {
  expect_error([&] { parse_scales_json(document.dump(), "m.json"); }, "m.json: " + field, detail);
}

TEST(MalformedScales, ValidDocumentParses) {
  const ScalesFile scales = parse_scales_json(valid_document().dump());
  EXPECT_EQ(scales.layers.size(), 2u);
  EXPECT_EQ(scales.headroom, 1.25);
  EXPECT_EQ(scales.layers[1].v_scale, std::vector<float>(8, 0.5f));
}

// Found by tests/fuzz/scales_parse: a number beyond a double's range was an internal error.
TEST(MalformedScales, NumberBeyondADoubleIsAFileError) {
  expect_error([&] { parse_scales_json("644366E14436640", "m.json"); },
               "m.json: not a JSON scales file", "number overflow");
  std::string text = valid_document().dump();
  text.replace(text.find("1.25"), 4, "1e999");
  expect_error([&] { parse_scales_json(text, "m.json"); }, "m.json: not a JSON scales file",
               "number overflow");
}

TEST(MalformedScales, FileNotFoundOrADirectory) {
  const TempDir dir;
  const auto missing = dir.file("missing.json");
  expect_error([&] { read_scales_file(missing); }, missing.string() + ": file not found");
  expect_error([&] { read_scales_file(dir.file("")); }, "", "is a directory");
}

TEST(MalformedScales, NotJson) {
  expect_error([] { parse_scales_json("scales: 1.0\n", "m.json"); },
               "m.json: not JSON: ", "line 1, column 1");
  expect_error([] { parse_scales_json("{\"format\" \"fp8_e4m3\"}", "m.json"); },
               "m.json: not JSON: ", "line 1");
  expect_error([] { parse_scales_json("", "m.json"); }, "m.json: is empty");
  // Through the file reader, the path names the file.
  const TempDir dir;
  const auto path = dir.file("garbage.json");
  std::ofstream(path) << "\x01\x02 not json";
  expect_error([&] { read_scales_file(path); }, path.string() + ": not JSON: ");
}

TEST(MalformedScales, Truncated) {
  const std::string text = valid_document().dump(2);
  for (std::size_t length : {text.size() / 3, text.size() / 2, text.size() - 1}) {
    SCOPED_TRACE(length);
    expect_error([&] { parse_scales_json(text.substr(0, length), "m.json"); },
                 "m.json: truncated: ");
  }
}

TEST(MalformedScales, WrongVersion) {
  Json document = valid_document();
  document["mjolnir_scales_version"] = 2;
  expect_malformed(document, "mjolnir_scales_version: 2 is not supported (this build reads 1)");
  document.erase("mjolnir_scales_version");
  expect_malformed(document, "missing field \"mjolnir_scales_version\"");
}

TEST(MalformedScales, MissingFields) {
  for (const char* key :
       {"format", "granularity", "num_kv_heads", "head_dim", "headroom", "layers"}) {
    Json document = valid_document();
    document.erase(key);
    expect_malformed(document, std::string("missing field \"") + key + "\"");
  }
  Json document = valid_document();
  document["layers"][1].erase("v_scale");
  expect_malformed(document, "layers[1]: missing field \"v_scale\"");
}

TEST(MalformedScales, UnknownNames) {
  Json document = valid_document();
  document["format"] = "fp3_e1m1";
  expect_malformed(document, "format: ", "fp3_e1m1");
  document = valid_document();
  document["granularity"] = "block";
  expect_malformed(document, "granularity: 'block'");
}

TEST(MalformedScales, MismatchedCounts) {
  Json document = valid_document();
  document["layers"][1]["k_scale"] = std::vector<float>(7, 1.0f);
  expect_malformed(document,
                   "layers[1].k_scale: 7 values, expected 8 for granularity channel with 2 heads x "
                   "4 channels");
  document = valid_document();
  document["granularity"] = "head";  // the arrays still hold Hk * D values
  expect_malformed(document, "layers[0].k_scale: 8 values, expected 2 for granularity head");
  document = valid_document();
  document["layers"] = Json::array();
  expect_malformed(document, "layers: is empty");
}

TEST(MalformedScales, BadScaleValues) {
  Json document = valid_document();
  document["layers"][0]["v_scale"][2] = -0.5;
  expect_malformed(document, "layers[0].v_scale[2]: -0.5 is not a positive finite scale");
  document["layers"][0]["v_scale"][2] = 0;
  expect_malformed(document, "layers[0].v_scale[2]: 0 is not a positive finite scale");
  document["layers"][0]["v_scale"][2] = 1e39;
  expect_malformed(document, "layers[0].v_scale[2]: 1e+39 is outside the range of float");
  document["layers"][0]["v_scale"][2] = 1e-50;
  expect_malformed(document, "layers[0].v_scale[2]: ", "outside the range of float");
}

TEST(MalformedScales, BadHeader) {
  Json document = valid_document();
  document["num_kv_heads"] = 0;
  expect_malformed(document, "num_kv_heads: 0 is less than 1");
  document = valid_document();
  document["head_dim"] = 5000000000LL;
  expect_malformed(document, "head_dim: 5000000000 is out of range");
  document = valid_document();
  document["headroom"] = -1;
  expect_malformed(document, "headroom: -1 is not a positive finite factor");
}

TEST(MalformedScales, WrongTypes) {
  struct Case {
    const char* pointer;  // JSON pointer of the field to replace
    Json value;
    const char* field;  // how the error names it
    const char* expected;
  };
  const Case cases[] = {
      {"/mjolnir_scales_version", "1", "mjolnir_scales_version: ", "expected an integer"},
      {"/mjolnir_scales_version", 1.0, "mjolnir_scales_version: ", "expected an integer"},
      {"/format", 8, "format: ", "expected a string, found number 8"},
      {"/granularity", nullptr, "granularity: ", "expected a string, found null"},
      {"/num_kv_heads", 2.5, "num_kv_heads: ", "expected an integer"},
      {"/head_dim", "4", "head_dim: ", "expected an integer, found string"},
      {"/headroom", "1.0", "headroom: ", "expected a number, found string"},
      {"/layers", Json::object(), "layers: ", "expected an array of layers, found object"},
      {"/layers/1", Json::array(), "layers[1]: ", "expected an object"},
      {"/layers/0/k_scale", "0.5", "layers[0].k_scale: ", "expected an array of numbers"},
      {"/layers/1/v_scale/3", "0.5", "layers[1].v_scale[3]: ", "expected a number"},
      {"/layers/1/v_scale/4", true, "layers[1].v_scale[4]: ", "expected a number, found boolean"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.pointer);
    Json document = valid_document();
    document[Json::json_pointer(c.pointer)] = c.value;
    expect_malformed(document, c.field, c.expected);
  }
  expect_error([] { parse_scales_json("[1, 2]", "m.json"); },
               "m.json: expected a JSON object at the top level, found array");
}

// --- the amax file a calibration run writes, and scales from it --------------------------------

AmaxFile random_amax(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> value(0.0f, 20.0f);
  AmaxFile amax;
  amax.num_kv_heads = 2;
  amax.head_dim = 4;
  for (int l = 0; l < 3; ++l) {
    AmaxFile::Layer layer;
    layer.name = "model.layers." + std::to_string(l) + ".self_attn.attn";
    for (int i = 0; i < 8; ++i) {
      layer.k_amax.push_back(value(rng));
      layer.v_amax.push_back(value(rng));
    }
    layer.k_amax[5] = 0.0f;  // a channel calibration never saw non-zero
    amax.layers.push_back(layer);
  }
  return amax;
}

TEST(AmaxFile, RoundTripsExactlyAndGivesEachLayersScales) {
  TempDir dir;
  const AmaxFile amax = random_amax(testing::test_seed());
  write_amax_file(amax, dir.file("amax.json"));
  const AmaxFile back = read_amax_file(dir.file("amax.json"));
  ASSERT_EQ(back.layers.size(), 3u);
  EXPECT_EQ(back.num_kv_heads, 2);
  EXPECT_EQ(back.head_dim, 4);
  for (std::size_t l = 0; l < 3; ++l) {
    EXPECT_EQ(back.layers[l].name, amax.layers[l].name);
    EXPECT_EQ(back.layers[l].k_amax, amax.layers[l].k_amax);  // bit for bit
    EXPECT_EQ(back.layers[l].v_amax, amax.layers[l].v_amax);
  }
  const ScalesFile scales =
      scales_from_amax_file(back, Format::fp4_e2m1, ScaleGranularity::channel, 1.5);
  ASSERT_EQ(scales.layers.size(), 3u);
  EXPECT_EQ(scales.format, Format::fp4_e2m1);
  EXPECT_EQ(scales.headroom, 1.5);
  for (std::size_t l = 0; l < 3; ++l) {
    for (int i = 0; i < 8; ++i) {
      // scale = amax / 6 * 1.5, worked here in double and rounded once, as the library does.
      const float want = i == 5 ? kFloatMin : float(double(amax.layers[l].k_amax[i]) / 6.0 * 1.5);
      EXPECT_EQ(scales.layers[l].k_scale[i], want) << "layer " << l << " channel " << i;
    }
  }
  const ScalesFile heads = scales_from_amax_file(back, Format::fp8_e4m3, ScaleGranularity::head);
  EXPECT_EQ(heads.layers[1].v_scale.size(), 2u);
}

TEST(AmaxFile, MalformedFilesNameTheFileAndTheField) {
  TempDir dir;
  Json document = Json::parse(R"({"mjolnir_amax_version": 1, "num_kv_heads": 1, "head_dim": 2,
      "layers": [{"name": "l0", "k_amax": [1, 2], "v_amax": [3, 4]}]})");
  EXPECT_EQ(parse_amax_json(document.dump(), "a.json").layers[0].v_amax[1], 4.0f);
  const auto malformed = [&](const Json& bad, const std::string& expected) {
    expect_error([&] { parse_amax_json(bad.dump(), "a.json"); }, "a.json: " + expected);
  };
  Json bad = document;
  bad["mjolnir_amax_version"] = 2;
  malformed(bad, "mjolnir_amax_version: 2 is not supported");
  bad = document;
  bad["layers"][0]["k_amax"] = Json::array({1});
  malformed(bad, "layers[0].k_amax: 1 values, expected 1 heads x 2 channels = 2");
  bad = document;
  bad["layers"][0]["v_amax"][1] = -3;
  malformed(bad, "layers[0].v_amax[1]: -3 is not a finite non-negative maximum");
  bad = document;
  bad["layers"] = Json::array();
  malformed(bad, "layers: is empty");
  bad = document;
  bad["layers"][0].erase("name");
  malformed(bad, "layers[0]: missing field \"name\"");
  expect_error([&] { read_amax_file(dir.file("missing.json")); }, dir.file("missing.json").string(),
               "file not found");
}

}  // namespace
}  // namespace mjolnir
