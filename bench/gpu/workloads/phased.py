#!/usr/bin/env python3
"""phased: training with periodic evaluation, as a fine-tuning job runs.

A small transformer language model (token embedding, --layers
nn.TransformerEncoderLayer of width --width, causal mask, LM head over
--vocab tokens; random data) trained with AdamW under bf16 autocast for
--train-s seconds, then evaluated under torch.no_grad() and model.eval() for
--eval-s seconds, repeated. Every step reads its loss back (.item()). The JSON
lines carry "phase": "train" or "eval" (an interval ends where the phase
changes). Unit: steps/s (a train step and an eval step each count one).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import Reporter, parser, ready_start, wait_go


class LM(nn.Module):
    def __init__(self, vocab, width, layers, heads, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        h = self.enc(h, mask=self.mask, is_causal=True)
        return self.head(h)


def lm_arguments(ap, layers: int) -> None:
    """The LM's shape and its batch, as options."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)


def lm_setup(a):
    """On the GPU, from lm_arguments' options: the LM, its AdamW optimizer,
    a batch of random tokens and the next-token loss of logits for it."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = LM(a.vocab, a.width, a.layers, a.heads, a.seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
    x, y = ids[:, :-1], ids[:, 1:]

    def loss_of(logits):
        return F.cross_entropy(logits.reshape(-1, a.vocab).float(), y.reshape(-1))
    return model, opt, x, loss_of


def main():
    ap = parser(__doc__)
    lm_arguments(ap, layers=6)
    ap.add_argument("--train-s", type=float, default=3.0)
    ap.add_argument("--eval-s", type=float, default=1.5)
    a = ap.parse_args()
    wait_go(a)
    model, opt, x, loss_of = lm_setup(a)

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model(x))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    @torch.no_grad()
    def eval_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_of(model(x)).item()

    for _ in range(2):
        model.train()
        train_step()
        model.eval()
        eval_step()
    model.train()
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter("phased", "steps/s", a.seconds)
    rep.begin("train")
    period = a.train_s + a.eval_s
    phase = "train"
    while not rep.done():
        want = "train" if rep.now() % period < a.train_s else "eval"
        if want != phase:
            phase = want
            model.train(phase == "train")
            rep.set_phase(phase)
        if phase == "train":
            train_step()
        else:
            eval_step()
        rep.add(1)
    rep.finish(layers=a.layers, width=a.width, batch=a.batch, seq=a.seq, train_s=a.train_s, eval_s=a.eval_s)


if __name__ == "__main__":
    main()
