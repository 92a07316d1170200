// RUN: block-sparse{block_q=8,enabled=true}
// A causal prefill of 32 rows in tiles of 8: tile i reads only the keys 0:8(i+1) its rows can see.
graph prefill(q:f32[1,2,32,8], k:f32[1,2,32,8], v:f32[1,2,32,8]) {
  sdpa:f32[1,2,32,8] = sdpa[scale=None, causal='bottom_right'] q k v
  return sdpa
}
// CHECK: sdpa_q0:f32[1,2,8,8] = slice[start=(0, 0, 0, 0), stop=(1, 2, 8, 8)
// CHECK-NEXT: sdpa_k0:f32[1,2,8,8] = slice[start=(0, 0, 0, 0), stop=(1, 2, 8, 8)
// CHECK: sdpa_t0:f32[1,2,8,8] = sdpa[scale=None, causal='bottom_right'] sdpa_q0 sdpa_k0 sdpa_v0
// CHECK: sdpa_k1:f32[1,2,16,8] = slice[start=(0, 0, 0, 0), stop=(1, 2, 16, 8)
// CHECK: sdpa_t1:f32[1,2,8,8] = sdpa
// CHECK: sdpa_k2:f32[1,2,24,8] = slice[start=(0, 0, 0, 0), stop=(1, 2, 24, 8)
// CHECK: sdpa_t2:f32[1,2,8,8] = sdpa
// CHECK-NOT: sdpa_k3
// CHECK: sdpa_t3:f32[1,2,8,8] = sdpa[scale=None, causal='bottom_right'] sdpa_q3 k v
// CHECK-NEXT: sdpa_rows:f32[1,2,32,8] = concat[axis=2] sdpa_t0 sdpa_t1 sdpa_t2 sdpa_t3
// REMARK: block-sparse applied sdpa - applied
// -----
// RUN: block-sparse{block_q=8,enabled=true}
// 8 rows are one tile: nothing to skip.
graph short(q:f32[1,2,8,8], k:f32[1,2,32,8], v:f32[1,2,32,8]) {
  sdpa:f32[1,2,8,8] = sdpa[scale=None, causal='bottom_right'] q k v
  return sdpa
}
// CHECK: sdpa:f32[1,2,8,8] = sdpa[scale=None, causal='bottom_right'] q k v
// CHECK-NEXT: return sdpa
// REMARK: block-sparse declined sdpa - too_few_rows
// -----
// RUN: block-sparse{block_q=8,enabled=true}
// No causal kind: nothing says which key blocks a tile may skip.
graph dense(q:f32[1,2,32,8], k:f32[1,2,32,8], v:f32[1,2,32,8]) {
  sdpa:f32[1,2,32,8] = sdpa[scale=None, causal='none'] q k v
  return sdpa
}
// CHECK: sdpa:f32[1,2,32,8] = sdpa[scale=None, causal='none'] q k v
// CHECK-NEXT: return sdpa
// REMARK: block-sparse declined sdpa - no_structured_mask
