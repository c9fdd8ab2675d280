import pytest

from graphtrain.config import PRESETS, parse_hidden, preset
from graphtrain.errors import UsageError


def test_presets_match_the_design():
    jhu, mlp, mnist = PRESETS["jhu"], PRESETS["cuda-mlp"], PRESETS["cuda-mnist"]
    assert jhu.dims == (784, 10) and jhu.bias and (jhu.batch, jhu.epochs, jhu.lr) == (128, 20, 0.1)
    assert mlp.dims == (784, 784, 784, 784, 784, 10) and not mlp.bias and (mlp.batch, mlp.epochs) == (64, 10)
    assert mnist.steps == 5000 and mnist.epochs is None and mnist.batch == 32 and mnist.lr == 0.003


@pytest.mark.parametrize("changes,needle", [
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"lr": -1.0}, "lr must be a finite number > 0"),
    ({"lr": float("inf")}, "lr must be a finite number > 0, got inf"),
    ({"lr": float("nan")}, "lr must be a finite number > 0, got nan"),
    ({"batch": 0}, "batch must be >= 1"),
    ({"hidden": (784, 0)}, "hidden sizes"),
    ({"epochs": 0}, "epochs must be >= 1"),
    ({"metrics_every": 0}, "metrics_every"),
    ({"precision": "fp8"}, "precision"),
])
def test_a_config_that_cannot_train_cannot_be_made(changes, needle):
    """Checked once, as the config is made: nothing downstream validates it again."""
    with pytest.raises(UsageError, match=needle):
        PRESETS["jhu"].replace(**changes)


def test_unknown_preset_names_the_choices():
    with pytest.raises(UsageError, match="jhu"):
        preset("nope")


def test_parse_hidden():
    assert parse_hidden("784,784") == (784, 784)
    assert parse_hidden("none") == parse_hidden("") == ()  # softmax regression
    with pytest.raises(UsageError):
        parse_hidden("784,x")
    with pytest.raises(UsageError):
        parse_hidden("784,-2")
    with pytest.raises(UsageError, match="--hidden none"):  # 0 is not a way to say "no layer"
        parse_hidden("0")


def test_epochs_and_steps_replace_each_other():
    assert PRESETS["cuda-mnist"].replace(epochs=2).steps is None
    assert PRESETS["jhu"].replace(steps=10).epochs is None
