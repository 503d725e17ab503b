#!/usr/bin/env python3
"""unet_sample: a latent-diffusion sampler making images batch after batch.

A convolutional UNet written in PyTorch (residual blocks with GroupNorm, SiLU
and a timestep embedding; self-attention at the lowest resolution; skips
from the down path to the up path; --channels at the top, three levels),
fp16, channels_last, random weights. Each request denoises a batch of
--batch latents (4 x --size x --size) over --steps DDIM steps (the step's
coefficients computed on the host, as schedulers do), decodes them to RGB at
4x the latent size with a small convolutional decoder, and copies the images
to the host: one synchronize per batch, none between the steps, so the
launch queue holds the denoising loop's work. Unit: images/s.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import parser, run_requests, wait_go


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, temb):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(temb, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, e):
        h = self.c1(F.silu(self.n1(x))) + self.t(e)[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class Attention(nn.Module):
    def __init__(self, c, heads=8):
        super().__init__()
        self.norm, self.heads = nn.GroupNorm(32, c), heads
        self.qkv, self.out = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        o = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.out(o.transpose(-1, -2).reshape(b, c, h, w))


class UNet(nn.Module):
    def __init__(self, ch=128, mult=(1, 2, 4), latent=4):
        super().__init__()
        temb = 4 * ch
        self.ch = ch
        self.temb = nn.Sequential(nn.Linear(ch, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(latent, ch, 3, padding=1)
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        chans, c = [ch], ch
        for i, m in enumerate(mult):
            for _ in range(2):
                self.down.append(ResBlock(c, ch * m, temb))
                c = ch * m
                chans.append(c)
            if i < len(mult) - 1:
                self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                chans.append(c)
        self.mid1, self.mid_attn, self.mid2 = ResBlock(c, c, temb), Attention(c), ResBlock(c, c, temb)
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for i, m in reversed(list(enumerate(mult))):
            for _ in range(3):
                self.up.append(ResBlock(c + chans.pop(), ch * m, temb))
                c = ch * m
            if i > 0:
                self.upsample.append(nn.Conv2d(c, c, 3, padding=1))
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, latent, 3, padding=1))
        self.levels = len(mult)

    def forward(self, x, t):
        e = self.temb(timestep_embedding(t, self.ch).to(x.dtype))
        h = self.inp(x)
        skips = [h]
        for i in range(self.levels):
            for j in range(2):
                h = self.down[2 * i + j](h, e)
                skips.append(h)
            if i < self.levels - 1:
                h = self.downsample[i](h)
                skips.append(h)
        h = self.mid2(self.mid_attn(self.mid1(h, e)), e)
        for i in range(self.levels):
            for j in range(3):
                h = self.up[3 * i + j](torch.cat([h, skips.pop()], 1), e)
            if i < self.levels - 1:
                h = self.upsample[i](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.out(h)


def decoder(latent=4, ch=128):
    """Latents to RGB at 4x their size: convolutions and two upsamplings."""
    return nn.Sequential(
        nn.Conv2d(latent, ch, 3, padding=1), nn.SiLU(),
        nn.Upsample(scale_factor=2.0), nn.Conv2d(ch, ch, 3, padding=1), nn.SiLU(),
        nn.Upsample(scale_factor=2.0), nn.Conv2d(ch, ch // 2, 3, padding=1), nn.SiLU(),
        nn.Conv2d(ch // 2, 3, 3, padding=1), nn.Tanh())


def main():
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--channels", type=int, default=128)
    a = ap.parse_args()
    wait_go(a)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last
    unet = UNet(a.channels).to(dev).half().eval().to(memory_format=cl)
    vae = decoder(ch=a.channels).to(dev).half().eval().to(memory_format=cl)
    # DDIM over a linear beta schedule of 1000 steps, --steps of them
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0).tolist()
    ts = list(range(999, -1, -1000 // a.steps))[:a.steps]

    @torch.inference_mode()
    def request(rep):
        x = torch.randn(a.batch, 4, a.size, a.size, device=dev, dtype=torch.half).contiguous(memory_format=cl)
        for i, t in enumerate(ts):
            eps = unet(x, torch.full((a.batch,), t, device=dev))
            a_t = abar[t]
            a_prev = abar[ts[i + 1]] if i + 1 < len(ts) else 1.0
            x0 = (x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
            x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
        images = ((vae(x) + 1) * 127.5).clamp(0, 255).to(torch.uint8).cpu()
        if rep is not None:
            rep.add(a.batch)
        return images

    run_requests(a, "unet_sample", "images/s", request, batch=a.batch, size=a.size,
                 steps=a.steps, channels=a.channels,
                 params=sum(p.numel() for p in unet.parameters()))


if __name__ == "__main__":
    main()
