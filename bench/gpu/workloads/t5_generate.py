#!/usr/bin/env python3
"""t5_generate: an encoder-decoder model answering requests with generate().

A transformers T5ForConditionalGeneration built from a T5Config (llm_common.build:
random weights; t5-small's shape by default), bf16. Each request encodes a
batch of --batch prompts of --prompt tokens and decodes --new tokens greedily
with Hugging Face's generate() (KV cache, cross-attention, its own stopping
check each step, which reads a flag back: a synchronize per token). Unit:
generated tokens/s.
"""
import torch

from common import parser, run_requests, wait_go
from llm_common import build   # before transformers: it sets the offline environment
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402


def main():
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    a = ap.parse_args()
    wait_go(a)
    cfg = T5Config(d_model=a.d_model, d_ff=4 * a.d_model, num_layers=a.layers,
                   num_decoder_layers=a.layers, num_heads=max(1, a.d_model // 64),
                   decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    model, params = build(T5ForConditionalGeneration, cfg, dtype=torch.bfloat16)
    dev = torch.device("cuda")
    ids = torch.randint(2, cfg.vocab_size, (a.batch, a.prompt), device=dev)

    @torch.no_grad()
    def request(rep):
        out = model.generate(input_ids=ids, max_new_tokens=a.new, min_new_tokens=a.new,
                             do_sample=False, num_beams=1)
        if rep is not None:
            rep.add(a.batch * (out.shape[1] - 1))

    run_requests(a, "t5_generate", "tokens/s", request, params=params, batch=a.batch,
                 prompt=a.prompt, new=a.new)


if __name__ == "__main__":
    main()
