"""The cnn's float64 reference, its optimizers and schedules, the config, the speedrun command's
refusals: everything about the speedrun that needs no GPU."""

import math

import numpy as np
import pytest
from click.testing import CliRunner

from graphtrain import config, reference_cnn as R
from graphtrain.cli import main
from graphtrain.errors import UsageError
from tests.helpers import rel_err

SPECS = [
    R.CnnSpec((R.ConvLayer(3, 3, 1, 0, 2), R.ConvLayer(4, 3, 2, 1, 2)), (5,), classes=4, channels=2, height=11, width=12),
    R.CnnSpec((R.ConvLayer(2, 5),), (), classes=3, channels=1, height=12, width=12),
]


@pytest.mark.parametrize("spec", SPECS, ids=["padding-stride", "one-conv"])
def test_backward_matches_finite_differences(spec):
    """The reference's gradients (conv backward filter and data, pool, bias) against central
    differences of its own loss, in float64."""
    seed = 1
    params = R.init_params(spec, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, spec.channels * spec.height * spec.width))
    y = rng.integers(0, spec.classes, 3)
    acts = R.forward(spec, params, x)
    grads = R.backward(spec, params, acts, R.loss_and_dlogits(acts["logits"], y)[1])
    for i, p in enumerate(params):
        numeric = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            old = p[idx]
            p[idx] = old + 1e-6
            up = R.loss_and_dlogits(R.forward(spec, params, x)["logits"], y)[0]
            p[idx] = old - 1e-6
            down = R.loss_and_dlogits(R.forward(spec, params, x)["logits"], y)[0]
            p[idx] = old
            numeric[idx] = (up - down) / 2e-6
        assert rel_err(grads[i], numeric) < 1e-6, f"parameter {i} {p.shape}, seed {seed}"


def test_conv_forward_matches_a_direct_loop():
    seed = 2
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((2, 3, 7, 6)), rng.standard_normal((4, 3, 3, 3))
    y = R.conv_forward(x, w, stride=2, padding=1)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    direct = np.zeros((2, 4, 4, 3))
    for n, o, i, j in np.ndindex(direct.shape):
        direct[n, o, i, j] = (xp[n, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3] * w[o]).sum()
    assert rel_err(y, direct) < 1e-12, f"seed {seed}"


def test_speedrun_spec_shapes():
    spec = R.CnnSpec((R.ConvLayer(24, 5), R.ConvLayer(32, 3)), (256,))
    assert spec.conv_shapes() == [(1, 28, 28, 24, 24, 24), (24, 12, 12, 32, 10, 10)]
    assert spec.dims == (800, 256, 10)
    assert [p.shape for p in R.init_params(spec, 0)] == [(24, 1, 5, 5), (24,), (32, 24, 3, 3), (32,), (256, 800),
                                                         (256,), (10, 256), (10,)]


def test_schedules():
    one = R.Schedule("one-cycle", 0.01, 235)
    assert one.at(0) == pytest.approx(0.01 / 25)
    peak = 0.3 * 235 - 1  # 69.5: the rate peaks between steps 69 and 70
    assert one.at(69) < 0.01 and one.at(70) < 0.01 and max(one.at(k) for k in range(235)) == pytest.approx(0.01, 1e-3)
    assert one.at(234) == pytest.approx(0.01 / 25 / 1e4)
    assert one.at(100) == pytest.approx(0.01 / 25 / 1e4 + (0.01 - 0.01 / 25 / 1e4) / 2 *
                                        (math.cos(math.pi * (100 - peak) / (234 - peak)) + 1))
    warm = R.Schedule("warmup", 0.1, 50, warmup_steps=10)
    assert [warm.at(k) for k in (0, 4, 9, 30)] == pytest.approx([0.01, 0.05, 0.1, 0.1])
    cos = R.Schedule("cosine", 0.1, 50)
    assert [cos.at(k) for k in (0, 25)] == pytest.approx([0.1, 0.05])
    assert R.Schedule("constant", 0.3, 9).at(7) == 0.3


def test_optimizers_by_hand():
    """Two steps of each rule written out."""
    g1, g2, p0, lr = np.array([0.5, -2.0]), np.array([1.0, 1.0]), np.array([1.0, 1.0]), 0.1

    def run(opt):
        p = [p0.copy()]
        state = opt.init_state(p)
        opt.step(p, [g1], state, 1, lr)
        opt.step(p, [g2], state, 2, lr)
        return p[0]

    assert run(R.Optimizer("sgd")) == pytest.approx(p0 - lr * (g1 + g2))
    b = 0.9 * g1 + g2
    assert run(R.Optimizer("momentum", momentum=0.9)) == pytest.approx(p0 - lr * g1 - lr * b)
    assert run(R.Optimizer("nesterov", momentum=0.9)) == pytest.approx(p0 - lr * (g1 + 0.9 * g1) - lr * (g2 + 0.9 * b))
    b1, b2, eps = 0.7, 0.9, 1e-8
    m1, v1 = (1 - b1) * g1, (1 - b2) * g1 ** 2
    p1 = p0 - lr / (1 - b1) * m1 / (np.sqrt(v1) / math.sqrt(1 - b2) + eps)
    m2, v2 = b1 * m1 + (1 - b1) * g2, b2 * v1 + (1 - b2) * g2 ** 2
    p2 = p1 - lr / (1 - b1 ** 2) * m2 / (np.sqrt(v2) / math.sqrt(1 - b2 ** 2) + eps)
    assert run(R.Optimizer("adam", betas=(b1, b2))) == pytest.approx(p2)
    # AdamW: the decay is applied to the weights before the Adam step, not added to the gradient.
    wd = 0.5
    q1 = p0 * (1 - lr * wd) - lr / (1 - b1) * m1 / (np.sqrt(v1) / math.sqrt(1 - b2) + eps)
    q2 = q1 * (1 - lr * wd) - lr / (1 - b1 ** 2) * m2 / (np.sqrt(v2) / math.sqrt(1 - b2 ** 2) + eps)
    assert run(R.Optimizer("adamw", betas=(b1, b2), weight_decay=wd)) == pytest.approx(q2)


def test_speedrun_preset_and_conv_option():
    cfg = config.preset("speedrun")
    assert (cfg.model, cfg.conv, cfg.hidden, cfg.batch, cfg.epochs, cfg.lr) == ("cnn", ((24, 5), (32, 3)), (256,),
                                                                               256, 1, 0.01)
    assert (cfg.optimizer, cfg.betas, cfg.schedule) == ("adam", (0.7, 0.9), "one-cycle")
    assert config.parse_conv("24x5, 32X3") == ((24, 5), (32, 3))
    for bad in ("24", "24x", "0x3", "axb"):
        with pytest.raises(UsageError):
            config.parse_conv(bad)


@pytest.mark.parametrize("changes", [dict(model="cnn"), dict(conv=((4, 3),)), dict(optimizer="lion"),
                                     dict(schedule="step"), dict(betas=(1.0, 0.9)), dict(schedule="warmup")])
def test_config_refusals(changes):
    with pytest.raises(UsageError):
        config.TrainConfig(**changes)


def test_cnn_too_deep_for_the_image_is_refused():
    from graphtrain import speedrun

    cfg = config.preset("speedrun").replace(conv=((8, 5), (8, 5), (8, 5)))
    with pytest.raises(UsageError, match="smaller than"):
        config.cnn_spec(cfg)


@pytest.mark.parametrize("args,words", [
    (["--rows", "nope"], "unknown speedrun row"),
    (["--betas", "0.7"], "--betas wants two numbers"),
    (["--optimizer", "adam", "--schedule", "warmup"], "warmup"),
    (["--conv", "3"], "--conv wants"),
    (["--optimizer", "sgd", "--peer", "jax-scan"],
     "jax-scan trains the cnn with adam or adamw, not --optimizer sgd; the recipe trains on numpy and on graphs "
     "through device-loop; --peer none leaves the peers out"),
])
def test_speedrun_command_refuses_bad_input(args, words):
    result = CliRunner().invoke(main, ["speedrun", *args, "--no-process-wall"])
    assert result.exit_code == 2, result.output
    assert words in result.output
    assert "Traceback" not in result.output


def small_mnist(mnist_dir, train: int, test: int):
    from graphtrain import data

    full = data.load("mnist", data_dir=mnist_dir)
    return data.Dataset.from_arrays(full.train_images[:train], full.train_labels[:train], full.test_images[:test],
                                    full.test_labels[:test])


def reference_accuracy(cfg, data, seed: int) -> float:
    """What the speedrun's numpy row computed before its rows were the registry's Stage classes:
    reference_cnn's float32 step by hand over seed `seed`'s run plan, on the normalised images."""
    from graphtrain.plan import RunPlan
    from graphtrain.recipe import normalise, recipe_of

    plan = RunPlan.for_data(cfg.replace(seed=seed), data)
    spec, recipe = config.cnn_spec(cfg), recipe_of(cfg, sum(plan.batches), plan.num_epochs)
    params = [a.copy() for layer in plan.initial for a in (layer.w, layer.b)]
    state, t = recipe.optimizer.init_state(params), 0
    train_x, labels = normalise(data.train_images), data.train_labels.astype(np.int32)
    for epoch, order in enumerate(plan.orders):
        for lo, hi in plan.epoch_bounds(epoch):
            idx = order[lo:hi]
            R.train_step(spec, params, train_x[idx], labels[idx], recipe.optimizer, state, t + 1, recipe.schedule.at(t))
            t += 1
    return R.accuracy(spec, params, normalise(data.test_images), data.test_labels.astype(np.int32))


def test_speedrun_numpy_row_is_the_numpy_stage_and_its_report(mnist_dir):
    """The numpy row on a slice of MNIST (192 training samples, 200 test) is the registry's
    CnnNumpyStage, set up once and restarted per seed: each seed's accuracy is exactly the
    reference's by hand, and the JSON and Markdown report carry what the speedrun reports."""
    from graphtrain import speedrun
    from graphtrain.stages.cnn_rungs import CnnNumpyStage

    small = small_mnist(mnist_dir, 192, 200)
    cfg = config.preset("speedrun").replace(batch=64, schedule="constant")
    case = speedrun.SpeedrunCase.of(cfg.replace(precision="tf32"), small)
    assert case.row_class("numpy") is CnnNumpyStage
    seeds = [0, 1]
    result = speedrun.run_row("numpy", case, seeds)
    for seed, accuracy in zip(seeds, result.accuracies):
        assert accuracy == reference_accuracy(cfg, small, seed), f"seed {seed}"
    assert min(result.accuracies) > 0.25  # 3 Adam steps at 0.01; chance is 0.1
    assert result.setups == 1 and result.precision == "fp32" and result.note == CnnNumpyStage.note
    doc = speedrun.summary([result], case, "graphtrain speedrun --rows numpy", "2026-01-01 00:00:00 UTC")
    row = doc["rows"][0]
    assert {"name", "accuracy_mean", "time_ms_median", "accuracies", "times_ms", "setup_ms", "setups",
            "precision"} <= set(row)
    assert doc["task"]["steps"] == 3 and doc["task"]["evaluated_on"] == "test" and doc["task"]["precision"] == "tf32"
    text = speedrun.markdown(doc)
    assert "- Revision: " in text and "- Command: `graphtrain speedrun --rows numpy`" in text


def test_speedrun_holdout_trains_on_the_rest_and_refuses_too_much():
    from graphtrain import data, speedrun

    small = data.Dataset.synthetic(600, 100, seed=1, num_features=784, num_classes=10)
    case = speedrun.SpeedrunCase.of(config.preset("speedrun").replace(batch=100), small, holdout=200)
    assert (len(case.data.train_images), len(case.data.test_images), case.evaluated_on) == (400, 200, "holdout")
    assert case.data.test_images is not small.test_images
    np.testing.assert_array_equal(case.data.test_images, small.train_images[-200:])
    for bad in (550, 600):
        with pytest.raises(UsageError, match="--holdout"):
            speedrun.SpeedrunCase.of(config.preset("speedrun").replace(batch=100), small, holdout=bad)


def test_speedrun_refuses_a_recipe_a_row_cannot_train_before_any_data_is_read():
    from graphtrain import speedrun
    from graphtrain.errors import ModelUnsupported

    speedrun.row_class("numpy", config.preset("speedrun").replace(optimizer="momentum"))
    with pytest.raises(ModelUnsupported, match="torch-graph trains the cnn with adam or adamw"):
        speedrun.row_class("torch-graph", config.preset("speedrun").replace(optimizer="momentum"))
    with pytest.raises(UsageError, match="unknown speedrun row 'baseline'"):
        speedrun.row_class("baseline", config.preset("speedrun"))


def test_rungs_train_the_cnn_or_refuse_it(mnist_dir):
    """The cnn runs on its own numpy rung through the common trainer (a slice of MNIST); MLP-only
    rungs refuse it, and MLP rungs refuse an optimizer or schedule they cannot hold."""
    from graphtrain.stages import get_stage
    from graphtrain.training import plan_for, run_stage

    small = small_mnist(mnist_dir, 600, 300)
    cfg = config.preset("speedrun").replace(batch=200, schedule="constant")
    plan = plan_for(cfg, small)
    assert [layer.w.shape for layer in plan.initial] == [(24, 1, 5, 5), (32, 24, 3, 3), (256, 800), (10, 256)]
    record = run_stage(get_stage("numpy"), plan, small)
    assert record.test_accuracy > 0.3 and math.isfinite(record.epochs[0].train_loss)  # 3 Adam steps; chance: 0.1
    for rung in ("baseline", "fused"):
        with pytest.raises(UsageError, match="trains MLPs only"):
            run_stage(get_stage(rung), plan, small)
    mlp = plan_for(config.preset("jhu").replace(optimizer="adam", epochs=1), small)
    with pytest.raises(UsageError, match="SGD at a constant rate"):  # the MLP's recipe: numpy, graphs on
        run_stage(get_stage("baseline"), mlp, small)
