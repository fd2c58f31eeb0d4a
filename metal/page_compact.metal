// page_compact: gather the K and V rows that an OmniPage migration moves, for mx.fast.metal_kernel.
//
// One thread copies one channel of one moved row of one KV head, for K and V. The host evaluates the gathered
// rows before it scatters them into the cache's own buffers, so MLX updates those buffers in place and memory
// grows with the rows moved, never with the cache (docs/design.md, cache.migrate).

#include <metal_stdlib>
using namespace metal;

template <typename T, typename PSrc, typename PDims>
METAL_FUNC void page_compact_impl(
    const device T* k,      // [Hkv, capacity, D]
    const device T* v,      // [Hkv, capacity, D]
    PSrc src,               // [n] int32 source slots
    PDims dims,             // [capacity, n, D]
    device T* k_rows,       // [Hkv, n, D]
    device T* v_rows,       // [Hkv, n, D]
    uint3 pos) {
  const int capacity = dims[0];
  const int n = dims[1];
  const int d = dims[2];
  const int c = int(pos.x);
  const int i = int(pos.y);
  const int h = int(pos.z);
  if (c >= d || i >= n) return;
  const size_t from = ((size_t)h * capacity + src[i]) * d + c;
  const size_t to = ((size_t)h * n + i) * d + c;
  k_rows[to] = k[from];
  v_rows[to] = v[from];
}
