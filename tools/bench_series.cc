// The series of a `mjolnir bench` run and the sweep's results path (bench_series.h).
#include "bench_series.h"

#include <cctype>
#include <charconv>
#include <filesystem>
#include <iterator>
#include <string_view>

#include "mjolnir/error.h"

namespace mjolnir::tools {

Heads parse_heads(const std::string& text) {
  const auto colon = text.find(':');
  Heads heads;
  const auto parse = [&](std::string_view part, int& value) {
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    return ec == std::errc() && end == part.data() + part.size() && value > 0;
  };
  const std::string_view view(text);
  const bool ok = colon != std::string::npos && parse(view.substr(0, colon), heads.num_q_heads) &&
                  parse(view.substr(colon + 1), heads.num_kv_heads);
  MJOLNIR_REQUIRE(ok, "--heads: '", text, "' is not HQ:HK with two positive counts");
  MJOLNIR_REQUIRE(heads.num_q_heads % heads.num_kv_heads == 0, "--heads: Hq ", heads.num_q_heads,
                  " is not a multiple of Hk ", heads.num_kv_heads);
  return heads;
}

std::vector<Format> parse_formats(const std::vector<std::string>& names) {
  std::vector<Format> formats;
  for (const std::string& name : names) {
    if (name == "all") {
      formats.insert(formats.end(), std::begin(kAllFormats), std::end(kAllFormats));
    } else {
      formats.push_back(parse_format(name, "--format"));
    }
  }
  return formats;
}

Series series_from_flags(const BenchOptions& options) {
  return Series{"",
                parse_heads(options.heads),
                options.head_dim,
                options.q_len,
                options.batches,
                options.contexts,
                parse_formats(options.formats)};
}

// The sweep of docs/cpu-performance.md (and docs/cuda.md for the GPU): every format on the
// Llama-3-8B layer (Hq 32, Hk 8, D 128) from 8k to 128k tokens at the batches the targets name,
// speculative verify (q_len 4) and short contexts beside it, and the wider shapes reported.
std::vector<Series> sweep_series(bool on_gpu) {
  const std::vector<Format> all(std::begin(kAllFormats), std::end(kAllFormats));
  const std::vector<int> batches = on_gpu ? std::vector<int>{1, 16, 64} : std::vector<int>{1, 8};
  const Heads llama{32, 8};
  return {
      {"long", llama, 128, 1, batches, {8192, 32768, 131072}, all},
      {"q_len4", llama, 128, 4, batches, {32768}, all},
      {"short", llama, 128, 1, {1}, {256, 512, 1024}, all},
      {"hq64", Heads{64, 8}, 128, 1, {batches.back()}, {32768}, all},
      {"d256", llama, 256, 1, {batches.back()}, {32768}, all},
  };
}

// bench/results/<backend>-sweep-<date>-<machine>[-q<mode>][-p<mode>].json: the machine named by
// its CPU (or GPU) model without trademark signs ("Intel(R) Xeon(R)" -> intel-xeon), lower case,
// runs of other characters as one '-'; the Q and P modes named where they are not fp32.
std::string sweep_results_path(const std::string& dir, const std::string& backend,
                               const std::string& date, const std::string& machine,
                               const std::string& q_mode, const std::string& p_mode) {
  std::string model = machine;
  for (const std::string mark : {"(R)", "(r)", "(TM)", "(tm)"}) {
    for (std::size_t at = model.find(mark); at != std::string::npos; at = model.find(mark, at)) {
      model.erase(at, mark.size());
    }
  }
  std::string slug;
  for (const char c : model) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      slug += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!slug.empty() && slug.back() != '-') {
      slug += '-';
    }
  }
  while (!slug.empty() && slug.back() == '-') slug.pop_back();
  std::string modes;
  if (q_mode == "auto" && p_mode == "auto") {
    modes = "-auto";  // the backend's modes, per format
  } else {
    if (q_mode != "fp32") modes += "-q" + q_mode;
    if (p_mode != "fp32") modes += "-p" + p_mode;
  }
  return dir + "/" + backend + "-sweep-" + date + "-" + (slug.empty() ? "unknown" : slug) + modes +
         ".json";
}

std::string unused_results_path(const std::string& path) {
  if (!std::filesystem::exists(path)) return path;
  const std::filesystem::path given(path);
  const std::string stem = (given.parent_path() / given.stem()).string();
  const std::string extension = given.extension().string();
  for (int n = 2;; ++n) {
    std::string candidate = stem + "-" + std::to_string(n) + extension;
    if (!std::filesystem::exists(candidate)) return candidate;
  }
}

}  // namespace mjolnir::tools
