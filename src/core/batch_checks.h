// The batch's own checks (block table, seq_lens, query tokens) without the cache geometry's, for
// callers that have validated the geometry already: validate(DecodeArgs) checks the cache view
// (its geometry included) first, then this. validate(PagedBatch, ...) is both.
#pragma once

#include "mjolnir/cache.h"

namespace mjolnir::detail {

// validate(batch, geometry, q_len) for a geometry that validate_geometry has accepted.
void check_batch(const PagedBatch& batch, const CacheGeometry& geometry, int q_len);

}  // namespace mjolnir::detail
