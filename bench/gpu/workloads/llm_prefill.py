#!/usr/bin/env python3
"""llm_prefill: batched forward passes of a small Llama, no gradients.

The llm_common.py model (random weights, bf16), --batch sequences of --seq
tokens per step (logits for every position, as a scoring pass computes them),
torch.cuda.synchronize() after each step. Compute-bound. Unit: sequences/s.
"""
import torch

from common import parser, run_steps, wait_go
from llm_common import add_model_args, build_llama


def main():
    ap = parser(__doc__)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    a = ap.parse_args()
    wait_go(a)
    model, cfg, params = build_llama(a)
    dev = torch.device("cuda")
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=dev)

    @torch.no_grad()
    def step():
        model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()

    run_steps(a, "llm_prefill", "sequences/s", step, units=a.batch, warmup=2,
              params=params, batch=a.batch, seq=a.seq)


if __name__ == "__main__":
    main()
