// A8 activation fake-quant (spec §3 fake_quant, §4.9) of fwht_buf[0 : length] in place: one
// scale for the whole vector, scale = max|v| / 127 (1 when all are 0), v = clip(round(v /
// scale), -128, 127) · scale, dividing correctly rounded and rounding half to even, as the
// reference (reference.ops.fake_quant). Included by kernels that hold one position's vector in
// `fwht_buf` and call it from uniform control flow with all `threads` invocations. The max is
// an atomicMax of the bit patterns (non-negative f32 order as u32), so it is exact in any order.
//#include include/div_rn.wgsl

var<workgroup> act_quant_max: atomic<u32>;

fn act_quant(lid: u32, threads: u32, length: u32) {
  if (lid == 0u) {
    atomicStore(&act_quant_max, 0u);
  }
  workgroupBarrier();
  var m = 0.0;
  for (var i = lid; i < length; i += threads) {
    m = max(m, abs(fwht_buf[i]));
  }
  atomicMax(&act_quant_max, bitcast<u32>(m));
  workgroupBarrier();
  let scale = a8_scale(bitcast<f32>(atomicLoad(&act_quant_max)));
  for (var i = lid; i < length; i += threads) {
    fwht_buf[i] = f32(quantize_i8(fwht_buf[i], scale)) * scale;
  }
  workgroupBarrier();
}
