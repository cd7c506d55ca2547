// The bad-input table (tests/bad_inputs.json): one list of bad decode arguments that every binding
// runs through its own API, so that each check, written once in the library, is seen to reach
// every caller with the same argument named. The C++ API's run is in test_decode_validation.cc,
// the C API's in test_capi.cc; python/tests/test_bad_input.py reads the same file.
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mjolnir::testing {

struct BadInputCase {
  std::string name;       // what is wrong, for the test's trace
  nlohmann::json change;  // one argument: {"q_len": 9}, {"block_table": [seq, page, value]}, ...
  std::vector<std::string> names;  // what the error message must contain, each of them
};

// Whether `message` contains each of `names`.
inline bool names_all(const std::string& message, const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    if (message.find(name) == std::string::npos) return false;
  }
  return true;
}

struct BadInputTable {
  nlohmann::json step;  // the valid step each binding builds: format, heads, D, page, q_len, ...
  std::vector<BadInputCase> cases;
};

inline BadInputTable bad_input_table() {
  std::ifstream file(MJOLNIR_TESTS_DIR "/bad_inputs.json");
  if (!file) throw std::runtime_error("cannot open " MJOLNIR_TESTS_DIR "/bad_inputs.json");
  const nlohmann::json table = nlohmann::json::parse(file);
  BadInputTable out{table.at("step"), {}};
  for (const auto& entry : table.at("cases")) {
    out.cases.push_back(
        {entry.at("case"), entry.at("change"), entry.at("names").get<std::vector<std::string>>()});
  }
  return out;
}

// A number of the table: a JSON number, or the string "nan".
inline float table_float(const nlohmann::json& value) {
  if (value.is_string() && value.get<std::string>() == "nan") {
    return std::numeric_limits<float>::quiet_NaN();
  }
  return value.get<float>();
}

// An integer of the table, with the named values of bad_inputs.json: "num_pages" (the first page
// past the pool) and "pages_plus_one" (one token more than a sequence's pages hold).
inline std::int32_t table_int(const nlohmann::json& value, std::int32_t num_pages,
                              std::int32_t pages_plus_one) {
  if (value.is_string()) {
    const std::string name = value.get<std::string>();
    if (name == "num_pages") return num_pages;
    if (name == "pages_plus_one") return pages_plus_one;
    throw std::runtime_error("bad_inputs.json: unknown value '" + name + "'");
  }
  return value.get<std::int32_t>();
}

inline std::vector<float> table_floats(const nlohmann::json& values) {
  std::vector<float> out;
  for (const auto& value : values) out.push_back(table_float(value));
  return out;
}

}  // namespace mjolnir::testing
