// Static scales: reduce recorded amax to scales, and read / write the versioned JSON scales file
// (docs/design.md section 3 "Calibration", section 7 for the errors).
#include "mjolnir/calibrate.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include <nlohmann/json.hpp>

#include "core/format_table.h"
#include "mjolnir/error.h"

namespace mjolnir {
namespace {

using Json = nlohmann::json;

bool is_valid(Format format) { return static_cast<std::size_t>(format) < std::size(kAllFormats); }
bool is_valid(ScaleGranularity granularity) {
  return granularity == ScaleGranularity::tensor || granularity == ScaleGranularity::head ||
         granularity == ScaleGranularity::channel;
}

std::string count_explanation(ScaleGranularity granularity, int num_kv_heads, int head_dim) {
  std::string text = "for granularity " + std::string(to_string(granularity));
  if (granularity == ScaleGranularity::head) {
    text += " with " + std::to_string(num_kv_heads) + " heads";
  } else if (granularity == ScaleGranularity::channel) {
    text += " with " + std::to_string(num_kv_heads) + " heads x " + std::to_string(head_dim) +
            " channels";
  }
  return text;
}

// The consistency rules every scales file obeys, whether it was just parsed or is about to be
// written. `source` names the file in errors.
void check_scales_file(const ScalesFile& scales, const std::string& source) {
  MJOLNIR_REQUIRE(is_valid(scales.format), source, ": format: ", static_cast<int>(scales.format),
                  " is not a known format");
  MJOLNIR_REQUIRE(is_valid(scales.granularity), source,
                  ": granularity: ", static_cast<int>(scales.granularity),
                  " is not a scale granularity");
  MJOLNIR_REQUIRE(scales.num_kv_heads >= 1, source, ": num_kv_heads: ", scales.num_kv_heads,
                  " is less than 1");
  MJOLNIR_REQUIRE(scales.head_dim >= 1, source, ": head_dim: ", scales.head_dim, " is less than 1");
  MJOLNIR_REQUIRE(std::isfinite(scales.headroom) && scales.headroom > 0, source,
                  ": headroom: ", scales.headroom, " is not a positive finite factor");
  MJOLNIR_REQUIRE(!scales.layers.empty(), source, ": layers: is empty");
  const std::size_t expected =
      scale_count(scales.granularity, scales.num_kv_heads, scales.head_dim);
  for (std::size_t layer = 0; layer < scales.layers.size(); ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<float>& values =
          kv == 0 ? scales.layers[layer].k_scale : scales.layers[layer].v_scale;
      const char* field = kv == 0 ? "k_scale" : "v_scale";
      MJOLNIR_REQUIRE(values.size() == expected, source, ": layers[", layer, "].", field, ": ",
                      values.size(), " values, expected ", expected, " ",
                      count_explanation(scales.granularity, scales.num_kv_heads, scales.head_dim));
      for (std::size_t i = 0; i < values.size(); ++i) {
        MJOLNIR_REQUIRE(std::isfinite(values[i]) && values[i] > 0, source, ": layers[", layer, "].",
                        field, "[", i, "]: ", values[i], " is not a positive finite scale");
      }
    }
  }
}

// --- writing -------------------------------------------------------------------------------------

// The JSON number for a float scale. The shortest decimal that reads back as the float
// (to_chars) keeps the file readable; the reader parses it as a double and rounds to float, and
// that double rounding could in principle land on a neighbour, so the short form is used only
// after checking it comes back exactly. Otherwise the float's exact double value is written.
Json float_number(float value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof(text), value);
  if (error == std::errc()) {
    *end = '\0';
    const double reread = std::strtod(text, nullptr);
    if (static_cast<float>(reread) == value) return Json(reread);
  }
  return Json(static_cast<double>(value));
}

Json json_floats(const std::vector<float>& values) {
  Json array = Json::array();
  for (float value : values) array.push_back(float_number(value));
  return array;
}

// --- reading -------------------------------------------------------------------------------------

// Reads fields of a parsed document, naming the source and the field path in every error.
class FieldReader {
 public:
  explicit FieldReader(const std::string& source) : source_(source) {}

  [[noreturn]] void fail(const std::string& field, const std::string& message) const {
    detail::throw_error(source_, ": ", field, ": ", message);
  }

  const Json& member(const Json& object, const std::string& path, const char* key) const {
    const auto found = object.find(key);
    if (found == object.end()) {
      detail::throw_error(source_, ": ", path.empty() ? "" : path + ": ", "missing field \"", key,
                          "\"");
    }
    return *found;
  }

  std::int64_t integer(const Json& value, const std::string& field) const {
    if (value.is_number_unsigned()) {
      const auto u = value.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        fail(field, std::to_string(u) + " is out of range");
      }
      return static_cast<std::int64_t>(u);
    }
    if (!value.is_number_integer()) fail(field, "expected an integer, found " + describe(value));
    return value.get<std::int64_t>();
  }

  int int_in_range(const Json& value, const std::string& field) const {
    const std::int64_t n = integer(value, field);
    if (n < std::numeric_limits<int>::min() || n > std::numeric_limits<int>::max()) {
      fail(field, std::to_string(n) + " is out of range");
    }
    return static_cast<int>(n);
  }

  double number(const Json& value, const std::string& field) const {
    if (!value.is_number()) fail(field, "expected a number, found " + describe(value));
    return value.get<double>();
  }

  std::string string(const Json& value, const std::string& field) const {
    if (!value.is_string()) fail(field, "expected a string, found " + describe(value));
    return value.get<std::string>();
  }

  // A JSON array of numbers as floats. Range problems of the double -> float step are reported
  // with the number as written; sign and finiteness are checked later with the other rules.
  std::vector<float> float_array(const Json& value, const std::string& field) const {
    if (!value.is_array()) fail(field, "expected an array of numbers, found " + describe(value));
    std::vector<float> values;
    values.reserve(value.size());
    for (std::size_t i = 0; i < value.size(); ++i) {
      const std::string element = field + "[" + std::to_string(i) + "]";
      const double x = number(value[i], element);
      const auto f = static_cast<float>(x);
      if (std::isinf(f) || (f == 0 && x != 0)) {
        std::ostringstream os;
        os << x << " is outside the range of float";
        fail(element, os.str());
      }
      values.push_back(f);
    }
    return values;
  }

  static std::string describe(const Json& value) {
    std::string text = value.dump();
    if (text.size() > 40) text = text.substr(0, 37) + "...";
    return std::string(value.type_name()) + " " + text;
  }

 private:
  const std::string& source_;
};

Json parse_document(const std::string& text, const std::string& source) {
  const bool blank = std::all_of(text.begin(), text.end(), [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
  });
  MJOLNIR_REQUIRE(!blank, source, ": is empty, expected a JSON scales object");
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    // nlohmann's message starts "[json.exception.parse_error.101] parse error at line L, column
    // C: ..."; keep the part from "parse error".
    std::string reason = e.what();
    const std::size_t start = reason.find("parse error");
    if (start != std::string::npos) reason = reason.substr(start);
    // The parser read past the last byte: the text stops before the document is complete.
    if (e.byte > text.size()) {
      detail::throw_error(source, ": truncated: the JSON text ends after ", text.size(),
                          " bytes before the document is complete (", reason, ")");
    }
    detail::throw_error(source, ": not JSON: ", reason, " (byte ", e.byte, ")");
  } catch (const Json::exception& e) {
    // The parser's other failures are about the text too: a number beyond a double's range
    // ("number overflow parsing '1E400'"), nesting too deep.
    std::string reason = e.what();
    const std::size_t start = reason.find("] ");
    if (start != std::string::npos) reason = reason.substr(start + 2);
    detail::throw_error(source, ": not a JSON scales file: ", reason);
  }
}

std::string read_text(const std::filesystem::path& path, const char* what) {
  const std::string source = path.string();
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  MJOLNIR_REQUIRE(std::filesystem::exists(status), source, ": file not found");
  MJOLNIR_REQUIRE(!std::filesystem::is_directory(status), source, ": is a directory, not ", what);
  std::ifstream file(path, std::ios::binary);
  MJOLNIR_REQUIRE(file.is_open(), source, ": cannot be opened for reading");
  std::ostringstream text;
  text << file.rdbuf();
  MJOLNIR_REQUIRE(!file.bad(), source, ": reading failed");
  return text.str();
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  const std::string source = path.string();
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  MJOLNIR_REQUIRE(file.is_open(), source, ": cannot be opened for writing");
  file << text;
  file.close();
  MJOLNIR_REQUIRE(!file.fail(), source, ": writing failed");
}

void check_amax_file(const AmaxFile& amax, const std::string& source) {
  MJOLNIR_REQUIRE(amax.num_kv_heads >= 1, source, ": num_kv_heads: ", amax.num_kv_heads,
                  " is less than 1");
  MJOLNIR_REQUIRE(amax.head_dim >= 1, source, ": head_dim: ", amax.head_dim, " is less than 1");
  MJOLNIR_REQUIRE(!amax.layers.empty(), source, ": layers: is empty (no layer was recorded)");
  const std::size_t expected = std::size_t(amax.num_kv_heads) * std::size_t(amax.head_dim);
  for (std::size_t layer = 0; layer < amax.layers.size(); ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<float>& values =
          kv == 0 ? amax.layers[layer].k_amax : amax.layers[layer].v_amax;
      const char* name = kv == 0 ? "k_amax" : "v_amax";
      MJOLNIR_REQUIRE(values.size() == expected, source, ": layers[", layer, "].", name, ": ",
                      values.size(), " values, expected ", amax.num_kv_heads, " heads x ",
                      amax.head_dim, " channels = ", expected);
      for (std::size_t i = 0; i < values.size(); ++i) {
        MJOLNIR_REQUIRE(std::isfinite(values[i]) && values[i] >= 0, source, ": layers[", layer,
                        "].", name, "[", i, "]: ", values[i],
                        " is not a finite non-negative maximum");
      }
    }
  }
}

}  // namespace

// Zero (or tiny) amax: the scale is kept at least FLT_MIN, the smallest normal float. A zero
// scale would divide by zero on write, and a subnormal one turns into zero on GPUs that flush
// subnormals; FLT_MIN keeps an all-zero channel exactly representable (zero stays zero) while
// saturating anything large written to it later.
ScaleGranularity recommended_granularity(Format format) {
  if (!is_quantized(format)) return ScaleGranularity::tensor;
  // nvfp4's block scales (one per 16 channels of a token) already follow the outlier channels:
  // a per-channel outer scale on top measured worse than a per-head one (docs/accuracy.md).
  return format_facts(format).has_block_scales() ? ScaleGranularity::head
                                                 : ScaleGranularity::channel;
}

std::vector<float> scales_from_amax(std::span<const float> amax, Format format,
                                    ScaleGranularity granularity, int num_kv_heads, int head_dim,
                                    double headroom) {
  MJOLNIR_REQUIRE(is_valid(format), "format: ", static_cast<int>(format), " is not a known format");
  MJOLNIR_REQUIRE(is_valid(granularity), "granularity: ", static_cast<int>(granularity),
                  " is not a scale granularity");
  MJOLNIR_REQUIRE(num_kv_heads >= 1, "num_kv_heads: ", num_kv_heads, " is less than 1");
  MJOLNIR_REQUIRE(head_dim >= 1, "head_dim: ", head_dim, " is less than 1");
  MJOLNIR_REQUIRE(std::isfinite(headroom) && headroom > 0, "headroom: ", headroom,
                  " is not a positive finite factor");
  const std::size_t per_head = static_cast<std::size_t>(head_dim);
  const std::size_t expected = static_cast<std::size_t>(num_kv_heads) * per_head;
  MJOLNIR_REQUIRE(amax.size() == expected, "amax: ", amax.size(), " values, expected ",
                  num_kv_heads, " heads x ", head_dim, " channels = ", expected);
  for (std::size_t i = 0; i < amax.size(); ++i) {
    MJOLNIR_REQUIRE(std::isfinite(amax[i]) && amax[i] >= 0, "amax[", i, "]: ", amax[i],
                    " is not a finite non-negative maximum");
  }

  // Max-reduce [Hk, D] to the granularity's [1], [Hk] or [Hk, D].
  std::vector<float> reduced(scale_count(granularity, num_kv_heads, head_dim), 0.0f);
  for (std::size_t i = 0; i < amax.size(); ++i) {
    const std::size_t target = granularity == ScaleGranularity::tensor ? 0
                               : granularity == ScaleGranularity::head ? i / per_head
                                                                       : i;
    reduced[target] = std::max(reduced[target], amax[i]);
  }

  const double format_maximum = format_max(format);
  std::vector<float> scales(reduced.size());
  for (std::size_t i = 0; i < reduced.size(); ++i) {
    const double scale = double(reduced[i]) / format_maximum * headroom;
    MJOLNIR_REQUIRE(scale <= std::numeric_limits<float>::max(), "headroom: ", headroom,
                    " makes the scale of amax ", reduced[i], " overflow float");
    scales[i] = std::max(static_cast<float>(scale), std::numeric_limits<float>::min());
  }
  return scales;
}

// Top-level fields one a line and each layer on one line: readable, diffable, and small enough.
void write_scales_file(const ScalesFile& scales, const std::filesystem::path& path) {
  const std::string source = path.string();
  check_scales_file(scales, source);
  std::ostringstream text;
  text << "{\n"
       << "  \"mjolnir_scales_version\": " << ScalesFile::kVersion << ",\n"
       << "  \"format\": " << Json(std::string(to_string(scales.format))).dump() << ",\n"
       << "  \"granularity\": " << Json(std::string(to_string(scales.granularity))).dump() << ",\n"
       << "  \"num_kv_heads\": " << scales.num_kv_heads << ",\n"
       << "  \"head_dim\": " << scales.head_dim << ",\n"
       << "  \"headroom\": " << Json(scales.headroom).dump() << ",\n"
       << "  \"layers\": [\n";
  for (std::size_t layer = 0; layer < scales.layers.size(); ++layer) {
    text << "    {\"k_scale\": " << json_floats(scales.layers[layer].k_scale).dump()
         << ", \"v_scale\": " << json_floats(scales.layers[layer].v_scale).dump() << "}"
         << (layer + 1 < scales.layers.size() ? ",\n" : "\n");
  }
  text << "  ]\n}\n";
  write_text(path, text.str());
}

ScalesFile read_scales_file(const std::filesystem::path& path) {
  return parse_scales_json(read_text(path, "a scales file"), path.string());
}

void write_amax_file(const AmaxFile& amax, const std::filesystem::path& path) {
  check_amax_file(amax, path.string());
  std::ostringstream text;
  text << "{\n"
       << "  \"mjolnir_amax_version\": " << AmaxFile::kVersion << ",\n"
       << "  \"num_kv_heads\": " << amax.num_kv_heads << ",\n"
       << "  \"head_dim\": " << amax.head_dim << ",\n"
       << "  \"layers\": [\n";
  for (std::size_t layer = 0; layer < amax.layers.size(); ++layer) {
    const AmaxFile::Layer& l = amax.layers[layer];
    text << "    {\"name\": " << Json(l.name).dump()
         << ", \"k_amax\": " << json_floats(l.k_amax).dump()
         << ", \"v_amax\": " << json_floats(l.v_amax).dump() << "}"
         << (layer + 1 < amax.layers.size() ? ",\n" : "\n");
  }
  text << "  ]\n}\n";
  write_text(path, text.str());
}

AmaxFile read_amax_file(const std::filesystem::path& path) {
  return parse_amax_json(read_text(path, "an amax file"), path.string());
}

AmaxFile parse_amax_json(const std::string& text, const std::string& source) {
  const Json document = parse_document(text, source);
  MJOLNIR_REQUIRE(document.is_object(), source, ": expected a JSON object at the top level, found ",
                  FieldReader::describe(document));
  const FieldReader read(source);
  const char* version_key = "mjolnir_amax_version";
  const std::int64_t version = read.integer(read.member(document, "", version_key), version_key);
  MJOLNIR_REQUIRE(version == AmaxFile::kVersion, source, ": ", version_key, ": ", version,
                  " is not supported (this build reads ", AmaxFile::kVersion, ")");
  AmaxFile amax;
  amax.num_kv_heads = read.int_in_range(read.member(document, "", "num_kv_heads"), "num_kv_heads");
  amax.head_dim = read.int_in_range(read.member(document, "", "head_dim"), "head_dim");
  const Json& layers = read.member(document, "", "layers");
  if (!layers.is_array()) {
    read.fail("layers", "expected an array of layers, found " + FieldReader::describe(layers));
  }
  amax.layers.resize(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::string path = "layers[" + std::to_string(i) + "]";
    const Json& layer = layers[i];
    if (!layer.is_object()) {
      read.fail(path, "expected an object with name, k_amax and v_amax, found " +
                          FieldReader::describe(layer));
    }
    amax.layers[i].name = read.string(read.member(layer, path, "name"), path + ".name");
    amax.layers[i].k_amax = read.float_array(read.member(layer, path, "k_amax"), path + ".k_amax");
    amax.layers[i].v_amax = read.float_array(read.member(layer, path, "v_amax"), path + ".v_amax");
  }
  check_amax_file(amax, source);
  return amax;
}

ScalesFile scales_from_amax_file(const AmaxFile& amax, Format format, ScaleGranularity granularity,
                                 double headroom) {
  check_amax_file(amax, "amax");
  ScalesFile scales;
  scales.format = format;
  scales.granularity = granularity;
  scales.num_kv_heads = amax.num_kv_heads;
  scales.head_dim = amax.head_dim;
  scales.headroom = headroom;
  for (const AmaxFile::Layer& layer : amax.layers) {
    scales.layers.push_back({scales_from_amax(layer.k_amax, format, granularity, amax.num_kv_heads,
                                              amax.head_dim, headroom),
                             scales_from_amax(layer.v_amax, format, granularity, amax.num_kv_heads,
                                              amax.head_dim, headroom)});
  }
  return scales;
}

ScalesFile parse_scales_json(const std::string& text, const std::string& source) {
  const Json document = parse_document(text, source);
  MJOLNIR_REQUIRE(document.is_object(), source, ": expected a JSON object at the top level, found ",
                  FieldReader::describe(document));
  const FieldReader read(source);

  // The version comes first: other fields may mean something else in another version.
  const char* version_key = "mjolnir_scales_version";
  const std::int64_t version = read.integer(read.member(document, "", version_key), version_key);
  MJOLNIR_REQUIRE(version == ScalesFile::kVersion, source, ": ", version_key, ": ", version,
                  " is not supported (this build reads ", ScalesFile::kVersion, ")");

  ScalesFile scales;
  scales.format =
      parse_format(read.string(read.member(document, "", "format"), "format"), source + ": format");
  scales.granularity =
      parse_granularity(read.string(read.member(document, "", "granularity"), "granularity"),
                        source + ": granularity");
  scales.num_kv_heads =
      read.int_in_range(read.member(document, "", "num_kv_heads"), "num_kv_heads");
  scales.head_dim = read.int_in_range(read.member(document, "", "head_dim"), "head_dim");
  scales.headroom = read.number(read.member(document, "", "headroom"), "headroom");

  const Json& layers = read.member(document, "", "layers");
  if (!layers.is_array()) {
    read.fail("layers", "expected an array of layers, found " + FieldReader::describe(layers));
  }
  scales.layers.resize(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::string path = "layers[" + std::to_string(i) + "]";
    const Json& layer = layers[i];
    if (!layer.is_object()) {
      read.fail(path, "expected an object with k_scale and v_scale, found " +
                          FieldReader::describe(layer));
    }
    scales.layers[i].k_scale =
        read.float_array(read.member(layer, path, "k_scale"), path + ".k_scale");
    scales.layers[i].v_scale =
        read.float_array(read.member(layer, path, "v_scale"), path + ".v_scale");
  }
  check_scales_file(scales, source);
  return scales;
}

}  // namespace mjolnir
