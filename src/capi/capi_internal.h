// Shared machinery of the C API: the handle structs, error recording, the one place where C++
// exceptions become status codes, versioned-struct reading and enum conversions.
#pragma once

// Exports the C functions when this is a DLL (Windows); elsewhere MJOLNIR_API needs nothing.
#ifndef MJOLNIR_BUILDING_LIBRARY
#define MJOLNIR_BUILDING_LIBRARY 1
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "mjolnir/cache.h"
#include "mjolnir/calibrate.h"
#include "mjolnir/decode.h"
#include "mjolnir/error.h"
#include "mjolnir/mjolnir.h"
#include "mjolnir/plan.h"

namespace mjolnir::capi {

// The message of one handle (or thread): the most recent call's, "" after a success. Recording
// never throws: when the message cannot be stored, a static one stands in.
class ErrorSlot {
 public:
  void clear() noexcept {
    text_.clear();  // keeps the capacity: a success allocates nothing
    fixed_ = nullptr;
  }
  void set(const char* function, const char* message) noexcept {
    try {
      text_.assign(function).append(": ").append(message);
      fixed_ = nullptr;
    } catch (...) {
      text_.clear();
      fixed_ = "out of memory while recording the error message";
    }
  }
  const char* c_str() const noexcept { return fixed_ != nullptr ? fixed_ : text_.c_str(); }

 private:
  std::string text_;
  const char* fixed_ = nullptr;
};

// This thread's message (mjolnir_last_error).
ErrorSlot& thread_error() noexcept;

// A failure the C layer detects itself, with the status it maps to.
class StatusError : public Error {
 public:
  StatusError(mjolnir_status status, const std::string& message)
      : Error(message), status_(status) {}
  mjolnir_status status() const { return status_; }

 private:
  mjolnir_status status_;
};

template <typename... Parts>
[[noreturn]] void fail(mjolnir_status status, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw StatusError(status, os.str());
}

// Runs `body` and turns whatever it throws into a status and a message, recorded on the
// thread and on `handle_error` (the first-argument handle's slot; null when there is none).
// mjolnir::Error (the C++ API's bad input) maps to `error_status`.
template <typename Body>
mjolnir_status call(const char* function, ErrorSlot* handle_error, Body&& body,
                    mjolnir_status error_status = MJOLNIR_ERROR_INVALID_ARGUMENT) noexcept {
  // Recorded inside each handler: the exception (and what() with it) ends with its handler.
  auto record = [&](mjolnir_status status, const char* message) noexcept {
    thread_error().set(function, message);
    if (handle_error != nullptr) handle_error->set(function, message);
    return status;
  };
  try {
    body();
  } catch (const StatusError& e) {
    return record(e.status(), e.what());
  } catch (const Error& e) {
    return record(error_status, e.what());
  } catch (const std::bad_alloc&) {
    return record(MJOLNIR_ERROR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return record(MJOLNIR_ERROR_INTERNAL, e.what());
  } catch (...) {
    return record(MJOLNIR_ERROR_INTERNAL, "unknown exception");
  }
  thread_error().clear();
  if (handle_error != nullptr) handle_error->clear();
  return MJOLNIR_OK;
}

// A handle argument: NULL is MJOLNIR_ERROR_NULL_HANDLE naming it.
template <typename Handle>
Handle& require_handle(Handle* handle, const char* name) {
  if (handle == nullptr) fail(MJOLNIR_ERROR_NULL_HANDLE, name, ": is NULL");
  return *handle;
}

// A pointer argument the call needs.
template <typename T>
void require_pointer(T* pointer, const char* name) {
  if (pointer == nullptr) fail(MJOLNIR_ERROR_INVALID_ARGUMENT, name, ": is NULL");
}

// A mjolnir_row_type argument as the library's RowType; another value is
// MJOLNIR_ERROR_INVALID_ARGUMENT naming it.
inline RowType require_row_type(std::int32_t type, const char* name) {
  if (type != MJOLNIR_ROWS_F32 && type != MJOLNIR_ROWS_BF16) {
    fail(MJOLNIR_ERROR_INVALID_ARGUMENT, name, ": ", type,
         " is not a mjolnir_row_type (MJOLNIR_ROWS_F32 0, MJOLNIR_ROWS_BF16 1)");
  }
  return type == MJOLNIR_ROWS_BF16 ? RowType::bf16 : RowType::f32;
}

// Reads a versioned input struct that begins with `size`. `v1_size` is the size of the first
// published version (the end of its last field): fixed forever, so callers built against an old
// header keep working. Fields past the caller's size stay value-initialized (zero); every
// later version must treat zero as "absent". Bytes past this library's struct must be zero.
template <typename T>
T read_struct(const T* in, std::size_t v1_size, const char* name, const char* type) {
  require_pointer(in, name);
  const std::size_t size = in->size;
  if (size < v1_size) {
    fail(MJOLNIR_ERROR_STRUCT_SIZE, name, "->size: ", size, " is less than ", v1_size,
         ", the size of the first ", type, " (set it to sizeof(", type, "))");
  }
  T copy{};
  std::memcpy(&copy, in, size < sizeof(T) ? size : sizeof(T));
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  for (std::size_t i = sizeof(T); i < size; ++i) {
    if (bytes[i] != 0) {
      fail(MJOLNIR_ERROR_STRUCT_SIZE, name, "->size: ", size, " bytes, and byte ", i,
           " is set, but this library (", MJOLNIR_VERSION_MAJOR, ".", MJOLNIR_VERSION_MINOR, ".",
           MJOLNIR_VERSION_PATCH, ") knows only the first ", sizeof(T), " bytes of ", type);
    }
  }
  return copy;
}

// Writes a versioned output struct: the fields this library knows that fit in out->size; bytes
// past them up to out->size are zeroed.
template <typename T>
void write_struct(const T& value, T* out, std::size_t v1_size, const char* name, const char* type) {
  require_pointer(out, name);
  const std::size_t size = out->size;
  if (size < v1_size) {
    fail(MJOLNIR_ERROR_STRUCT_SIZE, name, "->size: ", size, " is less than ", v1_size,
         ", the size of the first ", type, " (set it to sizeof(", type, "))");
  }
  T copy = value;
  copy.size = size;
  std::memcpy(out, &copy, size < sizeof(T) ? size : sizeof(T));
  if (size > sizeof(T))
    std::memset(reinterpret_cast<unsigned char*>(out) + sizeof(T), 0, size - sizeof(T));
}

// C enum values <-> C++ enums. Explicit tables, so the C values stay pinned whatever the C++
// enums do; an unknown value throws Error naming `name`.
Format to_format(std::int32_t value, const char* name);
std::int32_t from_format(Format format);
ScaleGranularity to_granularity(std::int32_t value, const char* name);
std::int32_t from_granularity(ScaleGranularity granularity);

}  // namespace mjolnir::capi

// The handles. Each owns what it needs and its error slot; none is shared behind the caller's
// back, so calls on different handles never touch common state.

struct mjolnir_cache {
  mjolnir::KvCacheView view;  // the spans point into k_scale / v_scale below
  std::vector<float> k_scale;
  std::vector<float> v_scale;
  mjolnir::capi::ErrorSlot error;
};

struct mjolnir_backend {
  std::unique_ptr<mjolnir::Backend> impl;
  std::string name;
  mjolnir::capi::ErrorSlot error;
};

struct mjolnir_plan {
  explicit mjolnir_plan(mjolnir::PlanCapacity capacity)
      : plan(capacity), seq_lens(static_cast<std::size_t>(capacity.max_seqs)) {
    const mjolnir::PlanOptions defaults;
    options[MJOLNIR_PLAN_WORKERS] = 0;  // the backend's
    options[MJOLNIR_PLAN_MAX_SPLITS] = capacity.max_splits;
    options[MJOLNIR_PLAN_TILE_TOKENS] = defaults.tile_tokens;
    options[MJOLNIR_PLAN_MIN_CHUNK_TOKENS] = defaults.min_chunk_tokens;
    options[MJOLNIR_PLAN_FIXED_SPLITS] = defaults.fixed_splits;
  }

  mjolnir::BackendPlan plan;
  // The seq_lens of the last successful update ([plan.num_seqs] valid), so that decode can
  // tell a plan made for another step; sized once, at creation.
  std::vector<std::int32_t> seq_lens;
  bool filled = false;           // false until an update succeeds, and after one fails
  std::int32_t options[5] = {};  // indexed by mjolnir_plan_option
  mjolnir::capi::ErrorSlot error;
};

struct mjolnir_scales {
  mjolnir::ScalesFile file;
  mjolnir::capi::ErrorSlot error;
};
