// RUN: decompose-sdpa{device=cpu,target=mlx}
// A decode call on CPU: the GQA-folded form, one matmul per KV head over its 2*1 query rows, softmax, @ v.
graph decode(q:f32[1,4,1,8], k:f32[1,2,6,8], v:f32[1,2,6,8]) {
  sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK-NOT: sdpa
// CHECK: q_folded:f32[1,2,2,8] = reshape[shape=(1, 2, 2, 8)] q
// CHECK: mul:f32[1,2,2,8] = mul q_folded scale
// CHECK: scores_t:f32[1,2,6,2] = matmul k q_t
// CHECK: probs:f32[1,2,2,6] = softmax[axis=-1, precise=False] scores
// CHECK-NEXT: attended:f32[1,2,2,8] = matmul probs v
// CHECK-NEXT: attended_1:f32[1,4,1,8] = reshape[shape=(1, 4, 1, 8)] attended
// CHECK-NEXT: return attended_1
// REMARK: decompose-sdpa applied sdpa - applied
// -----
// RUN: decompose-sdpa{device=gpu,target=jax}
// On a GPU the fused kernel serves the call: it stays.
graph decode(q:f32[1,4,1,8], k:f32[1,2,6,8], v:f32[1,2,6,8]) {
  sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK: sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
// CHECK-NOT: matmul
// REMARK: decompose-sdpa declined sdpa - fused_kernel_serves
