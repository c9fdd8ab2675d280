// The batch at the run's sample cursor, and one rank's slice of it, data-parallel over `ranks` GPUs
// (ranks = 1: the one-GPU step, the same arithmetic); gather.cu, cnn.cu and head.cu read it from
// here. Epoch e's samples are e·epoch_samples ... of the run's sample stream, so the (combined)
// batch of `batch` rows at `cursor` has
//   valid = min(batch, epoch_samples − cursor mod epoch_samples)
// real rows (the tail batch of an epoch is smaller). Rank `rank` holds rows = batch / ranks rows,
// the first mine = valid / ranks of them real (valid splits evenly over the ranks: checked on the
// host), gathered from sample first = cursor + rank·mine of the order on: the ranks' slices in
// rank order are the one-GPU batch. Its other rows read on (the next rank's rows, or the order's
// padding at the run's end) and the loss step gives them zero gradient. Every rank divides its
// rows' gradients by the combined `valid` (the ranks' dW summed is the combined batch's mean) and
// moves the cursor by it: next = cursor + valid.
struct BatchSlice {
    int cursor, valid, rows, mine;
    __device__ __forceinline__ int first(int rank) const { return cursor + rank * mine; }
    __device__ __forceinline__ int next() const { return cursor + valid; }
};

__device__ __forceinline__ BatchSlice batch_slice(int cursor, int batch, int epoch_samples, int ranks) {
    const int valid = min(batch, epoch_samples - cursor % epoch_samples);
    return BatchSlice{cursor, valid, batch / ranks, valid / ranks};
}
