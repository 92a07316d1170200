// RUN: raise-attention
// softmax(q·kᵀ·0.5)·v written with matmuls becomes one sdpa with the scale moved in.
graph attn(q:f32[1,2,3,4], k:f32[1,2,5,4], v:f32[1,2,5,4]) {
  transpose:f32[1,2,4,5] = transpose[perm=(0, 1, 3, 2)] k
  matmul:f32[1,2,3,5] = matmul q transpose
  constant:f32[] = constant[value=(0.5,), shape=(), dtype='float32']
  mul:f32[1,2,3,5] = mul matmul constant
  softmax:f32[1,2,3,5] = softmax[axis=-1, precise=False] mul
  matmul_1:f32[1,2,3,4] = matmul softmax v
  return matmul_1
}
// CHECK: graph attn(
// CHECK-NOT: matmul
// CHECK-NOT: softmax
// CHECK-NEXT: matmul_1_sdpa:f32[1,2,3,4] = sdpa[scale=0.5, causal='none'] q k v
// CHECK-NEXT: return matmul_1_sdpa
// REMARK: raise-attention applied matmul_1 attention applied
// REMARK: raise-attention analysis - - rule_hits
// -----
// RUN: raise-attention
// The scores pass through sin before the softmax, a step sdpa does not have: declined, nothing changes.
graph sine(q:f32[1,2,3,4], k:f32[1,2,5,4], v:f32[1,2,5,4]) {
  transpose:f32[1,2,4,5] = transpose[perm=(0, 1, 3, 2)] k
  matmul:f32[1,2,3,5] = matmul q transpose
  sin:f32[1,2,3,5] = sin matmul
  softmax:f32[1,2,3,5] = softmax[axis=-1, precise=False] sin
  matmul_1:f32[1,2,3,4] = matmul softmax v
  return matmul_1
}
// CHECK: sin:f32[1,2,3,5] = sin matmul
// CHECK-NOT: sdpa
// CHECK: matmul_1:f32[1,2,3,4] = matmul softmax v
// REMARK: raise-attention declined matmul_1 attention not_attention
// REMARK: raise-attention analysis - - rule_hits
