#!/usr/bin/env python3
"""Sweep launch parameters of the foundation kernels (contiguous map, strided map, row reduce) on
one GPU, to pick the heuristics in flame/kernels/{elementwise,reduce}.py. Prints one table.

    PYTHONPATH=. python3 scripts/sweep_basic.py
"""
# ruff: noqa: B023, E501
# (each lambda is timed before its loop moves on; table lines are long)
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# isort: off
import flame  # noqa: F401 - first: selects the backend before triton is imported
import torch
import triton
import triton.language as tl
import triton.testing
# isort: on

from flame.kernels import elementwise as KE
from flame.kernels import reduce as KR
from flame.kernels.launch import launch


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    m = n = 4096
    for dt in (torch.bfloat16, torch.float32):
        es = torch.empty((), dtype=dt).element_size()
        a = torch.randn(m, n, device="cuda", dtype=dt)
        b = torch.randn(m, n, device="cuda", dtype=dt)
        row = torch.randn(n, device="cuda", dtype=dt)
        out = torch.empty_like(a)
        print(f"== {dt}: torch add {bench(lambda: a + b):.1f} us, mul-bcast {bench(lambda: a * row):.1f} us, "
              f"sum(-1) {bench(lambda: a.sum(-1)):.1f} us")
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                us = bench(lambda: launch(KE._map_contiguous_kernel, (triton.cdiv(m * n, block),), out, a, b, out,
                                          m * n, 0.0, 0.0, NIN=2, OP=KE.ADD.value, CD=tl.float32, OUT_BOOL=False,
                                          WIDE=False, BLOCK=block, num_warps=warps))
                print(f"add contiguous BLOCK={block:5d} warps={warps:2d}: {us:7.1f} us {3 * m * n * es / us / 1e3:6.0f} GB/s")
        rb = row.expand(m, n)
        for bc in (256, 512, 1024, 2048):
            for br in (1, 2, 4, 8, 16):
                for warps in (4, 8):
                    us = bench(lambda: launch(KE._map_strided_kernel, (triton.cdiv(m, br), triton.cdiv(n, bc)), out, a, rb,
                                              out, 0.0, 0.0, m, 1, m, n, 0, 0, n, 1, 0, 0, n, 1, 0, 0, 0, 1, 0, 0, 0, 0,
                                              NIN=2, OP=KE.MUL.value, CD=tl.float32, OUT_BOOL=False, WIDE=False,
                                              BLOCK_R=br, BLOCK_C=bc, num_warps=warps))
                    print(f"mul strided BLOCK_R={br:2d} BLOCK_C={bc:4d} warps={warps}: {us:7.1f} us "
                          f"{2 * m * n * es / us / 1e3:6.0f} GB/s")
        s = torch.empty(m, device="cuda", dtype=dt)
        for br in (512, 1024, 2048, 4096):
            for warps in (2, 4, 8, 16):
                us = bench(lambda: launch(KR._reduce_kernel, (m, 1, 1), a, s, a, n, 1, n, 1, 1.0, n, 1, 0,
                                          OP=KR.SUM.value, CD=tl.float32, IDENT=0.0, BLOCK_R=br, BLOCK_I=1,
                                          num_warps=warps))
                print(f"sum(-1) row BLOCK_R={br:5d} warps={warps:2d}: {us:7.1f} us {m * n * es / us / 1e3:6.0f} GB/s")


if __name__ == "__main__":
    main()
