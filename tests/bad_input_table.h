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

// The arguments a case may change, as a binding's good step has them. A binding fills one from
// its step, applies the case's change, and passes the fields back to the call that takes each:
// what the table's change keys mean is written here once.
struct StepArguments {
  int q_len = 0;
  int num_q_heads = 0;
  float softmax_scale = 0.0f;
  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> block_table;  // [num_seqs, max_pages_per_seq]
  int max_pages_per_seq = 0;
  int num_pages = 0;  // of the pool
  int page_size = 0;
  std::vector<float> k_scale, v_scale;
  int threads = 0;
  bool scales_changed = false;   // the case is the cache's (its scales)
  bool threads_changed = false;  // the case is the backend's (its thread count)

  // Applies one case's change; throws std::runtime_error for a key the table does not define.
  void apply(const nlohmann::json& change) {
    const std::int32_t pages_plus_one = max_pages_per_seq * page_size + 1;
    for (const auto& [key, value] : change.items()) {
      if (key == "q_len") {
        q_len = value;
      } else if (key == "num_q_heads") {
        num_q_heads = value;
      } else if (key == "softmax_scale") {
        softmax_scale = table_float(value);
      } else if (key == "block_table") {
        block_table.at(value[0].get<std::size_t>() * std::size_t(max_pages_per_seq) +
                       value[1].get<std::size_t>()) =
            table_int(value[2], num_pages, pages_plus_one);
      } else if (key == "seq_lens") {
        seq_lens.at(value[0]) = table_int(value[1], num_pages, pages_plus_one);
      } else if (key == "k_scale" || key == "v_scale") {
        (key == "k_scale" ? k_scale : v_scale) = table_floats(value);
        scales_changed = true;
      } else if (key == "threads") {
        threads = value;
        threads_changed = true;
      } else {
        throw std::runtime_error("bad_inputs.json: no argument '" + key + "'");
      }
    }
  }
};

}  // namespace mjolnir::testing
