"""The NumPy reference: gradients against finite differences, init and order, one SGD step."""

import numpy as np
import pytest

from graphtrain import reference


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def loss_of(layers, x, y):
    return reference.loss_and_dlogits(reference.forward(layers, x)[-1], y)[0]


@pytest.mark.parametrize("dims,bias", [((12, 5), True), ((12, 7, 6, 5), True), ((12, 7, 5), False)])
def test_gradients_match_finite_differences(dims, bias):
    rng = np.random.default_rng(1)
    layers = reference.init_params(dims, bias, seed=3, dtype=np.float64)
    x = rng.standard_normal((9, dims[0]))
    y = rng.integers(0, dims[-1], size=9)
    acts = reference.forward(layers, x)
    _, dlogits = reference.loss_and_dlogits(acts[-1], y)
    grads = reference.backward(layers, acts, dlogits)
    h = 1e-6
    for layer, grad in zip(layers, grads):
        params = [(layer.w, grad.w)] + ([(layer.b, grad.b)] if bias else [])
        for p, g in params:
            numeric = np.zeros_like(p)
            for idx in np.ndindex(p.shape):
                old = p[idx]
                p[idx] = old + h
                up = loss_of(layers, x, y)
                p[idx] = old - h
                down = loss_of(layers, x, y)
                p[idx] = old
                numeric[idx] = (up - down) / (2 * h)
            assert rel_err(g, numeric) < 1e-6


def test_init_follows_torch_default_bounds_and_is_seeded():
    a = reference.init_params((784, 100, 10), True, seed=5)
    b = reference.init_params((784, 100, 10), True, seed=5)
    c = reference.init_params((784, 100, 10), True, seed=6)
    assert all(np.array_equal(p.w, q.w) and np.array_equal(p.b, q.b) for p, q in zip(a, b))
    assert not np.array_equal(a[0].w, c[0].w)
    for layer, fan_in in zip(a, (784, 100)):
        bound = 1 / np.sqrt(fan_in)
        assert layer.w.dtype == np.float32
        assert np.abs(layer.w).max() <= bound and np.abs(layer.w).max() > 0.9 * bound
        assert np.abs(layer.b).max() <= bound
    # The float64 oracle starts from exactly the float32 model's point.
    a64 = reference.init_params((784, 100, 10), True, seed=5, dtype=np.float64)
    assert np.array_equal(a64[0].w.astype(np.float32), a[0].w)
    assert reference.init_params((784, 10), False, seed=5)[0].b is None


def test_epoch_order_is_a_seeded_permutation_that_changes_per_epoch():
    e0 = reference.epoch_order(0, 0, 1000)
    assert sorted(e0.tolist()) == list(range(1000))
    assert np.array_equal(e0, reference.epoch_order(0, 0, 1000))
    assert not np.array_equal(e0, reference.epoch_order(0, 1, 1000))
    assert not np.array_equal(e0, reference.epoch_order(1, 0, 1000))


def test_batch_bounds_keep_the_tail_batch():
    bounds = reference.batch_bounds(60000, 128)
    assert len(bounds) == 469
    assert bounds[-1] == (59904, 60000)
    assert sum(hi - lo for lo, hi in bounds) == 60000


def test_train_step_is_sgd_on_the_batch_mean_gradient():
    rng = np.random.default_rng(2)
    layers = reference.init_params((20, 8, 4), True, seed=0, dtype=np.float64)
    before = [layer.copy() for layer in layers]
    x, y = rng.random((6, 20)), rng.integers(0, 4, 6)
    acts = reference.forward(before, x)
    loss, dlogits = reference.loss_and_dlogits(acts[-1], y)
    grads = reference.backward(before, acts, dlogits)
    loss_sum, correct = reference.train_step(layers, x, y, 0.5)
    assert loss_sum == pytest.approx(loss * 6)
    assert 0 <= correct <= 6
    for new, old, g in zip(layers, before, grads):
        np.testing.assert_allclose(new.w, old.w - 0.5 * g.w)
        np.testing.assert_allclose(new.b, old.b - 0.5 * g.b)


def test_loss_is_stable_for_huge_logits():
    logits = np.array([[1000.0, 0.0, -1000.0]])
    loss, d = reference.loss_and_dlogits(logits, np.array([0]))
    assert np.isfinite(loss) and loss == pytest.approx(0.0)
    assert np.isfinite(d).all()
