#!/usr/bin/env python3
"""llm_decode: greedy decoding with a KV cache, as a simple serving loop runs it.

A transformers LlamaForCausalLM (llm_common.py: random weights, bf16). Each
request: one prefill of a --prompt-token prompt, then --new-tokens decode
steps of one token each, the next token read back to the host every step
(.item(): a synchronize per token, as a loop that streams or checks for an
end token does); then the cache is dropped and the next request starts.
Unit: tokens/s (generated tokens, batch x steps).
"""
import torch

from common import Reporter, parser, ready_start, wait_go
from llm_common import add_model_args, build_llama


def main():
    ap = parser(__doc__)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    a = ap.parse_args()
    wait_go(a)
    model, cfg, params = build_llama(a)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(0)

    @torch.no_grad()
    def request(rep=None):
        prompt = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_tokens), device=dev, generator=g)
        out = model(input_ids=prompt, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tok[0, 0].item()
        if rep:
            rep.add(a.batch)
        for _ in range(a.new_tokens - 1):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tok[0, 0].item()
            if rep:
                rep.add(a.batch)
                if rep.done():
                    return

    request()
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter("llm_decode", "tokens/s", a.seconds)
    rep.begin()
    requests = 0
    while not rep.done():
        request(rep)
        requests += 1
    rep.finish(params=params, batch=a.batch, prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens,
               requests=requests)


if __name__ == "__main__":
    main()
