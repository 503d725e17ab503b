#!/usr/bin/env python3
"""gpt2_decode: sampled decoding with a GPT-2 model, a few streams at once.

A transformers GPT2LMHeadModel built from a GPT2Config (llm_common.build:
random weights; 12 layers, width 768 by default), fp16. Each request: a
--prompt-tokens prompt for --batch streams, then --new-tokens tokens of
top-k sampling (temperature, top-k filter, torch.multinomial) with the KV
cache, the sampled tokens read back every step (llm_common.decode: a
synchronize per token, as a streaming server does). Launch-bound: small
kernels, the host sets the pace. Unit: tokens/s (batch x tokens).
"""
import torch

from common import parser, run_requests, wait_go
from llm_common import build, decode   # before transformers: it sets the offline environment
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


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
    model, params = build(GPT2LMHeadModel, cfg, dtype=torch.float16)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(0)

    def sample(logits):
        top, idx = (logits.float() / 0.8).topk(a.top_k, dim=-1)
        return idx.gather(-1, torch.multinomial(top.softmax(-1), 1, generator=g))

    def request(rep):
        prompt = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_tokens), device=dev, generator=g)
        decode(model, prompt, sample, a.new_tokens, rep)

    run_requests(a, "gpt2_decode", "tokens/s", request, params=params, batch=a.batch,
                 new_tokens=a.new_tokens)


if __name__ == "__main__":
    main()
