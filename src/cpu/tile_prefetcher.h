// Software prefetch of a tile's K/V rows for the CPU kernel (attention_kernel.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace mjolnir::cpu {

// Prefetches the K and V rows of the next tile (all heads of the unit) while this one computes, a
// few rows at a time. Pages are scattered through the block table, so no hardware prefetcher can
// follow a sequence from one page to the next, and within a page the kernel visits one head's
// rows at a time, a strided pattern prefetchers follow poorly. Rows are issued token by token,
// heads and K/V innermost, which walks each page's memory in order.
class TilePrefetcher {
 public:
  // The rows of tokens bases[0 .. count) at every offset in offsets[0 .. num_offsets).
  void Reset(const std::uint8_t* const* bases, int count, const std::int64_t* offsets,
             int num_offsets, std::size_t row_bytes) {
    bases_ = bases;
    offsets_ = offsets;
    rows_ = count * num_offsets;
    num_offsets_ = num_offsets;
    row_bytes_ = row_bytes;
    next_ = token_ = offset_ = 0;
    // Rows that start on a cache line need row_bytes / 64 lines; others one more.
    aligned_ = row_bytes % 64 == 0;
    for (int i = 0; i < count && aligned_; ++i) aligned_ = (std::uintptr_t(bases[i]) & 63) == 0;
    for (int i = 0; i < num_offsets && aligned_; ++i) aligned_ = (offsets[i] & 63) == 0;
  }
  int rows() const { return rows_; }
  // Issues the next `n` rows, if any are left.
  inline void Issue(int n) {
    const int stop = std::min(rows_, next_ + n);
    for (; next_ < stop; ++next_) {
      const std::uint8_t* row = bases_[token_] + offsets_[offset_];
      // Into L2 (locality 2): the tiles in flight are larger than L1.
      for (std::size_t off = 0; off < row_bytes_; off += 64) __builtin_prefetch(row + off, 0, 2);
      if (!aligned_) __builtin_prefetch(row + row_bytes_ - 1, 0, 2);
      // Token-major order, kept by counters: a division per row cost more than the prefetch.
      if (++offset_ == num_offsets_) offset_ = 0, ++token_;
    }
  }

 private:
  const std::uint8_t* const* bases_ = nullptr;
  const std::int64_t* offsets_ = nullptr;
  int rows_ = 0, num_offsets_ = 1, next_ = 0;
  int token_ = 0, offset_ = 0;  // the row next_ is: token token_, offset offset_
  std::size_t row_bytes_ = 0;
  bool aligned_ = false;
};

}  // namespace mjolnir::cpu
