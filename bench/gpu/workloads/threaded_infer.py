#!/usr/bin/env python3
"""threaded_infer: an image-classification server answering on several threads.

One torchvision model (--arch, ResNet-50 by default) in fp16, channels_last,
shared by --threads Python threads, each with its own CUDA stream, as a
threaded HTTP front end runs inference: each thread classifies a batch of
--batch images and reads the top class back (.tolist(): a synchronize on its
stream), then takes the next. Launches come from several threads at once and
their synchronizes overlap. Unit: images/s over all threads.
"""
import threading

import torch
import torchvision

from common import Reporter, parser, ready_start, wait_go


def main():
    ap = parser(__doc__)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=3)
    a = ap.parse_args()
    wait_go(a)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = getattr(torchvision.models, a.arch)(num_classes=1000).to(dev).half().eval()
    model = model.to(memory_format=torch.channels_last)
    streams = [torch.cuda.Stream() for _ in range(a.threads)]
    inputs = [torch.randn(a.batch, 3, 224, 224, device=dev).half()
              .contiguous(memory_format=torch.channels_last) for _ in range(a.threads)]

    @torch.no_grad()
    def infer(i):
        with torch.cuda.stream(streams[i]):
            return model(inputs[i]).argmax(-1).tolist()

    for i in range(a.threads):
        for _ in range(3):
            infer(i)
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter("threaded_infer", "images/s", a.seconds)
    lock = threading.Lock()
    served = [0] * a.threads

    def serve(i):
        while not rep.done():
            infer(i)
            served[i] += 1
            with lock:
                rep.add(a.batch)

    rep.begin()
    workers = [threading.Thread(target=serve, args=(i,)) for i in range(a.threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    rep.finish(arch=a.arch, batch=a.batch, threads=a.threads, per_thread=served)


if __name__ == "__main__":
    main()
