"""fp8 base weights (issue 49): flame's linear over an fp8 weight (e4m3fn codes decoded in the GEMM's
main loop, per-output-channel scales) against flame's bf16 linear, PyTorch's bf16 F.linear (cuBLAS)
and ``torch._scaled_mm`` (W8A8: activations quantised per row, fp8 x fp8 tensor cores) where
PyTorch has it, at Flux's linear shapes, on one card, in one process.

Problems: ``fwd`` = y = x W^T (``linear_``), ``dx`` = dY W (``matmul_``; the input gradient of a
frozen layer under LoRA). Rows: ``flame bf16``, ``flame fp8`` (flame's own route, ``_fp8_route``),
``flame fp8 inline`` (codes decoded in the main loop: the TMA kernel on Hopper), ``... inline
portable`` (the pointer kernel, what cards before Hopper run), ``flame fp8 dequant`` (a dequantised
copy, then the bf16 GEMM), ``torch bf16``; fwd only: ``torch _scaled_mm`` (the GEMM of
already-quantised operands) and ``+ quant x`` (PyTorch quantising x per row first), ``flame w8a8``
(the route under FLAME_FP8_GEMM=w8a8: x quantised per row by flame's kernel, then the fp8 x fp8
Gluon product) and ``flame w8a8 product`` (that product alone, on codes quantised beforehand); and
the quantisation of x alone (ms, GB/s). Each row: median ms of CUDA-graph replays, TFLOP/s, speed
over flame bf16, and the relative RMS error against an fp32 product on the dequantised weight (the
W8A8 rows also carry the activations' rounding). Writes ``fp8.jsonl`` under ``--out`` (default $OUT or .).

    PYTHONPATH=. python3 scripts/bench_fp8.py
    PYTHONPATH=. python3 scripts/bench_fp8.py --shapes 4608x3072x3072 --rep 200
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: F401  (first: puts the checkout on sys.path and selects the backend)
import torch

import flame
import flame.kernels.matmul as KM
import flame.kernels.matmul_hopper as KH
from flame.autotune import graph_time_ms
from flame.kernels.quant import quantize_rows_
from flame.ops.quant import quantize_fp8

E4M3 = torch.float8_e4m3fn
# (M, K, N) of x (M, K) @ W (N, K)^T: Flux's single-block token count, the attention projections,
# the MLP up- and down-projections
SHAPES = [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 12288, 3072)]


def _rel_rms(got, want):
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


def _rows_fwd(x, q, w16):
    """(name, fn returning the output) of the forward problem, flame bf16 first (the baseline)."""
    M, N = x.shape[0], w16.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    rows = [("flame bf16", lambda: KM.linear_(out, x, w16))]
    rows += _fp8_rows(lambda: KM.linear_(out, x, q._data, w_scale=q.scale))
    rows.append(("torch bf16", lambda: torch.nn.functional.linear(x, w16)))
    if hasattr(torch, "_scaled_mm"):
        xs = x.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 448
        xq = (x.float() / xs).to(E4M3)
        wq, ws = q._data, q.scale[None, :]
        rows.append(("torch _scaled_mm", lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                                  out_dtype=torch.bfloat16)))

        def quantised_x():
            s = x.abs().amax(1, keepdim=True).float().clamp_min(1e-12) / 448
            return torch._scaled_mm((x.float() / s).to(E4M3), wq.t(), scale_a=s, scale_b=ws,
                                    out_dtype=torch.bfloat16)
        rows.append(("torch _scaled_mm + quant x", quantised_x))
    rows.append(("flame w8a8", lambda: KM.linear_(out, x, q._data, w_scale=q.scale, w8a8=True)))
    rows.append(("flame w8a8 product", _w8a8_product(out, x, q)))
    return rows


def _w8a8_product(out, x, q):
    """The fp8 x fp8 product of the W8A8 route alone (``matmul_hopper``, both scales in its
    epilogue), on x's codes quantised once beforehand: the route's time less its quantisation of x."""
    M, K = x.shape
    N = q.shape[0]
    codes, scales = torch.empty(M, K, dtype=E4M3, device=x.device), torch.empty(M, device=x.device)
    quantize_rows_(codes, scales, x, exact=False)
    f = KM.Fusion(b_scale=q.scale)
    cfg = KH._choose(M, N, K, speed=2)
    return lambda: KH.matmul(out, codes, q._data, M, N, K, f, (True, True, K, K, N), cfg, a_scale=scales)


def _quantise_row(x, spec, rep):
    """The W8A8 route's first step alone: x's rows quantised to e4m3 codes and scales, its time and
    memory throughput (x read, codes and scales written)."""
    M, K = x.shape
    codes, scales = torch.empty(M, K, dtype=E4M3, device=x.device), torch.empty(M, device=x.device)
    ms = graph_time_ms(lambda: quantize_rows_(codes, scales, x, exact=False), rep)
    gbps = (x.numel() * x.element_size() + codes.numel() + 4 * M) / (ms * 1e-3) / 1e9
    print(f"{'quantise x ' + spec:<28} {'flame quantize_rows_':<32} {ms:>8.3f} {gbps:>8.0f} GB/s")
    return dict(problem="quantise", M=M, K=K, row="flame quantize_rows_", ms=ms, gbps=gbps)


def _rows_dx(g, q, w16):
    M, K = g.shape[0], w16.shape[1]
    out = torch.empty(M, K, dtype=torch.bfloat16, device=g.device)
    return ([("flame bf16", lambda: KM.matmul_(out, g, w16))]
            + _fp8_rows(lambda: KM.matmul_(out, g, q._data, b_scale=q.scale)) + [("torch bf16", lambda: g @ w16)])


def _fp8_rows(fn):
    """flame's fp8 GEMM ``fn`` on its own route (``_fp8_route``), forced inline (TMA kernel, and the
    pointer kernel that cards before Hopper run) and forced through a dequantised copy."""
    return [("flame fp8", fn), ("flame fp8 inline", _with(fn, FP8_ROUTE="inline")),
            ("flame fp8 inline portable", _with(fn, FP8_ROUTE="inline", TMA=False)),
            ("flame fp8 dequant", _with(fn, FP8_ROUTE="dequant"))]


def _with(fn, **settings):
    """``fn`` run with ``flame.kernels.matmul``'s module settings changed for the call."""
    def run():
        was = {k: getattr(KM, k) for k in settings}
        for k, v in settings.items():
            setattr(KM, k, v)
        try:
            return fn()
        finally:
            for k, v in was.items():
                setattr(KM, k, v)
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=[f"{m}x{k}x{n}" for m, k, n in SHAPES], help="MxKxN")
    ap.add_argument("--rep", type=int, default=100, help="ms of graph replays per row")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if flame.is_interpreter():
        sys.exit("bench_fp8.py needs a CUDA GPU")
    torch.manual_seed(0)
    records = []
    print(f"{'problem':<28} {'row':<32} {'ms':>8} {'TFLOP/s':>8} {'x bf16':>7} {'rel err':>9}")
    for spec in args.shapes:
        M, K, N = (int(v) for v in spec.split("x"))
        w = torch.randn(N, K, device="cuda") / K ** 0.5
        q = quantize_fp8(flame.from_torch(w))
        wd = q._data.float() * q.scale[:, None]
        w16 = wd.bfloat16()
        x = torch.randn(M, K, device="cuda").bfloat16()
        g = torch.randn(M, N, device="cuda").bfloat16()
        problems = {"fwd": (_rows_fwd(x, q, w16), x.float() @ wd.t()),
                    "dx": (_rows_dx(g, q, w16), g.float() @ wd)}
        for problem, (rows, ref) in problems.items():
            times = {}
            for name, fn in rows:
                try:
                    got = fn()  # compiles outside the graph capture
                    err = _rel_rms(got, ref)
                    ms = graph_time_ms(fn, args.rep)
                except Exception as e:  # an experiment row that does not build: reported, not fatal
                    print(f"{problem} {spec:<24} {name:<32} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                times[name] = ms
                base = times.get("flame bf16")
                tflops = 2 * M * N * K / (ms * 1e-3) / 1e12 if ms else float("nan")
                ratio = base / ms if base and ms else float("nan")
                print(f"{problem + ' ' + spec:<28} {name:<32} {ms or float('nan'):>8.3f} {tflops:>8.1f} "
                      f"{ratio:>7.2f} {err:>9.2e}")
                records.append(dict(problem=problem, M=M, K=K, N=N, row=name, ms=ms, tflops=tflops, rel_err=err,
                                    speed_over_flame_bf16=ratio))
        records.append(_quantise_row(x, spec, args.rep))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "fp8.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
