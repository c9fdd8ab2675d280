// A persistent kernel's dynamic shared memory, carved from its one layout table (kernels/persistent.py:
// Layout): the launcher compiles the kernel with SMEM_<NAME>, a region's offset, SMEM_<NAME>_ELEMENT,
// the bytes of its elements, and SMEM_BYTES, the bytes it launches with. Not a kernel file: a
// launcher lists it in `headers`.

// s.member = the region at OFFSET (its SMEM_<NAME>) of the block's shared memory `base`, its element
// size checked against OFFSET's _ELEMENT.
#define SMEM_REGION(s, base, member, OFFSET) do {                                                   \
        static_assert(sizeof(*s.member) == OFFSET##_ELEMENT, "the layout table's element type of " #OFFSET); \
        s.member = reinterpret_cast<decltype(s.member)>((base) + OFFSET);                           \
    } while (0)

// Launched with other than the table's byte count, the kernel stops (the launch fails with an
// illegal-instruction error): the carve would run past the memory, or the table changed without it.
__device__ __forceinline__ void check_shared_bytes(unsigned bytes) {
    unsigned launched;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(launched));
    // (Two tests, not one of inequality: with one, ptxas scheduled the softmax kernel's loop
    // differently and its bf16 epoch took 3.6% longer on an H100.)
    if (launched > bytes) __trap();
    if (launched < bytes) __trap();
}
