// Tile-skipping attention over a quantised paged KV cache (kv_bits), for mx.fast.metal_kernel.
//
// The fp kernel (tile_skip_attention.metal) with K and V read as MLX affine-quantised rows: per slot, BITS-bit codes
// packed little-end first into uint32 words ([Hkv, capacity, D * BITS / 32]), one scale and one bias per GROUP
// channels ([Hkv, capacity, D / GROUP], type TS); a channel's value is code * scale + bias, as mx.dequantize
// computes it. Same contract, work split and merges as the fp kernel: key slot j is visible to query i iff
// 0 <= slot_seq[j] <= q_seq[i], only listed tiles are read, holes and future keys are skipped before their codes
// are loaded. Keys with a pending shift (deferred re-rotation) and full-precision rows are not handled here: the
// host runs the MLX reference for those steps (kernels/quantized.py).

#include <metal_stdlib>
using namespace metal;

#define TSQ_EMPTY (-1.0e30f)

template <int BITS, int GROUP, typename TS>
METAL_FUNC float tsq_channel(const device uint32_t* packed_row, const device TS* scales_row,
                             const device TS* biases_row, int c) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const uint32_t word = packed_row[c / PER_WORD];
  const uint32_t code = (word >> ((c % PER_WORD) * BITS)) & MASK;
  return float(code) * float(scales_row[c / GROUP]) + float(biases_row[c / GROUP]);
}

template <typename TQ, typename TS, int D, int TILE, int NQ, int NS, int BITS, int GROUP,
          typename PSeq, typename PQSeq, typename PTiles, typename PDims, typename PScale>
METAL_FUNC void tile_skip_attention_q_impl(
    const device TQ* q,               // [Hq, T, D]
    const device uint32_t* k,         // [Hkv, capacity, D * BITS / 32]
    const device TS* k_scales,        // [Hkv, capacity, D / GROUP]
    const device TS* k_biases,        // [Hkv, capacity, D / GROUP]
    const device uint32_t* v,
    const device TS* v_scales,
    const device TS* v_biases,
    PSeq slot_seq,                    // [capacity] int32, -1 = free
    PQSeq q_seq,                      // [T] int32
    PTiles tiles,                     // [n_tiles] int32 active tile ids
    PDims dims,                       // [Hq, T, capacity, n_tiles, Hkv]
    PScale scale,                     // [1] float32
    device float* o_part,             // [splits, Hq, T, D]
    device float* lse_part,           // [splits, Hq, T]
    threadgroup float* tg_o,          // [NQ * NS * D]
    threadgroup float* tg_ml,         // [2 * NQ * NS]
    uint3 tg_pos, uint3 tg_count, uint sg, uint lane_id) {
  const int lane = int(lane_id);
  constexpr int DPL = D / 32;  // channels per lane
  constexpr int WORDS = D * BITS / 32;  // packed words per row
  constexpr int GROUPS = D / GROUP;
  const int n_heads = dims[0];
  const int n_q = dims[1];
  const int capacity = dims[2];
  const int n_tiles = dims[3];
  const int n_kv = dims[4];
  const int group = n_heads / n_kv;
  const int rows = group * n_q;
  const int row_blocks = (rows + NQ - 1) / NQ;
  const int kvh = int(tg_pos.y) / row_blocks;
  const int row = (int(tg_pos.y) % row_blocks) * NQ + int(sg) / NS;
  const int part = int(sg) % NS;
  const int split = int(tg_pos.z);
  const int n_split = int(tg_count.z);
  const bool live = row < rows;
  const int t = live ? row / group : 0;
  const int head = kvh * group + (live ? row % group : 0);

  float qv[DPL];
  float acc[DPL];
  float m = TSQ_EMPTY;
  float l = 0.0f;
  for (int c = 0; c < DPL; ++c) acc[c] = 0.0f;

  if (live) {
    const float sc = scale[0];
    const int my_seq = q_seq[t];
    const device TQ* qr = q + ((size_t)head * n_q + t) * D + lane * DPL;
    for (int c = 0; c < DPL; ++c) qv[c] = float(qr[c]) * sc;
    const size_t kv_base = (size_t)kvh * capacity;
    for (int i = split * NS + part; i < n_tiles; i += n_split * NS) {
      const int first = tiles[i] * TILE;
      for (int j = 0; j < TILE; ++j) {
        const int slot = first + j;
        const int s = slot_seq[slot];
        if (s < 0 || s > my_seq) continue;  // a hole or a future key: its codes are never loaded
        const size_t r = kv_base + slot;
        float d = 0.0f;
        for (int c = 0; c < DPL; ++c)
          d += qv[c] * tsq_channel<BITS, GROUP, TS>(k + r * WORDS, k_scales + r * GROUPS, k_biases + r * GROUPS,
                                                     lane * DPL + c);
        const float score = simd_sum(d);
        const float m_new = max(m, score);
        const float keep = exp(m - m_new);
        const float p = exp(score - m_new);
        l = l * keep + p;
        for (int c = 0; c < DPL; ++c)
          acc[c] = acc[c] * keep + p * tsq_channel<BITS, GROUP, TS>(v + r * WORDS, v_scales + r * GROUPS,
                                                                    v_biases + r * GROUPS, lane * DPL + c);
        m = m_new;
      }
    }
  }

  if (NS > 1) {  // merge the NS parts of each row in threadgroup memory
    const int me = int(sg);
    if (lane == 0) {
      tg_ml[me] = m;
      tg_ml[NQ * NS + me] = l;
    }
    for (int c = 0; c < DPL; ++c) tg_o[me * D + lane * DPL + c] = acc[c];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (part == 0) {
      float mm = TSQ_EMPTY;
      for (int p = 0; p < NS; ++p) mm = max(mm, tg_ml[me + p]);
      float ll = 0.0f;
      for (int c = 0; c < DPL; ++c) acc[c] = 0.0f;
      for (int p = 0; p < NS; ++p) {
        const float w = exp(tg_ml[me + p] - mm);
        ll += w * tg_ml[NQ * NS + me + p];
        for (int c = 0; c < DPL; ++c) acc[c] += w * tg_o[(me + p) * D + lane * DPL + c];
      }
      m = mm;
      l = ll;
    }
  }

  if (live && part == 0) {
    const size_t out_row = ((size_t)split * n_heads + head) * n_q + t;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = 0; c < DPL; ++c) o_part[out_row * D + lane * DPL + c] = acc[c] * inv;
    if (lane == 0) lse_part[out_row] = l > 0.0f ? m + log(l) : TSQ_EMPTY;
  }
}
