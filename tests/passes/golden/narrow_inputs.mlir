// RUN: narrow-inputs
// The mask input is read only through one slice: the input becomes the slice's type and the slice goes.
graph decode(q:f32[1,4,1,8], k:f32[1,2,8,8], v:f32[1,2,8,8], m:f32[1,1,4,8]) {
  slice:f32[1,1,1,8] = slice[start=(0, 0, 0, 0), stop=(1, 1, 1, 8), step=(1, 1, 1, 1)] m
  sdpa:f32[1,4,1,8] = sdpa[scale=None, causal='none'] q k v mask=slice
  return sdpa
}
// CHECK: graph decode(q:f32[1,4,1,8], k:f32[1,2,8,8], v:f32[1,2,8,8], m:f32[1,1,1,8]) {
// CHECK-NOT: slice
// CHECK-NEXT: sdpa:f32[1,4,1,8] = sdpa[scale=None, causal='none'] q k v mask=m
// REMARK: narrow-inputs declined q - read_whole
// REMARK: narrow-inputs declined k - read_whole
// REMARK: narrow-inputs declined v - read_whole
// REMARK: narrow-inputs applied m - applied
