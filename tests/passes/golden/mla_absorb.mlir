// RUN: mla-absorb,dce
// MLA attention of 2 query rows: K and V are per-head up-projections of one latent [B, 1, T, R]. Absorbed,
// q is projected into the latent space (q·W_ukᵀ), one sdpa attends over the latent as K and V (one KV head),
// and the output is projected by W_uv; the expansion over the cache is dead.
graph mla(q:f32[1,2,2,2], latent:f32[1,1,8,4]{resident}, w_uk:f32[2,4,2]{resident}, w_uv:f32[2,2,4]{resident}, mask:f32[1,2,2,8]) {
  matmul:f32[1,2,8,2] = matmul latent w_uk
  transpose:f32[2,4,2] = transpose[perm=(0, 2, 1)] w_uv
  matmul_1:f32[1,2,8,2] = matmul latent transpose
  sdpa:f32[1,2,2,2] = sdpa[scale=0.25, causal='none'] q matmul matmul_1 mask=mask
  return sdpa
}
// CHECK-NOT: matmul latent
// CHECK: w_uk_t:f32[2,2,4] = transpose[perm=(0, 2, 1)] w_uk
// CHECK-NEXT: q_latent:f32[1,2,2,4] = matmul q w_uk_t
// CHECK-NEXT: sdpa_latent:f32[1,2,2,4] = sdpa[scale=0.25, causal='none'] q_latent latent latent mask=mask
// CHECK-NEXT: mla_out:f32[1,2,2,2] = matmul sdpa_latent transpose
// CHECK-NEXT: return mla_out
// REMARK: mla-absorb applied sdpa - applied
// REMARK: dce applied - - applied
// -----
// RUN: mla-absorb{crossover_factor=0.5}
// The same call under half the FLOP model's crossover (2.7 rows x 0.5): 2 rows keep the expansion.
graph mla(q:f32[1,2,2,2], latent:f32[1,1,8,4], w_uk:f32[2,4,2], w_uv:f32[2,2,4]) {
  matmul:f32[1,2,8,2] = matmul latent w_uk
  transpose:f32[2,4,2] = transpose[perm=(0, 2, 1)] w_uv
  matmul_1:f32[1,2,8,2] = matmul latent transpose
  sdpa:f32[1,2,2,2] = sdpa[scale=0.25, causal='none'] q matmul matmul_1
  return sdpa
}
// CHECK: sdpa:f32[1,2,2,2] = sdpa[scale=0.25, causal='none'] q matmul matmul_1
// CHECK-NOT: sdpa_latent
// REMARK: mla-absorb declined sdpa - little_gain
// -----
// RUN: mla-absorb
// K and V are graph inputs, not projections of a latent.
graph plain(q:f32[1,2,2,4], k:f32[1,2,8,4], v:f32[1,2,8,4]) {
  sdpa:f32[1,2,2,4] = sdpa[scale=0.5, causal='none'] q k v
  return sdpa
}
// CHECK: sdpa:f32[1,2,2,4] = sdpa[scale=0.5, causal='none'] q k v
// REMARK: mla-absorb declined sdpa - not_latent
