// RUN: shard-attention{heads=model}
// KV heads over a 2-device model axis: q, k, v and the output are annotated on their head dimension.
graph decode(q:f32[1,4,1,8], k:f32[1,2,8,8]{resident}, v:f32[1,2,8,8]{resident}) mesh(model=2) {
  sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK: graph decode(q:f32[1,4@model,1,8], k:f32[1,2@model,8,8]{resident}, v:f32[1,2@model,8,8]{resident}) mesh(model=2) {
// CHECK-NEXT: sdpa:f32[1,4@model,1,8] = sdpa[scale=0.25, causal='none'] q k v
// CHECK-NEXT: return sdpa
// REMARK: shard-attention applied sdpa sdpa applied
// REMARK: shard-attention analysis - - rule_hits
// -----
// RUN: shard-attention{heads=model}
// 4 devices cannot hold 2 KV heads without splitting a GQA group.
graph decode(q:f32[1,4,1,8], k:f32[1,2,8,8]{resident}, v:f32[1,2,8,8]{resident}) mesh(model=4) {
  sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
  return sdpa
}
// CHECK-NOT: @model
// CHECK: sdpa:f32[1,4,1,8] = sdpa[scale=0.25, causal='none'] q k v
// REMARK: shard-attention declined sdpa sdpa not_divisible
// REMARK: shard-attention analysis - - rule_hits
