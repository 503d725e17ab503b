#!/usr/bin/env python3
"""bert_infer: an encoder serving batches, as a classification or embedding service runs.

A transformers BertModel built from a BertConfig (llm_common.build: random weights; base size by
default: hidden 768, 12 layers, 12 heads), fp16, no grad. Each step encodes a
batch of --batch sequences of --seq tokens with a padding mask, pools the
first token and reads the pooled vectors' argmax back to the host (.tolist():
a synchronize per batch). GPU-bound. Unit: sequences/s.
"""
import torch

from common import parser, run_steps, wait_go
from llm_common import build   # before transformers: it sets the offline environment
from transformers import BertConfig, BertModel  # noqa: E402


def main():
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    a = ap.parse_args()
    wait_go(a)
    cfg = BertConfig(hidden_size=a.hidden, num_hidden_layers=a.layers,
                     num_attention_heads=max(1, a.hidden // 64), intermediate_size=4 * a.hidden)
    model, params = build(BertModel, cfg, dtype=torch.float16)
    dev = torch.device("cuda")
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=dev)
    lengths = torch.randint(a.seq // 4, a.seq + 1, (a.batch, 1), device=dev)
    mask = (torch.arange(a.seq, device=dev)[None, :] < lengths).long()

    @torch.no_grad()
    def step():
        out = model(input_ids=ids, attention_mask=mask)
        return out.last_hidden_state[:, 0].argmax(-1).tolist()

    run_steps(a, "bert_infer", "sequences/s", step, units=a.batch,
              params=params, batch=a.batch, seq=a.seq)


if __name__ == "__main__":
    main()
