#!/usr/bin/env python3
"""lstm_train: a recurrent language model trained on cuDNN's LSTM kernels.

Token embedding, an nn.LSTM of --layers layers and --hidden units (cuDNN's
persistent and per-step RNN kernels, not GEMMs launched from Python), and an
LM head, trained with Adam in fp32 on random token sequences of --seq tokens,
batch --batch. Gradients are clipped by norm (clip_grad_norm_ reduces on the
GPU) and every step reads its loss back (.item()). Unit: steps/s.
"""
import torch
import torch.nn as nn

from common import parser, run_steps, wait_go


class LM(nn.Module):
    def __init__(self, vocab, hidden, layers):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        y, _ = self.rnn(self.emb(x))
        return self.head(y)


def main():
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    wait_go(a)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = LM(a.vocab, a.hidden, a.layers).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)

    def step():
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss = nn.functional.cross_entropy(model(x).reshape(-1, a.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    run_steps(a, "lstm_train", "steps/s", step, batch=a.batch, seq=a.seq, hidden=a.hidden,
              layers=a.layers)


if __name__ == "__main__":
    main()
