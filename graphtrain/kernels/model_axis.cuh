// The model axis: one launch trains K models of one shape. Their per-model buffers are K copies of
// one arena layout, model k's at model 0's address + k·model_stride bytes; the buffers every model
// shares (the training and test images and labels) are passed once and do not move. Model k is
// blockIdx.z (gridDim.z = K): each kernel offsets its per-model pointers by it and nothing else,
// so a block computes for model k exactly what the same block computes for model k launched alone
// (K = 1, model_stride = 0), and every model's result is that run's bit for bit. Which pointers
// are per-model is each kernel's own knowledge, said in its comment. The launchers check the
// stride (a multiple of 256 bytes: every buffer keeps the alignment its 16-byte loads need).

// p moved to model blockIdx.z's copy (a null pointer, an absent buffer, stays null).
template <class T>
__device__ __forceinline__ T* model_at(T* p, long long model_stride) {
    return p == nullptr ? p
                        : reinterpret_cast<T*>(reinterpret_cast<unsigned long long>(p) +
                                               (unsigned long long)((long long)blockIdx.z * model_stride));
}

// Model blockIdx.z's offset in bytes, and p moved by it on the pointer, for a kernel whose loads
// must stay global ones: from model_at's integer step the compiler no longer knows the address is
// global memory, and fused.cu's head_backward and relu_bias_grad then compiled to generic loads and
// stores (no read-only-cache loads), ~2 µs a step slower for the 784³ MLP on an H100. The caller
// keeps a null pointer null itself.
__device__ __forceinline__ long long model_offset(long long model_stride) {
    return (long long)blockIdx.z * model_stride;
}
template <class T>
__device__ __forceinline__ T* step_bytes(T* p, long long bytes) {
    return (T*)((const char*)p + bytes);
}
