// Rounding to the FP16 grid in f32 (no shader-f16 feature needed). Included by kernels that
// store halves (qk_rope's f16 KV) or round a value as an FP16 store would (qkv_post's CQ norm).
const HALF_MAX: f32 = 65504.0;
const HALF_MIN_NORMAL: f32 = 6.103515625e-05;  // 2^-14; below it halves are multiples of 2^-24

// x saturated to ±HALF_MAX and rounded to the nearest half, ties to even, as an f32 (exact).
fn to_half_grid(x: f32) -> f32 {
  let c = clamp(x, -HALF_MAX, HALF_MAX);
  if (abs(c) < HALF_MIN_NORMAL) {
    return round(c * 16777216.0) * 5.9604644775390625e-08;  // round() is ties-to-even
  }
  // Keep 10 of the 23 mantissa bits: add just under half of the dropped part, plus its last
  // kept bit (ties to even); a carry moves into the exponent as it should.
  let bits = bitcast<u32>(c);
  return bitcast<f32>((bits + 0x0FFFu + ((bits >> 13u) & 1u)) & 0xFFFFE000u);
}
