// The emulator behind the Backend interface: runs the plan's items in order, then merges.
#include "reference/emulator_backend.h"

#include <vector>

#include "core/chunk_merge.h"
#include "reference/emulator.h"

namespace mjolnir::reference {

namespace {

class EmulatorBackend final : public Backend {
 public:
  std::string_view name() const override { return "reference"; }
  bool takes_rows(RowType) const override { return true; }  // float32 and bf16
  std::string unsupported_reason(const CacheGeometry&, const DecodeParams&) const override {
    return {};
  }
  int workers() const override { return 1; }

  void run(const DecodeArgs& args, const BackendPlan& planned,
           std::span<std::byte> workspace) const override {
    check_run(args, planned, workspace);
    const Plan& plan = planned.plan();
    const int d = args.cache.geometry.head_dim;
    const int hk = args.cache.geometry.num_kv_heads;
    const int g = args.params.num_q_heads / hk;
    const PartialLayout layout = partial_layout(args.cache.geometry, args.params);
    const int slots = plan.partial_slots();
    float* partial_o = reinterpret_cast<float*>(workspace.data());
    float* partial_lse = partial_o + layout.o_floats(slots);

    std::vector<float> o(std::size_t(layout.rows) * d), lse(layout.rows);
    // Q is prepared once per (query tile, KV head), as a kernel does before its chunks.
    int prepared_tile = -1, prepared_head = -1;
    PreparedQuery query;
    for (const WorkItem& item : plan.work()) {
      if (item.tile != prepared_tile || item.kv_head != prepared_head) {
        query = prepare_query(args, item);
        prepared_tile = item.tile;
        prepared_head = item.kv_head;
      }
      run_item(args, plan, item, query, o, lse);
      for (int r = 0; r < item.q_count * g; ++r) {
        const float* src = &o[std::size_t(r) * d];
        if (item.partial_slot < 0) {
          args.write_o_row(item, r, g, src);
          if (float* out_lse = args.lse_at(item, r, g)) *out_lse = lse[r];
        } else {
          std::copy(src, src + d, partial_o + layout.o_offset(item.partial_slot, item.kv_head, r));
          partial_lse[layout.lse_offset(item.partial_slot, item.kv_head, r)] = lse[r];
        }
      }
    }

    // Merge the chunks of every split query tile.
    std::vector<float> merged_o(d);
    for (int i = 0; i < plan.num_query_tiles; ++i) {
      const int splits = plan.num_splits[i];
      if (splits <= 1) continue;
      const QueryTile& qt = plan.query_tiles[i];
      const int first = plan.first_partial[i];
      for (int h = 0; h < hk; ++h) {
        const WorkItem rows_of{
            .seq = qt.seq, .kv_head = h, .q_begin = qt.q_begin, .q_count = qt.q_count};
        for (int r = 0; r < qt.q_count * g; ++r) {
          float merged_lse;
          merge_chunks(partial_o + layout.o_offset(first, h, r), layout.o_offset(1, 0, 0),
                       partial_lse + layout.lse_offset(first, h, r), layout.lse_offset(1, 0, 0),
                       splits, d, merged_o.data(), &merged_lse);
          args.write_o_row(rows_of, r, g, merged_o.data());
          if (float* out_lse = args.lse_at(rows_of, r, g)) *out_lse = merged_lse;
        }
      }
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_emulator_backend() { return std::make_unique<EmulatorBackend>(); }

}  // namespace mjolnir::reference
