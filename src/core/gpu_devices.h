// The CUDA devices this process sees, for `mjolnir info` and for backends deciding whether they
// can run. Without the CUDA backend compiled it reports none, saying why.
#pragma once

#include <string>
#include <vector>

namespace mjolnir {

struct GpuDevice {
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  double memory_gib = 0;
};

// The visible devices; when there are none, `why_none` says why ("CUDA not compiled", "no
// CUDA device: <driver message>").
std::vector<GpuDevice> cuda_devices(std::string* why_none = nullptr);

}  // namespace mjolnir
