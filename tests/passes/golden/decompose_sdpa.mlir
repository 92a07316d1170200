// RUN: decompose-sdpa{device=cpu,target=mlx}
// A bf16 decode call on MLX's CPU: the fallback's own ops in bf16 (no cast), GQA-folded, one matmul per KV head.
graph decode(q:bf16[1,4,1,8], k:bf16[1,2,6,8], v:bf16[1,2,6,8], m:bool[1,1,1,6]) {
  sdpa:bf16[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v mask=m
  return sdpa
}
// CHECK-NOT: cast
// CHECK: q_folded:bf16[1,2,2,8] = reshape[shape=(1, 2, 2, 8)] q
// CHECK-NEXT: scale:bf16[] = constant[value=(0.25,), shape=(), dtype='bfloat16']
// CHECK-NEXT: mul:bf16[1,2,2,8] = mul q_folded scale
// CHECK-NEXT: k_t:bf16[1,2,8,6] = transpose[perm=(0, 1, 3, 2)] k
// CHECK-NEXT: scores:bf16[1,2,2,6] = matmul mul k_t
// CHECK: lowest:bf16[] = constant[value=(-3.3895313892515355e+38,), shape=(), dtype='bfloat16']
// CHECK-NEXT: scores_2:bf16[1,2,2,1,6] = where mask_folded scores_1 lowest
// CHECK-NEXT: probs:bf16[1,2,2,1,6] = softmax[axis=-1, precise=True] scores_2
// CHECK: attended:bf16[1,2,2,8] = matmul probs_1 v
// CHECK-NEXT: attended_1:bf16[1,4,1,8] = reshape[shape=(1, 4, 1, 8)] attended
// CHECK-NEXT: return attended_1
// REMARK: decompose-sdpa applied sdpa - applied
// -----
// RUN: decompose-sdpa{device=cpu,target=jax}
// A decode call on JAX's CPU: the GQA-folded float32 form, one matmul per KV head over its 2*1 query rows, softmax, @ v.
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
