// RUN: mla-absorb{selection_input=idx, rows_have_keys=true},dsa-gather{selection_input=idx, rows_have_keys=true},dce
// DSA with 2 query rows, each attending its K=3 indexed cells of T=8: absorbed first, then the latent is
// gathered once per row (one KV head), the additive mask read at the same cells, one sdpa over 2 rows x 3 cells.
graph dsa(q:f32[1,2,2,2], latent:f32[1,1,8,4]{resident}, w_uk:f32[2,4,2]{resident}, w_uv:f32[2,2,4]{resident}, mask:f32[1,2,2,8], idx:i32[1,1,2,3]) {
  constant:bool[1,1,2,8] = constant[value=(False,), shape=(1, 1, 2, 8), dtype='bool']
  constant_1:bool[] = constant[value=(True,), shape=(), dtype='bool']
  put_along_axis:bool[1,1,2,8] = put_along_axis[axis=-1] constant idx constant_1
  constant_2:f32[] = constant[value=(-3.4028234663852886e+38,), shape=(), dtype='float32']
  where:f32[1,2,2,8] = where put_along_axis mask constant_2
  matmul:f32[1,2,8,2] = matmul latent w_uk
  transpose:f32[2,4,2] = transpose[perm=(0, 2, 1)] w_uv
  matmul_1:f32[1,2,8,2] = matmul latent transpose
  sdpa:f32[1,2,2,2] = sdpa[scale=0.25, causal='none'] q matmul matmul_1 mask=where
  return sdpa
}
// CHECK-NOT: put_along_axis
// CHECK: cells:i32[1,2,3] = reshape[shape=(1, 2, 3)] idx
// CHECK-NEXT: kv_gathered:f32[2,1,3,4] = qsa_gather latent cells
// CHECK: mask_gathered:f32[1,2,2,3] = take_along_axis[axis=3] mask mask_cells
// CHECK: sdpa_gather:f32[2,2,1,4] = sdpa[scale=0.25, causal='none'] q_latent_rows kv_gathered kv_gathered mask=mask_gathered_1
// CHECK: mla_out:f32[1,2,2,2] = matmul sdpa_gather_1 transpose
// CHECK-NEXT: return mla_out
// REMARK: mla-absorb applied sdpa - applied
// REMARK: dsa-gather applied sdpa_latent - applied
// REMARK: dce applied - - applied
// -----
// RUN: dsa-gather{selection_input=idx}
// A finite fill (finfo.min) and no rows_have_keys promise: a row whose selected cells all hold the fill would
// weigh all T cells masked and only its K cells gathered, so the masked form stays.
graph dsa(q:f32[1,2,2,4], k:f32[1,2,8,4], v:f32[1,2,8,4], mask:f32[1,2,2,8], idx:i32[1,1,2,3]) {
  constant:bool[1,1,2,8] = constant[value=(False,), shape=(1, 1, 2, 8), dtype='bool']
  constant_1:bool[] = constant[value=(True,), shape=(), dtype='bool']
  put_along_axis:bool[1,1,2,8] = put_along_axis[axis=-1] constant idx constant_1
  constant_2:f32[] = constant[value=(-3.4028234663852886e+38,), shape=(), dtype='float32']
  where:f32[1,2,2,8] = where put_along_axis mask constant_2
  sdpa:f32[1,2,2,4] = sdpa[scale=0.5, causal='none'] q k v mask=where
  return sdpa
}
// CHECK: sdpa:f32[1,2,2,4] = sdpa[scale=0.5, causal='none'] q k v mask=where
// CHECK-NOT: qsa_gather
// REMARK: dsa-gather declined sdpa - rows_without_keys
// -----
// RUN: dsa-gather,dce
// A bool selection needs no promise about keys (every row has its K cells), but the indices are an input
// nobody promised distinct: a repeated index is one masked cell and two gathered ones.
graph dsa(q:f32[1,2,2,4], k:f32[1,2,8,4], v:f32[1,2,8,4], idx:i32[1,1,2,3]) {
  constant:bool[1,1,2,8] = constant[value=(False,), shape=(1, 1, 2, 8), dtype='bool']
  constant_1:bool[] = constant[value=(True,), shape=(), dtype='bool']
  put_along_axis:bool[1,1,2,8] = put_along_axis[axis=-1] constant idx constant_1
  sdpa:f32[1,2,2,4] = sdpa[scale=0.5, causal='none'] q k v mask=put_along_axis
  return sdpa
}
// CHECK: sdpa:f32[1,2,2,4] = sdpa[scale=0.5, causal='none'] q k v mask=put_along_axis
// REMARK: dsa-gather declined sdpa - indices_not_distinct
// REMARK: dce declined - - no_candidates
// -----
// RUN: dsa-gather{selection_input=idx},dce
// Expanded K and V (two KV heads) under a -inf fill (an unselected cell weighs exactly 0 and a row whose
// selected cells are all -inf is NaN either way, so no rows_have_keys promise is needed): K and V are gathered
// at each row's cells, [B*L, Hkv, K, D], and the mask's selected values beside them.
graph dsa(q:f32[1,4,2,4], k:f32[1,2,8,4], v:f32[1,2,8,4], mask:f32[1,1,2,8], idx:i32[1,1,2,3]) {
  constant:bool[1,1,2,8] = constant[value=(False,), shape=(1, 1, 2, 8), dtype='bool']
  constant_1:bool[] = constant[value=(True,), shape=(), dtype='bool']
  put_along_axis:bool[1,1,2,8] = put_along_axis[axis=-1] constant idx constant_1
  constant_2:f32[] = constant[value=(-inf,), shape=(), dtype='float32']
  where:f32[1,1,2,8] = where put_along_axis mask constant_2
  sdpa:f32[1,4,2,4] = sdpa[scale=0.5, causal='none'] q k v mask=where
  return sdpa
}
// CHECK: k_gathered:f32[2,2,3,4] = qsa_gather k cells
// CHECK-NEXT: v_gathered:f32[2,2,3,4] = qsa_gather v cells
// CHECK: mask_gathered:f32[1,1,2,3] = take_along_axis[axis=3] mask mask_cells
// CHECK-NEXT: mask_gathered_1:f32[2,1,1,3] = reshape[shape=(2, 1, 1, 3)] mask_gathered
// CHECK-NEXT: sdpa_gather:f32[2,4,1,4] = sdpa[scale=0.5, causal='none'] q_rows k_gathered v_gathered mask=mask_gathered_1
// CHECK-NOT: put_along_axis
// REMARK: dsa-gather applied sdpa - applied
// REMARK: dce applied - - applied
