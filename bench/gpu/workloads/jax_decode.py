#!/usr/bin/env python3
"""jax_decode: a JAX transformer decoder streaming tokens, one request after another.

A decoder-only transformer written in jax.numpy (--layers x --width, RMSNorm,
multi-head attention over a KV cache held on the GPU, GELU MLP, embedding
shared with the head; random bf16 weights). Each request prefills a prompt of
--prompt tokens in one jitted call, then decodes --new tokens greedily, one
jitted call per token with the cache donated back to XLA; each token is read
back to the host (np.asarray: a synchronize per token), as a streaming server
sends it. XLA decides the kernels (fusions, and on recent versions CUDA graphs
of them). XLA's allocator does not take most of the GPU up front
(XLA_PYTHON_CLIENT_PREALLOCATE=false, XLA_PYTHON_CLIENT_MEM_FRACTION=0.15).
Unit: generated tokens/s.
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.15")

from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from common import Reporter, parser, ready_start, wait_go  # noqa: E402


def rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def make_params(key, layers, width, vocab):
    ks = jax.random.split(key, 4 * layers + 1)
    s = width ** -0.5
    nrm = partial(jax.random.normal, dtype=jnp.bfloat16)
    layer = [{"wqkv": nrm(ks[4 * i], (width, 3 * width)) * s,
              "wo": nrm(ks[4 * i + 1], (width, width)) * s,
              "w1": nrm(ks[4 * i + 2], (width, 4 * width)) * s,
              "w2": nrm(ks[4 * i + 3], (4 * width, width)) * (s / 2),
              "ln1": jnp.ones((width,), jnp.bfloat16), "ln2": jnp.ones((width,), jnp.bfloat16)}
             for i in range(layers)]
    return {"embed": nrm(ks[-1], (vocab, width)) * s, "layers": layer}


def forward(params, ks, vs, toks, start, heads):
    """Tokens `toks` (batch, n) at positions start..start+n-1: their keys and
    values written into the cache (layers, batch, max_len, heads, head_dim),
    attention over everything up to each one; the next token after the last."""
    b, n = toks.shape
    width = params["embed"].shape[1]
    hd = width // heads
    x = params["embed"][toks]
    qpos = start + jnp.arange(n)
    mask = jnp.arange(ks.shape[2])[None, :] <= qpos[:, None]
    for i, p in enumerate(params["layers"]):
        q, k, v = jnp.split(rms(x) * p["ln1"] @ p["wqkv"], 3, axis=-1)
        q, k, v = (t.reshape(b, n, heads, hd) for t in (q, k, v))
        ks = lax.dynamic_update_slice(ks, k[None], (i, 0, start, 0, 0))
        vs = lax.dynamic_update_slice(vs, v[None], (i, 0, start, 0, 0))
        s = jnp.einsum("bnhd,bthd->bhnt", q, ks[i]).astype(jnp.float32) * hd ** -0.5
        a = jax.nn.softmax(jnp.where(mask[None, None], s, -1e30), -1).astype(x.dtype)
        x = x + jnp.einsum("bhnt,bthd->bnhd", a, vs[i]).reshape(b, n, width) @ p["wo"]
        x = x + jax.nn.gelu(rms(x) * p["ln2"] @ p["w1"]) @ p["w2"]
    logits = rms(x[:, -1]) @ params["embed"].T
    return ks, vs, jnp.argmax(logits, -1).astype(jnp.int32)


def main():
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    wait_go(a)
    dev = jax.devices()[0]
    if dev.platform not in ("gpu", "cuda"):
        raise SystemExit(f"jax_decode: JAX's first device is {dev} (platform {dev.platform}), not a GPU")
    params = make_params(jax.random.PRNGKey(0), a.layers, a.width, a.vocab)
    max_len = a.prompt + a.new
    shape = (a.layers, a.batch, max_len, a.heads, a.width // a.heads)
    step = jax.jit(partial(forward, heads=a.heads), donate_argnums=(1, 2))
    prompts = jax.random.randint(jax.random.PRNGKey(1), (a.batch, a.prompt), 0, a.vocab, jnp.int32)

    def request(rep):
        ks = jnp.zeros(shape, jnp.bfloat16)
        vs = jnp.zeros(shape, jnp.bfloat16)
        ks, vs, tok = step(params, ks, vs, prompts, jnp.int32(0))
        out = [np.asarray(tok)]
        if rep is not None:
            rep.add(a.batch)
        for pos in range(a.prompt, max_len - 1):
            ks, vs, tok = step(params, ks, vs, tok[:, None], jnp.int32(pos))
            out.append(np.asarray(tok))     # streamed to the client: a synchronize per token
            if rep is not None:
                rep.add(a.batch)
                if rep.done():
                    break
        return out

    request(None)       # compiles the prefill and the decode step
    ready_start(a)
    rep = Reporter("jax_decode", "tokens/s", a.seconds)
    rep.begin()
    requests = 0
    while not rep.done():
        request(rep)
        requests += 1
    rep.finish(requests=requests, layers=a.layers, width=a.width, batch=a.batch,
               jax=jax.__version__, device=str(dev))


if __name__ == "__main__":
    main()
