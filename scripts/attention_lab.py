"""Flash-attention variants side by side on one GPU (issue 46): launch configs and code paths of
flame's forward and backward against PyTorch SDPA (cuDNN and flash backends), in one process.

Each variant forces a launch config (``flame.kernels.attention._fwd_config`` / ``_bwd_config``
replaced for its calls, the Hopper route off); ``production`` keeps flame's own choice (on sm_90
the Gluon kernel where it is routed), ``portable`` flame's own config of the portable kernel.
``gluon`` variants launch ``flame.kernels.attention_hopper``'s kernel with their options (pipeline
stages, ping-pong) and check its log-sum-exp too. Every variant is checked
against a float32 reference (error next to cuDNN's own) before it is timed as CUDA-graph replays
(median device time). Compiling costs more than timing: ``--jobs N`` compiles the variants in N
worker processes first (each runs its share once into Triton's on-disk cache), then this process
times them one by one.

    PYTHONPATH=. FLAME_DEVICE=cuda python3 scripts/attention_lab.py --jobs 8 --out /tmp/lab
    PYTHONPATH=. FLAME_DEVICE=cuda python3 scripts/attention_lab.py --only flux   # one shape's variants

Writes ``lab.jsonl`` (one line per variant and baseline) under ``--out``; prints a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: F401  (first: puts the checkout on sys.path and selects the backend)
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flame.kernels.attention as KA
import flame.kernels.attention_hopper as AH
from flame.autotune import graph_time_ms

SHAPES = {  # (B, H, Lq, Lk, D)
    "flux": (1, 24, 4608, 4608, 128),
    "sdxl4k": (1, 10, 4096, 4096, 64),
    "sdxl4k_b4": (4, 10, 4096, 4096, 64),  # SDXL training at batch 4
    "sdxl1k": (1, 20, 1024, 1024, 64),
    "cross4k": (1, 10, 4096, 77, 64),
}


def fwd(bm, bn, warps, stages, tma=True, d=128):
    return dict(BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, M_GROUP=1, SINGLE_KV=False, KV_TMA=tma, num_warps=warps,
                num_stages=stages)


def bwd(kv, dq, d=128):
    """The dK/dV program's (BLOCK_M, BLOCK_N, warps, stages) and the dQ program's."""
    return tuple(dict(BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in (kv, dq))


def gluon(stages=2, pingpong=True, consumers=None):
    """Options of attention_hopper.attention_fwd (consumers None: its FWD_CONSUMERS for the head dim)."""
    return dict(stages=stages, pingpong=pingpong, consumers=consumers)


def gluon_bwd(stages=3):
    """Options of attention_hopper.attention_bwd (its dK/dV and dQ programs in one launch)."""
    return dict(stages=stages)


PORTABLE = "portable"  # a forward "config": flame's own choice with the Hopper route off

# (name, shape, "fwd" | "bwd" | "gluon" | "gbwd", config or None for flame's own choice; "bwd" with
# PORTABLE: the portable kernels); a portable backward variant is also timed without its dQ kernel ("dkdv")
VARIANTS = [
    ("production", "flux", "fwd", None),
    ("portable", "flux", "fwd", PORTABLE),
    ("gluon s2 pingpong", "flux", "gluon", gluon(2, True)),
    ("gluon s2", "flux", "gluon", gluon(2, False)),
    ("gluon s3 pingpong", "flux", "gluon", gluon(3, True)),
    ("64x64 w4 s3", "flux", "fwd", fwd(64, 64, 4, 3)),
    ("128x128 w8 s3", "flux", "fwd", fwd(128, 128, 8, 3)),
    ("128x64 w8 s4", "flux", "fwd", fwd(128, 64, 8, 4)),
    ("128x64 w8 s5", "flux", "fwd", fwd(128, 64, 8, 5)),
    ("128x128 w8 s3 no TMA", "flux", "fwd", fwd(128, 128, 8, 3, tma=False)),
    ("production", "flux", "bwd", None),
    ("portable", "flux", "bwd", PORTABLE),
    ("gluon bwd s2", "flux", "gbwd", gluon_bwd(2)),
    ("gluon bwd s3", "flux", "gbwd", gluon_bwd(3)),
    ("kv32x64w4s4 dq128x64w8s4", "flux", "bwd", bwd((32, 64, 4, 4), (128, 64, 8, 4))),
    ("kv32x64w4s2 dq128x64w8s2", "flux", "bwd", bwd((32, 64, 4, 2), (128, 64, 8, 2))),
    ("kv64x64w4s3 dq128x64w8s3", "flux", "bwd", bwd((64, 64, 4, 3), (128, 64, 8, 3))),
    ("kv16x64w4s3 dq128x64w8s3", "flux", "bwd", bwd((16, 64, 4, 3), (128, 64, 8, 3))),
    ("kv32x128w8s3 dq128x64w8s3", "flux", "bwd", bwd((32, 128, 8, 3), (128, 64, 8, 3))),
    ("kv16x128w8s3 dq128x64w8s3", "flux", "bwd", bwd((16, 128, 8, 3), (128, 64, 8, 3))),
    ("kv64x64w8s3 dq128x64w8s3", "flux", "bwd", bwd((64, 64, 8, 3), (128, 64, 8, 3))),
    ("kv32x64w4s3 dq64x64w4s3", "flux", "bwd", bwd((32, 64, 4, 3), (64, 64, 4, 3))),
    ("kv32x64w4s3 dq128x128w8s2", "flux", "bwd", bwd((32, 64, 4, 3), (128, 128, 8, 2))),
    ("kv32x64w4s3 dq64x32w4s3", "flux", "bwd", bwd((32, 64, 4, 3), (64, 32, 4, 3))),
    ("kv32x64w4s3 dq128x32w8s3", "flux", "bwd", bwd((32, 64, 4, 3), (128, 32, 8, 3))),
    ("production", "sdxl4k", "fwd", None),
    ("portable", "sdxl4k", "fwd", PORTABLE),
    ("128x128 w8 s3", "sdxl4k", "fwd", fwd(128, 128, 8, 3, d=64)),
    ("128x64 w8 s4", "sdxl4k", "fwd", fwd(128, 64, 8, 4, d=64)),
    ("64x128 w4 s3", "sdxl4k", "fwd", fwd(64, 128, 4, 3, d=64)),
    ("64x64 w4 s4 no TMA", "sdxl4k", "fwd", fwd(64, 64, 4, 4, tma=False, d=64)),
    ("64x64 w4 s3", "sdxl4k", "fwd", fwd(64, 64, 4, 3, d=64)),
    *[(name, shape, "gluon", cfg) for shape in ("sdxl4k", "sdxl4k_b4", "sdxl1k") for name, cfg in (
        ("gluon 3 consumers s2", gluon(2)), ("gluon 3 consumers s3", gluon(3)),
        ("gluon 2 consumers s2", gluon(2, consumers=2)))],
    ("production", "sdxl4k", "bwd", None),
    ("portable", "sdxl4k", "bwd", PORTABLE),
    ("gluon bwd s2", "sdxl4k", "gbwd", gluon_bwd(2)),
    ("gluon bwd s3", "sdxl4k", "gbwd", gluon_bwd(3)),
    ("production", "sdxl4k_b4", "fwd", None),
    ("portable", "sdxl4k_b4", "fwd", PORTABLE),
    ("production", "sdxl4k_b4", "bwd", None),
    ("gluon bwd s3", "sdxl4k_b4", "gbwd", gluon_bwd(3)),
    ("gluon bwd s3", "sdxl1k", "gbwd", gluon_bwd(3)),
    ("production", "sdxl1k", "fwd", None),
    ("portable", "sdxl1k", "fwd", PORTABLE),
    ("production", "sdxl1k", "bwd", None),
    ("production", "cross4k", "fwd", None),
    ("production", "cross4k", "bwd", None),
]


class Problem:
    """Inputs of one shape as diffusers makes them ((B, L, H, D) projections viewed as (B, H, L, D)),
    flame's forward outputs under its own config, and (``check``) the fp32 and cuDNN references."""

    def __init__(self, shape, check=True):
        B, H, Lq, Lk, D = self.shape = shape
        gen = torch.Generator(device="cuda").manual_seed(0)

        def make(L):
            return torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=gen).permute(0, 2, 1, 3)

        self.t = [make(Lq), make(Lk), make(Lk)]
        self.g = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        if check:
            self.ref = self._reference(torch.float32, None)
            self.cudnn = self._reference(None, SDPBackend.CUDNN_ATTENTION)
        self.o = torch.empty_like(self.t[0])
        self.lse = torch.empty(B * H, Lq, device="cuda", dtype=torch.float32)
        self.scale = 1 / math.sqrt(D)
        self.forward()

    def _reference(self, dtype, backend):
        ts = [t.detach().to(dtype or t.dtype).requires_grad_() for t in self.t]
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(*ts)
            out.backward(self.g.to(out.dtype))
        return [out.detach()] + [t.grad for t in ts]

    @staticmethod
    def strides(t):
        s = t.stride()
        return s[0], s[1], s[2]

    def forward(self):
        B, H, Lq, Lk, D = self.shape
        q, k, v = self.t
        KA.attention_fwd(q, k, v, self.o, self.lse, *(self.strides(t) for t in (q, k, v, self.o)),
                         B, H, Lq, Lk, D, self.scale, False)
        return self.o

    def gluon_forward(self, cfg):
        """attention_hopper's forward with options ``cfg`` into its own O and lse buffers."""
        B, H, Lq, Lk, D = self.shape
        q, k, v = self.t
        if not hasattr(self, "o_gluon"):
            if not AH.available():
                raise RuntimeError("the Gluon kernel needs an sm_90 GPU and triton.experimental.gluon")
            self.o_gluon, self.lse_gluon = torch.empty_like(self.o), torch.empty_like(self.lse)
        AH.attention_fwd(q, k, v, self.o_gluon, self.lse_gluon, *(self.strides(t) for t in (q, k, v, self.o_gluon)),
                         B, H, Lq, Lk, D, self.scale * KA.LOG2E, **cfg)
        return self.o_gluon

    def lse_reference(self):
        """The base-2 log-sum-exp of the scaled scores in fp32, (B*H, Lq)."""
        if not hasattr(self, "lse_ref"):
            q, k, _ = (t.float() for t in self.t)
            s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            self.lse_ref = (torch.logsumexp(s, -1) * KA.LOG2E).reshape(self.lse.shape)
            del s
        return self.lse_ref

    def backward(self):
        B, H, Lq, Lk, D = self.shape
        q, k, v = self.t
        grads = [torch.empty_like(t) for t in self.t]
        KA.attention_bwd(q, k, v, self.o, self.g, self.lse, *grads,
                         *(self.strides(t) for t in (q, k, v, self.o, self.g, *grads)), B, H, Lq, Lk, D,
                         self.scale, False)
        return grads


def _problem(problems, shape, check):
    if shape not in problems:
        problems[shape] = Problem(SHAPES[shape], check)
    return problems[shape]


def _err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


@contextlib.contextmanager
def _forced(kind, cfg, skip=()):
    """Within it, flame's attention launches of ``kind`` take ``cfg`` (None: flame's own choice;
    PORTABLE: flame's own choice of the portable kernel), the Hopper route stays off unless cfg is
    None, and the kernels named in ``skip`` are not launched."""
    name = "_fwd_config" if kind == "fwd" else "_bwd_config"
    original, launch, route, route_bwd = getattr(KA, name), KA.launch, KA.HOPPER_FWD, KA.HOPPER_BWD
    hopper_bwd, hopper_launch, head_dims = AH.attention_bwd, AH.launch, KA.HOPPER_HEAD_DIMS
    if kind == "gbwd":  # every head dim the kernels serve (a backward variant runs no forward)
        AH.attention_bwd = functools.partial(hopper_bwd, **cfg)
        KA.HOPPER_HEAD_DIMS = {KA.FORWARD: AH.HEAD_DIMS, KA.BACKWARD: AH.HEAD_DIMS}
    elif cfg is not None and cfg != PORTABLE and kind != "gluon":
        if kind == "fwd":
            setattr(KA, name, lambda Lq, Lk, D, BH, dtype: cfg)
        else:  # every query block in one chunk
            setattr(KA, name, lambda Lq, Lk, D, BH, dtype: (cfg[0], cfg[1], -(-Lq // cfg[0]["BLOCK_M"])))
    KA.HOPPER_FWD = route and cfg is None
    KA.HOPPER_BWD = route_bwd and (cfg is None or kind == "gbwd")
    KA.launch = lambda kernel, *args, **kw: None if kernel.__name__ in skip else launch(kernel, *args, **kw)
    AH.launch = lambda kernel, *args, **kw: None if kernel.__name__ in skip else hopper_launch(kernel, *args, **kw)
    KA._route.cache_clear()  # routes are memoised per problem: planned afresh under these settings
    try:
        yield
    finally:
        setattr(KA, name, original)
        KA.launch, AH.launch, AH.attention_bwd = launch, hopper_launch, hopper_bwd
        KA.HOPPER_FWD, KA.HOPPER_BWD, KA.HOPPER_HEAD_DIMS = route, route_bwd, head_dims
        KA._route.cache_clear()


def run_variant(problems, name, shape, kind, cfg, rep_ms, timed=True):
    """One variant's errors against the fp32 reference (and cuDNN's) and its device time; for a
    portable backward, also the time without its dQ kernel (``dkdv_ms``; the Gluon backward's dK/dV and
    dQ programs are one launch); for a Gluon forward, the largest
    difference of its log-sum-exp from the fp32 one (``lse_err``)."""
    p = _problem(problems, shape, timed)
    row = dict(name=name, shape=shape, kind=kind, config=_jsonable(cfg))
    if kind == "gluon":
        fn = lambda: p.gluon_forward(cfg)
    else:
        fn = p.forward if kind == "fwd" else p.backward  # bwd, gbwd
    try:
        with _forced(kind, cfg):
            if kind == "fwd":
                p.o.fill_(float("nan"))
            if kind == "gluon":
                p.gluon_forward(cfg)
                p.o_gluon.fill_(float("nan"))
                p.lse_gluon.fill_(float("nan"))
            got = fn()
            torch.cuda.synchronize()
            if timed:
                back = kind in ("bwd", "gbwd")
                want, cudnn = (p.ref[1:], p.cudnn[1:]) if back else (p.ref[:1], p.cudnn[:1])
                got = got if back else [got]
                row["err"] = [_err(g, r) for g, r in zip(got, want)]
                row["cudnn_err"] = [_err(c, r) for c, r in zip(cudnn, want)]
                if kind == "gluon":
                    row["lse_err"] = float((p.lse_gluon - p.lse_reference()).abs().max())
                row["ms"] = graph_time_ms(fn, rep_ms)
        gluon_bwd_routed = cfg is None and p.shape[4] in KA.HOPPER_HEAD_DIMS[KA.BACKWARD]  # flame's own choice on sm_90
        if timed and kind == "bwd" and not gluon_bwd_routed:
            with _forced(kind, cfg, skip=("_attn_bwd_dq_kernel",)):
                row["dkdv_ms"] = graph_time_ms(fn, rep_ms)
    except Exception as e:  # a config that does not compile or fit: recorded, the sweep goes on
        lines = str(e).strip().splitlines()
        row["error"] = f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"
    finally:
        if kind == "fwd":
            p.forward()  # flame's own forward outputs again, for the backward variants
    return row


def baselines(problems, shape, rep_ms):
    """cuDNN and flash SDPA: forward and forward+backward device times."""
    p = _problem(problems, shape, True)
    rows = []
    for label, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        ts = [t.detach().requires_grad_() for t in p.t]

        def f(backend=backend, ts=ts):
            with sdpa_kernel(backend), torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(*ts)

        def fb(backend=backend, ts=ts):
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(*ts)
                return torch.autograd.grad(out, ts, p.g)

        for kind, fn in (("fwd", f), ("fwd+bwd", fb)):
            try:
                fn()
                rows.append(dict(name=f"torch {label}", shape=shape, kind=kind, ms=graph_time_ms(fn, rep_ms)))
            except Exception as e:
                rows.append(dict(name=f"torch {label}", shape=shape, kind=kind, error=str(e)[:200]))
    return rows


def _jsonable(cfg):
    if cfg is None or isinstance(cfg, str):
        return cfg
    return [{k: str(v) for k, v in c.items()} for c in ((cfg,) if isinstance(cfg, dict) else cfg)]


def flops(shape, kind):
    B, H, Lq, Lk, D = SHAPES[shape]
    return 4 * B * H * Lq * Lk * D * (2.5 if kind in ("bwd", "gbwd") else 3.5 if kind == "fwd+bwd" else 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=0, help="compile the variants in N worker processes first")
    ap.add_argument("--compile-only", action="store_true", help="with --jobs: compile, then exit (time later)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "i/n": run every n-th variant once
    ap.add_argument("--only", default=None, help="comma-separated shapes")
    ap.add_argument("--kinds", default=None, help="comma-separated variant kinds (fwd, bwd, gluon, gbwd)")
    ap.add_argument("--match", default=None, help="only variants whose name matches this regular expression")
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    variants = [v for v in VARIANTS if (args.only is None or v[1] in args.only.split(","))
                and (args.kinds is None or v[2] in args.kinds.split(","))
                and (args.match is None or re.search(args.match, v[0]))]
    problems = {}
    if args.worker:
        i, n = map(int, args.worker.split("/"))
        for v in variants[i::n]:
            run_variant(problems, *v, rep_ms=args.rep_ms, timed=False)
        return
    if args.jobs:
        t0 = time.time()
        cmd = [sys.executable, __file__] + [f"--{a}={getattr(args, a)}" for a in ("only", "kinds", "match")
                                             if getattr(args, a)]
        procs = [subprocess.Popen(cmd + ["--worker", f"{i}/{args.jobs}"]) for i in range(args.jobs)]
        for proc in procs:
            proc.wait()
        print(f"compiled in {time.time() - t0:.0f} s", flush=True)
        if args.compile_only:
            return
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lab.jsonl", "w") as log:
        for shape in dict.fromkeys(v[1] for v in variants):
            for row in baselines(problems, shape, args.rep_ms):
                rows.append(row)
                log.write(json.dumps(row) + "\n")
            for v in (v for v in variants if v[1] == shape):
                row = run_variant(problems, *v, rep_ms=args.rep_ms)
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
    cudnn = {(r["shape"], r["kind"]): r["ms"] for r in rows if r["name"] == "torch cuDNN" and r.get("ms")}
    portable = {(r["shape"], r["kind"]): r["ms"] for r in rows if r["name"] == "portable" and r.get("ms")}
    print(f"{'shape':8} {'kind':7} {'variant':34} {'ms':>7} {'TFLOP/s':>7} {'/cuDNN':>6} {'/port':>6} {'dkdv':>6}  "
          f"err (cuDNN's) [lse err]")
    for r in rows:
        ms = r.get("ms")
        kind = {"gluon": "fwd", "gbwd": "bwd"}.get(r["kind"], r["kind"])
        base = cudnn.get((r["shape"], kind))
        if r["kind"] in ("bwd", "gbwd") and base is None:
            f, fb = cudnn.get((r["shape"], "fwd")), cudnn.get((r["shape"], "fwd+bwd"))
            base = fb - f if f and fb else None
        port = portable.get((r["shape"], kind))
        tf = flops(r["shape"], r["kind"]) / ms * 1e-9 if ms else None
        err = " ".join(f"{e:.1e}" for e in r.get("err", [])) + (" (" + " ".join(
            f"{e:.1e}" for e in r.get("cudnn_err", [])) + ")" if r.get("cudnn_err") else "")
        if "lse_err" in r:
            err += f" [{r['lse_err']:.1e}]"
        print(f"{r['shape']:8} {r['kind']:7} {r['name'][:34]:34} "
              f"{ms if ms else float('nan'):7.3f} {tf if tf else float('nan'):7.0f} "
              f"{ms / base if ms and base else float('nan'):6.2f} {ms / port if ms and port else float('nan'):6.2f} "
              f"{r.get('dkdv_ms', float('nan')):6.3f}  {err} {r.get('error', '')}")

if __name__ == "__main__":
    main()
