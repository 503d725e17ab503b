#!/usr/bin/env python3
"""loader_train: image classification training fed by a DataLoader, with AMP's loss scaling.

torchvision ResNet-18 (--arch) in channels_last, trained with SGD under fp16
autocast and a GradScaler (its step reads the found-inf flag back: a
synchronize per step). Batches come from a torch DataLoader with --workers
worker processes decoding synthetic uint8 images on the CPU (random crops and
flips, as a real input pipeline does), pinned, copied with non_blocking=True
and normalized on the GPU. Unit: steps/s.
"""
import torch
import torchvision

from common import parser, run_steps, wait_go


class Images(torch.utils.data.IterableDataset):
    def __init__(self, batch, size):
        self.batch, self.size = batch, size

    def __iter__(self):
        gen = torch.Generator().manual_seed(torch.utils.data.get_worker_info().id
                                            if torch.utils.data.get_worker_info() else 0)
        src = torch.randint(0, 256, (64, 3, self.size + 32, self.size + 32), dtype=torch.uint8,
                            generator=gen)
        while True:
            pick = torch.randint(0, src.shape[0], (self.batch,), generator=gen)
            ox, oy = torch.randint(0, 33, (2,), generator=gen).tolist()
            x = src[pick, :, oy:oy + self.size, ox:ox + self.size]
            if torch.rand((), generator=gen) < 0.5:
                x = x.flip(-1)
            y = torch.randint(0, 1000, (self.batch,), generator=gen)
            yield x.contiguous(), y


def main():
    ap = parser(__doc__)
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--size", type=int, default=160)
    ap.add_argument("--workers", type=int, default=3)
    a = ap.parse_args()
    loader = torch.utils.data.DataLoader(Images(a.batch, a.size), batch_size=None,
                                         num_workers=a.workers, pin_memory=True,
                                         prefetch_factor=4, persistent_workers=True)
    batches = iter(loader)
    next(batches)       # workers started before the GPU is touched, as a real script does
    wait_go(a)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = getattr(torchvision.models, a.arch)(num_classes=1000).to(dev)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255

    def step():
        x, y = next(batches)
        x = x.to(dev, non_blocking=True).float().sub_(mean).div_(std)
        x = x.contiguous(memory_format=torch.channels_last)
        y = y.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    run_steps(a, "loader_train", "steps/s", step, warmup=8,
              arch=a.arch, batch=a.batch, size=a.size, workers=a.workers)


if __name__ == "__main__":
    main()
