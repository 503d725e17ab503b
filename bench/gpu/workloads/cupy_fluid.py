#!/usr/bin/env python3
"""cupy_fluid: a pseudo-spectral 2D Navier-Stokes solver in CuPy.

Vorticity on an --n x --n periodic grid (float32): each step takes the
stream function from the vorticity with one FFT and a division in Fourier
space, the velocity and the vorticity's gradient with four inverse FFTs,
the advection term with elementwise kernels and one more FFT, and advances
implicitly in viscosity with the 2/3 dealiasing mask (cuFFT through
cupy.fft, with its plan cache; CuPy's elementwise kernels). Every
--check-every steps the solver reads the largest velocity back to choose its
time step (a CFL check: a synchronize), as simulation codes do. No PyTorch.
Unit: steps/s.
"""
import cupy as cp

from common import Reporter, parser, ready_start, wait_go


def main():
    ap = parser(__doc__)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--check-every", type=int, default=10)
    ap.add_argument("--nu", type=float, default=1e-4)
    a = ap.parse_args()
    wait_go(a)
    n = a.n
    k = cp.fft.fftfreq(n, 1.0 / n).astype(cp.float32)
    kr = cp.fft.rfftfreq(n, 1.0 / n).astype(cp.float32)
    ky, kx = cp.meshgrid(k, kr, indexing="ij")
    ksq = kx * kx + ky * ky
    inv = cp.where(ksq > 0, 1.0 / cp.where(ksq > 0, ksq, 1), 0).astype(cp.float32)
    keep = ((cp.abs(kx) < n / 3) & (cp.abs(ky) < n / 3)).astype(cp.float32)
    ikx, iky = (1j * kx).astype(cp.complex64), (1j * ky).astype(cp.complex64)
    rng = cp.random.default_rng(0)
    smooth = cp.exp(-ksq / (n / 16) ** 2)     # a smooth field to start from
    wh = cp.fft.rfft2(rng.standard_normal((n, n), dtype=cp.float32)) * keep * smooth
    dt = [1e-3]

    def step():
        psih = wh * inv
        u = cp.fft.irfft2(iky * psih, s=(n, n))
        v = cp.fft.irfft2(-ikx * psih, s=(n, n))
        wx = cp.fft.irfft2(ikx * wh, s=(n, n))
        wy = cp.fft.irfft2(iky * wh, s=(n, n))
        adv = cp.fft.rfft2(u * wx + v * wy) * keep
        return (wh - dt[0] * adv) / (1 + dt[0] * a.nu * ksq), u, v

    def cfl(u, v):
        umax = float(cp.sqrt(cp.max(u * u + v * v)))     # read back: a synchronize
        dt[0] = min(1e-3, 0.5 * (2 * cp.pi / n) / max(umax, 1e-6))

    for i in range(20):
        wh, u, v = step()
    cfl(u, v)
    cp.cuda.Device().synchronize()
    ready_start(a)
    rep = Reporter("cupy_fluid", "steps/s", a.seconds)
    rep.begin()
    i = 0
    while not rep.done():
        wh, u, v = step()
        i += 1
        if i % a.check_every == 0:
            cfl(u, v)
        rep.add(1)
    rep.finish(n=n, check_every=a.check_every, cupy=cp.__version__)


if __name__ == "__main__":
    main()
