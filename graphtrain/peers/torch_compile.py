"""`torch-compile`: the whole training step through `torch.compile`, with bf16 autocast (AMP).

The seeds' fastest PyTorch setup: the step (gather, forward, loss, gradients, SGD, metric sums)
is one function compiled with `fullgraph=True`, so nothing in it falls back to Python. The
gradients come from `torch.func.grad_and_value`, which the compiler traces into the same graph
(a `loss.backward()` would end the graph). Matmuls run in bf16 under autocast; the weights, the
loss and the SGD update stay fp32 (fp32 master weights).

The compile mode defaults to "max-autotune", which benchmarks matmul kernels and replays the
step as a CUDA graph, and can take minutes to compile. The environment variable
GRAPHTRAIN_TORCH_COMPILE_MODE overrides it, e.g. "default", "reduce-overhead" or
"max-autotune-no-cudagraphs". Compilation and warm-up are setup: excluded from the epoch times,
included in setup_ms and total_ms.
"""

from __future__ import annotations

import os

from graphtrain.peers.torch_common import TorchPeer, forward

MODE_VARIABLE = "GRAPHTRAIN_TORCH_COMPILE_MODE"
DEFAULT_MODE = "max-autotune"


def compile_mode() -> str:
    return os.environ.get(MODE_VARIABLE, "").strip() or DEFAULT_MODE


class TorchCompilePeer(TorchPeer):
    name = "torch-compile"
    summary = "PyTorch: the whole step through torch.compile (fullgraph), bf16 autocast"

    def setup(self) -> None:
        self.mode = compile_mode()
        self.note = f"bf16 autocast, fp32 weights, torch.compile mode={self.mode}"
        super().setup()

    def build(self) -> None:
        torch = self.torch
        F = torch.nn.functional
        # Compiled code is cached per Python function; a fresh start keeps earlier runs in this
        # process (another hidden size in a sweep, say) from using up the recompile limit.
        torch.compiler.reset()
        # Tensors that keep their address for the whole run. Marked static, CUDA-graph replays
        # read them in place; unmarked inputs would be copied into the graph's buffers per
        # step, the whole dataset included.
        mark_static = getattr(torch._dynamo, "mark_static_address", None)
        if mark_static is not None:
            for t in (*self.params, self.train_x, self.train_y, self.loss_sum, self.correct):
                mark_static(t)

        lr = self.config.lr
        num_layers = len(self.layers)

        def loss_fn(params, x, y):
            layers = _pairs(params, num_layers)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = forward(layers, x)
            logits = logits.float()  # softmax and loss in fp32
            return F.cross_entropy(logits, y), logits

        def train_step(params, train_x, train_y, idx, loss_sum, correct):
            x = train_x.index_select(0, idx)
            y = train_y.index_select(0, idx)
            grads, (loss, logits) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, x, y)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-lr)
                loss_sum.add_(loss * idx.shape[0])
                correct.add_((logits.argmax(dim=1) == y).sum())

        # dynamic=False: the full and the tail batch each get a graph specialised to their shape.
        self.step_fn = torch.compile(train_step, mode=self.mode, fullgraph=True, dynamic=False)
        self.warm_up_steps()

    def step(self, order, lo: int, hi: int) -> None:
        self.step_fn(self.params, self.train_x, self.train_y, order[lo:hi], self.loss_sum, self.correct)


def _pairs(params, num_layers: int):
    """The flat parameter list back as (weight, bias or None) per layer."""
    if len(params) == 2 * num_layers:
        return [(params[2 * i], params[2 * i + 1]) for i in range(num_layers)]
    return [(w, None) for w in params]

