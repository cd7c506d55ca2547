// Packing a step's plan and batch into the step buffer layout of decode_params.h, as plain host
// code (DecodeStep::upload copies what this writes). No CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cuda/decode_params.h"
#include "mjolnir/cache.h"
#include "mjolnir/plan.h"

namespace mjolnir::cuda {

// Byte offsets of the step buffer's regions for the given counts.
struct StepRegions {
  std::size_t items = 0, seqs = 0, pages = 0, end = 0;
};

inline StepRegions step_regions(std::size_t items, std::size_t seqs, std::size_t pages) {
  StepRegions r;
  r.items = kStepHeaderBytes;
  r.seqs = r.items + align16(items * sizeof(WorkItem));
  r.pages = r.seqs + align16(seqs * sizeof(SeqEntry));
  r.end = r.pages + align16(pages * sizeof(std::int32_t));
  return r;
}

inline int used_pages(int seq_len, int page_size) { return (seq_len + page_size - 1) / page_size; }

// Writes the step buffer of `plan` over `batch` (both already checked) into `out`, which holds at
// least step_regions(items, seqs, used pages).end bytes; returns the bytes written.
inline std::size_t pack_step(const PagedBatch& batch, const Plan& plan, int page_size,
                             std::byte* out) {
  const int num_seqs = batch.num_seqs();
  std::size_t total_pages = 0;
  for (int b = 0; b < num_seqs; ++b)
    total_pages += std::size_t(used_pages(batch.seq_lens[b], page_size));
  const StepRegions regions =
      step_regions(std::size_t(plan.num_items), std::size_t(num_seqs), total_pages);
  StepHeader header;
  header.num_items = plan.num_items;
  header.num_seqs = num_seqs;
  header.tile_tokens = plan.tile_tokens;
  header.q_len = plan.q_len;
  header.items_offset = static_cast<std::int32_t>(regions.items);
  header.seqs_offset = static_cast<std::int32_t>(regions.seqs);
  header.pages_offset = static_cast<std::int32_t>(regions.pages);
  std::memset(out, 0, kStepHeaderBytes);
  std::memcpy(out, &header, sizeof(header));
  if (plan.num_items > 0) {
    std::memcpy(out + regions.items, plan.items.data(),
                std::size_t(plan.num_items) * sizeof(WorkItem));
  }
  auto* seqs = reinterpret_cast<SeqEntry*>(out + regions.seqs);
  auto* pages = reinterpret_cast<std::int32_t*>(out + regions.pages);
  std::int32_t next_page = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int count = used_pages(batch.seq_lens[b], page_size);
    seqs[b] = SeqEntry{batch.seq_lens[b], plan.num_splits[b], plan.first_partial[b], next_page};
    for (int i = 0; i < count; ++i) pages[next_page + i] = batch.page(b, i);
    next_page += count;
  }
  return regions.end;
}

}  // namespace mjolnir::cuda
