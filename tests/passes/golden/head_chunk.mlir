// RUN: head-chunk{budget=16}
// q_len*gqa = 5*4 = 20 > 16: four subcalls of at most 3 query heads on one-head K/V slices, concatenated back.
graph heads(q:f32[1,8,5,16], k:f32[1,2,16,16], v:f32[1,2,16,16]) {
  sdpa:f32[1,8,5,16] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK: sdpa_k0:f32[1,1,16,16] = slice[start=(0, 0, 0, 0), stop=(1, 1, 16, 16)
// CHECK: sdpa_q0:f32[1,3,5,16] = slice[start=(0, 0, 0, 0), stop=(1, 3, 5, 16)
// CHECK-NEXT: sdpa_c0:f32[1,3,5,16] = sdpa[scale=0.25, causal='none'] sdpa_q0 sdpa_k0 sdpa_v0
// CHECK: sdpa_c1:f32[1,1,5,16] = sdpa[scale=0.25, causal='none'] sdpa_q1 sdpa_k0 sdpa_v0
// CHECK: sdpa_k1:f32[1,1,16,16] = slice[start=(0, 1, 0, 0), stop=(1, 2, 16, 16)
// CHECK: sdpa_c2:f32[1,3,5,16] = sdpa[scale=0.25, causal='none'] sdpa_q2 sdpa_k1 sdpa_v1
// CHECK: sdpa_c3:f32[1,1,5,16] = sdpa[scale=0.25, causal='none'] sdpa_q3 sdpa_k1 sdpa_v1
// CHECK-NEXT: sdpa_heads:f32[1,8,5,16] = concat[axis=1] sdpa_c0 sdpa_c1 sdpa_c2 sdpa_c3
// CHECK-NEXT: return sdpa_heads
// REMARK: head-chunk applied sdpa - applied
// -----
// RUN: head-chunk
// q_len*gqa = 5*4 = 20 fits the default budget of 32: the fused call stays whole.
graph fits(q:f32[1,8,5,16], k:f32[1,2,16,16], v:f32[1,2,16,16]) {
  sdpa:f32[1,8,5,16] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK: sdpa:f32[1,8,5,16] = sdpa[scale=0.25, causal='none'] q k v
// CHECK-NOT: slice
// CHECK-NEXT: return sdpa
// REMARK: head-chunk declined sdpa - fused_kernel_serves
