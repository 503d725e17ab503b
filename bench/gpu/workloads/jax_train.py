#!/usr/bin/env python3
"""jax_train: a JAX MLP training step (jit, hand-written SGD), block_until_ready
per step. bf16 weights and activations, --layers x --width, batch --batch.
XLA's allocator is told not to take most of the GPU up front
(XLA_PYTHON_CLIENT_PREALLOCATE=false, XLA_PYTHON_CLIENT_MEM_FRACTION=0.15)
so it coexists with others. Unit: steps/s.
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.15")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import Reporter, parser, ready_start, wait_go  # noqa: E402


def main():
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    a = ap.parse_args()
    wait_go(a)
    dev = jax.devices()[0]
    if dev.platform not in ("gpu", "cuda"):
        raise SystemExit(f"jax_train: JAX's first device is {dev} (platform {dev.platform}), not a GPU")
    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, a.layers + 2)
    scale = 1.0 / a.width ** 0.5
    params = [(jax.random.normal(keys[i], (a.width, a.width), jnp.bfloat16) * scale,
               jnp.zeros((a.width,), jnp.bfloat16)) for i in range(a.layers)]
    x = jax.random.normal(keys[-2], (a.batch, a.width), jnp.bfloat16)
    y = jax.random.normal(keys[-1], (a.batch, a.width), jnp.bfloat16)

    def loss_fn(ps, x, y):
        h = x
        for i, (w, b) in enumerate(ps):
            h = h @ w + b
            if i < len(ps) - 1:
                h = jax.nn.gelu(h)
        return jnp.mean((h.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

    @jax.jit
    def train_step(ps, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(ps, x, y)
        ps = jax.tree_util.tree_map(lambda p, g: p - (a.lr * g).astype(p.dtype), ps, grads)
        return ps, loss

    for _ in range(3):
        params, loss = train_step(params, x, y)
    loss.block_until_ready()
    ready_start(a)
    rep = Reporter("jax_train", "steps/s", a.seconds)
    rep.begin()
    while not rep.done():
        params, loss = train_step(params, x, y)
        loss.block_until_ready()
        rep.add(1)
    rep.finish(layers=a.layers, width=a.width, batch=a.batch, jax=jax.__version__, device=str(dev))


if __name__ == "__main__":
    main()
