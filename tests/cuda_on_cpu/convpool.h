// What convpool_tc.cu uses beyond tf32.h, emulated on the CPU (tests/test_convpool_tc_emulated.py):
// the grid's size (a launch of gridDim.x × 1 × gridDim.z blocks), int2, and cvt.rna.tf32.f32 (round
// to nearest, ties away from zero, to TF32's 10 mantissa bits: the low 13 bits cleared).
#include "tf32.h"
Dim3 gridDim;
struct int2 { int x, y; };
inline int2 make_int2(int a, int b) { return {a, b}; }
inline unsigned tf32_rna(float v) { return (float_bits(v) + 0x1000u) & 0xffffe000u; }
