// RUN: qsa-gather,dce
// A QSA decode step: K and V are gathered at the W=5 selected cells (2 blocks x ratio 2 + 1 tail), the
// visibility at the same cells, and one sdpa attends over them; the masked path is dead.
graph decode(q:f32[1,4,1,8], k:f32[1,2,12,8]{resident}, v:f32[1,2,12,8]{resident}, scores:f32[1,1,6], positions:i32[1,1], vis:f32[1,1,1,12]) {
  qsa_select:i32[1,1,2] = qsa_select[ratio=2, top_k_blocks=2] scores positions
  qsa_mask:bool[1,1,1,12] = qsa_mask[ratio=2, kv_len=12] qsa_select positions
  constant:f32[] = constant[value=(-inf,), shape=(), dtype='float32']
  where:f32[1,1,1,12] = where qsa_mask vis constant
  sdpa:f32[1,4,1,8] = sdpa[scale=0.5, causal='none'] q k v mask=where
  return sdpa
}
// CHECK-NOT: qsa_mask
// CHECK: qsa_cells:i32[1,1,5] = qsa_cells[ratio=2, width=5, kv_len=12] qsa_select positions
// CHECK: k_gathered:f32[1,2,5,8] = qsa_gather k qsa_cells
// CHECK-NEXT: v_gathered:f32[1,2,5,8] = qsa_gather v qsa_cells
// CHECK: vis_gathered:f32[1,1,1,5] = take_along_axis[axis=3] vis vis_cells
// CHECK: gather_mask:f32[1,1,1,5] = where cell_ok vis_gathered neg_inf
// CHECK-NEXT: sdpa_gather:f32[1,4,1,8] = sdpa[scale=0.5, causal='none'] q k_gathered v_gathered mask=gather_mask
// CHECK-NEXT: return sdpa_gather
// REMARK: qsa-gather applied sdpa - applied
// REMARK: dce applied - - applied
// -----
// RUN: qsa-gather
// The mask is a graph input, not a QSA selection: the masked path is kept.
graph masked(q:f32[1,4,1,8], k:f32[1,2,12,8], v:f32[1,2,12,8], mask:f32[1,1,1,12]) {
  sdpa:f32[1,4,1,8] = sdpa[scale=0.5, causal='none'] q k v mask=mask
  return sdpa
}
// CHECK: sdpa:f32[1,4,1,8] = sdpa[scale=0.5, causal='none'] q k v mask=mask
// CHECK-NOT: qsa_gather
// REMARK: qsa-gather declined sdpa - mask_not_selection
