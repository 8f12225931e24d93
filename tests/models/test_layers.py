"""LayerNorm's written-out backward (`jaxsora.models.layers.layer_norm`) against the gradient in float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsora.models import layers as L
from tests.conftest import rel_err


def _gradients_f64(x, scale, w, eps=L.NORM_EPS):
    """d/d(x, shift, scale) of Σ w·(x̂·(1 + scale) + shift), x̂ = LayerNorm(x), in float64 (the textbook form)."""
    xc = x - x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((xc**2).mean(-1, keepdims=True) + eps)
    x_hat = xc * rstd
    g = w * (1 + scale)
    dx = rstd * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
    return dx, w.sum((1, 2), keepdims=True), (w * x_hat).sum((1, 2), keepdims=True)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_layer_norm_gradients(dtype, tol):
    """Tokens with a large mean and a small spread (where a careless variance loses digits) and one constant
    token (rstd = 1/√eps), through the modulation as STDiT3 uses it; bf16 inputs keep bf16 gradients."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 48)) * rng.uniform(0.01, 3, (2, 3, 5, 1)) + rng.uniform(-20, 20, (2, 3, 5, 1))
    x[1, 2, 4] = 0.5
    x, shift, scale = (jnp.asarray(a, dtype) for a in (x, *rng.standard_normal((2, 2, 1, 1, 48))))
    w = rng.standard_normal(x.shape)

    def loss(x, shift, scale):
        return jnp.sum(L.modulate(L.layer_norm(x), shift, scale).astype(jnp.float32) * jnp.asarray(w, jnp.float32))

    f64 = [np.asarray(a.astype(jnp.float32), np.float64) for a in (x, scale)]  # the inputs as rounded to dtype
    x_hat = (f64[0] - f64[0].mean(-1, keepdims=True)) / np.sqrt(f64[0].var(-1, keepdims=True) + L.NORM_EPS)
    assert rel_err(np.asarray(L.layer_norm(x).astype(jnp.float32)), x_hat) <= tol
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, shift, scale)
    for got, want in zip(grads, _gradients_f64(f64[0], f64[1], w)):
        assert got.dtype == dtype
        assert rel_err(np.asarray(got.astype(jnp.float32)), want) <= tol
