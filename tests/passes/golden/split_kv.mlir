// RUN: split-kv{shards=2}
// Two T-shards of 4 keys: one batched partial sdpa and its sdpa_lse, combined by log-sum-exp weights.
graph decode(q:f32[1,4,1,8], k:f32[1,2,8,8]{resident}, v:f32[1,2,8,8]{resident}) {
  sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK: sdpa_q_rep_1:f32[2,4,1,8] = reshape[shape=(2, 4, 1, 8)] sdpa_q_rep
// CHECK: sdpa_k_split_2:f32[2,2,4,8] = reshape
// CHECK: sdpa_v_split_2:f32[2,2,4,8] = reshape
// CHECK-NEXT: sdpa_partial:f32[2,4,1,8] = sdpa[scale=0.25, causal='none'] sdpa_q_rep_1 sdpa_k_split_2 sdpa_v_split_2
// CHECK-NEXT: sdpa_lse:f32[2,4,1] = sdpa_lse[scale=0.25, causal='none'] sdpa_q_rep_1 sdpa_k_split_2 sdpa_v_split_2
// CHECK: sdpa_lse_max:f32[1,1,4,1,1] = max[axes=(0,), keepdims=True] sdpa_lse_parts
// CHECK: sdpa_weight:f32[2,1,4,1,1] = exp
// CHECK: sdpa_num:f32[1,4,1,8] = sum[axes=(0,), keepdims=False]
// CHECK-NEXT: sdpa_den:f32[1,4,1,1] = sum[axes=(0,), keepdims=False] sdpa_weight
// CHECK-NEXT: sdpa_combined:f32[1,4,1,8] = div sdpa_num sdpa_den
// CHECK-NEXT: return sdpa_combined
// REMARK: split-kv applied sdpa - applied
// -----
// RUN: split-kv{shards=3}
// 8 keys do not split into 3 shards.
graph decode(q:f32[1,4,1,8], k:f32[1,2,8,8]{resident}, v:f32[1,2,8,8]{resident}) {
  sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK: sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
// CHECK-NOT: sdpa_lse
// REMARK: split-kv declined sdpa - not_divisible
