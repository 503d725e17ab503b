#!/usr/bin/env python3
"""cnn_train: torchvision ResNet training, as a plain PyTorch loop would run it.

ResNet-50 (random weights, 1000 classes), batch 64 of random 224x224 images
copied from pinned host memory each step (as a data loader hands them over),
bf16 autocast, SGD with momentum, cudnn.benchmark (its autotuning happens in
the warm-up, once, as in real life). --sync-every K: loss.item() every K
steps (1: every step, as loops that log the loss do; 0: never, the host runs
ahead until the launch queue fills). Unit: steps/s (one step = one batch).
"""
import torch
import torch.nn.functional as F
import torchvision

from common import Reporter, parser, ready_start, wait_go


def main():
    ap = parser(__doc__)
    ap.add_argument("--arch", default="resnet50", help="any torchvision.models constructor name")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sync-every", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    wait_go(a)
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    model = getattr(torchvision.models, a.arch)(num_classes=1000).to(dev)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x_host = torch.randn(a.batch, 3, 224, 224).pin_memory()
    y_host = torch.randint(0, 1000, (a.batch,)).pin_memory()

    def step():
        x = x_host.to(dev, non_blocking=True)
        y = y_host.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter("cnn_train", "steps/s", a.seconds)
    rep.begin()
    i = 0
    pending = 0
    while not rep.done():
        loss = step()
        i += 1
        pending += 1
        if a.sync_every and i % a.sync_every == 0:
            loss.item()
            rep.add(pending)
            pending = 0
        elif not a.sync_every:
            rep.add(1)          # issued, not finished: the launch queue bounds the gap
    torch.cuda.synchronize()
    if pending and a.sync_every:
        rep.add(pending)
    rep.finish(arch=a.arch, batch=a.batch, sync_every=a.sync_every)


if __name__ == "__main__":
    main()
