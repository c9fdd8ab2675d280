"""`fused`: fewer, fatter graph nodes; the same fp32 math.

A replayed graph still pays about a microsecond of GPU time per node, however little the node
does, and the `graphs` step has one node per kernel (12 for softmax regression, 42 for a
4-layer MLP). This rung keeps the graph and removes nodes:

    forward    each product through cuBLASLt with its epilogue: + bias and ReLU inside the
               product's kernel, which also keeps a bit mask of the ReLU for the backward pass
    loss       one kernel: softmax, loss and accuracy when measured, dlogits, the last layer's
               bias gradient and update, and the cursor. cuDNN's softmax was one node among
               five; fused with what surrounds it, the loss step is one small block
    backward   dX = dY·W with the ReLU's derivative applied from the mask (DRELU epilogue),
               before W changes; then SGD fused into the weight-gradient product:
               W ← W − lr·dYᵀX as one product with β = 1 and α = −lr (dY already carries the
               1/rows of the batch mean), whose BGRADB epilogue writes db = Σ_rows dY alongside
    biases     the hidden layers' biases in one kernel, over their packed span

Every product runs without split-K: one kernel each, the same bits every run. Nodes per step:
4 for softmax regression (gather, product, loss, SGD product), 14 for the 4-layer MLP with
biases. The eager path of the earlier rungs (cuBLAS, the test-set forward) is kept as it was.
"""

from __future__ import annotations

import numpy as np

from graphtrain.kernels.fused import MAX_CLASSES, Fused
from graphtrain.libs import cublaslt
from graphtrain.libs.cublaslt import R_32F, Lt, Matmul, Product
from graphtrain.stages.graphs import GraphsStage


class FusedStage(GraphsStage):
    name = "fused"
    summary = "fewer, fatter graph nodes: cuBLASLt epilogues, one loss kernel, SGD fused into the products"
    precision = "fp32"
    AB, ACT = R_32F, R_32F  # the products' operand type, and the hidden activations' type

    # ---- setup ---------------------------------------------------------------------------------

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        cfg = self.config
        if cfg.classes > MAX_CLASSES:
            raise ValueError(f"the fused loss kernel handles at most {MAX_CLASSES} classes, not {cfg.classes}")
        # The ReLU bit mask of each hidden layer's output, written forward, read backward.
        self.relu_masks = [arena.reserve(f"relu_mask{i}", (cublaslt.aux_bytes(cfg.batch, d),), np.uint8)
                           for i, d in enumerate(cfg.dims[1:-1], 1)]

    def setup_extra(self) -> None:
        super().setup_extra()
        self.fused_cu = Fused(self.device)
        # cuBLASLt shares cuBLAS's workspace: both run on the one stream, one call at a time.
        self.lt = Lt(self.workspace.ptr, self.workspace.nbytes)
        self.products = {rows: self.plan_products(rows) for rows in sorted({hi - lo for lo, hi in self.bounds})}
        if self.config.bias:  # the padding between the packed biases stays zero
            for buf in (*self.b, *self.db):
                buf.zero(self.stream)

    def plan_products(self, rows: int) -> dict[str, list[Matmul | None]]:
        """Each layer's three products for a batch of `rows`: forward, dX and SGD."""
        cfg, last = self.config, len(self.w) - 1
        plans = {"forward": [], "dx": [], "sgd": []}
        for i, (fan_in, fan_out) in enumerate(zip(cfg.dims[:-1], cfg.dims[1:])):
            hidden = i < last
            bias = self.b[i] is not None
            if hidden:
                epilogue, out_type = ("relu_aux_bias" if bias else "relu_aux"), self.ACT
            else:
                epilogue, out_type = ("bias" if bias else "none"), R_32F  # fp32 logits
            plans["forward"].append(self.matmul(
                Product(rows, fan_out, fan_in, transb=True, ab_type=self.AB, c_type=out_type, epilogue=epilogue,
                        bias_type=out_type), bias=self.forward_bias(i) if bias else 0,
                aux=self.relu_masks[i].ptr if hidden else 0))
            # dX of the layer below, masked by that layer's ReLU; none for the first layer.
            plans["dx"].append(self.matmul(
                Product(rows, fan_in, fan_out, ab_type=self.AB, c_type=self.ACT, epilogue="drelu"),
                aux=self.relu_masks[i - 1].ptr) if i > 0 else None)
            # W += −lr·dYᵀX into the fp32 weights; the hidden layers' db alongside.
            hidden_bias = bias and hidden
            plans["sgd"].append(self.matmul(
                Product(fan_out, fan_in, rows, transa=True, ab_type=self.AB, c_type=R_32F,
                        epilogue="bgrad_a" if hidden_bias else "none"), bias=self.db[i].ptr if hidden_bias else 0))
        return plans

    def matmul(self, product: Product, bias: int = 0, aux: int = 0) -> Matmul:
        return Matmul(self.lt, product, bias, aux)

    # ---- what the operands are: fp32 buffers here, bf16 copies in the next rung ----------------

    def forward_bias(self, i: int) -> int:
        return self.b[i].ptr

    def layer_input(self, i: int) -> int:
        """The input of layer i as the products read it: the batch x, or hidden activations."""
        return self.acts[i].ptr

    def layer_grad(self, i: int) -> int:
        """dL/d(input of layer i) for i ≥ 1, dL/dlogits for i = len(w)."""
        return self.grads[i].ptr

    def product_weight(self, i: int) -> int:
        return self.w[i].ptr

    # ---- the step ------------------------------------------------------------------------------

    def train_step(self, offset: int, rows: int, measure: bool, loop: int = 0, steps_left: int = 0) -> None:
        cfg, stream, plans = self.config, self.stream, self.products[rows]
        handle, last = int(stream.handle), len(self.w) - 1  # cuBLASLt takes the raw address
        self.load_batch(offset, rows)
        for i, forward in enumerate(plans["forward"]):
            forward(self.layer_input(i), self.product_weight(i), self.acts[i + 1].ptr if i == last
                    else self.layer_input(i + 1), 1.0, 0.0, handle)
        self.fused_cu.loss_step(stream, self.acts[-1].ptr, self.y.ptr, self.layer_grad(last + 1),
                                self.b[last].ptr if cfg.bias else 0, cfg.lr, rows, cfg.classes, self.metrics.ptr,
                                measure, self.cursor.ptr, bf16=self.AB != R_32F, loop=loop, steps_left=steps_left)
        for i in reversed(range(last + 1)):
            dy = self.layer_grad(i + 1)
            if i > 0:  # before W_i changes
                plans["dx"][i](dy, self.product_weight(i), self.layer_grad(i), 1.0, 0.0, handle)
            plans["sgd"][i](dy, self.layer_input(i), self.w[i].ptr, -cfg.lr, 1.0, handle)
        self.end_step()

    def end_step(self) -> None:
        """The hidden layers' biases: b −= lr·db over their packed span."""
        if self.config.bias and len(self.b) > 1:
            self.fused_cu.sgd_bias_refresh(self.stream, self.b[0].ptr, self.db[0].ptr, 0, self.span(self.b[:-1]),
                                           self.config.lr, 0, 0, 0)

    @staticmethod
    def span(buffers) -> int:
        """Floats from the first buffer's start to the last one's end (they were reserved in order)."""
        return (buffers[-1].offset + buffers[-1].nbytes - buffers[0].offset) // 4

    def capture(self) -> None:
        super().capture()
        self.nodes_per_step = self.graphs[self.config.batch, False].num_nodes

    def library_versions(self) -> dict:
        return {**super().library_versions(), "cublaslt": cublaslt.version()}

    def close(self) -> None:
        for plans in getattr(self, "products", {}).values():
            for matmul in (m for role in plans.values() for m in role if m is not None):
                matmul.close()
        for name in ("lt", "fused_cu"):
            if getattr(self, name, None) is not None:
                getattr(self, name).close()
        super().close()
