// mjolnir::Error: the one exception type every C++ entry point throws on bad input.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mjolnir {

// Thrown for invalid arguments and unusable files. The message always starts with the name of
// the offending argument ("block_table[3][7]: page 912 is outside the pool of 512 pages").
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
template <typename... Parts>
[[noreturn]] void throw_error(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(os.str());
}
}  // namespace detail

}  // namespace mjolnir

// MJOLNIR_REQUIRE(cond, "arg", ": message ", value, ...) throws mjolnir::Error when cond is false.
#define MJOLNIR_REQUIRE(cond, ...)                  \
  do {                                              \
    if (!(cond)) ::mjolnir::detail::throw_error(__VA_ARGS__); \
  } while (0)
