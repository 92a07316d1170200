// RUN: dce
// A node nothing reads and an input nothing reads both go; the input leaves the signature.
graph dead(x:f32[2,3], unused:f32[4]) {
  exp:f32[2,3] = exp x
  neg:f32[2,3] = neg x
  return neg
}
// CHECK: graph dead(x:f32[2,3]) {
// CHECK-NOT: exp
// CHECK-NEXT: neg:f32[2,3] = neg x
// CHECK-NEXT: return neg
// REMARK: dce applied unused - applied
// REMARK: dce applied - - applied
// -----
// RUN: dce
graph live(x:f32[2,3]) {
  neg:f32[2,3] = neg x
  return neg
}
// CHECK: neg:f32[2,3] = neg x
// REMARK: dce declined - - no_candidates
