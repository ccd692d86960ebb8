// A one-row q4 product for IREE's embedded ELF dispatches (AVX-512 BW, F16C; no libc, no
// globals): out[r] = sum_b s[r, b] * sum_j x[32 b + j] * q[r, b, j] for the rows
// [row0, row0 + n), s in f16 (the archive's scales, widened exactly).
// q holds IREE's `i4` layout (the archive's bytes): element 2k of a block in the low nibble of
// byte k, 16 bytes a block of 32 values. The arithmetic is f32, as the graph's and the
// reference's, associated otherwise: a block's x·q products summed, then times its scale (the
// reference scales each value first). Each row keeps one 16-lane accumulator, summed across
// lanes once, where IREE's code sums across lanes every four blocks. The nibbles' values are
// looked up (vpermps) rather than sign-extended and converted: fewer instructions a block,
// which is what bound the first version (LM head 7.9-8.6 -> 6.1 ms standalone).
//
// Every memref argument arrives as MLIR's descriptor (base, aligned, offset, size, stride).
#include <immintrin.h>
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
  const __m128i low = _mm_set1_epi8(0x0f);
  // The signed value of each nibble, looked up (vpermps) instead of sign-extended and converted.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  for (size_t r = row0; r < row0 + n; ++r) {
    __m512 acc = _mm512_setzero_ps();
    const uint8_t* qr = q + r * nb * 16;
    const uint16_t* sr = s + r * nb;
    for (size_t b = 0; b < nb; ++b) {
      __m128i bytes = _mm_loadu_si128((const __m128i*)(qr + b * 16));
      __m128i even = _mm_and_si128(bytes, low);
      __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
      __m512 w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd)), values);
      __m512 w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(even, odd)), values);
      // The block's sum, then its scale: one multiply a block where each value took one.
      __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x + b * 32), w0);
      t = _mm512_fmadd_ps(_mm512_loadu_ps(x + b * 32 + 16), w1, t);
      acc = _mm512_fmadd_ps(t, _mm512_set1_ps(_cvtsh_ss(sr[b])), acc);
    }
    o[r] = _mm512_reduce_add_ps(acc);
  }
}
