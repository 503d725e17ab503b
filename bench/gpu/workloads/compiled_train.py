#!/usr/bin/env python3
"""compiled_train: a transformer LM trained under torch.compile.

The language model of phased.py (token embedding, --layers
nn.TransformerEncoderLayer of width --width, causal mask, LM head) wrapped in
torch.compile (--mode: "default" runs Inductor's fused Triton kernels,
"reduce-overhead" also replays them as CUDA graphs), trained with AdamW under
bf16 autocast on random tokens. Compilation happens in the warm-up, before
the timed loop, as a real job pays it once at start. Every step reads its
loss back (.item()). Unit: steps/s.
"""
import torch

from common import parser, run_steps, wait_go
from phased import lm_arguments, lm_setup


def main():
    ap = parser(__doc__)
    lm_arguments(ap, layers=4)
    ap.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    wait_go(a)
    model, opt, x, loss_of = lm_setup(a)
    fwd = torch.compile(model, mode=a.mode)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(x)
        loss = loss_of(logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    run_steps(a, "compiled_train", "steps/s", step, warmup=a.warmup,
              layers=a.layers, width=a.width, batch=a.batch, seq=a.seq, mode=a.mode)


if __name__ == "__main__":
    main()
