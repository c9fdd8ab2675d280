// Batch assembly: the whole training set lives on the device; a batch is a gather of its rows
// through the epoch's shuffled order, so no host work or copy is needed per step.

__device__ __forceinline__ void gather_rows(const float* images, const int* labels, const int* order,
                                            int offset, int features, float* x, int* y) {
    // x[r, :] = images[order[offset + r], :],  y[r] = labels[order[offset + r]];  one block per row r
    int r = blockIdx.x;
    int sample = order[offset + r];
    const float* src = images + (long long)sample * features;
    float* dst = x + (long long)r * features;
    if (features % 4 == 0) {
        // 16-byte copies: every row starts 16-byte aligned when the row length is a multiple of 4.
        const float4* src4 = reinterpret_cast<const float4*>(src);
        float4* dst4 = reinterpret_cast<float4*>(dst);
        for (int j = threadIdx.x; j < features / 4; j += blockDim.x) dst4[j] = src4[j];
    } else {
        for (int j = threadIdx.x; j < features; j += blockDim.x) dst[j] = src[j];
    }
    if (threadIdx.x == 0) y[r] = labels[sample];
}

extern "C" __global__ void gather_batch(const float* images, const int* labels, const int* order,
                                        int offset, int features, float* x, int* y) {
    gather_rows(images, labels, order, offset, features, x, y);
}

// The same, with the offset read from device memory: a captured graph replays unchanged while
// the cursor it reads moves on, so no kernel parameter has to be patched per batch. Model axis
// (model_axis.cuh): per model order, cursor, x, y; shared images, labels.
extern "C" __global__ void gather_batch_at(const float* images, const int* labels, const int* order,
                                           const int* cursor, int features, float* x, int* y,
                                           long long model_stride) {
    order = model_at(order, model_stride);
    cursor = model_at(cursor, model_stride);
    x = model_at(x, model_stride);
    y = model_at(y, model_stride);
    gather_rows(images, labels, order, *cursor, features, x, y);
}

// One rank's slice of the combined batch of `batch` rows at *cursor, data-parallel over `ranks`
// GPUs (graphtrain.stages.data_parallel; the arithmetic is batch_slice.cuh's, put before this file
// by the launcher): rows from sample cursor + rank·valid/ranks of the order on, so the ranks'
// slices in rank order are the one-GPU batch. One block per row of this rank's batch / ranks rows;
// the rows past its slice read on and are given zero gradient by the loss step.
extern "C" __global__ void gather_slice_at(const float* images, const int* labels, const int* order,
                                           const int* cursor, int features, float* x, int* y, int batch,
                                           int epoch_samples, int rank, int ranks) {
    const BatchSlice slice = batch_slice(*cursor, batch, epoch_samples, ranks);
    gather_rows(images, labels, order, slice.first(rank), features, x, y);
}

// The batch's sample indices and labels, for a step whose first layer reads its rows where they lie
// (convpool_tc.cu's `samples`): samples[r] = order[*cursor + r], y[r] = labels[samples[r]] for r < rows.
// One block a model. Model axis: per model order, cursor, samples, y; shared labels.
extern "C" __global__ void gather_samples_at(const int* labels, const int* order, const int* cursor, int rows,
                                             int* samples, int* y, long long model_stride) {
    order = model_at(order, model_stride);
    cursor = model_at(cursor, model_stride);
    samples = model_at(samples, model_stride);
    y = model_at(y, model_stride);
    const int offset = *cursor;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const int sample = order[offset + r];
        samples[r] = sample;
        y[r] = labels[sample];
    }
}

// cursor += rows, after every kernel of the step that reads the batch has run.
extern "C" __global__ void advance_cursor(int* cursor, int rows) {
    *cursor += rows;
}

extern "C" __global__ void set_cursor(int* cursor, int value) {
    *cursor = value;
}
