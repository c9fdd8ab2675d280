"""What the PyTorch peers share: data and sample orders on the GPU, the model, timing, metrics.

The model is the reference's: `y = x Wᵀ + b` per layer (F.linear), ReLU between layers, mean
cross-entropy over the batch. Parameters start from the plan's initial weights and are updated
by plain SGD, so with fp32 and TF32 off a peer follows the numpy stage step by step.

Each subclass says how one batch is run (`step`) and how it warms up (`build`). The warm-up runs
on the real parameter tensors, because compiled code and CUDA graphs are tied to their
addresses; afterwards `reset` copies the initial values back, so it does not change the result.
"""

from __future__ import annotations

import numpy as np

from graphtrain.environment import driver_version
from graphtrain.errors import INSTALL_HINTS
from graphtrain.peers import PeerUnavailable
from graphtrain.peers.common import WARMUP_STEPS, Peer
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult

EVAL_ROWS = 4096  # test rows per forward pass when measuring accuracy


def import_torch():
    """torch, with a CUDA GPU it can see; PeerUnavailable saying what is missing otherwise."""
    try:
        import torch
    except ImportError:
        raise PeerUnavailable(f"torch is not installed ({INSTALL_HINTS['torch']})") from None
    if not torch.cuda.is_available():
        raise PeerUnavailable("no CUDA GPU visible to torch")
    return torch


def forward(layers, x):
    """Logits of the MLP; `layers` is a list of (weight, bias or None)."""
    import torch.nn.functional as F

    for i, (w, b) in enumerate(layers):
        x = F.linear(x, w, b)
        if i < len(layers) - 1:
            x = F.relu(x)
    return x


class TorchPeer(Peer):
    note = "fp32, TF32 off"
    allow_tf32 = False

    @classmethod
    def check_available(cls) -> int | None:
        return import_torch().cuda.get_device_properties(0).total_memory

    def setup(self) -> None:
        torch = self.torch = import_torch()
        data = self.data
        # TF32 would round the fp32 matmul inputs to 10 mantissa bits: faster, but no longer the
        # fp32 model the stages train. The flags are process-wide, so close() restores them.
        self.saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32
        dev = self.device = torch.device("cuda")

        # The whole dataset and every epoch's sample order go to the GPU once, here, untimed.
        plan = self.plan
        self.train_x = torch.as_tensor(data.train_images, device=dev)
        self.train_y = torch.as_tensor(data.train_labels.astype(np.int64), device=dev)
        self.test_x = torch.as_tensor(data.test_images, device=dev)
        self.test_y = torch.as_tensor(data.test_labels.astype(np.int64), device=dev)
        self.orders = torch.as_tensor(plan.orders.astype(np.int64), device=dev)
        self.shapes = plan.batch_sizes  # full, then tail

        self.layers = [(torch.tensor(layer.w, device=dev),
                        None if layer.b is None else torch.tensor(layer.b, device=dev))
                       for layer in plan.initial]
        self.params = [t for pair in self.layers for t in pair if t is not None]
        # Σ (batch loss × batch rows) and Σ correct over the epoch, kept on the device.
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
        self.correct = torch.zeros((), dtype=torch.int64, device=dev)
        self.start_event = torch.cuda.Event(enable_timing=True)
        self.end_event = torch.cuda.Event(enable_timing=True)

        self.build()
        torch.cuda.synchronize()
        self.reset()

    def build(self) -> None:
        """Prepare and warm up the step for every batch shape (compile, capture, autotune)."""
        raise NotImplementedError

    def step(self, order, lo: int, hi: int) -> None:
        """Train on samples order[lo:hi]; add the batch's loss sum and correct count to the totals."""
        raise NotImplementedError

    def warm_up_steps(self) -> None:
        """A few steps of every batch shape on the real tensors (undone by `reset`)."""
        order = self.orders[0]
        for rows in self.shapes:
            for _ in range(WARMUP_STEPS):
                self.step(order, 0, rows)

    def reset(self) -> None:
        """Initial weights and zero totals again, in place: the tensors keep their addresses."""
        with self.torch.no_grad():
            for (w, b), layer in zip(self.layers, self.plan.initial):
                w.copy_(self.torch.tensor(layer.w))  # the plan's arrays are read-only
                if b is not None:
                    b.copy_(self.torch.tensor(layer.b))
        self.loss_sum.zero_()
        self.correct.zero_()

    def record_metrics(self, logits, y, loss, rows: int) -> None:
        with self.torch.no_grad():
            self.loss_sum.add_(loss.detach(), alpha=rows)
            self.correct.add_((logits.argmax(dim=1) == y).sum())

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        self.loss_sum.zero_()
        self.correct.zero_()
        order = self.orders[epoch]
        bounds = self.plan.epoch_bounds(epoch, num_batches)
        # Events on the current stream bracket the whole loop: if the host cannot launch work
        # fast enough, the GPU idles between them and that time counts, as it should.
        self.start_event.record()
        for lo, hi in bounds:
            self.step(order, lo, hi)
        self.end_event.record()
        self.end_event.synchronize()
        ms = self.start_event.elapsed_time(self.end_event)
        seen = self.plan.samples_seen(num_batches)
        totals = self.torch.stack([self.loss_sum.double(), self.correct.double()]).tolist()  # one read
        return EpochResult(ms, totals[0] / seen, totals[1] / seen)

    def predict_layers(self):
        return self.layers

    def test_accuracy(self) -> float:
        torch = self.torch
        correct = 0
        with torch.no_grad():
            for start in range(0, len(self.test_x), EVAL_ROWS):
                logits = forward(self.predict_layers(), self.test_x[start:start + EVAL_ROWS])
                correct += int((logits.argmax(dim=1) == self.test_y[start:start + EVAL_ROWS]).sum())
        return correct / len(self.test_x)

    def weights(self) -> list[Layer]:
        return [Layer(w.detach().cpu().numpy().copy(), None if b is None else b.detach().cpu().numpy().copy())
                for w, b in self.layers]

    def environment(self) -> dict:
        torch = self.torch
        major, minor = torch.cuda.get_device_capability()
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return {"gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}",
                "driver": driver_version(), "torch": torch.__version__,
                "torch_cuda": torch.version.cuda, "torch_cudnn": _cudnn_text(cudnn)}

    def close(self) -> None:
        torch = getattr(self, "torch", None)
        if torch is None:
            return
        if hasattr(self, "saved_tf32"):
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved_tf32
        # Drop the tensors and hand the cached blocks back, so the rows after this one (our own
        # stages allocate with cudaMalloc) find the GPU's memory free.
        for name in ("train_x", "train_y", "test_x", "test_y", "orders", "layers", "params",
                     "optimizer", "graphs", "step_fn", "idx"):
            if hasattr(self, name):
                setattr(self, name, None)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _cudnn_text(version) -> str | None:
    """cuDNN 9 encodes 9.10.2 as 91002 (major·10000 + minor·100 + patch); earlier ones ×1000."""
    if not version:
        return None
    version = int(version)
    if version >= 90000:
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"
