"""`fused`: fewer, fatter graph nodes; the same fp32 math.

A replayed graph still pays about a microsecond of GPU time per node, however little the node
does, and the `graphs` step has one node per kernel (12 for softmax regression, 42 for a
4-layer MLP). This rung keeps the graph and the math, and removes nodes:

    hidden layers   each product through cuBLASLt with its epilogue (+ bias, ReLU) inside the
                    product's kernel; backward, dX = dY·W before W changes, then SGD fused into
                    the weight-gradient product: W ← W − lr·dYᵀX as one product with β = 1,
                    α = −lr (dY already carries the batch mean's 1/rows); the ReLU's derivative
                    and the bias gradient in one pass over dX (kernels/fused.cu)
    the head        the logits layer is at most 32 wide, too narrow for cuBLAS's tiles: one
                    kernel computes the logits and the loss step of every row (softmax, dlogits,
                    loss and accuracy when measured; cuDNN's softmax was one node among five),
                    one the backward pass into the layer below with its ReLU and bias gradient,
                    and one the head's SGD update with its bias, the metrics and the cursor.
                    Softmax regression is all head: the batch is gathered by its first kernel
    biases          the hidden layers' biases updated by one kernel, over their packed span

Products run without split-K (one kernel each, the same bits every run). Nodes per step: 2 for
softmax regression, 15 for the 4-layer MLP with biases (`graphs`: 12 and 42). The test-set
forward pass runs eagerly through cuBLAS, as on the rungs before.

Another recipe (an optimizer other than SGD, or a schedule) cannot be folded into a product: there
the weight-gradient products write dW = dYᵀX (α = 1, β = 0), the head's update kernel writes its
dW and db, and the step ends in the recipe's one update of every parameter (DeviceOptimizer).

Its own program, not a step of the chain: the GPU and its stream (graphtrain.stages.device's
DeviceContext) and the model the fused step trains (graphtrain.stages.fused_mlp.FusedMlp: the
dataset, the parameters, the step's buffers, kernels and products, in one arena). What this rung
adds to them is how the steps reach the GPU, as `graphs` does: a step captured once per (batch
rows, metrics on/off) and replayed per batch, the batch's start in the device cursor the step
moves on. `bf16` is this rung with bf16 operands.

A set-up row trains the next plan of its shape in place (FusedRung.restart): the plan's weights,
orders and recipe written on the model. The step graphs are kept where they hold nothing of what
changed; with SGD fused into the step they hold its rate (kernel arguments and the products' α,
captured by value), so another rate captures them again.
"""

from __future__ import annotations

from graphtrain import environment
from graphtrain.libs import cuda
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult
from graphtrain.stages.fused_mlp import FusedMlp, FusedRung, open_fused


class FusedStage(FusedRung):
    name = "fused"
    summary = "fewer, fatter graph nodes: cuBLASLt epilogues, a fused head, SGD fused into the products"

    first_uses = staticmethod(FusedMlp.first_uses)

    def measures(self, epoch: int) -> bool:
        return self.plan.metrics_due[epoch]

    def setup(self) -> None:
        self.context, self.arena, self.mlp = open_fused(self)  # the model at this row's precision
        self.device, self.stream = self.context.device, self.context.stream
        self.arena.allocate()
        self.mlp.start(self.device, self.stream)
        self.capture()
        cuda.wait_for_head_starts()  # none still runs beside the timed epochs

    def capture(self) -> None:
        """A step graph per (batch rows, metrics on/off), in place of any captured before."""
        old, self.graphs = getattr(self, "graphs", {}), {}
        for graph in old.values():
            graph.close()
        for rows in self.plan.batch_sizes:
            for measure in (False, True):
                self.graphs[rows, measure] = self.mlp.capture_step(self.stream, rows, measure)
        self.nodes_per_step = self.graphs[self.config.batch, False].num_nodes
        self.captured_for = self.mlp.step_constants(self.config)

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        return self.context.epoch(lambda: self.run_batches(epoch, num_batches, measure), self.mlp.metrics, measure,
                                  self.plan.samples_seen(num_batches))

    def run_batches(self, epoch: int, num_batches: int, measure: bool) -> None:
        self.mlp.set_cursor(self.stream, epoch * self.plan.num_train)
        for lo, hi in self.plan.epoch_bounds(epoch, num_batches):
            self.graphs[hi - lo, measure].launch(self.stream)

    def test_accuracy(self) -> float:
        return self.mlp.accuracy(self.stream)

    def weights(self) -> list[Layer]:
        return self.mlp.weights(self.stream)

    def environment(self) -> dict:
        return {**environment.gpu(self.device), **self.mlp.library_versions()}

    def close(self) -> None:
        for graph in getattr(self, "graphs", {}).values():
            graph.close()
        for name in ("mlp", "arena", "context"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
