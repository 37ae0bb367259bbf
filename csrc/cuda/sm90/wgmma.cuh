/*
 * Hopper (sm_90a) primitives for the wgmma attention kernels: shared-memory matrix descriptors,
 * warpgroup MMA (wgmma.mma_async: FP16 and BF16 operands with FP32 accumulators, 8-bit integer
 * operands with int32 accumulators), named barriers and mbarriers
 * between the producer and consumer warpgroups, TMA tensor loads, and register reallocation
 * (setmaxnreg).
 *
 * Shared-memory operand layout used throughout ("K-major, 128-byte swizzle"): a tile of R rows x W
 * FP16 columns (the reduction dimension contiguous) is stored as W/64 column blocks of R rows x
 * 128 bytes; inside a block, 16-byte chunk c of row r sits at chunk position c ^ (r % 8). Blocks
 * are 1024-byte aligned, because the hardware applies the XOR to address bits 4-6 from bits 7-9.
 * A descriptor addresses 8-row groups 1024 bytes apart (stride byte offset); stepping 16 columns
 * (one k16 MMA) inside a block is +32 bytes on the start address.
 *
 * Only the sm_90a device pass has these instructions; elsewhere the wrappers are never called (the
 * kernel body is compiled out, see FP4ATTN_SM90_WGMMA) and compile to nothing.
 */
#ifndef FP4ATTN_CUDA_HOPPER_WGMMA_CUH
#define FP4ATTN_CUDA_HOPPER_WGMMA_CUH

#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FP4ATTN_SM90_WGMMA 1
#endif

namespace fp4attn_cuda {
namespace sm90 {

/* Element offset of (row, col) in a K-major 128-byte-swizzled FP16 tile of `rows` rows. */
__device__ __forceinline__ int sw128_offset(int rows, int row, int col) {
  return (col >> 6) * rows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

/* Descriptor of a K-major 128-byte-swizzled operand, built from its low word (the start address
 * field and the leading byte offset); the high word is the same for every operand of this layout.
 * Shared addresses lie below 2^18, so the 14-bit start field (address >> 4) of an operand never
 * carries: the descriptor of addr + 16 n is that of addr with n added to the low word. The kernel
 * computes each operand's low word once and adds constants instead of recomputing the field from
 * the address for every wgmma. */
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t addr) {
  return ((addr & 0x3FFFFu) >> 4) /* start address */
         | (1u << 16);            /* leading byte offset: unused for this layout */
}
__device__ __forceinline__ uint64_t sw128_desc(uint32_t lo) {
  return (uint64_t)lo | ((uint64_t)(1024 >> 4) << 32) /* stride byte offset: 8 rows x 128 bytes */
         | ((uint64_t)1 << 62);                       /* 128-byte swizzle */
}

/* Descriptor of a K-major operand of 8-bit elements whose rows are kRowBytes (64 or 128) bytes
 * wide and swizzled over that width (the TMA's SWIZZLE_64B / SWIZZLE_128B), 8-row groups
 * 8 x kRowBytes apart; the tile is aligned to that group. A k32 step is +32 bytes: + 2 on the
 * descriptor (as for sw128_desc_lo, the start field never carries). */
template <int kRowBytes>
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t addr) {
  static_assert(kRowBytes == 64 || kRowBytes == 128, "64- or 128-byte swizzle");
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | (1ull << 16) |
         ((uint64_t)(8 * kRowBytes >> 4) << 32) | ((uint64_t)(kRowBytes == 128 ? 1 : 2) << 62);
}

/* Descriptor of an MN-major ("transposed") 16-bit operand with the 128-byte swizzle, as the TMA
 * lands row-major [K][N] data in boxes of 64 N-values: per K index a 128-byte row of 64 N-values,
 * 8 K indices per 1024-byte swizzle atom (stride byte offset), the next 64 N-values `nblock`
 * bytes on (leading byte offset). A k16 step is + 2048 bytes (+ 128 on the descriptor). */
__device__ __forceinline__ uint64_t mnmajor_sw128_desc(uint32_t addr, uint32_t nblock) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)((nblock >> 4) & 0x3FFFu) << 16) |
         ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

#if defined(FP4ATTN_SM90_WGMMA)

/* Read-write operands d[n..n+7][0..3] of an FP32 accumulator (32 registers), for the asm
 * operand lists below. */
#define FP4ATTN_WGMMA_ACC4(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define FP4ATTN_WGMMA_ACC(d, n)                                                                 \
  FP4ATTN_WGMMA_ACC4(d, n), FP4ATTN_WGMMA_ACC4(d, n + 1), FP4ATTN_WGMMA_ACC4(d, n + 2),         \
      FP4ATTN_WGMMA_ACC4(d, n + 3), FP4ATTN_WGMMA_ACC4(d, n + 4), FP4ATTN_WGMMA_ACC4(d, n + 5), \
      FP4ATTN_WGMMA_ACC4(d, n + 6), FP4ATTN_WGMMA_ACC4(d, n + 7)

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keep the compiler from moving accumulator reads/writes across an in-flight wgmma. */
template <int NB>
__device__ __forceinline__ void fence_regs(float (&d)[NB][4]) {
#pragma unroll
  for (int n = 0; n < NB; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e])::"memory");
}

/* D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, A and B in shared memory (K-major descriptors). */
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[16][4], uint64_t desc_a,
                                                    uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : FP4ATTN_WGMMA_ACC(d, 0), FP4ATTN_WGMMA_ACC(d, 8)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* The same for an int32 accumulator (the 8-bit products). */
#define FP4ATTN_WGMMA_IACC4(d, n) "+r"(d[n][0]), "+r"(d[n][1]), "+r"(d[n][2]), "+r"(d[n][3])
#define FP4ATTN_WGMMA_IACC(d, n)                                                                   \
  FP4ATTN_WGMMA_IACC4(d, n), FP4ATTN_WGMMA_IACC4(d, n + 1), FP4ATTN_WGMMA_IACC4(d, n + 2),         \
      FP4ATTN_WGMMA_IACC4(d, n + 3), FP4ATTN_WGMMA_IACC4(d, n + 4), FP4ATTN_WGMMA_IACC4(d, n + 5), \
      FP4ATTN_WGMMA_IACC4(d, n + 6), FP4ATTN_WGMMA_IACC4(d, n + 7)

template <int NB>
__device__ __forceinline__ void fence_regs(int (&d)[NB][4]) {
#pragma unroll
  for (int n = 0; n < NB; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(d[n][e])::"memory");
}

/* 8-bit products, exact int32 accumulation (no scale or transpose operands for integers).
 * D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, signed A and B in shared memory. */
__device__ __forceinline__ void wgmma_ss_m64n128k32_s8(int (&d)[16][4], uint64_t desc_a,
                                                       uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "%64, %65, p;\n}\n"
      : FP4ATTN_WGMMA_IACC(d, 0), FP4ATTN_WGMMA_IACC(d, 8)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* D[64 x 64] (+)= A[64 x 32] * B[64 x 32]^T, signed A and B in shared memory. */
__device__ __forceinline__ void wgmma_ss_m64n64k32_s8(int (&d)[8][4], uint64_t desc_a,
                                                      uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "%32, %33, p;\n}\n"
      : FP4ATTN_WGMMA_IACC(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* D[64 x 32] (+)= A[64 x 32] * B[32 x 32]^T, signed A and B in shared memory. */
__device__ __forceinline__ void wgmma_ss_m64n32k32_s8(int (&d)[4][4], uint64_t desc_a,
                                                      uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "%16, %17, p;\n}\n"
      : FP4ATTN_WGMMA_IACC4(d, 0), FP4ATTN_WGMMA_IACC4(d, 1), FP4ATTN_WGMMA_IACC4(d, 2),
        FP4ATTN_WGMMA_IACC4(d, 3)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

/* D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, signed bytes, A in registers (each warp's
 * m16n8k32 A fragment of its 16 rows), B in shared memory. */
__device__ __forceinline__ void wgmma_rs_m64n128k32_s8(int (&d)[16][4], const uint32_t (&a)[4],
                                                       uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "{%64,%65,%66,%67}, %68, p;\n}\n"
      : FP4ATTN_WGMMA_IACC(d, 0), FP4ATTN_WGMMA_IACC(d, 8)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

/* D[64 x 64] (+)= A[64 x 32] * B[64 x 32]^T, as above. */
__device__ __forceinline__ void wgmma_rs_m64n64k32_s8(int (&d)[8][4], const uint32_t (&a)[4],
                                                      uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "{%32,%33,%34,%35}, %36, p;\n}\n"
      : FP4ATTN_WGMMA_IACC(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

/* O[64 x N] += A[64 x 16] * B[N x 16]^T with FP16 or (kBf16) BF16 operands and FP32
 * accumulation, A in registers (each warp's m16n8k16 A fragment of its 16 rows), B in shared
 * memory (K-major descriptor, or with kTransB an MN-major one): the attention kernels' P V into
 * O and the 8-bit backward's P^T dO into dV, N = the head dim. */
#define FP4ATTN_WGMMA_RS_N64_K16(type)                                  \
  asm volatile(                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                      \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type       \
      " {"                                                              \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"          \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31" \
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"                   \
      : FP4ATTN_WGMMA_ACC(d, 0)                                         \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"((int)kTransB))
#define FP4ATTN_WGMMA_RS_N128_K16(type)                                  \
  asm volatile(                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                       \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type       \
      " {"                                                               \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"           \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"  \
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"                    \
      : FP4ATTN_WGMMA_ACC(d, 0), FP4ATTN_WGMMA_ACC(d, 8)                 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"((int)kTransB))
#define FP4ATTN_WGMMA_RS_N256_K16(type)                                                 \
  asm volatile(                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                     \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." type "." type                      \
      " {"                                                                              \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                          \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"                \
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"                \
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"                \
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"    \
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127" \
      "}, {%128,%129,%130,%131}, %132, p, 1, 1, %134;\n}\n"                             \
      : FP4ATTN_WGMMA_ACC(d, 0), FP4ATTN_WGMMA_ACC(d, 8), FP4ATTN_WGMMA_ACC(d, 16),     \
        FP4ATTN_WGMMA_ACC(d, 24)                                                        \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"((int)kTransB))
template <int N, bool kBf16, bool kTransB = false>
__device__ __forceinline__ void wgmma_rs_acc_k16(float (&d)[N / 8][4], const uint32_t (&a)[4],
                                                 uint64_t desc_b) {
  static_assert(N == 64 || N == 128 || N == 256, "m64n{64,128,256}k16");
  if constexpr (N == 64) {
    if constexpr (kBf16)
      FP4ATTN_WGMMA_RS_N64_K16("bf16");
    else
      FP4ATTN_WGMMA_RS_N64_K16("f16");
  } else if constexpr (N == 128) {
    if constexpr (kBf16)
      FP4ATTN_WGMMA_RS_N128_K16("bf16");
    else
      FP4ATTN_WGMMA_RS_N128_K16("f16");
  } else {
    if constexpr (kBf16)
      FP4ATTN_WGMMA_RS_N256_K16("bf16");
    else
      FP4ATTN_WGMMA_RS_N256_K16("f16");
  }
}
#undef FP4ATTN_WGMMA_RS_N64_K16
#undef FP4ATTN_WGMMA_RS_N128_K16
#undef FP4ATTN_WGMMA_RS_N256_K16

/* D[64 x 64] (+)= A[64 x 16] * B[64 x 16]^T, FP16 or (kBf16) BF16 A and B in shared memory,
 * FP32 accumulation; K-major descriptors, or MN-major (mnmajor_sw128_desc) for an operand whose
 * kTrans flag is set. */
#define FP4ATTN_WGMMA_SS_N64_K16(type)                                     \
  asm volatile(                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                         \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type          \
      " {"                                                                 \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"             \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, " \
      "%32, %33, p, 1, 1, %35, %36;\n}\n"                                  \
      : FP4ATTN_WGMMA_ACC(d, 0)                                            \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"((int)kTransA), "n"((int)kTransB))
template <bool kBf16, bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[8][4], uint64_t desc_a,
                                                   uint64_t desc_b, int accumulate) {
  if constexpr (kBf16)
    FP4ATTN_WGMMA_SS_N64_K16("bf16");
  else
    FP4ATTN_WGMMA_SS_N64_K16("f16");
}
#undef FP4ATTN_WGMMA_SS_N64_K16

/* The N = 32 form, for wgmma_ss_k16. */
#define FP4ATTN_WGMMA_SS_N32_K16(type)                                                     \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                         \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." type "." type                          \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, " \
      "%20;\n}\n"                                                                          \
      : FP4ATTN_WGMMA_ACC4(d, 0), FP4ATTN_WGMMA_ACC4(d, 1), FP4ATTN_WGMMA_ACC4(d, 2),      \
        FP4ATTN_WGMMA_ACC4(d, 3)                                                           \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"((int)kTransA), "n"((int)kTransB))
/* m64n{N}k16 with both operands in shared memory, N = 32 or 64 (the flags as above). */
template <int N, bool kBf16, bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_ss_k16(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b,
                                             int accumulate) {
  static_assert(N == 32 || N == 64, "m64n{32,64}k16");
  if constexpr (N == 64)
    wgmma_ss_m64n64k16<kBf16, kTransA, kTransB>(d, desc_a, desc_b, accumulate);
  else if constexpr (kBf16)
    FP4ATTN_WGMMA_SS_N32_K16("bf16");
  else
    FP4ATTN_WGMMA_SS_N32_K16("f16");
}
#undef FP4ATTN_WGMMA_SS_N32_K16

/* Named barriers (0 is __syncthreads): `sync` waits until `count` threads have arrived or
 * synced; `arrive` signals without waiting. Both order this thread's earlier shared-memory
 * accesses before the waiting threads' later ones. */
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

/* Make this thread's ordinary (and cp.async, once waited for) shared-memory writes visible to the
 * tensor cores' asynchronous proxy. */
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* mbarriers (shared memory, 8 bytes): the producer's "full" signal. A phase completes when `count`
 * arrivals have been made and all bytes announced by expect_tx have been written by the tensor
 * memory accelerator (TMA). */
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* Make initialized mbarriers visible to the async proxy (TMA) and the other threads (then sync). */
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
/* Arrive (release: this thread's earlier shared-memory writes are visible to the waiters). */
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
/* Wait (acquire) until the phase of parity `parity` (0 for the first) has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

/* TMA: box (c0, c1, c2) of the 3-D tensor map `tmap` (a __grid_constant__ kernel parameter) into
 * shared memory at `dst` (1024-byte aligned for the 128-byte swizzle); its bytes count against the
 * transaction count announced on mbarrier `bar` (mbar_expect_tx). */
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void *tmap, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void *tmap, int c0, int c1, int c2,
                                            int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

/* Bulk copy of `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte
 * aligned), counted against the transaction count announced on mbarrier `bar`. */
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

/* TMA reduction: global box (c0, c1, c2) of the 3-D FP32 tensor map `tmap` += the shared tile at
 * `src` (1024-byte aligned, laid out as the map's swizzle places the box), as part of this
 * thread's current bulk group; elements outside the map's dims are skipped. */
__device__ __forceinline__ void tma_reduce_add_3d(const void *tmap, uint32_t src, int c0, int c1,
                                                  int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], "
      "[%1];\n" ::"l"(tmap),
      "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
/* Close this thread's current bulk group. */
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
/* Wait until at most N bulk groups of this thread still read their shared source. */
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
/* Wait until at most N bulk groups of this thread are incomplete (their global writes done). */
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Make this thread's ordinary global-memory writes visible to later reads by the asynchronous
 * proxy (bulk copies, TMA), once the reader is ordered after it (a barrier). */
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

template <int R>
__device__ __forceinline__ void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

#endif /* FP4ATTN_SM90_WGMMA */

}  // namespace sm90
}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_HOPPER_WGMMA_CUH */
