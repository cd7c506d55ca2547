// What the CLI reports about the machine it runs on (info, bench's JSON) and the memory the bench
// may use for its cache copies.
#pragma once

#include <cstddef>
#include <string>

namespace mjolnir::tools {

// The CPU's model name from /proc/cpuinfo ("AMD EPYC 9654 96-Core Processor"), or "unknown".
// On AMD CPUs the Zen generation follows in parentheses ("AMD EPYC (Zen 4)"): virtual machines
// often report just "AMD EPYC", and the bench's results files, named after the CPU, would
// otherwise not tell (or would overwrite) one generation's sweep with another's.
std::string cpu_model_name();
// The Zen generation of an AMD CPU family and model (/proc/cpuinfo's "cpu family" and "model",
// decimal there): "Zen" .. "Zen 5", or "" for a family before Zen or not known here.
std::string amd_zen_generation(int family, int model);
// The generation of an Intel Xeon from its family and model ("Skylake-SP" .. "Granite Rapids"),
// or "" for one not known here; cpu_model_name adds it where the name does not say it.
std::string intel_xeon_generation(int family, int model);
// Hardware threads this process may run on (at least 1).
int hardware_threads();
// MemAvailable from /proc/meminfo in bytes; 0 when it cannot be read.
std::size_t available_memory_bytes();
// Today's UTC date, YYYY-MM-DD: results files are named and stamped with it.
std::string utc_date();
// "1.5 GiB", "128.0 MiB", "512 B": sizes for people.
std::string format_bytes(double bytes);

}  // namespace mjolnir::tools
