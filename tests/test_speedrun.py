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
])
def test_speedrun_command_refuses_bad_input(args, words):
    result = CliRunner().invoke(main, ["speedrun", *args, "--no-process-wall"])
    assert result.exit_code == 2, result.output
    assert words in result.output
    assert "Traceback" not in result.output


def test_speedrun_numpy_row_and_report(mnist_dir):
    """The numpy row on a slice of MNIST (800 training samples, 500 test): trains to well above
    chance, and the JSON and Markdown report carry what the issue asks for."""
    from graphtrain import data, speedrun

    full = data.load("mnist", data_dir=mnist_dir)
    small = data.Dataset.from_arrays(full.train_images[:800], full.train_labels[:800], full.test_images[:500],
                                     full.test_labels[:500])
    task = speedrun.make_task(config.preset("speedrun").replace(batch=200, schedule="constant"), small)
    result = speedrun.run_row("numpy", task, [0, 1])
    assert len(result.accuracies) == 2 and min(result.accuracies) > 0.5  # 4 Adam steps at 0.01; chance is 0.1
    doc = speedrun.summary([result], task, "graphtrain speedrun --rows numpy", "2026-01-01 00:00:00 UTC")
    row = doc["rows"][0]
    assert {"name", "accuracy_mean", "time_ms_median", "accuracies", "times_ms"} <= set(row)
    assert doc["task"]["steps"] == 4 and doc["task"]["evaluated_on"] == "test"
    text = speedrun.markdown(doc)
    assert "- Revision: " in text and "- Command: `graphtrain speedrun --rows numpy`" in text


def test_rungs_train_the_cnn_or_refuse_it(mnist_dir):
    """The cnn runs on its own numpy rung through the common trainer (a slice of MNIST); MLP-only
    rungs refuse it, and MLP rungs refuse an optimizer or schedule they cannot hold."""
    from graphtrain import data
    from graphtrain.stages import get_stage
    from graphtrain.training import plan_for, run_stage

    full = data.load("mnist", data_dir=mnist_dir)
    small = data.Dataset.from_arrays(full.train_images[:600], full.train_labels[:600], full.test_images[:300],
                                     full.test_labels[:300])
    cfg = config.preset("speedrun").replace(batch=200, schedule="constant")
    plan = plan_for(cfg, small)
    assert [layer.w.shape for layer in plan.initial] == [(24, 1, 5, 5), (32, 24, 3, 3), (256, 800), (10, 256)]
    record = run_stage(get_stage("numpy"), plan, small)
    assert record.test_accuracy > 0.3 and math.isfinite(record.epochs[0].train_loss)  # 3 Adam steps; chance: 0.1
    for rung in ("baseline", "fused", "persistent"):
        with pytest.raises(UsageError, match="trains MLPs only"):
            run_stage(get_stage(rung), plan, small)
    mlp = plan_for(config.preset("jhu").replace(optimizer="adam", epochs=1), small)
    with pytest.raises(UsageError, match="SGD at a constant rate"):  # the MLP's recipe: numpy, graphs on
        run_stage(get_stage("baseline"), mlp, small)
