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
import torch.nn.functional as F

from common import Reporter, parser, ready_start, wait_go
from phased import LM, lm_arguments


def main():
    ap = parser(__doc__)
    lm_arguments(ap, layers=4)
    ap.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    wait_go(a)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = LM(a.vocab, a.width, a.layers, a.heads, a.seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fwd = torch.compile(model, mode=a.mode)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(x)
        loss = F.cross_entropy(logits.reshape(-1, a.vocab).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter("compiled_train", "steps/s", a.seconds)
    rep.begin()
    while not rep.done():
        step()
        rep.add(1)
    rep.finish(layers=a.layers, width=a.width, batch=a.batch, seq=a.seq, mode=a.mode)


if __name__ == "__main__":
    main()
