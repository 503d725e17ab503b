#!/usr/bin/env python3
"""End-to-end throughput of a small training step and an inference loop.

  train   4 x Linear(4096, 4096) + GELU MLP, batch 512, bf16 autocast, AdamW;
          loss.item() every step (as a training loop logs it)
  infer   8 TransformerEncoder layers (d=1024, 16 heads), batch 8 x 128 tokens,
          bf16, no grad; argmax().item() every step (a decode step's sync)

Prints one JSON line: steps/s over --seconds after --warmup seconds.
"""
import argparse
import json
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["train", "infer"])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if a.kind == "train":
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(512, 4096, device=dev)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()
    else:
        layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
        model = model.to(dev, torch.bfloat16).eval()
        x = torch.randn(8, 128, 1024, device=dev, dtype=torch.bfloat16)

        def step():
            with torch.no_grad():
                return model(x).argmax().item()
    t0 = time.monotonic()
    while time.monotonic() - t0 < a.warmup:
        step()
    n, t1 = 0, time.monotonic()
    while time.monotonic() - t1 < a.seconds:
        step()
        n += 1
    dt = time.monotonic() - t1
    print(json.dumps({"label": a.label, "kind": a.kind, "pid": os.getpid(),
                      "steps_per_s": round(n / dt, 2),
                      "sm_limit": os.environ.get("CUDA_DEVICE_SM_LIMIT"),
                      "memory_limit": os.environ.get("CUDA_DEVICE_MEMORY_LIMIT")}), flush=True)


if __name__ == "__main__":
    main()
