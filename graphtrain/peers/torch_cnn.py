"""The cnn in PyTorch (`run --preset speedrun --stage torch-graph`, the speedrun's peers), written
for speed as a competent user would: the data and the sample orders on the GPU, the model as
functional ops over parameter tensors made straight from the plan's initial weights, Adam's fused
or capturable implementation.

    torch-eager    a Python loop over the batches, fused Adam, the rate set per step
    torch-graph    the whole step (gather, forward, backward, Adam, the rate) in one CUDA graph,
                   replayed per batch: capturable Adam reading the rate from a device tensor that
                   the graph computes from a device step counter; the tail batch its own graph
    torch-compile  the forward and loss compiled by torch.compile (default mode), fused Adam

Setup compiles, autotunes (cudnn.benchmark) and captures on the row's own tensors, then puts the
plan's initial weights on them. A restart (another seed, learning rate or recipe) makes new
parameters and a new optimizer for eager and compile; torch-graph copies the weights and the
orders into the tensors its graphs read and zeroes Adam's state and the step counter, and takes
another peak learning rate (a device value) but not another schedule or optimizer (the graph
holds them): there, another is set up anew.

TF32 for convolutions and products unless the precision is fp32. PyTorch's flags for them are
process-wide, and other rows may live beside this one in a process: each piece of work sets this
row's flags and puts the process's back (`flags`).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from graphtrain.peers.common import WARMUP_STEPS
from graphtrain.peers.torch_common import import_torch
from graphtrain.recipe import Recipe, schedule_rate
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult
from graphtrain.stages.cnn_rungs import CnnStage, as_layers, cnn_setup, flat_params


class TorchCnnPeer(CnnStage):
    """What the torch peers' cnn classes share: the data on the GPU, the model, Adam, the clock."""

    @classmethod
    def check_available(cls) -> int | None:
        return import_torch().cuda.get_device_properties(0).total_memory

    @contextmanager
    def flags(self):
        """This row's TF32 and cudnn.benchmark flags for the block, the process's afterwards."""
        torch = self.torch
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
        tf32 = self.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = True  # picks each convolution's algorithm once, in the warm-up
        try:
            yield
        finally:
            (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark) = saved

    def setup(self) -> None:
        torch = self.torch = import_torch()
        self.spec, self.recipe, train_x, test_x = cnn_setup(self)
        self.note = f"{'TF32' if self.precision == 'tf32' else 'fp32'}, cudnn.benchmark"
        dev = self.dev = torch.device("cuda")
        spec, data = self.spec, self.data
        shape = (-1, spec.channels, spec.height, spec.width)
        self.train_x = torch.as_tensor(train_x, device=dev).view(shape)
        self.train_y = torch.as_tensor(data.train_labels.astype(np.int64), device=dev)
        self.test_x = torch.as_tensor(test_x, device=dev).view(shape)
        self.test_y = torch.as_tensor(data.test_labels.astype(np.int64), device=dev)
        self.start_event = torch.cuda.Event(enable_timing=True)
        self.end_event = torch.cuda.Event(enable_timing=True)
        with self.flags():
            self.build()
            torch.cuda.synchronize()
            self.start_run()

    def build(self) -> None:
        """Warm up what the run needs (compile, autotune, lazy initialisation, capture)."""

    # ---- the model ----

    def forward(self, params, x):
        F = self.torch.nn.functional
        spec = self.spec
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

    def new_params(self):
        """The plan's initial weights as new leaf tensors on the GPU."""
        return [self.torch.tensor(p, device=self.dev, requires_grad=True) for p in flat_params(self.plan.initial)]

    def adam_kwargs(self) -> dict:
        opt = self.recipe.optimizer
        return {"betas": tuple(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}

    def optimizer_class(self):
        """torch.optim's Adam or AdamW: the optimizers the registry lets these classes train
        (another is refused before any work, so one asked for here is a bug)."""
        optim, kind = self.torch.optim, self.recipe.optimizer.kind
        if kind not in ("adam", "adamw"):
            raise RuntimeError(f"{self.name} trains the cnn with Adam or AdamW, not {kind}")
        return optim.AdamW if kind == "adamw" else optim.Adam

    def accuracy(self, params) -> float:
        with self.torch.no_grad():
            correct = (self.forward(params, self.test_x).argmax(1) == self.test_y).sum()
        return int(correct) / len(self.test_y)

    def test_accuracy(self) -> float:
        with self.flags():
            return self.accuracy(self.params)

    def weights(self) -> list[Layer]:
        return as_layers([p.detach().cpu().numpy().copy() for p in self.params])

    def timed(self, run_batches, num_batches: int, measure: bool) -> EpochResult:
        """`run_batches()` bracketed by CUDA events on the current stream; its returned device
        loss sum (or None) read once, divided by the samples of `num_batches` batches."""
        with self.flags():
            self.start_event.record()
            loss_sum = run_batches()
            self.end_event.record()
            self.end_event.synchronize()
        seen = self.plan.samples_seen(num_batches)
        loss = float(loss_sum) / seen if measure and loss_sum is not None else None
        return EpochResult(self.start_event.elapsed_time(self.end_event), loss)

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
        # Drop the tensors and hand the cached blocks back, so the rows after this one (graphtrain's
        # allocate with cudaMalloc) find the GPU's memory free.
        for name in list(vars(self)):
            if name not in ("torch", "plan", "config", "data", "precision", "note", "spec", "recipe"):
                setattr(self, name, None)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class TorchEagerCnnPeer(TorchCnnPeer):
    name = "torch-eager"
    summary = "PyTorch eager: the cnn's functional ops, fused Adam, the rate set per step"

    def loss(self, params, x, y):
        return self.torch.nn.functional.cross_entropy(self.forward(params, x), y)

    def build(self) -> None:
        self.note += ", fused Adam"
        order = self.torch.tensor(self.plan.orders[0], device=self.dev)
        params = self.new_params()  # thrown away: the run starts from new ones
        opt = self.optimizer_class()(params, lr=self.recipe.schedule.lr, fused=True, **self.adam_kwargs())
        bounds = self.plan.bounds
        for lo, hi in bounds[:WARMUP_STEPS] + bounds[-1:]:
            self.step(params, opt, order[lo:hi])
        self.accuracy(params)

    def start_run(self) -> None:
        """New parameters from the plan's initial weights, a new optimizer for the recipe, the
        orders on the GPU."""
        self.orders = self.torch.tensor(self.plan.orders, device=self.dev)  # the plan's arrays are read-only
        self.params = self.new_params()
        self.opt = self.optimizer_class()(self.params, lr=self.recipe.schedule.lr, fused=True, **self.adam_kwargs())
        self.t = 0

    def step(self, params, opt, idx):
        loss = self.loss(params, self.train_x[idx], self.train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        schedule, order, dev = self.recipe.schedule, self.orders[epoch], self.dev

        def run_batches():
            loss_sum = self.torch.zeros((), dtype=self.torch.float64, device=dev) if measure else None
            for lo, hi in self.plan.epoch_bounds(epoch, num_batches):
                for group in self.opt.param_groups:
                    group["lr"] = schedule.at(self.t)
                loss = self.step(self.params, self.opt, order[lo:hi])
                if measure:
                    loss_sum += loss.detach() * (hi - lo)
                self.t += 1
            return loss_sum

        return self.timed(run_batches, num_batches, measure)


class TorchCompileCnnPeer(TorchEagerCnnPeer):
    name = "torch-compile"
    summary = "PyTorch: the cnn's forward and loss through torch.compile, fused Adam"

    def build(self) -> None:
        self.compiled_loss = self.torch.compile(super().loss)
        super().build()
        self.note += ", torch.compile (forward and loss)"

    def loss(self, params, x, y):
        return self.compiled_loss(params, x, y)


class TorchGraphCnnPeer(TorchCnnPeer):
    name = "torch-graph"
    summary = "PyTorch: the cnn's whole step in one CUDA graph, capturable Adam, the rate on the device"

    def measures(self, epoch: int) -> bool:
        return False  # the captured step holds no loss sum: the speedrun's graph, as timed

    def build(self) -> None:
        torch = self.torch
        self.note += ", whole step in a CUDA graph, capturable Adam, rate on the device"
        dev, b = self.dev, self.recipe.batch
        bounds = self.plan.bounds
        self.full_steps = sum(1 for lo, hi in bounds if hi - lo == b)
        tails = [hi - lo for lo, hi in bounds if hi - lo != b]
        self.tail_rows = tails[0] if tails else 0
        # Static tensors the graphs read, filled in place per run and epoch: the parameters, the
        # epoch's full batches as rows of its order, the tail batch's indices, the row and step
        # counters, the schedule's peak and the rate.
        self.params = self.new_params()
        self.order_rows = torch.zeros((max(self.full_steps, 1), b), dtype=torch.int64, device=dev)
        self.tail_idx = torch.zeros(max(self.tail_rows, 1), dtype=torch.int64, device=dev)
        self.row_t = torch.zeros((), dtype=torch.int64, device=dev)
        self.step_t = torch.zeros((), dtype=torch.int64, device=dev)
        self.peak_t = torch.tensor(self.recipe.schedule.lr, dtype=torch.float32, device=dev)
        self.lr_t = torch.tensor(self.recipe.schedule.lr, dtype=torch.float32, device=dev)
        self.opt = self.optimizer_class()(self.params, lr=self.lr_t, capturable=True, **self.adam_kwargs())
        # Lazy initialisation (Adam's state, cuDNN's algorithm search, cuBLAS's workspace, the
        # autograd engine's stream) on a side stream before any capture, as PyTorch requires.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.opt.zero_grad(set_to_none=True)
                self.full_step()
                if self.tail_rows:
                    self.opt.zero_grad(set_to_none=True)
                    self.tail_step()
        torch.cuda.current_stream().wait_stream(side)
        self.capture()
        self.accuracy(self.params)

    def schedule_rate(self):
        """The rate of step self.step_t, computed on the device from the peak self.peak_t."""
        return schedule_rate(self.recipe.schedule, self.step_t.to(self.torch.float32), self.peak_t, self.torch)

    def train_on(self, idx) -> None:
        F = self.torch.nn.functional
        self.lr_t.copy_(self.schedule_rate())
        loss = F.cross_entropy(self.forward(self.params, self.train_x[idx]), self.train_y[idx])
        loss.backward()
        self.opt.step()
        self.step_t += 1

    def full_step(self) -> None:
        self.train_on(self.order_rows.index_select(0, self.row_t.view(1)).view(-1))
        self.row_t += 1

    def tail_step(self) -> None:
        self.train_on(self.tail_idx)

    def capture(self) -> None:
        torch = self.torch
        self.graphs = []
        for step in ([self.full_step] + ([self.tail_step] if self.tail_rows else [])):
            self.opt.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.graphs.append(graph)

    def put_recipe(self, recipe: Recipe) -> bool:
        """Another peak rate is a device value (start_run writes it); the rest of the schedule and
        the optimizer's constants are held by the captured graph."""
        return recipe.but_for_the_peak() == self.recipe.but_for_the_peak()

    def start_run(self) -> None:
        """The plan's weights copied into the captured parameters, its orders to the GPU, Adam's
        state, the step counter zeroed and the peak rate written, in place."""
        torch = self.torch
        self.orders = torch.as_tensor(self.plan.orders.astype(np.int64), device=self.dev)
        with torch.no_grad():
            for p, init in zip(self.params, flat_params(self.plan.initial)):
                p.copy_(torch.tensor(init))  # the plan's arrays are read-only
            self.step_t.zero_()
            self.peak_t.fill_(self.recipe.schedule.lr)
            for state in self.opt.state.values():
                for value in state.values():
                    value.zero_()  # exp_avg, exp_avg_sq and the step count

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        b, full = self.recipe.batch, self.full_steps
        order = self.orders[epoch]

        def run_batches():
            with self.torch.no_grad():
                if full:
                    self.order_rows.copy_(order[:full * b].view(full, b))
                if self.tail_rows:
                    self.tail_idx.copy_(order[full * b:full * b + self.tail_rows])
                self.row_t.zero_()
            for _ in range(min(num_batches, full)):
                self.graphs[0].replay()
            if num_batches > full:
                self.graphs[1].replay()
            return None

        return self.timed(run_batches, num_batches, measure)
