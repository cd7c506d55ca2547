// Static scales: from recorded amax to scales, and the versioned JSON scales file.
#pragma once

#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "mjolnir/cache.h"

namespace mjolnir {

// Scales of every layer of a model, for one KV format and granularity.
struct ScalesFile {
  static constexpr int kVersion = 1;
  Format format = Format::fp8_e4m3;
  ScaleGranularity granularity = ScaleGranularity::channel;
  int num_kv_heads = 0;
  int head_dim = 0;
  double headroom = 1.0;
  struct Layer {
    std::vector<float> k_scale;  // scale_count(granularity, Hk, D) values
    std::vector<float> v_scale;
  };
  std::vector<Layer> layers;
};

// scale = amax / format_max(format) * headroom, reduced from per-(head, channel) amax [Hk * D]
// to the granularity by taking the max. A zero (or tiny) amax gives FLT_MIN, the smallest normal
// float, so the scale stays positive and normal (GPUs flush subnormals).
std::vector<float> scales_from_amax(std::span<const float> amax, Format format,
                                    ScaleGranularity granularity, int num_kv_heads, int head_dim,
                                    double headroom = 1.0);

// The scale granularity to use for a format unless there is a reason not to, as measured by
// `mjolnir accuracy` (docs/accuracy.md): per (KV head, channel) for the quantized formats (K has
// outlier channels, which a head-wide scale crushes the other channels under: fp4_e2m1's error
// halves with per-channel scales), per KV head for nvfp4 (its per-16-channel block scales
// already follow the outliers), per tensor for bf16 and fp16 (their scale is 1). `mjolnir
// calibrate`, `python -m mjolnir.calibrate` and `mjolnir bench` default to it.
ScaleGranularity recommended_granularity(Format format);

// Recorded per-(KV head, channel) maxima of |K| and |V| of every layer, before any scale: what
// a calibration run writes (the vLLM plugin with MJOLNIR_ATTN_KV_CALIBRATE) and `mjolnir
// calibrate` turns into a ScalesFile.
struct AmaxFile {
  static constexpr int kVersion = 1;
  int num_kv_heads = 0;
  int head_dim = 0;
  struct Layer {
    std::string name;           // the engine's layer name, in model order
    std::vector<float> k_amax;  // [Hk * D], finite and >= 0
    std::vector<float> v_amax;
  };
  std::vector<Layer> layers;
};

// JSON: {"mjolnir_amax_version": 1, "num_kv_heads": 8, "head_dim": 128,
//        "layers": [{"name": "model.layers.0.self_attn.attn", "k_amax": [...], "v_amax": [...]}]}
void write_amax_file(const AmaxFile& amax, const std::filesystem::path& path);
// Throws Error naming the file and the field, as read_scales_file does.
AmaxFile read_amax_file(const std::filesystem::path& path);
AmaxFile parse_amax_json(const std::string& text, const std::string& source = "amax");

// Every layer's scales from its recorded maxima (scales_from_amax), in the same layer order.
ScalesFile scales_from_amax_file(const AmaxFile& amax, Format format, ScaleGranularity granularity,
                                 double headroom = 1.0);

// JSON: {"mjolnir_scales_version": 1, "format": "fp8_e4m3", "granularity": "channel",
//        "num_kv_heads": 8, "head_dim": 128, "headroom": 1.0,
//        "layers": [{"k_scale": [...], "v_scale": [...]}, ...]}
void write_scales_file(const ScalesFile& scales, const std::filesystem::path& path);
// Throws Error naming the file and the field for unreadable, malformed, truncated, wrong-version
// or inconsistent files (counts that do not match the granularity, non-positive scales).
ScalesFile read_scales_file(const std::filesystem::path& path);
// Same, from a string (the file's contents); `source` names it in errors.
ScalesFile parse_scales_json(const std::string& text, const std::string& source = "scales");

}  // namespace mjolnir
