"""`bf16`: the fused step on tensor cores, bf16 operands with fp32 accumulation and master weights.

fp32 products run on the GPU's CUDA cores; bf16 ones on its tensor cores, many times faster.
Every hidden layer's product here reads bf16 operands and accumulates in fp32:

    the batch      gathered straight into bf16
    activations    the hidden layers write bf16 (the bias from a bf16 copy, as cuBLASLt wants
                   for a bf16 output); the head reads them and keeps fp32: logits, softmax,
                   loss and dlogits
    dX             bf16, masked by the ReLU, its bias gradient summed in fp32
    weights        fp32 masters, which the fused SGD products update in place (bf16 A and B,
                   fp32 C with β = 1); the forward and dX products read bf16 copies, refreshed
                   with the bf16 biases by the kernel that updates the biases, at the end of a step

The rounding is bf16's 8 bits of mantissa on the operands only: sums and weights keep fp32, so
the loss curve follows the fp32 rungs' (the test accuracy is measured with the fp32 master
weights). Softmax regression has no product wide enough for tensor cores (its head is the whole
model, fp32 in the fused kernels), so there this rung trains in fp32 and is the fused one; the
nodes per step are the fused rung's.

The `fused` program at another precision: the same pieces (graphtrain.stages.fused_mlp.FusedMlp
with its `Bf16Copies`), the same graphs, the operands' precision its parameter.
"""

from __future__ import annotations

from graphtrain.stages.fused import FusedStage
from graphtrain.stages.fused_mlp import bf16_where_hidden


class Bf16Stage(FusedStage):
    name = "bf16"
    summary = "bf16 tensor-core operands, fp32 accumulation and fp32 master weights"

    @classmethod
    def precision_run(cls, config, chosen: str) -> str:
        return bf16_where_hidden(config, chosen)
