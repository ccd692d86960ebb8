// The aarch64 twin of q4_matvec_x86_64.c for IREE's embedded ELF dispatches: Armv8.0-A
// Advanced SIMD only (every aarch64 CPU, Android's arm64-v8a included; no libc, no globals):
// out[r] = sum_b s[r, b] * sum_j x[32 b + j] * q[r, b, j] for the rows [row0, row0 + n),
// s in f16 (the archive's scales, widened exactly by fcvt).
// q holds IREE's `i4` layout (the archive's bytes): element 2k of a block in the low nibble of
// byte k, 16 bytes a block of 32 values, two's complement. The arithmetic is f32, as the graph's
// and the reference's, associated otherwise: a block's x·q products summed (two 4-lane partial
// sums, even and odd elements), then times its scale.
//
// Why this form (docs/quantized-weights.md counts it against llama.cpp's Q4_0 dot product):
// - x is loaded de-interleaved (ld2): its even elements meet the low nibbles, its odd ones the
//   high nibbles, so the nibbles are never interleaved.
// - Each nibble is moved into the top four bits of a 32-bit lane by one tbl (indices past 15
//   give zero bytes) and converted by one scvtf with 28 fraction bits: value * 2^28 / 2^28,
//   exact, with the sign from the nibble's top bit. The sign-extending chain (sshll, sshll2
//   twice, then scvtf) takes 12 + 8 instructions for what 8 tbl + 8 scvtf do here.
// - No integer dot product (sdot, smmla): those need x quantized to 8 bits, another arithmetic
//   than the graph's and the reference's.
//
// Every memref argument arrives as MLIR's descriptor (base, aligned, offset, size, stride).
#include <arm_neon.h>
#include <stddef.h>
#include <stdint.h>

void q4_matvec_workgroup(
    const float* x_base, const float* x, size_t x_off, size_t x_size, size_t x_stride,
    const uint8_t* q_base, const uint8_t* q, size_t q_off, size_t q_size, size_t q_stride,
    const uint16_t* s_base, const uint16_t* s, size_t s_off, size_t s_size, size_t s_stride,
    float* o_base, float* o, size_t o_off, size_t o_size, size_t o_stride,
    size_t k, size_t row0, size_t n) {
  x += x_off;
  q += q_off;
  s += s_off;
  o += o_off;
  const size_t nb = k / 32;
  // Lane j of vector i takes byte 4i + j as its top byte, zeros below.
  uint8x16_t lanes[4];
  for (int i = 0; i < 4; ++i) {
    const uint32x4_t byte = vaddq_u32(vdupq_n_u32(4 * i), (uint32x4_t){0, 1, 2, 3});
    // Indices 0xff (out of the table: zero) below the byte's own index in the top position.
    lanes[i] = vreinterpretq_u8_u32(vorrq_u32(vshlq_n_u32(byte, 24), vdupq_n_u32(0x00ffffff)));
  }
  const uint8x16_t high = vdupq_n_u8(0xf0);
  const __fp16* scales = (const __fp16*)s;
  for (size_t r = row0; r < row0 + n; ++r) {
    float32x4_t acc = vdupq_n_f32(0);
    const uint8_t* qr = q + r * nb * 16;
    const __fp16* sr = scales + r * nb;
    const float* xb = x;
    for (size_t b = 0; b < nb; ++b, xb += 32) {
      const uint8x16_t bytes = vld1q_u8(qr + b * 16);
      const uint8x16_t even = vshlq_n_u8(bytes, 4);
      const uint8x16_t odd = vandq_u8(bytes, high);
      // Unrolled by hand: the first products start the two partial sums (no zeroing).
      float32x4x2_t xv = vld2q_f32(xb);
      float32x4_t te = vmulq_f32(xv.val[0], vcvtq_n_f32_s32(vreinterpretq_s32_u8(vqtbl1q_u8(even, lanes[0])), 28));
      float32x4_t to = vmulq_f32(xv.val[1], vcvtq_n_f32_s32(vreinterpretq_s32_u8(vqtbl1q_u8(odd, lanes[0])), 28));
      for (int i = 1; i < 4; ++i) {
        xv = vld2q_f32(xb + 8 * i);
        te = vfmaq_f32(te, xv.val[0], vcvtq_n_f32_s32(vreinterpretq_s32_u8(vqtbl1q_u8(even, lanes[i])), 28));
        to = vfmaq_f32(to, xv.val[1], vcvtq_n_f32_s32(vreinterpretq_s32_u8(vqtbl1q_u8(odd, lanes[i])), 28));
      }
      // The block's sum, then its scale: one multiply a block where each value took one.
      acc = vfmaq_n_f32(acc, vaddq_f32(te, to), (float)sr[b]);
    }
    o[r] = vaddvq_f32(acc);
  }
}
