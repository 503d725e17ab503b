#!/usr/bin/env python3
"""graph_replay: an MLP's forward pass captured in a CUDA graph and replayed.

--layers blocks of LayerNorm, Linear(--width, --width) and GELU (bf16) on a
fixed [--batch, --width] input, captured once with torch.cuda.CUDAGraph (after
warm-up on a side stream, as PyTorch's recipe has it) and replayed in a loop:
one cuGraphLaunch per replay, the output read back every --sync-every replays
(torch.cuda.synchronize()). Unit: replays/s.
"""
import torch
import torch.nn as nn

from common import Reporter, parser, ready_start, wait_go


def main():
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sync-every", type=int, default=1)
    a = ap.parse_args()
    wait_go(a)
    dev = torch.device("cuda")
    blocks = []
    for _ in range(a.layers):
        blocks += [nn.LayerNorm(a.width), nn.Linear(a.width, a.width), nn.GELU()]
    model = nn.Sequential(*blocks).to(dev, torch.bfloat16).eval()
    static_x = torch.randn(a.batch, a.width, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = model(static_x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter("graph_replay", "replays/s", a.seconds)
    rep.begin()
    k = max(1, a.sync_every)
    while not rep.done():
        for _ in range(k):
            graph.replay()
        torch.cuda.synchronize()
        rep.add(k)
    rep.finish(layers=a.layers, width=a.width, batch=a.batch, sync_every=k,
               kernels_per_replay=3 * a.layers, out_shape=list(static_y.shape))


if __name__ == "__main__":
    main()
