#!/usr/bin/env python3
"""tp_decode: tensor-parallel greedy decoding, one process per GPU (NCCL).

A Llama-style decoder written out in PyTorch (RMSNorm, attention with rotary
embeddings and GQA over a static KV cache, SwiGLU MLP; random weights, bf16).
Attention heads and the MLP intermediate are split over the ranks: QKV and
gate/up are column-parallel, o_proj and down row-parallel, so each layer does
one all_reduce after attention and one after the MLP. Embedding and lm_head
are replicated, so every rank computes the same argmax from the all-reduced
hidden state and no extra collective is needed per token.

Each request: a prefill of --prompt-tokens tokens (eager), then --new-tokens
decode steps; every token is read back to the host (.item(): a synchronize per
token). With --graphs one decode step (all layers, both all-reduces, argmax,
position bump) is captured once in a CUDA graph and replayed.

Rank and rendezvous come from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), set by the launcher; rank r uses GPU r (LOCAL_RANK if set).

Output, per rank: a {"start": true} line when the timed loop begins, one JSON
line per second {"w": "tp_decode", "rank", "t", "dt", "n", "rate", "unit":
"tokens/s", "max_gap_ms"} (max_gap_ms: the longest time between two
consecutive tokens that ended in that interval; a request's first token comes
after its prefill), and a summary line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import Reporter


class TPReporter(Reporter):
    """Reporter with the rank and the longest token-to-token gap per line."""

    def __init__(self, rank: int, seconds: float):
        super().__init__("tp_decode", "tokens/s", seconds)
        self.rank = rank
        self.last = None
        self.gap_max = 0.0
        self.gaps: list[float] = []

    def token(self, units: float) -> None:
        now = time.monotonic()
        if self.last is not None:
            gap = now - self.last
            self.gaps.append(gap)
            self.gap_max = max(self.gap_max, gap)
        self.last = now
        self.add(units)

    def _emit(self, end_t: float) -> None:
        dt = end_t - self.start_t
        if dt <= 0:
            return
        print(json.dumps({"w": self.name, "rank": self.rank, "t": round(self.start_t, 4),
                          "dt": round(dt, 4), "n": self.n, "rate": round(self.n / dt, 4),
                          "unit": self.unit, "max_gap_ms": round(self.gap_max * 1e3, 3)}), flush=True)
        if self.start_t >= 5.0:
            self.after5[0] += self.n
            self.after5[1] += dt
        self.total += self.n
        self.n = 0.0
        self.gap_max = 0.0
        self.start_t = end_t


def rms_norm(x, w, eps=1e-5):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class TPLlama:
    """This rank's shard of the model, its static KV cache and the two paths
    (prefill, one decode step) that use them."""

    def __init__(self, a, rank: int, world: int, dev):
        assert a.heads % world == 0 and a.kv_heads % world == 0 and a.ffn % world == 0
        assert a.heads % a.kv_heads == 0
        self.dev, self.rank, self.world = dev, rank, world
        self.hidden, self.layers = a.hidden, a.layers
        self.d = a.hidden // a.heads
        self.hq, self.hkv = a.heads // world, a.kv_heads // world     # this rank's heads
        self.rep = self.hq // self.hkv
        self.ffn = a.ffn // world
        self.vocab = a.vocab
        self.batch = a.batch
        self.max_len = a.prompt_tokens + a.new_tokens
        bf = torch.bfloat16

        # Replicated weights from one seed on every rank; shards from a seed per rank.
        rep_g = torch.Generator(device=dev)
        rep_g.manual_seed(1234)
        shard_g = torch.Generator(device=dev)
        shard_g.manual_seed(5678 + rank)

        def rand(shape, g, std=0.02):
            return (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * std).to(bf)

        H, d = self.hidden, self.d
        self.embed = rand((self.vocab, H), rep_g)
        self.lm_head = rand((H, self.vocab), rep_g)
        self.norm_f = torch.ones(H, device=dev, dtype=bf)
        self.w = []
        for _ in range(self.layers):
            self.w.append({
                "in": torch.ones(H, device=dev, dtype=bf),
                "post": torch.ones(H, device=dev, dtype=bf),
                "qkv": rand((H, (self.hq + 2 * self.hkv) * d), shard_g),   # column-parallel
                "o": rand((self.hq * d, H), shard_g),                      # row-parallel
                "gu": rand((H, 2 * self.ffn), shard_g),                    # column-parallel
                "down": rand((self.ffn, H), shard_g),                      # row-parallel
            })
        self.params = (2 * self.vocab * H + H + a.layers * (
            2 * H + H * (a.heads + 2 * a.kv_heads) * d + a.heads * d * H + 3 * H * a.ffn))

        inv = 1.0 / (a.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        f = torch.outer(torch.arange(self.max_len, device=dev, dtype=torch.float32), inv)
        emb = torch.cat((f, f), dim=-1)
        self.cos, self.sin = emb.cos().to(bf), emb.sin().to(bf)          # [max_len, d]

        shape = (self.batch, self.hkv, self.max_len, d)
        self.k_cache = [torch.zeros(shape, device=dev, dtype=bf) for _ in range(self.layers)]
        self.v_cache = [torch.zeros(shape, device=dev, dtype=bf) for _ in range(self.layers)]
        self.positions = torch.arange(self.max_len, device=dev)
        # Static inputs/outputs of a decode step (what a CUDA graph replays on).
        self.tok = torch.zeros((self.batch, 1), device=dev, dtype=torch.long)
        self.pos = torch.zeros(1, device=dev, dtype=torch.long)
        self.out = torch.zeros((self.batch, 1), device=dev, dtype=torch.long)

    def _qkv(self, h, w):
        b, t, _ = h.shape
        qkv = h @ w["qkv"]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.view(b, t, self.hq, self.d).transpose(1, 2)
        k = k.view(b, t, self.hkv, self.d).transpose(1, 2)
        v = v.view(b, t, self.hkv, self.d).transpose(1, 2)
        return q, k, v

    def _mlp(self, x, w):
        h = rms_norm(x, w["post"])
        gate, up = (h @ w["gu"]).split(self.ffn, dim=-1)
        y = (F.silu(gate) * up) @ w["down"]
        dist.all_reduce(y)
        return x + y

    def _logits_argmax(self, x_last):
        return (rms_norm(x_last, self.norm_f) @ self.lm_head).argmax(-1, keepdim=True)

    @torch.no_grad()
    def prefill(self, prompt):
        """Positions 0..T-1 into the cache; returns the first generated token [b, 1]."""
        b, t = prompt.shape
        x = self.embed[prompt]
        cos, sin = self.cos[:t], self.sin[:t]
        for li, w in enumerate(self.w):
            q, k, v = self._qkv(rms_norm(x, w["in"]), w)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            self.k_cache[li][:, :, :t] = k
            self.v_cache[li][:, :, :t] = v
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(self.rep, dim=1),
                                               v.repeat_interleave(self.rep, dim=1), is_causal=True)
            o = o.transpose(1, 2).reshape(b, t, self.hq * self.d) @ w["o"]
            dist.all_reduce(o)
            x = self._mlp(x + o, w)
        return self._logits_argmax(x[:, -1])

    @torch.no_grad()
    def step(self):
        """One decode step on the static buffers: reads tok and pos, writes the
        next token to out and tok, bumps pos. Fixed shapes (attention over the
        whole cache with a mask), so it can be captured as is."""
        b = self.batch
        x = self.embed[self.tok]                                     # [b, 1, H]
        cos = self.cos.index_select(0, self.pos)                     # [1, d]
        sin = self.sin.index_select(0, self.pos)
        mask = (self.positions <= self.pos).view(1, 1, 1, self.max_len)
        for li, w in enumerate(self.w):
            q, k, v = self._qkv(rms_norm(x, w["in"]), w)             # [b, h, 1, d]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            self.k_cache[li].index_copy_(2, self.pos, k)
            self.v_cache[li].index_copy_(2, self.pos, v)
            # GQA without copying the cache: the query heads sharing a KV head
            # become that head's query rows.
            qg = q.reshape(b, self.hkv, self.rep, self.d)
            o = F.scaled_dot_product_attention(qg, self.k_cache[li], self.v_cache[li], attn_mask=mask)
            o = o.reshape(b, 1, self.hq * self.d) @ w["o"]
            dist.all_reduce(o)
            x = self._mlp(x + o, w)
        nxt = self._logits_argmax(x[:, -1])
        self.out.copy_(nxt)
        self.tok.copy_(nxt)
        self.pos.add_(1)


def capture(model: TPLlama):
    """A CUDA graph of one decode step, or (None, why) when capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):                       # warm-up outside the graph
                model.step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            # thread_local: NCCL's watchdog thread may query events meanwhile.
            ctx = torch.cuda.graph(g, capture_error_mode="thread_local")
        except TypeError:
            ctx = torch.cuda.graph(g)
        with ctx:
            model.step()
        torch.cuda.synchronize()
        return g, None
    except Exception as e:  # noqa: BLE001 - fall back to eager, and say so
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=12.0, help="length of the timed loop")
    ap.add_argument("--graphs", action="store_true", help="replay each decode step as a CUDA graph")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    a = ap.parse_args()

    t_proc = time.monotonic()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=120)    # a lost peer ends the run instead of hanging it
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=dev)
    except TypeError:   # an older torch: no device_id
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout)

    model = TPLlama(a, rank, world, dev)
    g = torch.Generator(device=dev)
    g.manual_seed(0)          # same prompts on every rank
    flag = torch.ones(1, device=dev)

    graph, graph_error = (None, None)
    if a.graphs:
        # NCCL communicators exist before capture (a collective has run).
        dist.all_reduce(flag)
        graph, graph_error = capture(model)
    run_step = graph.replay if graph is not None else model.step

    def request(rep=None):
        prompt = torch.randint(0, a.vocab, (a.batch, a.prompt_tokens), device=dev, generator=g)
        first = model.prefill(prompt)
        first[0, 0].item()
        if rep:
            rep.token(a.batch)
        model.tok.copy_(first)
        model.pos.fill_(a.prompt_tokens)
        for _ in range(a.new_tokens):
            run_step()
            model.out[0, 0].item()
            if rep:
                rep.token(a.batch)

    request()                                     # warm-up
    flag.fill_(1.0)
    dist.all_reduce(flag)                         # both ranks start together
    torch.cuda.synchronize()
    setup_s = time.monotonic() - t_proc
    rep = TPReporter(rank, a.seconds)
    rep.begin()
    print(json.dumps({"w": "tp_decode", "rank": rank, "start": True, "mono": rep.t0, "pid": os.getpid(),
                      "setup_s": round(setup_s, 3)}), flush=True)
    requests = 0
    while True:
        request(rep)
        requests += 1
        # Stop at a request boundary, and on every rank after the same request:
        # a rank that stopped alone would leave its peer in a collective.
        flag.fill_(0.0 if rep.done() else 1.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0.0:
            break
    gaps = sorted(rep.gaps)
    all_max = gaps[-1] if gaps else None
    p99 = gaps[int(0.99 * (len(gaps) - 1))] if gaps else None
    rep.finish(rank=rank, world=world, mode="graphs" if a.graphs else "eager", graph=graph is not None,
               graph_error=graph_error, params=model.params, batch=a.batch, prompt_tokens=a.prompt_tokens,
               new_tokens=a.new_tokens, requests=requests,
               max_gap_ms=None if all_max is None else round(all_max * 1e3, 3),
               p99_gap_ms=None if p99 is None else round(p99 * 1e3, 3),
               median_gap_ms=round(gaps[len(gaps) // 2] * 1e3, 3) if gaps else None,
               torch_reserved=torch.cuda.memory_reserved(dev), torch_allocated=torch.cuda.memory_allocated(dev))
    # Both ranks left their last collective together; skip NCCL teardown, which
    # hung after a graph capture on this kind of machine before.
    os._exit(0)


if __name__ == "__main__":
    main()
