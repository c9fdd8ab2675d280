"""`torch-graph`: one whole PyTorch training step captured into a CUDA graph, replayed per batch.

Gather, forward, backward, SGD and the metric sums are captured with `torch.cuda.graph`, the
whole-network capture of PyTorch's CUDA Graphs documentation. The graph reads the batch's sample
indices from a static index tensor, so per batch the host does two things: copy the batch's
slice of the epoch order into that tensor and replay the graph. The tail batch has its own
graph (its shapes differ). fp32 with TF32 off, like `torch-eager`.
"""

from __future__ import annotations

from graphtrain.peers.common import WARMUP_STEPS
from graphtrain.peers.torch_common import TorchPeer, forward


class TorchGraphPeer(TorchPeer):
    name = "torch-graph"
    summary = "PyTorch: forward, backward and SGD captured once into a CUDA graph per batch shape"

    def build(self) -> None:
        torch = self.torch
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.SGD(self.params, lr=self.config.lr)
        # Static inputs: one index tensor per batch shape, filled before each replay.
        self.idx = {rows: self.orders[0][:rows].clone() for rows in self.shapes}

        # Warm up on a side stream before capturing, as the CUDA Graphs docs require: lazy
        # initialisation (cuBLAS handles, workspaces) must not happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for rows in self.shapes:
                for _ in range(WARMUP_STEPS):
                    self.optimizer.zero_grad(set_to_none=True)
                    self.captured_step(rows)
        torch.cuda.current_stream().wait_stream(side)

        # Capture records work without running it. With the gradients unset, the captured
        # backward allocates them in the graph's private memory pool and writes (rather than
        # accumulates) into them on every replay.
        self.graphs = {}
        for rows in self.shapes:
            self.optimizer.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.captured_step(rows)
            self.graphs[rows] = graph

    def captured_step(self, rows: int) -> None:
        F = self.torch.nn.functional
        idx = self.idx[rows]
        x = self.train_x.index_select(0, idx)
        y = self.train_y.index_select(0, idx)
        with self.autocast():
            logits = forward(self.layers, x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        self.optimizer.step()
        self.record_metrics(logits, y, loss, rows)

    def autocast(self):
        """The precision the step's products run in: fp32 here (autocast off)."""
        return self.torch.autocast("cuda", enabled=False)

    def step(self, order, lo: int, hi: int) -> None:
        rows = hi - lo
        self.idx[rows].copy_(order[lo:hi])
        self.graphs[rows].replay()



class TorchGraphBf16Peer(TorchGraphPeer):
    """`torch-graph-bf16`: the same captured step under bf16 autocast: the products on bf16
    operands, the fp32 weights updated by SGD (the precision of graphtrain's bf16 rungs)."""

    name = "torch-graph-bf16"
    summary = "PyTorch: the step in one CUDA graph per batch shape, bf16 autocast, fp32 weights"
    note = "bf16 autocast, fp32 weights"

    def autocast(self):
        return self.torch.autocast("cuda", dtype=self.torch.bfloat16)
