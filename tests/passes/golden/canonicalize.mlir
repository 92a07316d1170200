// RUN: canonicalize
// Layout chains collapse (reshape of a reshape, a transpose and its inverse) and a product of constants folds.
graph canon(x:f32[2,3,4]) {
  reshape:f32[6,4] = reshape[shape=(6, 4)] x
  reshape_1:f32[2,12] = reshape[shape=(2, 12)] reshape
  transpose:f32[12,2] = transpose[perm=(1, 0)] reshape_1
  transpose_1:f32[2,12] = transpose[perm=(1, 0)] transpose
  constant:f32[] = constant[value=(2.0,), shape=(), dtype='float32']
  constant_1:f32[] = constant[value=(3.0,), shape=(), dtype='float32']
  mul:f32[] = mul constant constant_1
  add:f32[2,12] = add transpose_1 mul
  return add
}
// CHECK: graph canon(x:f32[2,3,4]) {
// CHECK-NOT: transpose
// CHECK-NEXT: reshape_1_1:f32[2,12] = reshape[shape=(2, 12)] x
// CHECK-NEXT: mul_folded:f32[] = constant[value=(6.0,), shape=(), dtype='float32']
// CHECK-NEXT: add:f32[2,12] = add reshape_1_1 mul_folded
// CHECK-NEXT: return add
// REMARK: canonicalize applied reshape_1 reshape-chain applied
// REMARK: canonicalize applied transpose_1 transpose-chain applied
// REMARK: canonicalize applied mul fold applied
// REMARK: canonicalize applied transpose_1_1 transpose-identity applied
// REMARK: canonicalize analysis - - rule_hits
// -----
// RUN: canonicalize
// cos is computed by each target its own way: folding it with the reference would change the last bits.
graph rope(x:f32[2,8]) {
  constant:f32[8] = constant[value=(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0), shape=(8,), dtype='float32']
  cos:f32[8] = cos constant
  mul:f32[2,8] = mul x cos
  return mul
}
// CHECK: cos:f32[8] = cos constant
// CHECK-NEXT: mul:f32[2,8] = mul x cos
// REMARK: canonicalize declined cos fold target_defined
// REMARK: canonicalize analysis - - rule_hits
