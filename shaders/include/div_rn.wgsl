// The correctly rounded f32 quotient (WGSL division may be 2.5 ulp off). Included by kernels
// that quantise as the reference does: IEEE division, then round half to even, where a quotient
// next to a .5 must round the same way on every adapter.

// v with the low 12 significand bits cleared: products of two such halves are exact in f32.
fn split_high(v: f32) -> f32 {
  return bitcast<f32>(bitcast<u32>(v) & 0xFFFFF000u);
}

// a - q·b, exact up to the last of four small terms (a ≈ q·b makes the first step exact).
fn residual(a: f32, b: f32, q: f32) -> f32 {
  let qh = split_high(q);
  let ql = q - qh;
  let bh = split_high(b);
  let bl = b - bh;
  return (((a - qh * bh) - qh * bl) - ql * bh) - ql * bl;
}

// a / b correctly rounded, for a >= 0, b > 0.
fn div_rn(a: f32, b: f32) -> f32 {
  var q = a / b;
  if (!(q > 1e-30)) {
    return q;
  }
  for (var i = 0u; i < 4u; i++) {
    let bits = bitcast<u32>(q);
    let up = bitcast<f32>(bits + 1u) - q;
    let down = q - bitcast<f32>(bits - 1u);
    let r = residual(a, b, q);
    if (r > 0.5 * up * b) {
      q = bitcast<f32>(bits + 1u);
    } else if (r < -0.5 * down * b) {
      q = bitcast<f32>(bits - 1u);
    } else {
      break;
    }
  }
  return q;
}

// clip(round_half_even(x / scale), -128, 127) for scale > 0 (reference.ops.quantize_rows).
fn quantize_i8(x: f32, scale: f32) -> i32 {
  let n = i32(min(round(div_rn(abs(x), scale)), 128.0));
  return clamp(select(n, -n, x < 0.0), -128, 127);
}

// The A8 scale of a vector (spec §3, §4.9): absmax / 127 correctly rounded, or 1 for zeros.
fn a8_scale(absmax: f32) -> f32 {
  return select(1.0, div_rn(absmax, 127.0), absmax > 0.0);
}
