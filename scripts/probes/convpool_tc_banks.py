"""Shared-memory wavefronts of convpool_tc.cu's forward A loads (the image's words a k-step's eight
32-bit loads read: a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4] for the two m-tiles u) for the
speedrun's two layers, a forward round's (the samples a block stages at once), computed on the CPU
for a few layouts of the staged image (words: a sample's):

  rowmajor   image[c][y][x] at (c·H + y)·W + x;
  padded     at c·CS + y·RS + x: the kernel's, with the launcher's strides (convpool_tc.forward_strides);
  colsplit   each row's even columns, then its odd ones: (c, y, x) at c·CS + y·RS + (x mod 2)·PX + x div 2
             (the v = 1 column then needs its own tap offset: b + v changes parity);
  regions    three column regions a row: region r index i holds column 2i + r (r = 0, 1, 2; the even
             columns from 2 on stored twice), at c·CS + y·RS + r·PX + i: tap (c, a, b) at
             c·CS + a·RS + (b mod 2)·PX + b div 2, and u, v add RS, PX (immediates, as W, 1 today).

A load's wavefronts: the most distinct words any of the 32 banks serves (a word read by several
lanes is one). Lanes (g, t): window group·8 + g (past the plane: window 0, as the kernel), tap
ks·8 + t (+ 4 for the second pair; past TAPS: offset 0). --search tries every stride (PX, RS, CS) up
to 31 words past the least, keeps those whose images fit `--words` a sample, and prints the best.
Usage: python3 scripts/probes/convpool_tc_banks.py [--search] [--words 6500]"""

import argparse

import numpy as np

from graphtrain.kernels import convpool_tc
from graphtrain.kernels.convpool_tc import ConvPoolShape, wavefronts

LAYERS = {"conv0 1→24 5×5 28×28": (1, 28, 5), "conv1 24→32 3×3 12×12": (24, 12, 3)}


def lane_reads(c_in: int, h: int, k: int):
    """(c, y, x − v, v) read by each lane of every A load of one forward round (the samples
    convpool_tc.forward_round_samples models; c counts on across them), as arrays (loads, 4, 32):
    the launcher's forward_a_reads, whose loads run v = 0, 1 innermost, with the column split."""
    reads = convpool_tc.forward_a_reads(c_in, h, h, k, convpool_tc.forward_round_samples(c_in, h, h, k))
    v = np.broadcast_to((np.arange(len(reads)) % 2)[:, None], (len(reads), 32))
    return np.stack([reads[:, 0], reads[:, 1], reads[:, 2] - v, v], axis=1)


def rowmajor(reads, h, w):
    c, y, xb, v = reads.transpose(1, 0, 2)
    return (c * h + y) * w + xb + v


def colsplit(reads, px, rs, cs):
    c, y, xb, v = reads.transpose(1, 0, 2)
    x = xb + v
    return c * cs + y * rs + (x % 2) * px + x // 2


def regions(reads, px, rs, cs):
    c, y, xb, v = reads.transpose(1, 0, 2)
    return c * cs + y * rs + (xb % 2 + v) * px + xb // 2


def least(kind, c_in, h, w):
    """The least strides (PX, RS, CS) that keep the layout one-to-one, and the image's words."""
    half = (w + 1) // 2
    rs = w if kind == "colsplit" else 2 * half + (w - 1) // 2  # regions: 0 and 1 of ⌈W/2⌉, 2 of ⌈W/2⌉ − 1
    return half, rs, h * rs


def search(kind, reads, c_in, h, w, budget):
    px0, rs0, _ = least(kind, c_in, h, w)
    layout = colsplit if kind == "colsplit" else regions
    best = None
    for px in range(px0, px0 + 32):
        low_rs = max(rs0, (px + w // 2) if kind == "colsplit" else 2 * px + (w - 1) // 2)
        for rs in range(low_rs, low_rs + 32):
            for cs in ([h * rs] if c_in == 1 else range(h * rs, h * rs + 32)):
                if c_in * cs > budget:
                    continue
                n = int(wavefronts(layout(reads, px, rs, cs)).sum())
                if best is None or (n, c_in * cs) < best[:2]:
                    best = (n, c_in * cs, px, rs, cs)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--search", action="store_true")
    p.add_argument("--words", type=int, default=6500, help="an image's shared words at most (--search)")
    args = p.parse_args()
    for name, (c_in, h, k) in LAYERS.items():
        reads = lane_reads(c_in, h, k)
        loads = reads.shape[0]
        old = wavefronts(rowmajor(reads, h, h))
        samples = convpool_tc.forward_round_samples(c_in, h, h, k)
        print(f"{name}: {loads} A loads a round of {samples} sample(s)")
        print(f"  rowmajor            image {c_in * h * h:5d} words  {old.sum():5d} wavefronts ({old.mean():.2f} a load)")
        s = ConvPoolShape(c_in, h, h, k, 1)
        c, y, xb, v = reads.transpose(1, 0, 2)
        pad = wavefronts(c * s.channel_stride + y * s.row_stride + xb + v)
        print(f"  padded    launcher  image {c_in * s.channel_stride:5d} words  {pad.sum():5d} wavefronts ({pad.mean():.2f})"
              f"  RS {s.row_stride} CS {s.channel_stride}")
        for kind in ("colsplit", "regions"):
            px, rs, cs = least(kind, c_in, h, h)
            layout = colsplit if kind == "colsplit" else regions
            n = wavefronts(layout(reads, px, rs, cs))
            print(f"  {kind:9} least     image {c_in * cs:5d} words  {n.sum():5d} wavefronts ({n.mean():.2f})"
                  f"  PX {px} RS {rs} CS {cs}")
            if args.search:
                found = search(kind, reads, c_in, h, h, args.words)
                if found:
                    n, words, px, rs, cs = found
                    print(f"  {kind:9} searched  image {words:5d} words  {n:5d} wavefronts ({n / loads:.2f})"
                          f"  PX {px} RS {rs} CS {cs}")


if __name__ == "__main__":
    main()
