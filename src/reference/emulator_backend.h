// The emulator as a Backend ("reference"): single-threaded, every configuration supported.
#pragma once

#include <memory>

#include "mjolnir/decode.h"

namespace mjolnir::reference {

std::unique_ptr<Backend> make_emulator_backend();

}  // namespace mjolnir::reference
