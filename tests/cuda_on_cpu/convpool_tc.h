// What convpool_tc.cu uses beyond prelude.h and tf32.h, emulated on the CPU (tests/test_convpool_tc_emulated.py,
// tests/test_convpool_tc_weight_grad_emulated.py): the grid's size, int2, cvt.rna.tf32.f32 (to the
// nearest TF32 value, ties away from zero: the 13 low mantissa bits rounded off by magnitude) and
// tf32_mma.cuh's mma_tf32.
#include "tf32.h"
inline unsigned tf32_rna_emulated(float v) { return (float_bits(v) + 0x1000u) & 0xffffe000u; }
inline void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { mma_tf32_emulated(d, a, b); }
thread_local Dim3 gridDim;  // the launch's grid, as each of its threads sees it
struct int2 { int x, y; };
inline int2 make_int2(int a, int b) { return {a, b}; }
