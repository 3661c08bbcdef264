"""Attention routes (kernels/attention.py): which kernels ``plan`` names for a call and why, from its
description alone (an H200's routes on the CPU), every route of the comment block planned, the Gluon
route exactly where attention_hopper.py serves a call, the entry points running the route planned for
their buffers, the memo following ``tune``, and ``FLAME_DEBUG_ROUTES``. The routes' numerics are
tested in test_attention.py."""
import re
from pathlib import Path

import pytest
import torch

import flame
import flame.kernels.attention as KA
import flame.kernels.attention_hopper as AH
from flame import tune
from flame.ops.attention import scaled_dot_product_attention as sdpa
from tests.helpers import DEVICE

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
FWD, BWD = KA.FORWARD, KA.BACKWARD
H200 = dict(tma=True, gluon=True)  # what an H200 with Gluon runs (gpu follows tma)
INTERPRETER = dict(tma=True, gpu=False)  # the interpreter emulates TMA descriptors
FLUX = (1, 24, 4608, 4608, 128)  # B, H, Lq, Lk, D
SDXL = (1, 10, 4096, 4096, 64)
CROSS = (1, 20, 1024, 77, 64)  # SDXL's cross-attention: 77 text tokens


@pytest.fixture(autouse=True)
def _fresh_routes():
    KA._route.cache_clear()
    yield
    KA._route.cache_clear()


def problem(direction, B, H, Lq, Lk, D, dtype=BF16, **kw):
    return KA.AttentionProblem.dense(direction, B, H, Lq, Lk, D, dtype, **kw)


# (direction, route, words of its reason, problem); configs are this process's (the interpreter's on the CPU)
ROUTE_CASES = [
    (FWD, "gluon", "warp-specialised kernel", problem(FWD, *FLUX, **H200)),
    (BWD, "gluon", "dK/dV and dQ kernels", problem(BWD, *FLUX, layout="blhd", **H200)),
    (FWD, "gluon", "head dim 64, 4096 keys", problem(FWD, *SDXL, **H200)),  # its backward stays portable:
    (BWD, "dkdv_dq", "then the dQ program; not Gluon: head dim 64", problem(BWD, *SDXL, **H200)),
    (FWD, "kv_tma", "K/V blocks by TMA; not Gluon: causal", problem(FWD, *SDXL, causal=True, **H200)),
    (FWD, "kv_tma", "not Gluon: a mask", problem(FWD, *FLUX, mask=2, **H200)),
    (BWD, "dkdv_dq", "not Gluon: a mask", problem(BWD, *FLUX, mask=1, **H200)),
    (FWD, "kv_tma", "not Gluon: causal", problem(FWD, *FLUX, causal=True, **H200)),
    (BWD, "dkdv_dq", "not Gluon: causal", problem(BWD, *FLUX, causal=True, **H200)),
    (FWD, "kv_tma", "not Gluon: scale <= 0", problem(FWD, *FLUX, scale=-0.1, **H200)),
    (FWD, "kv_tma", "not Gluon: Lk = 4600 not a positive multiple of 128",
     problem(FWD, 1, 24, 4608, 4600, 128, **H200)),
    (BWD, "dkdv_dq", "not Gluon: Lk = 4600", problem(BWD, 1, 24, 4608, 4600, 128, **H200)),
    (BWD, "dkdv_dq", "not Gluon: do not 16-byte aligned", problem(BWD, *FLUX, **H200)._replace(misaligned=("do",))),
    (FWD, "pointer", "1000 keys < KV_TMA_MIN_KEYS", problem(FWD, 2, 3, 1000, 1000, 128, **H200)),
    (FWD, "pointer", "the interpreter", problem(FWD, *SDXL, **INTERPRETER)),
    (FWD, "pointer", "no TMA here", problem(FWD, *SDXL, tma=False, gpu=True)),  # FLAME_ATTN_TMA=0
    (FWD, "pointer", "head dim 80 not a power of two", problem(FWD, 1, 4, 4096, 4096, 80, **H200)),
    (FWD, "pointer", "K or V not 16-byte aligned", problem(FWD, *FLUX, **H200)._replace(misaligned=("k",))),
    (FWD, "pointer", "int64 offsets", problem(FWD, *SDXL, causal=True, **H200)._replace(wide=True)),
    (FWD, "pointer", "TMA takes 16-bit", problem(FWD, *SDXL, dtype=F32, **H200)),
    (FWD, "short_kv", "77 keys in one block", problem(FWD, *CROSS, **H200)),
    (BWD, "fused_dq", "computes delta and writes dQ", problem(BWD, *CROSS, **H200)),
    (BWD, "dkdv_dq", "no keys", problem(BWD, 1, 2, 4, 0, 8, F32)),
    (FWD, "none", "no query", problem(FWD, 1, 2, 0, 5, 8, F32)),
    (FWD, "none", "no (batch, head) pair", problem(FWD, 0, 2, 4, 5, 8, F32)),
    (BWD, "none", "no (batch, head) pair", problem(BWD, 0, 2, 4, 5, 8, F32)),
]


@pytest.mark.parametrize("direction,route,why,p", ROUTE_CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_plan_names_each_route(direction, route, why, p):
    got = KA.plan(p)
    assert got.kernel == route and why in got.reason, got
    portable = route not in ("gluon", "none")
    assert bool(got.config) == portable and bool(got.grid) == portable, got
    if portable:
        assert got.config["UPCAST"] == (not p.gpu and p.dtype == BF16) and got.config["WIDE"] == p.wide  # from p
    if direction == FWD and portable:
        assert got.config["KV_TMA"] == (route == "kv_tma") and got.config["SINGLE_KV"] == (route == "short_kv")
    if direction == BWD and portable:
        assert got.config["FUSED_DQ"] == (route == "fused_dq") and (got.dq_config is None) == (route == "fused_dq")


def test_every_route_of_the_comment_block_is_planned():
    """The routes listed above ``ROUTES`` in kernels/attention.py are ROUTES, each has a runner, and
    ROUTE_CASES plans every one of them in both directions."""
    source = Path(KA.__file__).read_text()
    start = source.index("# ---- routes: which kernels run an attention call")
    block = source[start:source.index("\nROUTES = ")]
    forward, backward = block.split("\n# Backward:\n")
    listed = {FWD: re.findall(r'^#   "(\w+)"', forward, re.M), BWD: re.findall(r'^#   "(\w+)"', backward, re.M)}
    assert listed == {d: list(names) for d, names in KA.ROUTES.items()}
    assert {d: set(run) for d, run in KA._RUN.items()} == {d: set(names) for d, names in listed.items()}
    assert {(d, r) for d, r, *_ in ROUTE_CASES} == {(d, r) for d, names in listed.items() for r in names}


def _buffers(B, H, L, D, dtype, offset=0):
    """A (B, H, L, D) view of (B, L, H, D) storage (a projection's heads), its base ``offset`` elements in."""
    t = torch.zeros(B * L * H * D + offset, dtype=dtype, device=DEVICE)[offset:]
    return t.view(B, L, H, D).permute(0, 2, 1, 3)


@pytest.mark.parametrize("D,Lk,dtype,scale,causal,masked,k_offset", [
    (128, 256, BF16, 0.1, False, False, 0),
    (64, 128, F16, 0.1, False, False, 0),
    (128, 200, BF16, 0.1, False, False, 0),  # Lk not a multiple of 128
    (96, 256, BF16, 0.1, False, False, 0),
    (128, 256, F32, 0.1, False, False, 0),
    (128, 256, BF16, 0.1, True, False, 0),
    (128, 256, BF16, 0.1, False, True, 0),
    (128, 256, BF16, -0.1, False, False, 0),
    (128, 256, BF16, 0.1, False, False, 4),  # K's base 8 bytes off a 16-byte boundary
])
def test_gluon_route_is_where_attention_hopper_serves(monkeypatch, D, Lk, dtype, scale, causal, masked, k_offset):
    """On an sm_90 GPU with Gluon (here pretended), a forward of real buffers takes the "gluon" route exactly
    when ``attention_hopper.usable`` accepts it and its head dim is in HOPPER_HEAD_DIMS[FORWARD]."""
    monkeypatch.setattr(AH, "available", lambda: True)
    monkeypatch.setattr(KA, "HOPPER_FWD", True)
    B, H, Lq = 1, 2, 64
    q, v = _buffers(B, H, Lq, D, dtype), _buffers(B, H, Lk, D, dtype)
    k = _buffers(B, H, Lk, D, dtype, k_offset)
    st = [t.stride()[:3] for t in (q, k, v)]
    mask = (q, (0, 0, 0, 0), 2) if masked else None
    p = KA._problem(FWD, (("q", q, st[0]), ("k", k, st[1]), ("v", v, st[2])), B, H, Lq, Lk, D, scale, causal, mask,
                    False, KA.HOPPER_FWD)
    serves = AH.usable(q, k, v, *st, Lk, D, scale, causal, mask) and D in KA.HOPPER_HEAD_DIMS[FWD]
    assert p.gluon and (KA.plan(p).kernel == "gluon") == serves, (p, KA.plan(p).reason)


def test_switches_reach_the_problem(monkeypatch):
    """FLAME_ATTN_TMA=0 (TMA_SWITCH) clears ``tma``; FLAME_ATTN_GLUON_BWD=0 (HOPPER_BWD) clears a backward's
    ``gluon`` only: the backward of a Gluon forward then runs the portable kernels."""
    monkeypatch.setattr(AH, "available", lambda: True)
    q = _buffers(1, 2, 256, 128, BF16)
    ops = (("q", q, q.stride()[:3]), ("k", q, q.stride()[:3]), ("v", q, q.stride()[:3]))
    fwd = KA._problem(FWD, ops, 1, 2, 256, 256, 128, 0.1, False, None, False, True)
    bwd = KA._problem(BWD, ops + (("do", q, q.stride()[:3]),), 1, 2, 256, 256, 128, 0.1, False, None, False, False)
    assert fwd.tma and fwd.gluon and not bwd.gluon
    assert (KA.plan(fwd).kernel, KA.plan(bwd).kernel) == ("gluon", "dkdv_dq")
    monkeypatch.setattr(KA, "TMA_SWITCH", False)
    assert not KA._problem(FWD, ops, 1, 2, 256, 256, 128, 0.1, False, None, False, False).tma


def test_kv_tma_route_agrees_with_fwd_config(monkeypatch):
    """On a GPU, the KV_TMA field of ``_fwd_config`` (what the tuning tools and the sm_90 compile check
    read) is the "kv_tma" route's choice for aligned 16-bit operands."""
    monkeypatch.setattr(KA, "KV_TMA", True)
    tune.reset()  # _fwd_config's memo
    try:
        for B, H, Lq, Lk, D in (SDXL, FLUX, CROSS, (1, 4, 4096, 4096, 80), (2, 3, 1000, 1000, 128),
                                (1, 4, 2048, 2048, 64)):
            p = problem(FWD, B, H, Lq, Lk, D, tma=True)
            assert (KA.plan(p).kernel == "kv_tma") == KA._fwd_config(Lq, Lk, D, B * H, BF16)["KV_TMA"], p
    finally:
        tune.reset()


def test_routes_are_memoised_and_follow_tune():
    """One Route per problem until ``tune.override`` or ``tune.reset`` empties the memo; an override
    of the backward's CHUNKS splits the fused route's query blocks."""
    p = problem(FWD, *SDXL, causal=True, **H200)
    first = KA.plan(p)
    assert KA.plan(KA.AttentionProblem(*p)) is first
    with tune.override("attention_fwd", dict(BLOCK_M=16, BLOCK_N=32, M_GROUP=1, num_warps=4, num_stages=1)):
        assert KA.plan(p).config["BLOCK_N"] == 32 and KA.plan(p).grid == (256, 10)
    assert KA.plan(p).config == first.config
    bwd = dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=1, BLOCK_M_DQ=16, BLOCK_N_DQ=16, num_warps_dq=4,
               num_stages_dq=1, CHUNKS=2)
    with tune.override("attention_bwd", bwd):
        chunked = KA.plan(problem(BWD, *CROSS, **H200))
    assert (chunked.kernel, chunked.splits, chunked.per_chunk, chunked.grid) == ("fused_dq", 2, 32, (1, 20, 2))
    assert "2 query chunks of 32 blocks" in chunked.reason


def test_forced_blocks_are_planned_afresh(monkeypatch):
    """While a test forces blocks (FORCE_BLOCKS) plan skips the memo; forced BLOCK_DV splits the value
    columns over grid axis 2 and forced KV_TMA reads K/V through (emulated) descriptors."""
    p = problem(FWD, 1, 1, 40, 70, 512, F16, **INTERPRETER)
    monkeypatch.setattr(KA, "FORCE_BLOCKS", dict(BLOCK_M=16, BLOCK_N=16, BLOCK_DV=256, KV_TMA=True))
    r = KA.plan(p)
    assert (r.kernel, r.splits, r.grid, r.config["BLOCK_DV"]) == ("kv_tma", 2, (3, 1, 2), 256), r
    assert "value columns in 2 slices of 256" in r.reason
    monkeypatch.setattr(KA, "FORCE_BLOCKS", dict(BLOCK_M=16, BLOCK_N=16))
    assert KA.plan(p).kernel == "pointer" and "forced without KV_TMA" in KA.plan(p).reason


@pytest.mark.parametrize("shape,layout,routes,kernels", [
    ((1, 2, 20, 37, 16), "bhld", ("short_kv", "fused_dq"), ["_attn_fwd_kernel", "_attn_bwd_dkdv_kernel"]),
    ((1, 2, 20, 150, 16), "blhd", ("pointer", "dkdv_dq"),
     ["_attn_fwd_kernel", "_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"]),
])
def test_entry_points_plan_their_buffers_and_launch_the_route(monkeypatch, shape, layout, routes, kernels):
    """``attention_fwd``/``attention_bwd`` describe real buffers as ``AttentionProblem.dense`` describes
    their shapes and launch the planned route: its kernels, grids and configs."""
    planned, launched = [], []
    real_plan, real_launch = KA.plan, KA.launch
    monkeypatch.setattr(KA, "plan", lambda p: planned.append((p, real_plan(p))) or planned[-1][1])
    monkeypatch.setattr(KA, "launch", lambda kernel, grid, *args, sig=None, **meta: launched.append(
        (kernel.fn.__name__, grid, meta)) or real_launch(kernel, grid, *args, sig=sig, **meta))
    B, H, Lq, Lk, D = shape
    tq, tk, tv = (_buffers(B, H, L, D, F16).copy_(torch.randn(B, H, L, D)) for L in (Lq, Lk, Lk))
    if layout == "bhld":
        tq, tk, tv = (t.contiguous() for t in (tq, tk, tv))
    q, k, v = (flame.from_torch(t, requires_grad=True) for t in (tq, tk, tv))
    out = sdpa(q, k, v)
    out.backward(flame.from_torch(torch.randn(B, H, Lq, D, device=DEVICE).half()))
    torch.testing.assert_close(out.to_torch(), torch.nn.functional.scaled_dot_product_attention(
        tq.float(), tk.float(), tv.float()).half(), atol=2e-3, rtol=2e-3)
    interpreter = flame.is_interpreter()
    tma = KA.TMA_SWITCH and (interpreter or KA.tma_available())
    device = dict(tma=tma, gpu=not interpreter, layout=layout)
    assert [p for p, _ in planned] == [
        problem(FWD, *shape, F16, gluon=KA.HOPPER_FWD and AH.available(), **device),
        problem(BWD, *shape, F16, gluon=KA.HOPPER_BWD and AH.available(), **device)]
    (_, fwd), (_, bwd) = planned
    assert (fwd.kernel, bwd.kernel) == routes
    assert [name for name, _, _ in launched] == kernels
    assert launched[0][1:] == (fwd.grid, fwd.config) and launched[kernels.index("_attn_bwd_dkdv_kernel")][1:] == (
        bwd.grid, bwd.config)
    if bwd.dq_config is not None:
        assert launched[-1][2] == bwd.dq_config


def test_debug_routes_prints_each_problem_once(monkeypatch, capsys):
    """FLAME_DEBUG_ROUTES=1 (read at import; here switched on directly): one line per distinct
    problem on stderr, naming the direction, the route and why."""
    monkeypatch.setattr(KA, "DEBUG_ROUTES", True)
    monkeypatch.setattr(KA, "_reported", set())
    flux = problem(FWD, *FLUX, **H200)
    for p in (flux, flux, problem(BWD, *SDXL, causal=True, **H200), flux):
        KA.plan(p)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert "forward" in lines[0] and ": gluon," in lines[0] and "warp-specialised" in lines[0], lines
    assert "backward" in lines[1] and "causal" in lines[1] and ": dkdv_dq," in lines[1], lines


@pytest.mark.gpu
def test_gpu_calls_take_the_planned_routes(monkeypatch):
    """On an H200 (bf16, (B, L, H, D) projections): Flux's attention takes "gluon" both ways where Gluon
    is present (else "kv_tma" and "dkdv_dq"), SDXL's self-attention "gluon" forward there (else "kv_tma")
    and "dkdv_dq", its cross-attention "short_kv" and "fused_dq"."""
    if not (KA.TMA_SWITCH and KA.tma_available()):
        pytest.skip("no TMA on this GPU / Triton, or FLAME_ATTN_TMA=0")
    taken = []
    monkeypatch.setattr(KA, "plan", lambda p, real=KA.plan: taken.append(real(p).kernel) or real(p))
    for B, H, Lq, Lk, D in ((1, 4, 4608, 4608, 128), (1, 10, 4096, 4096, 64), (1, 20, 1024, 77, 64)):
        q, k, v = (flame.from_torch(torch.randn(B, L, H, D, device=DEVICE).bfloat16().permute(0, 2, 1, 3),
                                    requires_grad=True) for L in (Lq, Lk, Lk))
        sdpa(q, k, v).backward(flame.from_torch(torch.randn(B, H, Lq, D, device=DEVICE).bfloat16()))
    gluon = AH.available() and KA.HOPPER_FWD
    assert taken == ["gluon" if gluon else "kv_tma", "gluon" if gluon and KA.HOPPER_BWD else "dkdv_dq",
                     "gluon" if gluon else "kv_tma", "dkdv_dq", "short_kv", "fused_dq"], taken
