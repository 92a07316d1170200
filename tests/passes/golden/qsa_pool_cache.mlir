// RUN: qsa-pool-cache{enabled=true}
// The pooled block keys come from a new resident cache: each step pools only the block of the new row
// and writes it with one dynamic_update_slice; the updated cache is the state output fed back.
graph pool(idx_q:f32[1,1,2,8], raw:f32[1,16,8]{resident}, positions:i32[1,1]) {
  qsa_pool:f32[1,4,8] = qsa_pool[ratio=4] raw
  qsa_block_scores:f32[1,1,4] = qsa_block_scores idx_q qsa_pool
  qsa_select:i32[1,1,2] = qsa_select[ratio=4, top_k_blocks=2] qsa_block_scores positions
  return qsa_select
}
// CHECK: graph pool(idx_q:f32[1,1,2,8], raw:f32[1,16,8]{resident}, positions:i32[1,1], raw_blocks:f32[1,4,8]{resident}) {
// CHECK-NOT: qsa_pool[ratio=4] raw
// CHECK: new_block:i32[1] = minimum floor_divide last_block
// CHECK: raw_new:f32[1,4,8] = take[axis=1] raw new_cells
// CHECK-NEXT: pooled_new:f32[1,1,8] = qsa_pool[ratio=4] raw_new
// CHECK: raw_blocks_next:f32[1,4,8] = dynamic_update_slice raw_blocks pooled_new cache_at
// CHECK-NEXT: block_scores:f32[1,1,4] = qsa_block_scores idx_q raw_blocks_next
// CHECK-NEXT: qsa_select:i32[1,1,2] = qsa_select[ratio=4, top_k_blocks=2] block_scores positions
// CHECK-NEXT: return qsa_select, raw_blocks_next -> raw_blocks
// REMARK: qsa-pool-cache applied qsa_block_scores - applied
// -----
// RUN: qsa-pool-cache{enabled=false}
graph pool(idx_q:f32[1,1,2,8], raw:f32[1,16,8]{resident}, positions:i32[1,1]) {
  qsa_pool:f32[1,4,8] = qsa_pool[ratio=4] raw
  qsa_block_scores:f32[1,1,4] = qsa_block_scores idx_q qsa_pool
  qsa_select:i32[1,1,2] = qsa_select[ratio=4, top_k_blocks=2] qsa_block_scores positions
  return qsa_select
}
// CHECK: qsa_pool:f32[1,4,8] = qsa_pool[ratio=4] raw
// CHECK-NOT: raw_blocks
// REMARK: qsa-pool-cache declined qsa_block_scores - disabled
