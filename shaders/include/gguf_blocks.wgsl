// GGUF block decoding (dense-gguf spec §4.1, GPU layout §4.3), shared by q_matmul,
// q_matmul_rows and get_rows.
//
//   quad(block, j) = the dequantised weights 4j .. 4j+3 of GPU block `block` of the bound part
//                  = sub_scale(block, s).x * sub_quad(block, s, jj) + sub_scale(block, s).y,
//                    s = j / SUB_QUADS, jj = j % SUB_QUADS
//
// so that a kernel walking a row in order decodes each scale once per sub-block.
// A GPU block is one GGUF block (float types: one quad of 4 weights), BLOCK_WORDS u32 words of
// the word plane at block * BLOCK_WORDS; the f16 scale of Q4_0, Q5_0, Q8_0 and Q6_K blocks sits
// in the side plane (block b in half b & 1 of word side_base + b / 2). Everything is read as
// u32 words: no 8/16-bit storage and no shader-f16 needed.
//
// The includer provides: `fn word(i: u32) -> u32` (word i of the bound part), a uniform
// `params` with a `side_base: u32` field, and the constants QTYPE (the GGML type id, one of the
// QT_* below), BLOCK_WORDS, BLOCK_QUADS and SUB_QUADS. Only the branch of QTYPE survives compilation.

const QT_F32: u32 = 0u;
const QT_F16: u32 = 1u;
const QT_Q4_0: u32 = 2u;
const QT_Q4_1: u32 = 3u;
const QT_Q5_0: u32 = 6u;
const QT_Q5_1: u32 = 7u;
const QT_Q8_0: u32 = 8u;
const QT_Q2_K: u32 = 10u;
const QT_Q3_K: u32 = 11u;
const QT_Q4_K: u32 = 12u;
const QT_Q5_K: u32 = 13u;
const QT_Q6_K: u32 = 14u;
const QT_IQ4_NL: u32 = 20u;
const QT_IQ4_XS: u32 = 23u;
const QT_BF16: u32 = 30u;

// The 16 values of IQ4_NL / IQ4_XS's non-linear grid (ggml's kvalues_iq4nl), four signed bytes
// a word: picked by select, not by indexing a const array (some compilers refuse a dynamic index).
const IQ4_GRID: vec4<u32> = vec4<u32>(0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u);

const BYTE_SHIFTS: vec4<u32> = vec4<u32>(0u, 8u, 16u, 24u);

// The f16 scale of a side-plane block type.
fn side_d(block: u32) -> f32 {
  let pair = unpack2x16float(word(params.side_base + (block >> 1u)));
  return select(pair.x, pair.y, (block & 1u) == 1u);
}

// Nibble `shift / 4` (0: low, 1: high) of each of the four bytes of w.
fn nibbles4(w: u32, shift: u32) -> vec4<u32> {
  return (vec4<u32>(w) >> (BYTE_SHIFTS + vec4<u32>(shift))) & vec4<u32>(15u);
}

// Bit `bit` of each of the four bytes of w (Q5_K's qh bytes).
fn byte_bits4(w: u32, bit: u32) -> vec4<u32> {
  return (vec4<u32>(w) >> (BYTE_SHIFTS + vec4<u32>(bit))) & vec4<u32>(1u);
}

// The four signed bytes of w (sign-extended by an arithmetic shift; no unpack4xI8 needed).
fn int8x4(w: u32) -> vec4<f32> {
  return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}

// Q5_0 / Q5_1: bit e of qh is the 5th bit (+16) of weight e; the bits of weights 4j .. 4j+3.
fn fifth_bits(qh: u32, j: u32) -> vec4<u32> {
  return ((vec4<u32>(qh) >> (vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(4u * j))) & vec4<u32>(1u)) << vec4<u32>(4u);
}

// The grid values of four 4-bit codes (IQ4_NL, IQ4_XS).
fn iq4_values(codes: vec4<u32>) -> vec4<f32> {
  let high = (codes & vec4<u32>(8u)) != vec4<u32>(0u);
  let odd = (codes & vec4<u32>(4u)) != vec4<u32>(0u);
  let w = select(select(vec4<u32>(IQ4_GRID.x), vec4<u32>(IQ4_GRID.y), odd),
                 select(vec4<u32>(IQ4_GRID.z), vec4<u32>(IQ4_GRID.w), odd), high);
  let bytes = w << (vec4<u32>(24u) - (codes & vec4<u32>(3u)) * 8u);
  return vec4<f32>(bitcast<vec4<i32>>(bytes) >> vec4<u32>(24u));
}

// Byte k of word-aligned bytes starting at word `base`.
fn byte_at(base: u32, k: u32) -> u32 {
  return (word(base + (k >> 2u)) >> ((k & 3u) * 8u)) & 255u;
}

// The signed 6-bit scale of sub-block s (< 16) of a Q3_K block: low 4 bits from byte s & 7
// (nibble s >> 3), high 2 bits from byte 8 + (s & 3) (bits 2 (s >> 2)); minus 32. The 12 scale
// bytes start at word base + 24.
fn q3k_scale(base: u32, s: u32) -> f32 {
  let low = (byte_at(base + 24u, s & 7u) >> ((s >> 3u) * 4u)) & 15u;
  let high = (byte_at(base + 24u, 8u + (s & 3u)) >> ((s >> 2u) * 2u)) & 3u;
  return f32(i32(low | (high << 4u)) - 32);
}

// The signed 6-bit scale of sub-block s (< 8) of an IQ4_XS block: low 4 bits from scales_l
// (word base + 1, nibble s), high 2 bits from scales_h (the upper half of word base, bits 2s).
fn iq4xs_scale(base: u32, s: u32) -> f32 {
  let low = (word(base + 1u) >> (4u * s)) & 15u;
  let high = (word(base) >> (16u + 2u * s)) & 3u;
  return f32(i32(low | (high << 4u)) - 32);
}

// Byte k of the 12 scale bytes of a Q4_K / Q5_K block (words base + 1 .. base + 3).
fn k_scale_byte(base: u32, k: u32) -> u32 {
  return (word(base + 1u + (k >> 2u)) >> ((k & 3u) * 8u)) & 255u;
}

// (sc_s, m_s) of sub-block s of a Q4_K / Q5_K block: the 6-bit pairs of §4.1.
fn k_scale_min(base: u32, s: u32) -> vec2<f32> {
  if (s < 4u) {
    return vec2<f32>(f32(k_scale_byte(base, s) & 63u), f32(k_scale_byte(base, s + 4u) & 63u));
  }
  let packed = k_scale_byte(base, s + 4u);
  let sc = (packed & 15u) | ((k_scale_byte(base, s - 4u) >> 6u) << 4u);
  let m = (packed >> 4u) | ((k_scale_byte(base, s) >> 6u) << 4u);
  return vec2<f32>(f32(sc), f32(m));
}

// Weight = scale.x * q + scale.y for every weight of sub-block s of a block: the sub-blocks are
// the spans of one scale (32 weights; Q6_K 16; float types: the quad, scale (1, 0)).
fn sub_scale(block: u32, s: u32) -> vec2<f32> {
  let base = block * BLOCK_WORDS;
  if (QTYPE == QT_Q8_0) {
    return vec2<f32>(side_d(block), 0.0);
  }
  if (QTYPE == QT_Q4_0) {
    let d = side_d(block);
    return vec2<f32>(d, -8.0 * d);
  }
  if (QTYPE == QT_Q5_0) {
    let d = side_d(block);
    return vec2<f32>(d, -16.0 * d);
  }
  if (QTYPE == QT_Q4_1 || QTYPE == QT_Q5_1) {
    return unpack2x16float(word(base));
  }
  if (QTYPE == QT_Q4_K || QTYPE == QT_Q5_K) {
    let dm = unpack2x16float(word(base));
    let sm = k_scale_min(base, s);
    return vec2<f32>(dm.x * sm.x, -(dm.y * sm.y));
  }
  if (QTYPE == QT_Q6_K) {
    let scale = side_d(block) * int8x4(word(base + 48u + (s >> 2u)))[s & 3u];
    return vec2<f32>(scale, -32.0 * scale);
  }
  if (QTYPE == QT_Q2_K) {
    // scales[16] (words 0..3: low nibble scale, high nibble min), qs (4..19), (d, dmin) word 20.
    let dm = unpack2x16float(word(base + 20u));
    let packed = byte_at(base, s);
    return vec2<f32>(dm.x * f32(packed & 15u), -(dm.y * f32(packed >> 4u)));
  }
  if (QTYPE == QT_Q3_K) {
    // sub_quad gives q + 4 (0..7): weight = d * sc * (q + 4) - 4 * d * sc.
    let scale = side_d(block) * q3k_scale(base, s);
    return vec2<f32>(scale, -4.0 * scale);
  }
  if (QTYPE == QT_IQ4_NL) {
    return vec2<f32>(side_d(block), 0.0);
  }
  if (QTYPE == QT_IQ4_XS) {
    return vec2<f32>(unpack2x16float(word(base)).x * iq4xs_scale(base, s), 0.0);
  }
  return vec2<f32>(1.0, 0.0);
}

// The four stored values (q, or the weights of a float type) of quad jj of sub-block s.
fn sub_quad(block: u32, s: u32, jj: u32) -> vec4<f32> {
  let base = block * BLOCK_WORDS;
  if (QTYPE == QT_F32) {
    return bitcast<vec4<f32>>(vec4<u32>(word(base), word(base + 1u), word(base + 2u), word(base + 3u)));
  }
  if (QTYPE == QT_F16) {
    return vec4<f32>(unpack2x16float(word(base)), unpack2x16float(word(base + 1u)));
  }
  if (QTYPE == QT_BF16) {
    let a = word(base);
    let b = word(base + 1u);
    return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
  }
  if (QTYPE == QT_Q8_0) {
    return int8x4(word(base + jj));
  }
  // 32-weight nibble blocks: weights 4jj.. are the low (jj < 4) or high nibbles of qs word jj & 3.
  let nibble_shift = (jj >> 2u) * 4u;
  if (QTYPE == QT_Q4_0) {
    return vec4<f32>(nibbles4(word(base + (jj & 3u)), nibble_shift));
  }
  if (QTYPE == QT_Q4_1) {
    return vec4<f32>(nibbles4(word(base + 1u + (jj & 3u)), nibble_shift));
  }
  if (QTYPE == QT_Q5_0) {
    return vec4<f32>(nibbles4(word(base + 1u + (jj & 3u)), nibble_shift) | fifth_bits(word(base), jj));
  }
  if (QTYPE == QT_Q5_1) {
    return vec4<f32>(nibbles4(word(base + 2u + (jj & 3u)), nibble_shift) | fifth_bits(word(base + 1u), jj));
  }
  if (QTYPE == QT_IQ4_NL) {
    return iq4_values(nibbles4(word(base + (jj & 3u)), nibble_shift));
  }
  if (QTYPE == QT_IQ4_XS) {
    // Sub-block s: qs[16s .. 16s + 15] (words 2 + 4s ..), low nibbles then high, as a Q4_0 block.
    return iq4_values(nibbles4(word(base + 2u + 4u * s + (jj & 3u)), nibble_shift));
  }
  // Q2_K / Q3_K: weight 128h + 32c + l (h < 2, c < 4, l < 32) takes bits 2c, 2c+1 of qs[32h + l];
  // sub-block s = 8h + 2c + l / 16 of 16 weights. Q3_K adds 4 unless bit 4h + c of hmask[l] is
  // clear (ggml: q - 4 when the bit is 0); words: Q2_K qs at 4, Q3_K hmask 0..7, qs 8..23.
  if (QTYPE == QT_Q2_K || QTYPE == QT_Q3_K) {
    let h2 = s >> 3u;
    let c2 = (s >> 1u) & 3u;
    let l_quad = 4u * (s & 1u) + jj;
    let qs_base = select(base + 8u, base + 4u, QTYPE == QT_Q2_K);
    let low = (vec4<u32>(word(qs_base + 8u * h2 + l_quad)) >> (BYTE_SHIFTS + vec4<u32>(2u * c2))) & vec4<u32>(3u);
    if (QTYPE == QT_Q2_K) {
      return vec4<f32>(low);
    }
    return vec4<f32>(low | (byte_bits4(word(base + l_quad), 4u * h2 + c2) << vec4<u32>(2u)));
  }
  // Q4_K / Q5_K: sub-block s is the low (s even) or high nibbles of qs[32 (s / 2) ..].
  let qs_word = 8u * (s >> 1u) + jj;
  let k_shift = (s & 1u) * 4u;
  if (QTYPE == QT_Q4_K) {
    return vec4<f32>(nibbles4(word(base + 4u + qs_word), k_shift));
  }
  if (QTYPE == QT_Q5_K) {
    return vec4<f32>(nibbles4(word(base + 12u + qs_word), k_shift) | (byte_bits4(word(base + 4u + jj), s) << vec4<u32>(4u)));
  }
  // Q6_K: weight 128h + 32c + l takes nibble c >> 1 of ql[64h + 32(c & 1) + l] and bits 2c, 2c+1
  // of qh[32h + l] (words: ql 0..31, qh 32..47); sub-block s = 8h + 2c + l / 16.
  let h = s >> 3u;
  let c = (s >> 1u) & 3u;
  let l_word = 4u * (s & 1u) + jj;
  let low = nibbles4(word(base + 16u * h + 8u * (c & 1u) + l_word), (c >> 1u) * 4u);
  let top = (vec4<u32>(word(base + 32u + 8u * h + l_word)) >> (BYTE_SHIFTS + vec4<u32>(2u * c))) & vec4<u32>(3u);
  return vec4<f32>(low | (top << vec4<u32>(4u)));
}

// Dequantised weights 4j .. 4j+3 of a block (random access: the GPU shape and the gather).
fn quad(block: u32, j: u32) -> vec4<f32> {
  let s = j / SUB_QUADS;
  let scale = sub_scale(block, s);
  return scale.x * sub_quad(block, s, j % SUB_QUADS) + scale.y;
}
