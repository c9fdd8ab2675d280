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
softmax regression, 15 for the 4-layer MLP with biases (`graphs`: 12 and 42). The eager path of
the earlier rungs (cuBLAS, the test-set forward) is kept as it was.

Another recipe (an optimizer other than SGD, or a schedule) cannot be folded into a product: there
the weight-gradient products write dW = dYᵀX (α = 1, β = 0), the head's update kernel writes its
dW and db, and the step ends in the recipe's one update of every parameter (graphs' DeviceOptimizer).
"""

from __future__ import annotations

from graphtrain.errors import ModelUnsupported
from graphtrain.kernels.fused import Fused
from graphtrain.libs import cublaslt
from graphtrain.libs.cublaslt import R_32F, Lt, LtMatmul, Product
from graphtrain.stages.graphs import GraphsStage


class FusedStage(GraphsStage):
    name = "fused"
    summary = "fewer, fatter graph nodes: cuBLASLt epilogues, a fused head, SGD fused into the products"
    AB, ACT = R_32F, R_32F  # the products' operand type, and the hidden activations' type
    # The fused head replaces softmax.cu and cuDNN; cuBLAS stays for the test-set forward pass.
    uses = GraphsStage.uses - {"softmax", "cudnn"} | {"fused", "cublaslt"}

    def needs(self, what: str) -> bool:
        if what == "cublaslt":  # only hidden layers have products wide enough for cuBLASLt
            return len(self.config.dims) > 2 and super().needs(what)
        return super().needs(what)

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        refusal = Fused.refusal(self.config.batch, self.config.classes)
        if refusal is not None:
            raise ModelUnsupported(f"the {self.name} rung cannot train {refusal}; use --stage graphs")
        super().setup()

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        cfg = self.config
        self.row_loss = arena.reserve("row_loss", (cfg.batch,))  # per row, summed by the head's update
        self.row_correct = arena.reserve("row_correct", (cfg.batch,))

    def setup_extra(self) -> None:
        super().setup_extra()
        # bf16 activations where there are hidden layers; softmax regression's head gathers fp32.
        self.fused_cu = Fused(self.device, self.config.classes, bf16=self.ACT != R_32F and bool(self.config.hidden))
        # cuBLASLt shares cuBLAS's workspace: both run on the one stream, one call at a time.
        self.lt, self.products = None, {}
        if self.needs("cublaslt"):
            self.lt = Lt(self.workspace.ptr, self.workspace.nbytes)
            self.products = {rows: self.plan_products(rows) for rows in self.plan.batch_sizes}
        if self.config.bias:  # the padding between the packed biases stays zero
            for buf in (*self.b, *self.db):
                buf.zero(self.stream)

    def cublas_precision(self) -> str:
        # From here on cuBLAS runs only the eager test-set forward pass, on the fp32 weights.
        return "fp32"

    def plan_products(self, rows: int) -> dict[str, list[LtMatmul | None]]:
        """The hidden layers' products for a batch of `rows`: forward, dX (none for the first
        layer) and SGD (W −= lr·dYᵀX, or dW = dYᵀX for another recipe). The head has its own kernels."""
        dims, plans = self.config.dims, {"forward": [], "dx": [], "sgd": []}
        for i in range(len(self.w) - 1):
            fan_in, fan_out = dims[i], dims[i + 1]
            bias = self.b[i] is not None
            plans["forward"].append(LtMatmul(self.lt, Product(
                rows, fan_out, fan_in, transb=True, ab_type=self.AB, c_type=self.ACT,
                epilogue="relu_bias" if bias else "relu", bias_type=self.ACT), self.forward_bias(i) if bias else 0))
            plans["dx"].append(LtMatmul(self.lt, Product(rows, fan_in, fan_out, ab_type=self.AB, c_type=self.ACT))
                               if i > 0 else None)
            plans["sgd"].append(LtMatmul(self.lt, Product(fan_out, fan_in, rows, transa=True, ab_type=self.AB,
                                                        c_type=R_32F)))
        return plans

    def products_for(self, rows: int) -> dict[str, list[LtMatmul | None]]:
        """The planned products of a batch of `rows`; none for softmax regression (all head)."""
        return self.products[rows] if self.lt is not None else {"forward": [], "dx": [], "sgd": []}

    # ---- what the operands are: fp32 buffers here, bf16 copies in the next rung ----------------

    def forward_bias(self, i: int) -> int:
        return self.b[i].ptr

    def layer_input(self, i: int) -> int:
        """The input of layer i as the products read it: the batch x, or hidden activations."""
        return self.acts[i].ptr

    def layer_grad(self, i: int) -> int:
        """dL/d(input of layer i), i ≥ 1."""
        return self.grads[i].ptr

    def product_weight(self, i: int) -> int:
        return self.w[i].ptr

    # ---- the step ------------------------------------------------------------------------------

    def train_step(self, offset: int, rows: int, measure: bool) -> None:
        cfg, stream, fused, plans = self.config, self.stream, self.fused_cu, self.products_for(rows)
        handle, head = int(stream.handle), len(self.w) - 1  # cuBLASLt takes the stream's raw address
        width, lr = cfg.dims[head], cfg.lr
        w_head, b_head = self.w[head].ptr, self.b[head].ptr if cfg.bias else 0
        metrics = (self.row_loss.ptr, self.row_correct.ptr) if measure else (0, 0)
        dlogits = self.grads[-1].ptr
        if head > 0:
            self.load_batch(offset, rows)
        for i, forward in enumerate(plans["forward"]):
            forward(self.layer_input(i), self.product_weight(i), self.layer_input(i + 1), 1.0, 0.0, handle)
        if head > 0:
            fused.head_step(stream, self.layer_input(head), w_head, b_head, width, rows, self.y.ptr, dlogits, *metrics)
            fused.head_backward(stream, dlogits, w_head, self.layer_input(head), self.layer_grad(head),
                                self.db[head - 1].ptr if cfg.bias else 0, width, rows)  # before W changes
            head_input = self.layer_input(head)
        else:
            fused.head_step(stream, 0, w_head, b_head, width, rows, self.y.ptr, dlogits, *metrics,
                            gather=(self.train_images.ptr, self.train_labels.ptr, self.order.ptr, self.cursor.ptr,
                                    self.x_copy_ptr()))
            head_input = self.x_copy_ptr()
        # SGD: the head's W and b updated in place; another recipe: its dW and db, for the optimizer.
        head_out = (w_head, b_head) if self.device_optimizer is None else (
            self.dw[head].ptr, self.db[head].ptr if cfg.bias else 0)
        fused.head_update(stream, head_input, dlogits, *head_out, width, rows, lr, *metrics, self.metrics.ptr,
                          self.cursor.ptr, gradient=self.device_optimizer is not None)
        for i in reversed(range(head)):
            if i > 0:  # dX before W_i changes, then the ReLU below and that layer's bias gradient
                plans["dx"][i](self.layer_grad(i + 1), self.product_weight(i), self.layer_grad(i), 1.0, 0.0, handle)
                fused.relu_bias_grad(stream, self.layer_input(i), self.layer_grad(i),
                                     self.db[i - 1].ptr if cfg.bias else 0, cfg.dims[i], rows)
            if self.device_optimizer is None:  # W −= lr·dYᵀX: SGD as the product
                plans["sgd"][i](self.layer_grad(i + 1), self.layer_input(i), self.w[i].ptr, -lr, 1.0, handle)
            else:  # dW = dYᵀX, for the optimizer
                plans["sgd"][i](self.layer_grad(i + 1), self.layer_input(i), self.dw[i].ptr, 1.0, 0.0, handle)
        self.end_step()

    def x_copy_ptr(self) -> int:
        """Where softmax regression's head keeps the gathered batch (fp32)."""
        return self.acts[0].ptr

    def end_step(self) -> None:
        """The hidden layers' biases: b −= lr·db over their packed span; with another recipe,
        every parameter's update from its gradient."""
        if self.device_optimizer is not None:
            self.device_optimizer.step(self.stream)
        elif self.config.bias and len(self.b) > 1:
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
        return {**super().library_versions(), **({"cublaslt": cublaslt.version()} if self.needs("cublaslt") else {})}

    def close(self) -> None:
        for plans in getattr(self, "products", {}).values():
            for matmul in (m for role in plans.values() for m in role if m is not None):
                matmul.close()
        for name in ("lt", "fused_cu"):
            if getattr(self, name, None) is not None:
                getattr(self, name).close()
        super().close()
