// Normalised Walsh-Hadamard transform of every G-chunk of `fwht_buf` (spec §3, §5.5.1).
// Included by kernels that declare `var<workgroup> fwht_buf: array<f32, N>` and call it from
// uniform control flow with all `threads` invocations of the workgroup. `scale` is the f32
// value of 1/sqrt(G), computed on the host so every back end multiplies by the same number.
fn fwht_groups(lid: u32, threads: u32, length: u32, group: u32, scale: f32) {
  workgroupBarrier();
  for (var h = 1u; h < group; h <<= 1u) {
    for (var p = lid; p < length / 2u; p += threads) {
      let i = (p / h) * 2u * h + (p % h);
      let a = fwht_buf[i];
      let b = fwht_buf[i + h];
      fwht_buf[i] = a + b;
      fwht_buf[i + h] = a - b;
    }
    workgroupBarrier();
  }
  for (var i = lid; i < length; i += threads) {
    fwht_buf[i] = fwht_buf[i] * scale;
  }
  workgroupBarrier();
}
