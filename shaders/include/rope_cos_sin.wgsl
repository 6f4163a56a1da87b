// RoPE's cos and sin, shared by qkv_post (Needle 3) and qk_rope (dense). Included by kernels
// built with the constants PIO2_1..PIO2_4 (constants.pio2_parts: π/2 as three 8-bit parts and the
// f32 remainder).

const TWO_OVER_PI: f32 = 0.636619772;

// (cos, sin) of an angle in [0, 2^16): Cody-Waite reduction by π/2 (the first three products
// k·PIO2_n are exact), then Taylor polynomials on |r| <= π/4. Built-in sin/cos are only
// accurate near [-π, π] on some GPUs, and RoPE angles reach the context length.
fn rope_cos_sin(a: f32) -> vec2<f32> {
  let k = floor(a * TWO_OVER_PI + 0.5);
  var r = a - k * PIO2_1;
  r = r - k * PIO2_2;
  r = r - k * PIO2_3;
  r = r - k * PIO2_4;
  let r2 = r * r;
  let s = r + r * r2 * (-1.0 / 6.0 + r2 * (1.0 / 120.0 + r2 * (-1.0 / 5040.0 + r2 * (1.0 / 362880.0
          + r2 * (-1.0 / 39916800.0)))));
  let c = 1.0 + r2 * (-0.5 + r2 * (1.0 / 24.0 + r2 * (-1.0 / 720.0 + r2 * (1.0 / 40320.0
          + r2 * (-1.0 / 3628800.0 + r2 * (1.0 / 479001600.0))))));
  switch (u32(k) & 3u) {
    case 0u: { return vec2<f32>(c, s); }
    case 1u: { return vec2<f32>(-s, c); }
    case 2u: { return vec2<f32>(-c, -s); }
    default: { return vec2<f32>(s, -c); }
  }
}
