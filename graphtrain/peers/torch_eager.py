"""`torch-eager`: the model as most people would write it in PyTorch, fp32 with TF32 off.

Standard autograd and `torch.optim.SGD`, one Python-launched kernel after another: the
framework's per-op overhead is what this row measures.
"""

from __future__ import annotations

from graphtrain.peers.torch_common import TorchPeer, forward


class TorchEagerPeer(TorchPeer):
    name = "torch-eager"
    summary = "PyTorch eager: autograd and torch.optim.SGD, fp32"

    def build(self) -> None:
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = self.torch.optim.SGD(self.params, lr=self.config.lr)
        self.warm_up_steps()

    def step(self, order, lo: int, hi: int) -> None:
        F = self.torch.nn.functional
        idx = order[lo:hi]
        x = self.train_x.index_select(0, idx)
        y = self.train_y.index_select(0, idx)
        logits = forward(self.layers, x)
        loss = F.cross_entropy(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.record_metrics(logits, y, loss, hi - lo)

