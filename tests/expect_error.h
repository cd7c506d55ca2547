// The check behind every bad-input test (docs/design.md section 7): the call throws mjolnir::Error
// whose message starts with the argument it names and contains the detail that says what is wrong.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "mjolnir/error.h"

namespace mjolnir::testing {

template <typename Call>
void expect_error(Call&& call, std::string_view argument, std::string_view detail = "") {
  try {
    call();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_TRUE(message.starts_with(argument))
        << "message \"" << message << "\" does not start with \"" << argument << "\"";
    EXPECT_NE(message.find(detail), std::string::npos)
        << "message \"" << message << "\" does not contain \"" << detail << "\"";
    return;
  }
  ADD_FAILURE() << "no mjolnir::Error thrown; expected one naming \"" << argument << "\"";
}

}  // namespace mjolnir::testing
