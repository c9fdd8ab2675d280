"""The speedrun in PyTorch, written for speed as a competent user would: the data and the
sample orders on the GPU, the model as functional ops over parameter tensors made straight from
the shared initial weights, Adam's fused or capturable implementation.

    torch-eager    a Python loop over the batches, fused Adam, the rate set per step
    torch-graph    the whole step (gather, forward, backward, Adam, the rate) in one CUDA graph,
                   replayed per batch: capturable Adam reading the rate from a device tensor that
                   the graph computes from a device step counter; the tail batch its own graph
    torch-compile  the forward and loss compiled by torch.compile (default mode), fused Adam

Per run the clock covers: parameters to the device, the optimizer (and for torch-graph its
capture), the epoch, the test accuracy as a Python number. Compilation, autotuning and the
lazy initialisation a capture needs happen in setup, on the same tensors, and are undone.
TF32 for convolutions and products unless the task's precision is fp32 (the flags are
process-wide: restored on close).
"""

from __future__ import annotations

import math

import numpy as np

from graphtrain.peers.torch_common import import_torch
from graphtrain.recipe import SpeedrunRow, SpeedrunTask

WARMUP_STEPS = 3


class _TorchRow(SpeedrunRow):
    def setup(self, task: SpeedrunTask) -> None:
        super().setup(task)
        torch = self.torch = import_torch()
        tf32 = task.recipe.precision == "tf32"
        self.saved_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                           torch.backends.cudnn.benchmark)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True  # picks each convolution's algorithm once, in the warm-up
        self.note = f"{'TF32' if tf32 else 'fp32'}, cudnn.benchmark"
        dev = self.dev = torch.device("cuda")
        spec = task.spec
        shape = (-1, spec.channels, spec.height, spec.width)
        self.train_x = torch.as_tensor(task.train_images, device=dev).view(shape)
        self.train_y = torch.as_tensor(task.train_labels.astype(np.int64), device=dev)
        self.test_x = torch.as_tensor(task.test_images, device=dev).view(shape)
        self.test_y = torch.as_tensor(task.test_labels.astype(np.int64), device=dev)
        n, b = len(task.train_images), task.recipe.batch
        self.bounds = [(lo, min(lo + b, n)) for lo in range(0, n, b)]
        self.build()
        torch.cuda.synchronize()

    # ---- the model ----

    def forward(self, params, x):
        F = self.torch.nn.functional
        spec = self.task.spec
        for i, layer in enumerate(spec.convs):
            x = F.conv2d(x, params[2 * i], params[2 * i + 1], layer.stride, layer.padding)
            if layer.pool > 1:
                x = F.max_pool2d(x, layer.pool)
            x = F.relu(x)
        x = x.flatten(1)
        head = params[2 * len(spec.convs):]
        for j in range(len(head) // 2):
            x = F.linear(x, head[2 * j], head[2 * j + 1])
            if j < len(head) // 2 - 1:
                x = F.relu(x)
        return x

    def new_params(self, seed: int):
        return [self.torch.tensor(p, device=self.dev, requires_grad=True) for p in self.task.initial(seed)]

    def adam_kwargs(self) -> dict:
        opt = self.task.recipe.optimizer
        if opt.kind not in ("adam", "adamw"):
            raise NotImplementedError(f"the torch speedrun peers train with Adam or AdamW, not {opt.kind}")
        return {"betas": tuple(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}

    def optimizer_class(self):
        optim = self.torch.optim
        return optim.AdamW if self.task.recipe.optimizer.kind == "adamw" else optim.Adam

    def accuracy(self, params) -> float:
        with self.torch.no_grad():
            correct = (self.forward(params, self.test_x).argmax(1) == self.test_y).sum()
        return int(correct) / len(self.test_y)

    def build(self) -> None:
        """Warm up what the run needs (compile, autotune, lazy initialisation)."""

    def environment(self) -> dict:
        from graphtrain.environment import driver_version
        from graphtrain.peers.torch_common import _cudnn_text

        torch = self.torch
        return {"gpu": torch.cuda.get_device_name(), "driver": driver_version(), "torch": torch.__version__,
                "torch_cuda": torch.version.cuda, "torch_cudnn": _cudnn_text(torch.backends.cudnn.version())}

    def close(self) -> None:
        torch = getattr(self, "torch", None)
        if torch is None:
            return
        if hasattr(self, "saved_tf32"):
            (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark) = self.saved_tf32
        for name in list(vars(self)):
            if name not in ("torch", "task", "note", "name"):
                setattr(self, name, None)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class TorchEagerRow(_TorchRow):
    name = "torch-eager"

    def loss(self, params, x, y):
        return self.torch.nn.functional.cross_entropy(self.forward(params, x), y)

    def build(self) -> None:
        self.note += ", fused Adam"
        order = self.torch.as_tensor(self.task.orders(0), device=self.dev)
        params = self.new_params(0)
        opt = self.optimizer_class()(params, lr=1e-3, fused=True, **self.adam_kwargs())
        for lo, hi in self.bounds[:WARMUP_STEPS] + self.bounds[-1:]:
            self.step(params, opt, order[0, lo:hi])
        self.accuracy(params)

    def step(self, params, opt, idx) -> None:
        loss = self.loss(params, self.train_x[idx], self.train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def run(self, seed: int) -> float:
        schedule = self.task.recipe.schedule
        orders = self.torch.as_tensor(self.task.orders(seed), device=self.dev)
        params = self.new_params(seed)
        opt = self.optimizer_class()(params, lr=schedule.lr, fused=True, **self.adam_kwargs())
        t = 0
        for order in orders:
            for lo, hi in self.bounds:
                for group in opt.param_groups:
                    group["lr"] = schedule.at(t)
                self.step(params, opt, order[lo:hi])
                t += 1
        return self.accuracy(params)


class TorchCompileRow(TorchEagerRow):
    name = "torch-compile"

    def build(self) -> None:
        self.compiled_loss = self.torch.compile(super().loss)
        super().build()
        self.note += ", torch.compile (forward and loss)"

    def loss(self, params, x, y):
        return self.compiled_loss(params, x, y)


class TorchGraphRow(_TorchRow):
    name = "torch-graph"

    def build(self) -> None:
        torch = self.torch
        self.note += ", whole step in a CUDA graph, capturable Adam, rate on the device"
        task, dev = self.task, self.dev
        if task.recipe.epochs != 1:
            raise NotImplementedError("the torch-graph speedrun peer trains one epoch")
        b = task.recipe.batch
        self.full_steps = sum(1 for lo, hi in self.bounds if hi - lo == b)
        self.tail = [hi - lo for lo, hi in self.bounds if hi - lo != b]
        # Static tensors the graphs read, filled in place per run: the parameters, the full
        # batches' order as rows, the tail batch's indices, the step counter and the rate.
        self.params = self.new_params(0)
        self.order_rows = torch.zeros((self.full_steps, b), dtype=torch.int64, device=dev)
        self.tail_idx = torch.zeros(self.tail[0] if self.tail else 1, dtype=torch.int64, device=dev)
        self.step_t = torch.zeros((), dtype=torch.int64, device=dev)
        self.lr_t = torch.tensor(task.recipe.schedule.lr, dtype=torch.float32, device=dev)
        self.opt = self.optimizer_class()(self.params, lr=self.lr_t, capturable=True, **self.adam_kwargs())
        # Lazy initialisation (Adam's state, cuDNN's algorithm search, cuBLAS's workspace, the
        # autograd engine's stream) on a side stream before any capture, as PyTorch requires.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.opt.zero_grad(set_to_none=True)
                self.full_step()
                if self.tail:
                    self.opt.zero_grad(set_to_none=True)
                    self.tail_step()
        torch.cuda.current_stream().wait_stream(side)
        self.capture()  # once untimed as well: the first capture has its own one-time costs
        self.accuracy(self.params)

    def schedule_rate(self):
        """The rate of step self.step_t, computed on the device (graphtrain.reference_cnn.Schedule)."""
        torch, s = self.torch, self.task.recipe.schedule
        k = self.step_t.to(torch.float32)
        if s.kind == "constant":
            return torch.full_like(k, s.lr)
        if s.kind == "warmup":
            return s.lr * torch.clamp((k + 1) / max(s.warmup_steps, 1), max=1.0)
        if s.kind == "cosine":
            return s.lr * (1 + torch.cos(math.pi * k / s.total)) / 2
        start, low = s.lr / s.div, s.lr / s.div / s.final_div
        end1, end2 = s.pct * s.total - 1, s.total - 1

        def anneal(a, b, pct):
            return b + (a - b) / 2 * (torch.cos(math.pi * pct) + 1)

        return torch.where(k <= end1, anneal(start, s.lr, k / end1), anneal(s.lr, low, (k - end1) / (end2 - end1)))

    def train_on(self, idx) -> None:
        F = self.torch.nn.functional
        self.lr_t.copy_(self.schedule_rate())
        loss = F.cross_entropy(self.forward(self.params, self.train_x[idx]), self.train_y[idx])
        loss.backward()
        self.opt.step()
        self.step_t += 1

    def full_step(self) -> None:
        self.train_on(self.order_rows.index_select(0, self.step_t.view(1)).view(-1))

    def tail_step(self) -> None:
        self.train_on(self.tail_idx)

    def capture(self) -> None:
        torch = self.torch
        self.graphs = []
        for step in ([self.full_step] + ([self.tail_step] if self.tail else [])):
            self.opt.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.graphs.append(graph)

    def run(self, seed: int) -> float:
        torch = self.torch
        b = self.task.recipe.batch
        order = torch.as_tensor(self.task.orders(seed)[0], device=self.dev)
        with torch.no_grad():
            for p, init in zip(self.params, self.task.initial(seed)):
                p.copy_(torch.from_numpy(init))
            self.order_rows.copy_(order[:self.full_steps * b].view(self.full_steps, b))
            if self.tail:
                self.tail_idx.copy_(order[self.full_steps * b:])
            self.step_t.zero_()
            for state in self.opt.state.values():
                for value in state.values():
                    value.zero_()  # exp_avg, exp_avg_sq and the step count
        self.capture()
        for _ in range(self.full_steps):
            self.graphs[0].replay()
        if self.tail:
            self.graphs[1].replay()
        return self.accuracy(self.params)
