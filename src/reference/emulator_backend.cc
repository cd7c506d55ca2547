// The emulator behind the Backend interface: runs the plan's items in order, then merges.
#include "reference/emulator_backend.h"

#include <vector>

#include "reference/emulator.h"

namespace mjolnir::reference {

namespace {

class EmulatorBackend final : public Backend {
 public:
  std::string_view name() const override { return "reference"; }
  std::string unsupported_reason(const CacheGeometry&, const DecodeParams&) const override {
    return {};
  }
  int workers() const override { return 1; }

  void run(const DecodeArgs& args, const Plan& plan,
           std::span<std::byte> workspace) const override {
    check_run(args, plan, workspace);
    const int d = args.cache.geometry.head_dim;
    const int hk = args.cache.geometry.num_kv_heads;
    const int g = args.params.num_q_heads / hk;
    const int q_len = args.params.q_len;
    const int rows = q_len * g;
    const PartialLayout layout{hk, rows, d};
    const int slots = plan.capacity.max_seqs * plan.capacity.max_splits;
    float* partial_o = reinterpret_cast<float*>(workspace.data());
    float* partial_lse = partial_o + layout.o_floats(slots);

    std::vector<float> o(std::size_t(rows) * d), lse(rows);
    auto output_row = [&](int seq, int kv_head, int r) {
      const int t = r / g, j = r % g;
      return args.o.data + (std::int64_t(seq) * q_len + t) * args.o.token_stride +
             std::int64_t(kv_head * g + j) * args.o.head_stride;
    };
    auto lse_index = [&](int seq, int kv_head, int r) {
      const int t = r / g, j = r % g;
      return (std::size_t(seq) * q_len + t) * args.params.num_q_heads + kv_head * g + j;
    };

    // Q is prepared once per (sequence, KV head), as a kernel does before its chunks.
    int prepared_seq = -1, prepared_head = -1;
    PreparedQuery query;
    for (const WorkItem& item : plan.work()) {
      if (item.seq != prepared_seq || item.kv_head != prepared_head) {
        query = prepare_query(args, item.seq, item.kv_head);
        prepared_seq = item.seq;
        prepared_head = item.kv_head;
      }
      run_item(args, plan, item, query, o, lse);
      for (int r = 0; r < rows; ++r) {
        const float* src = &o[std::size_t(r) * d];
        if (item.partial_slot < 0) {
          std::copy(src, src + d, output_row(item.seq, item.kv_head, r));
          if (!args.lse.empty()) args.lse[lse_index(item.seq, item.kv_head, r)] = lse[r];
        } else {
          std::copy(src, src + d, partial_o + layout.o_offset(item.partial_slot, item.kv_head, r));
          partial_lse[layout.lse_offset(item.partial_slot, item.kv_head, r)] = lse[r];
        }
      }
    }

    // Merge the chunks of every split sequence.
    std::vector<float> chunk_o, chunk_lse;
    for (int b = 0; b < plan.num_seqs; ++b) {
      const int splits = plan.num_splits[b];
      if (splits <= 1) continue;
      chunk_o.resize(std::size_t(splits) * d);
      chunk_lse.resize(splits);
      for (int h = 0; h < hk; ++h) {
        for (int r = 0; r < rows; ++r) {
          for (int s = 0; s < splits; ++s) {
            const int slot = plan.first_partial[b] + s;
            const float* src = partial_o + layout.o_offset(slot, h, r);
            std::copy(src, src + d, &chunk_o[std::size_t(s) * d]);
            chunk_lse[s] = partial_lse[layout.lse_offset(slot, h, r)];
          }
          float merged_lse;
          merge_chunks(chunk_o, chunk_lse, d, {output_row(b, h, r), std::size_t(d)}, &merged_lse);
          if (!args.lse.empty()) args.lse[lse_index(b, h, r)] = merged_lse;
        }
      }
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_emulator_backend() { return std::make_unique<EmulatorBackend>(); }

}  // namespace mjolnir::reference
