#!/usr/bin/env python3
"""gpt2_decode: sampled decoding with a GPT-2 model, a few streams at once.

A transformers GPT2LMHeadModel built from a GPT2Config (random weights; 12
layers, width 768 by default), fp16. Each request: a --prompt-tokens prompt
for --batch streams, then --new-tokens steps of top-k sampling (temperature,
top-k filter, torch.multinomial) with the KV cache, the sampled tokens read
back every step (.tolist(): a synchronize per step, as a streaming server
does). Launch-bound: small kernels, the host sets the pace. Unit: tokens/s
(batch x steps).
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from common import Reporter, parser, ready_start, wait_go  # noqa: E402


def main():
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=50)
    a = ap.parse_args()
    wait_go(a)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64),
                     n_positions=max(1024, a.prompt_tokens + a.new_tokens))
    torch.manual_seed(0)
    dev = torch.device("cuda")
    with torch.device(dev):
        model = GPT2LMHeadModel(cfg)
    model = model.to(dtype=torch.float16).eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=dev)
    g.manual_seed(0)

    def sample(logits):
        logits = logits.float() / 0.8
        top, idx = logits.topk(a.top_k, dim=-1)
        pick = torch.multinomial(top.softmax(-1), 1, generator=g)
        return idx.gather(-1, pick)

    @torch.no_grad()
    def request(rep=None):
        prompt = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_tokens), device=dev, generator=g)
        out = model(input_ids=prompt, use_cache=True)
        past, tok = out.past_key_values, sample(out.logits[:, -1])
        tok.view(-1).tolist()
        for _ in range(a.new_tokens - 1):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, sample(out.logits[:, -1])
            tok.view(-1).tolist()
            if rep:
                rep.add(a.batch)
                if rep.done():
                    return

    request()
    ready_start(a)
    rep = Reporter("gpt2_decode", "tokens/s", a.seconds)
    rep.begin()
    requests = 0
    while not rep.done():
        request(rep)
        requests += 1
    rep.finish(params=params, batch=a.batch, new_tokens=a.new_tokens, requests=requests)


if __name__ == "__main__":
    main()
