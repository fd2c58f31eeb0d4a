// Tile-skipping attention over a paged KV cache (OmniPage), for mx.fast.metal_kernel.
//
// Contract (docs/design.md): key slot j is visible to query i iff 0 <= slot_seq[j] <= q_seq[i]. Only the slots of
// the listed tiles (TILE consecutive slots each: 64 on the prefill path, 32 on the decode path) are ever read, so
// an empty page costs nothing; holes inside an active tile are skipped key by key before K or V is loaded.
//
// Work split. A "row" is one (query token, query head) pair; the rows that share a KV head (GQA) are numbered
// r = t * G + g so that consecutive rows read the same keys. A threadgroup holds NQ rows x NS parts, one simdgroup
// each: the NS simdgroups of a row walk disjoint, strided shares of the active tiles, and threadgroups along grid z
// ("splits") walk disjoint shares too. Each simdgroup keeps an online softmax (running max m, sum l, output acc in
// float32, D / 32 channels per lane, one simd_sum per key). The NS parts of a row merge in threadgroup memory; the
// splits are written as (normalised output, log-sum-exp) partials that the host merges (kernels/attention.py).
//
// Empty rows use the finite sentinel EMPTY instead of -inf: Metal compiles with fast math, where infinities are
// not reliable. A row with no visible key writes o = 0 and lse = EMPTY.

#include <metal_stdlib>
using namespace metal;

#define TSA_EMPTY (-1.0e30f)

template <typename TQ, typename TKV, int D, int TILE, int NQ, int NS,
          typename PSeq, typename PQSeq, typename PTiles, typename PDims, typename PScale>
METAL_FUNC void tile_skip_attention_impl(
    const device TQ* q,           // [Hq, T, D]
    const device TKV* k,          // [Hkv, capacity, D]
    const device TKV* v,          // [Hkv, capacity, D]
    PSeq slot_seq,                // [capacity] int32, -1 = free
    PQSeq q_seq,                  // [T] int32
    PTiles tiles,                 // [n_tiles] int32 active tile ids
    PDims dims,                   // [Hq, T, capacity, n_tiles, Hkv]
    PScale scale,                 // [1] float32
    device float* o_part,         // [splits, Hq, T, D]
    device float* lse_part,       // [splits, Hq, T]
    threadgroup float* tg_o,      // [NQ * NS * D]
    threadgroup float* tg_ml,     // [2 * NQ * NS]
    uint3 tg_pos, uint3 tg_count, uint sg, uint lane_id) {
  const int lane = int(lane_id);
  constexpr int DPL = D / 32;  // channels per lane
  const int n_heads = dims[0];
  const int n_q = dims[1];
  const int capacity = dims[2];
  const int n_tiles = dims[3];
  const int n_kv = dims[4];
  const int group = n_heads / n_kv;
  const int rows = group * n_q;                         // rows per KV head
  const int row_blocks = (rows + NQ - 1) / NQ;
  const int kvh = int(tg_pos.y) / row_blocks;
  const int row = (int(tg_pos.y) % row_blocks) * NQ + int(sg) / NS;
  const int part = int(sg) % NS;
  const int split = int(tg_pos.z);
  const int n_split = int(tg_count.z);
  const bool live = row < rows;                         // uniform over the simdgroup
  const int t = live ? row / group : 0;
  const int head = kvh * group + (live ? row % group : 0);

  float qv[DPL];
  float acc[DPL];
  float m = TSA_EMPTY;
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
        if (s < 0 || s > my_seq) continue;                // a hole or a future key: never loaded
        const device TKV* kr = k + (kv_base + slot) * D + lane * DPL;
        float d = 0.0f;
        for (int c = 0; c < DPL; ++c) d += qv[c] * float(kr[c]);
        const float score = simd_sum(d);
        const float m_new = max(m, score);
        const float keep = exp(m - m_new);
        const float p = exp(score - m_new);
        l = l * keep + p;
        const device TKV* vr = v + (kv_base + slot) * D + lane * DPL;
        for (int c = 0; c < DPL; ++c) acc[c] = acc[c] * keep + p * float(vr[c]);
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
      float mm = TSA_EMPTY;
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
    if (lane == 0) lse_part[out_row] = l > 0.0f ? m + log(l) : TSA_EMPTY;
  }
}
