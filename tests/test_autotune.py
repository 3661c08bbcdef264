"""scripts/autotune.py through the interpreter: --quick tables that flame.tune loads (GEMM, conv,
attention, norm, softmax, cross-entropy, elementwise and reduce families), resume and --force, the
candidate check, the budget stop and the command line's errors."""
import dataclasses
import importlib.util
import json
import pathlib
import sys
import warnings

import pytest
import torch
import triton

from flame import runtime, tune
from flame.kernels import attention as KA
from flame.kernels import conv2d as KC
from flame.kernels import elementwise as KE
from flame.kernels import matmul as KM
from flame.kernels import norms as KN
from flame.kernels import reduce as KR
from flame.kernels import softmax as KS

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU = runtime.device_name()  # the name --quick tables carry here ("cpu-interpreter")
# the keys of --quick's shapes: linear (24, 16, 40) as forward, dX and dW; two 3x3 convs
MM_KEYS = {(24, 40, 16, 1), (24, 16, 40, 1), (40, 16, 24, 1)}
CONV_KEYS = {(30, 12, 8, 9), (12, 8, 8, 9)}
BAD = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=8, num_warps=4, num_stages=2)  # a --quick candidate
# --quick's attention shapes: 24 queries over 136 keys (the loop over key blocks and a dQ program)
# and, causal, over 9 keys (K/V in one block, dQ fused); 2 heads of dimension 16
ATTN_KEYS = {(24, 136, 16, 2), (24, 9, 16, 2)}
# ... the weight gradients of the two convs: (Co, Ci, N*Ho*Wo, taps)
WGRAD_KEYS = {(12, 8, 30, 9), (8, 8, 12, 9)}
# ... GroupNorm over 1x6x5x7 channels-last (SiLU) and 2x4x3x5 NCHW; LayerNorm 10x24, RMSNorm 7x40
GN_KEYS = {(1, 6, 35, 3, 1), (2, 4, 15, 2, 0)}
LN_KEYS = {(10, 24), (7, 40)}
# ... softmax over 10 rows of 40, log_softmax and cross-entropy over 7 rows of 100
SM_KEYS, CE_KEYS = {(10, 40), (7, 100)}, {(7, 100)}
# ... maps of 1x3x5x7 (add and GELU: 105 dense elements, one key; times a per-channel scale: 3 rows of 35),
# the column sum of 40 x 24 and the row sums of 6 x 100
MAP_KEYS = dict(map_contiguous={(105,)}, map_strided={(3, 35, 0)}, reduce={(1, 40, 24), (6, 100, 1)})


@pytest.fixture(scope="module")
def autotune():
    spec = importlib.util.spec_from_file_location("autotune_script", ROOT / "scripts" / "autotune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _load(path):
    return json.loads(pathlib.Path(path).read_text())


def _keys(doc, kernel, dtype="bfloat16"):
    return {tuple(e["key"]) for e in doc["entries"].get(kernel, {}).get(dtype, [])}


def _table(path, rows, **top):
    doc = dict(format=1, gpu=GPU, triton=triton.__version__, date="2026-11-01", entries=rows)
    doc.update(top)
    path.write_text(json.dumps(doc))
    return path


def _overridden(kernel):
    """The config ``kernel`` runs with under a tune.override now (it answers any key), or None."""
    default = dict.fromkeys(tune.KERNELS[kernel][1], 1)
    cfg = tune.config(kernel, (1,) * len(tune.KERNELS[kernel][0]), "float32", default)
    return None if cfg is default else cfg


def _active(kernel, bad):
    """Whether the launch running now uses ``bad``'s values for ``kernel``."""
    cfg = _overridden(kernel)
    return cfg is not None and all(cfg[f] == v for f, v in bad.items())


def _bad_active():
    """Whether the launch running now is under ``tune.override("matmul", BAD)`` (asked after the
    launch: the first query of a run names its key)."""
    return tune.config("matmul", (1, 1, 1, 1), "float32", dict(BAD, BLOCK_M=1)) == BAD


def _wrap_builds(monkeypatch, autotune, wrap, family="matmul"):
    """The family, each problem's ``build`` replaced by ``wrap(problem, build)``."""
    fam = autotune.FAMILIES[family]

    def fn(ctx, shape):
        return [dataclasses.replace(p, build=wrap(p, p.build)) for p in fam.fn(ctx, shape)]

    monkeypatch.setitem(autotune.FAMILIES, family, dataclasses.replace(fam, fn=fn))


def _after_each_run(monkeypatch, autotune, after, family="matmul"):
    """The family with ``after(bench)`` called after every launch of its problems."""
    def wrap(p, build):
        def wrapped():
            bench = build()
            real_run = bench.run

            def run():
                real_run()
                after(bench)
            return dataclasses.replace(bench, run=run)
        return wrapped

    _wrap_builds(monkeypatch, autotune, wrap, family)


def _spy(monkeypatch, module, what):
    """The launches ``module`` makes (still launched), each listed as ``what(kernel name, grid, meta)``."""
    launched = []
    real_launch = module.launch

    def spy(kernel, grid, *args, **meta):
        launched.append(what(kernel.fn.__name__, grid, meta))
        return real_launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(module, "launch", spy)
    return launched


def _quick_table(autotune, tmp_path, families, keys):
    """The table of a --quick run of ``families``: exactly the kernels and keys of ``keys`` (kernel
    -> keys), each entry no slower than the default it was timed against."""
    out = tmp_path / f"{tune.slug(GPU)}.json"
    assert autotune.main(["--quick", "--family", ",".join(families), "--out", str(out)]) == 0
    doc = _load(out)
    assert (doc["format"], doc["gpu"], doc["triton"]) == (1, GPU, triton.__version__) and doc["date"]
    assert {k: _keys(doc, k) for k in doc["entries"]} == keys
    for rows in doc["entries"].values():
        for e in rows["bfloat16"]:
            assert 0 < e["ms"] <= e["default_ms"], e  # the default is one of the contenders
    return doc


def _quick_run(autotune, tmp_path, capsys, families, keys, names):
    """``_quick_table``, and its run's report names every problem of ``names`` and no rejected candidate."""
    doc = _quick_table(autotune, tmp_path, families, keys)
    text = capsys.readouterr().out
    assert all(name in text for name in names), text
    assert text.count("candidates rejected (wrong output): 0") == len(families), text
    return doc


def _tune_reads(monkeypatch, tmp_path, doc):
    """flame.tune reads every entry of ``doc`` back, without a warning, as it would on that GPU."""
    monkeypatch.setenv("FLAME_TUNE_DIR", str(tmp_path))
    tune.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tune.TuningTableWarning)
            for kernel, rows in doc["entries"].items():
                default = dict.fromkeys(tune.KERNELS[kernel][1], 1)
                for e in rows["bfloat16"]:
                    # an entry within MIN_GAIN of the heuristic's time answers "the heuristic"
                    want = e["config"] if e["default_ms"] >= tune.MIN_GAIN * e["ms"] else default
                    assert tune.config(kernel, tuple(e["key"]), "bfloat16", default, device_name=GPU) == want
    finally:
        tune.reset()


def test_quick_run_writes_a_table_that_tune_loads(autotune, tmp_path, monkeypatch, capsys):
    launched = _spy(monkeypatch, KM, lambda name, grid, meta: (meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]))
    doc = _quick_table(autotune, tmp_path, ["matmul", "conv2d"], {"matmul": MM_KEYS, "conv2d": CONV_KEYS})
    # every candidate of the forward GEMM really ran with its own blocks
    ctx = autotune.Ctx(torch.bfloat16, quick=True, smem=None)
    tried = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in ctx.gemm_space(24, 40, 16, group_m=True)}
    assert len(tried) >= 4 and tried <= set(launched), (tried, set(launched))
    text = capsys.readouterr().out
    assert "geometric-mean speedup" in text and "linear 24x16->40 dW" in text and "conv 3x3 s2 1x8x7x6->8" in text
    _tune_reads(monkeypatch, tmp_path, doc)


def test_the_linear_forward_is_tuned_with_its_bias(autotune, monkeypatch):
    """The matmul family's forward launches what F.linear(x, W, b) does, bias epilogue included (SDXL's
    feed-forward, output and projection layers have one, and it can change which config wins); the gradients'
    GEMMs have none."""
    launched = _spy(monkeypatch, KM, lambda name, grid, meta: (name, meta.get("BIAS")))
    ctx = autotune.Ctx(torch.bfloat16, quick=True, smem=None)
    for problem, bias in zip(autotune.FAMILIES["matmul"].fn(ctx, (24, 16, 40)), (True, False, False)):
        launched.clear()
        problem.build().run()
        assert launched == [("_matmul_kernel", bias)], (problem.name, launched)


@pytest.mark.extended  # the tuning loop and table: the other families' quick runs
def test_attention_quick_run_writes_a_table_that_tune_loads(autotune, tmp_path, monkeypatch, capsys):
    launched = _spy(monkeypatch, KA, lambda name, grid, meta: (name, grid, meta.get("BLOCK_M"), meta.get("BLOCK_N")))
    doc = _quick_table(autotune, tmp_path, ["attention"], {"attention_fwd": ATTN_KEYS, "attention_bwd": ATTN_KEYS})
    text = capsys.readouterr().out
    assert "attention B1 H2 Lq24 Lk9 D16 causal bwd" in text and "candidates rejected (wrong output): 0" in text
    # the candidates really ran: every forward tile of the loop path, both stages of the backward
    # (the dQ program's blocks too), the fused path's query chunks, M_GROUP query blocks per program
    ctx = autotune.Ctx(torch.bfloat16, quick=True, smem=None)
    fwd = autotune.search_stages(ctx, "attention_fwd", (24, 136, 16, 2))[0](None)
    fwd_tiles = {(c["BLOCK_M"], c["BLOCK_N"]) for c in fwd}
    assert len(fwd_tiles) == 4 and fwd_tiles <= {(m, n) for k, _, m, n in launched if k == "_attn_fwd_kernel"}
    dq_blocks = {(m, n) for k, _, m, n in launched if k == "_attn_bwd_dq_kernel"}
    assert {(16, 16), (32, 16)} <= dq_blocks
    assert {g[2] for k, g, _, _ in launched if k == "_attn_bwd_dkdv_kernel"} == {1, 2}  # query chunks
    assert (1, 2) in {g for k, g, _, _ in launched if k == "_attn_fwd_kernel"}  # 2 query blocks per program
    _tune_reads(monkeypatch, tmp_path, doc)


def _run_with_bad_candidates(autotune, monkeypatch, tmp_path, capsys, shapes, corrupt, bad):
    """A --quick run of the families of ``shapes`` ({family: [shape, ...]}) with ``corrupt(bench)``
    after each of their launches (the "kernel bugs" of the configs ``bad``, {kernel: fields}), under
    which the launches would also time fastest, were they not rejected. Returns (output, table)."""
    for family in shapes:
        _after_each_run(monkeypatch, autotune, corrupt, family)
    real_time = autotune.time_ms
    monkeypatch.setattr(autotune, "time_ms", lambda fn, **kw: 1e-6 if any(_active(k, v) for k, v in bad.items())
                        else real_time(fn, **kw))
    path = tmp_path / "s.yaml"
    path.write_text("".join(f"{autotune.FAMILIES[f].section}: {rows}\n" for f, rows in shapes.items()))
    out = tmp_path / "t.json"
    argv = ["--quick", "--shapes", str(path), "--family", ",".join(shapes), "--out", str(out)]
    assert autotune.main(argv) == 1
    return capsys.readouterr().out, _load(out)


@pytest.mark.extended  # the rejection itself: test_a_wrong_candidate_is_rejected_and_never_written
def test_a_wrong_attention_candidate_is_rejected(autotune, tmp_path, monkeypatch, capsys):
    bad_fwd = dict(BLOCK_M=16, BLOCK_N=16, M_GROUP=1, num_warps=4, num_stages=1)  # --quick candidates
    bad_dq = dict(BLOCK_M_DQ=16, BLOCK_N_DQ=16, num_warps_dq=4, num_stages_dq=1)

    def corrupt(bench):  # the "kernel bugs": the forward's output is off, the backward leaves dV unwritten
        if len(bench.out) == 2 and _active("attention_fwd", bad_fwd):  # (O, lse)
            bench.out[0].add_(0.5)
        if len(bench.out) == 3 and _active("attention_bwd", bad_dq):  # (dQ, dK, dV)
            bench.out[2].fill_(float("nan"))

    text, doc = _run_with_bad_candidates(autotune, monkeypatch, tmp_path, capsys,
                                         {"attention": [[1, 2, 24, 136, 16, 0]]}, corrupt,
                                         {"attention_fwd": bad_fwd, "attention_bwd": bad_dq})
    assert text.count("REJECTED attention_fwd") == 1 and repr(bad_fwd) in text, text
    assert text.count("REJECTED attention_bwd") == 1 and "output 2: max |error| nan" in text, text
    assert "candidates rejected (wrong output): 2" in text
    (fwd,), (bwd,) = doc["entries"]["attention_fwd"]["bfloat16"], doc["entries"]["attention_bwd"]["bfloat16"]
    assert fwd["config"] != bad_fwd and not all(bwd["config"][f] == v for f, v in bad_dq.items())
    assert min(fwd["ms"], bwd["ms"]) > 1e-3


def test_wgrad_quick_run_writes_a_table_that_tune_loads(autotune, tmp_path, monkeypatch, capsys):
    launched = _spy(monkeypatch, KC, lambda name, grid, meta: (meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]))
    doc = _quick_table(autotune, tmp_path, ["conv2d_wgrad"], {"conv2d_wgrad": WGRAD_KEYS})
    ctx = autotune.Ctx(torch.bfloat16, quick=True, smem=None)
    tried = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in ctx.gemm_space(12, 8, 30, group_m=False)}
    assert len(tried) == 2 and tried <= set(launched), (tried, set(launched))  # BLOCK_K 16 and 32
    text = capsys.readouterr().out
    assert "wgrad 3x3 s2 1x8x7x6->8" in text and "candidates rejected (wrong output): 0" in text
    _tune_reads(monkeypatch, tmp_path, doc)

@pytest.mark.extended  # a quick run's table: the attention family's test

def test_norms_quick_run_writes_a_table_that_tune_loads(autotune, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "num_sms", lambda: 1)  # the split and program counts below assume one SM
    launched = _spy(monkeypatch, KN, lambda name, grid, meta: (name, grid, meta.get("BLOCK_C"), meta.get("BLOCK_S"),
                                                               meta.get("BLOCK_M")))
    real_time = autotune.time_ms

    def time_ms(fn, **kw):  # LayerNorm's backward: fewer rows per program "time" faster, so that its
        cfg = _overridden("layer_norm_bwd")  # second stage (the persistent programs) has candidates
        return 1e-3 * cfg["BLOCK_M"] if cfg else real_time(fn, **kw)

    monkeypatch.setattr(autotune, "time_ms", time_ms)
    keys = dict(group_norm_fwd=GN_KEYS, group_norm_bwd=GN_KEYS, layer_norm_fwd=LN_KEYS, layer_norm_bwd=LN_KEYS)
    doc = _quick_run(autotune, tmp_path, capsys, ["group_norm", "layer_norm"], keys,
                     ("group_norm 1x6x5x7 G3 channels-last silu bwd", "group_norm 2x4x3x5 G2 fwd", "rms_norm 7x40 bwd"))
    # the candidates really ran: both stages of GroupNorm (the statistics pass split 2 and 3 ways
    # over 2-channel blocks of the 1x6x35 map, the apply pass in 2x16 and 4x8 tiles), LayerNorm's
    # 2- and 4-row blocks and the backward's 3 persistent programs
    partial = {(g, c) for k, g, c, _, _ in launched if k == "_gn_partial_kernel"}
    assert {((3, 2), 2), ((3, 3), 2)} <= partial, partial
    assert {(2, 16), (4, 8)} <= {(c, s) for k, _, c, s, _ in launched if k == "_gn_apply_kernel"}
    assert {2, 4} <= {m for k, _, _, _, m in launched if k == "_ln_fwd_kernel"}
    assert ((3,), 2) in {(g, m) for k, g, _, _, m in launched if k == "_ln_bwd_kernel"}
    _tune_reads(monkeypatch, tmp_path, doc)


@pytest.mark.extended  # the quick run's table written and loaded: test_quick_run_writes_a_table_that_tune_loads
def test_softmax_quick_run_writes_a_table_that_tune_loads(autotune, tmp_path, monkeypatch, capsys):
    launched = _spy(monkeypatch, KS, lambda name, grid, meta: (name, meta.get("SINGLE"), meta.get("BLOCK_ROWS"),
                                                               meta.get("BLOCK_R", meta.get("BLOCK_C"))))
    keys = dict(softmax_fwd=SM_KEYS, softmax_bwd=SM_KEYS, cross_entropy_fwd=CE_KEYS, cross_entropy_bwd=CE_KEYS)
    doc = _quick_run(autotune, tmp_path, capsys, ["softmax", "cross_entropy"], keys,
                     ("softmax 10x40 fwd", "log_softmax 7x100 bwd", "cross_entropy 7x100 bwd"))
    # the candidates really ran: 2 and 4 rows per program, the 40-wide rows whole in 64-wide blocks
    # and streamed through 32-wide ones, the 100 classes in 32- and 64-wide blocks
    for kernel in ("_softmax_fwd_kernel", "_softmax_bwd_kernel"):
        assert {(True, 2, 64), (False, 4, 32), (False, 2, 64)} <= {run[1:] for run in launched if run[0] == kernel}
    for kernel in ("_ce_fwd_kernel", "_ce_bwd_kernel"):
        assert {(2, 32), (4, 64)} <= {run[2:] for run in launched if run[0] == kernel}
    _tune_reads(monkeypatch, tmp_path, doc)


def test_elementwise_and_reduce_quick_run_writes_a_table_that_tune_loads(autotune, tmp_path, monkeypatch, capsys):
    maps = _spy(monkeypatch, KE, lambda name, grid, meta: (name, meta.get("BLOCK"), meta.get("BLOCK_R"),
                                                           meta.get("BLOCK_C")))
    sums = _spy(monkeypatch, KR, lambda name, grid, meta: (meta["BLOCK_R"], meta["BLOCK_I"]))
    doc = _quick_run(autotune, tmp_path, capsys, ["elementwise", "reduce"], MAP_KEYS,
                     ("add 1x3x5x7", "mul 1x3x5x7 by (1, 3, 1, 1)", "column sum 1x40x24", "row sum 6x100x1"))
    # the candidates really ran: 64- and 128-element blocks, 2 and 4 rows of 32, and the sums'
    # 16 x 4 and 16 x 8 tiles and 64- and 128-long rows
    assert {64, 128} <= {run[1] for run in maps if run[0] == "_map_contiguous_kernel"}
    assert {(2, 32), (4, 32)} <= {run[2:] for run in maps if run[0] == "_map_strided_kernel"}
    assert {(16, 4), (16, 8), (64, 1), (128, 1)} <= set(sums)
    _tune_reads(monkeypatch, tmp_path, doc)


def test_the_kernel_tuned_is_not_a_helper_map_or_reduction():
    from flame import autotune as A

    assert A.launched_kernel(["matmul", "matmul_tma"]) == "matmul_tma"
    # a split-K GEMM sums its partial tiles and casts them: still the GEMM
    assert A.launched_kernel(["matmul", "reduce", "map_contiguous"]) == "matmul"
    assert A.launched_kernel(["map_strided", "layer_norm_bwd", "reduce"]) == "layer_norm_bwd"
    assert A.launched_kernel(["reduce", "reduce"]) == "reduce"  # a split reduction: its own
    assert A.launched_kernel(["map_contiguous"]) == "map_contiguous"


@pytest.mark.extended  # as above
def test_a_wrong_norm_candidate_is_rejected(autotune, tmp_path, monkeypatch, capsys):
    bad_apply = dict(BLOCK_C_APPLY=4, BLOCK_S_APPLY=8)  # a --quick candidate of the apply pass
    bad_rows = dict(BLOCK_M=4)  # ... and of LayerNorm's rows per program

    def corrupt(bench):  # the "kernel bugs": GroupNorm's backward leaves dB unwritten, LayerNorm's forward is off
        if isinstance(bench.out, tuple) and len(bench.out) == 3 and _active("group_norm_bwd", bad_apply):
            bench.out[2].fill_(float("nan"))
        if not isinstance(bench.out, tuple) and bench.out.dim() == 2 and _active("layer_norm_fwd", bad_rows):
            bench.out.add_(0.5)

    text, doc = _run_with_bad_candidates(autotune, monkeypatch, tmp_path, capsys,
                                         {"group_norm": [[1, 6, 5, 7, 3, 1, 1]], "layer_norm": [[10, 24, 0]]},
                                         corrupt, {"group_norm_bwd": bad_apply, "layer_norm_fwd": bad_rows})
    assert text.count("REJECTED group_norm_bwd") == 1 and "output 2: max |error| nan" in text, text
    assert text.count("REJECTED layer_norm_fwd") == 1 and "'BLOCK_M': 4" in text, text
    (gn,), (ln,) = doc["entries"]["group_norm_bwd"]["bfloat16"], doc["entries"]["layer_norm_fwd"]["bfloat16"]
    assert not all(gn["config"][f] == v for f, v in bad_apply.items()) and ln["config"]["BLOCK_M"] != 4
    assert min(gn["ms"], ln["ms"]) > 1e-3


def test_the_sdxl_shapes_file_has_every_section(autotune):
    def error(msg):
        raise AssertionError(msg)

    shapes = autotune.load_shapes(autotune.DEFAULT_SHAPES, list(autotune.FAMILIES), error)
    assert set(shapes) == {"matmul", "conv2d", "attention", "group_norm", "layer_norm", "softmax", "cross_entropy",
                           "elementwise", "reduce"}
    # SDXL's activations at batch 1 (320, 640, 1280 channels) and 16M elements; bias-gradient
    # column sums (tokens x channels) and the 8192 x 32000 row sums
    assert set(shapes["elementwise"]) == {(1, 320, 128, 128), (1, 640, 64, 64), (1, 1280, 32, 32),
                                          (1, 16, 1024, 1024)}
    assert set(shapes["reduce"]) == {(1, 4096, 640), (1, 1024, 1280), (1, 16384, 320), (8192, 32000, 1)}
    group_norm = set(shapes["group_norm"])
    # 12 GroupNorm widths and sizes per batch (1, 2, 4) and image (1024x1024, 896x1152), both layouts
    assert len(group_norm) == 144 and {s[0] for s in group_norm} == {1, 2, 4} and {s[5] for s in group_norm} == {0, 1}
    assert {(s[1], s[2], s[3]) for s in group_norm} >= {(320, 128, 128), (640, 64, 64), (1280, 32, 32),
                                                        (2560, 32, 32), (960, 112, 144), (1920, 56, 72)}
    assert all(s[4] == 32 and s[6] == 1 for s in group_norm)
    assert set(shapes["layer_norm"]) == {(b * t, d, 0) for b in (1, 2, 4)
                                         for t, d in ((4096, 640), (1024, 1280), (4032, 640), (1008, 1280))}
    # the bench's 8192 x 32000 and common vocabularies (GPT-2, Llama 3), softmax and log_softmax
    assert set(shapes["cross_entropy"]) == {(8192, 32000), (8192, 50257), (4096, 128256)}
    assert set(shapes["softmax"]) == {(m, c, 0) for m, c in shapes["cross_entropy"]} | {(16384, 32000, 1)}
    attention = set(shapes["attention"])
    assert len(attention) == 24 and {s[0] for s in attention} == {1, 2, 4}
    assert {s[2:4] for s in attention} == {(4096, 4096), (1024, 1024), (4096, 77), (1024, 77), (4032, 4032),
                                           (1008, 1008), (4032, 77), (1008, 77)}


@pytest.mark.skipif(not runtime.INTERPRETER, reason="asserts which kernels the interpreter routes to "
                                                 "(the GPU sends these to the TMA kernels)")
def test_the_kernel_that_runs_is_the_one_tuned(autotune, tmp_path):
    # a 1x1 stride-1 convolution runs on the GEMM kernel: its forward is a "matmul" key, its
    # input gradient another; the 3x3 one is a conv2d_dgrad key (the interpreter has no TMA kernels)
    shapes = tmp_path / "s.yaml"
    shapes.write_text("conv: [[1, 8, 4, 4, 16, 1, 1], [1, 8, 4, 4, 16, 3, 1]]\n")
    out = tmp_path / "t.json"
    argv = ["--quick", "--shapes", str(shapes), "--family", "conv2d,conv2d_dgrad,conv2d_wgrad", "--out", str(out)]
    assert autotune.main(argv) == 0
    doc = _load(out)
    # the 1x1 weight gradient dW (16, 8) = dY^T (16 x 16 pixels) @ X is the input gradient's key again
    assert _keys(doc, "matmul") == {(16, 16, 8, 1), (16, 8, 16, 1)}
    assert _keys(doc, "conv2d") == {(16, 16, 8, 9)} and _keys(doc, "conv2d_dgrad") == {(16, 8, 16, 9)}
    assert _keys(doc, "conv2d_wgrad") == {(16, 8, 16, 9)}


def test_resume_skips_tuned_keys_keeps_others_and_force_retunes(autotune, tmp_path, monkeypatch, capsys):
    kept = dict(key=[24, 40, 16, 1], config=dict(BAD, BLOCK_M=128), ms=123.0, default_ms=456.0)
    other = dict(key=[999, 999, 999, 1], config=BAD, ms=1.0, default_ms=1.0)
    conv = dict(key=[30, 12, 8, 9], config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2),
                ms=1.0, default_ms=1.0)
    out = _table(tmp_path / "t.json", {"matmul": {"bfloat16": [kept, other]}, "conv2d": {"float16": [conv]}})
    tuned = []
    real = autotune.tune_launch
    monkeypatch.setattr(autotune, "tune_launch", lambda name, bench, launch, *a: tuned.append(launch.key)
                        or real(name, bench, launch, *a))
    argv = ["--quick", "--family", "matmul", "--out", str(out)]

    assert autotune.main(argv) == 0
    assert set(tuned) == MM_KEYS - {(24, 40, 16, 1)}
    doc = _load(out)
    rows = {tuple(e["key"]): e for e in doc["entries"]["matmul"]["bfloat16"]}
    assert set(rows) == MM_KEYS | {(999, 999, 999, 1)}
    assert rows[24, 40, 16, 1] == kept and rows[999, 999, 999, 1] == other
    assert doc["entries"]["conv2d"] == {"float16": [conv]}  # other kernels and dtypes untouched

    tuned.clear()
    before = out.read_text()
    assert autotune.main(argv) == 0
    assert tuned == [] and out.read_text() == before
    assert "0 keys tuned now, 3 already in the table" in capsys.readouterr().out

    assert autotune.main([*argv, "--force"]) == 0
    assert set(tuned) == MM_KEYS
    rows = {tuple(e["key"]): e for e in _load(out)["entries"]["matmul"]["bfloat16"]}
    assert rows[24, 40, 16, 1] != kept and rows[999, 999, 999, 1] == other


def test_force_times_the_tables_config_with_the_other_candidates(autotune, tmp_path, monkeypatch, capsys):
    """--force screens the key's table config in the same run as every other candidate: it stays
    when it is still the fastest (whatever time the table stored for it), and loses otherwise."""
    incumbent = dict(BAD, BLOCK_M=128)  # not a --quick candidate
    stale = dict(key=[24, 40, 16, 1], config=incumbent, ms=1e9, default_ms=1e9)  # stored times are ignored
    out = _table(tmp_path / "t.json", {"matmul": {"bfloat16": [stale]}})
    screened = []
    real_time = autotune.time_ms

    def timing(fast):
        def time_ms(fn, **kw):
            active = tune.config("matmul", (1, 1, 1, 1), "float32", dict(BAD, BLOCK_M=1))
            screened.append(active)
            return 1e-6 if active == fast else real_time(fn, **kw)
        return time_ms

    argv = ["--quick", "--family", "matmul", "--out", str(out), "--force"]
    monkeypatch.setattr(autotune, "time_ms", timing(incumbent))
    assert autotune.main(argv) == 0
    rows = {tuple(e["key"]): e for e in _load(out)["entries"]["matmul"]["bfloat16"]}
    assert rows[24, 40, 16, 1]["config"] == incumbent and rows[24, 40, 16, 1]["ms"] < 1e-3
    assert incumbent in screened
    assert all(e["config"] != incumbent for k, e in rows.items() if k != (24, 40, 16, 1))  # others never see it

    monkeypatch.setattr(autotune, "time_ms", timing(BAD))  # now another candidate is fastest
    assert autotune.main(argv) == 0
    rows = {tuple(e["key"]): e for e in _load(out)["entries"]["matmul"]["bfloat16"]}
    assert rows[24, 40, 16, 1]["config"] == BAD


def test_a_wrong_candidate_is_rejected_and_never_written(autotune, tmp_path, monkeypatch, capsys):
    def garbage_under_bad(bench):  # the "kernel bug": this config writes a wrong answer
        if _bad_active():
            bench.out.add_(0.5)

    _after_each_run(monkeypatch, autotune, garbage_under_bad)
    real_time = autotune.time_ms
    # ... and it would be the fastest by far, were it not rejected
    monkeypatch.setattr(autotune, "time_ms", lambda fn, **kw: 1e-6 if _bad_active() else real_time(fn, **kw))
    out = tmp_path / "t.json"
    assert autotune.main(["--quick", "--family", "matmul", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert text.count("REJECTED matmul") == 3 and repr(BAD) in text, text
    assert "candidates rejected (wrong output): 3" in text
    rows = _load(out)["entries"]["matmul"]["bfloat16"]
    assert {tuple(e["key"]) for e in rows} == MM_KEYS
    assert all(e["config"] != BAD for e in rows) and all(e["ms"] > 1e-3 for e in rows)


@pytest.mark.parametrize("message, rc", [("PassManager::run failed", 0),
                                          ("Triton Error [CUDA]: an illegal memory access was encountered", 1)])
def test_a_failing_candidate_is_skipped_unless_it_breaks_the_gpu(autotune, tmp_path, monkeypatch, capsys, message, rc):
    def fails_under_bad(bench):
        if _bad_active():
            raise RuntimeError(message)

    _after_each_run(monkeypatch, autotune, fails_under_bad)
    out = tmp_path / "t.json"
    assert autotune.main(["--quick", "--family", "matmul", "--out", str(out)]) == rc
    text = capsys.readouterr()
    if rc == 0:  # a compile failure: that config is no candidate, the others still are
        assert "skipped (compile or resources): 3" in text.out and _keys(_load(out), "matmul") == MM_KEYS
    else:
        assert "broke the CUDA context" in text.err and repr(BAD) in text.err and not out.exists()


def test_budget_stop_writes_what_is_done_and_a_rerun_finishes(autotune, tmp_path, monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(autotune, "_clock", lambda: now[0])

    def slow(p, build):
        def wrapped():
            now[0] += 40.0  # every problem takes 40 s of the 60 s budget
            return build()
        return wrapped

    _wrap_builds(monkeypatch, autotune, slow)
    out = tmp_path / "t.json"
    argv = ["--quick", "--family", "matmul", "--out", str(out)]
    assert autotune.main([*argv, "--budget-minutes", "1"]) == 0
    assert len(_keys(_load(out), "matmul")) == 1  # the second problem ran out of time mid-way
    assert "--budget-minutes 1 spent: 2 launches left" in capsys.readouterr().out
    assert autotune.main(argv) == 0
    assert _keys(_load(out), "matmul") == MM_KEYS


def test_a_launcher_that_ignores_the_override_is_an_error(autotune, tmp_path, monkeypatch, capsys):
    def fake(ctx, shape):  # "tunes" a launch that never asks flame.tune (PyTorch's own product)
        m, k, n = shape

        def build():
            x, w, out = ctx.randn(m, k), ctx.randn(n, k), ctx.empty(m, n)
            return autotune.Bench(lambda: torch.matmul(x, w.t(), out=out), out, x.float() @ w.float().t())

        return [autotune.Problem("torch", build)]

    monkeypatch.setitem(autotune.FAMILIES, "fake", autotune.Family(fake, "matmul", ("M", "K", "N"), ""))
    out = tmp_path / "t.json"
    assert autotune.main(["--quick", "--family", "fake", "--out", str(out)]) == 1
    assert "torch: the launch asked flame.tune for no config" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("args, shapes, match", [
    (["--family", "matmul,nope"], None, "unknown family nope; known: matmul, conv2d, conv2d_dgrad, conv2d_wgrad, "
                                        "attention, group_norm, layer_norm, softmax, cross_entropy, elementwise, "
                                        "reduce"),
    (["--budget-minutes", "0"], None, "--budget-minutes: must be a positive number of minutes, got '0'"),
    (["--budget-minutes", "soon"], None, "positive number of minutes, got 'soon'"),
    (["--dtype", "fp8"], None, "invalid choice: 'fp8'"),
    (["--shapes", "missing.yaml"], None, "cannot read it"),
    (["--shapes"], "linear: [[4096, 640]]\n", "linear[0] = [4096, 640] is not 3 positive integers ['M', 'K', 'N']"),
    (["--shapes"], "conv: [[1, 4, 8, 8, 16, 3, 0]]\n", "conv[0] = [1, 4, 8, 8, 16, 3, 0]"),
    (["--shapes"], "lienar: [[1, 2, 3]]\n",
     "unknown section 'lienar' (known: attention, conv2d, cross_entropy, elementwise, group_norm, layer_norm, "
     "matmul, reduce, softmax)"),
    (["--shapes"], "reduce: [[1, 0, 24]]\n",
     "reduce[0] = [1, 0, 24] is not 3 positive integers ['outer', 'R', 'inner']"),
    (["--shapes"], "softmax: [[8, 32, 2]]\n",
     "softmax[0] = [8, 32, 2] is not 3 integers ['ROWS', 'R', 'log'] (log 0 or 1"),
    (["--shapes"], "group_norm: [[1, 4, 2, 2, 2, 2, 1]]\n", "group_norm[0] = [1, 4, 2, 2, 2, 2, 1] is not 7 integers "
     "['N', 'C', 'H', 'W', 'G', 'channels_last', 'silu'] (channels_last, silu 0 or 1"),
    (["--shapes"], "layer_norm: [[0, 24, 0]]\n", "layer_norm[0] = [0, 24, 0] is not 3 integers"),
    (["--shapes"], "attention: [[1, 2, 8, 8, 16, 2]]\n",
     "attention[0] = [1, 2, 8, 8, 16, 2] is not 6 integers ['B', 'H', 'Lq', 'Lk', 'D', 'causal'] (causal 0 or 1"),
    (["--shapes"], "attention: [[1, 0, 8, 8, 16, 0]]\n", "attention[0] = [1, 0, 8, 8, 16, 0] is not 6 integers"),
    (["--shapes", "--family", "matmul"], "conv: [[1, 4, 8, 8, 16, 3, 1]]\n", "no shapes for the families matmul"),
])
def test_bad_command_lines_are_clear_errors(autotune, tmp_path, capsys, args, shapes, match):
    if shapes is not None:
        (tmp_path / "s.yaml").write_text(shapes)
        args = [args[0], str(tmp_path / "s.yaml"), *args[1:]]
    elif "missing.yaml" in args:
        args = [a.replace("missing.yaml", str(tmp_path / "missing.yaml")) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        autotune.main([*args, "--quick", "--out", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_group_norm_groups_must_divide_the_channels(autotune, tmp_path, capsys):
    shapes = tmp_path / "s.yaml"
    shapes.write_text("group_norm: [[1, 6, 2, 2, 4, 0, 0]]\n")
    out = tmp_path / "t.json"
    assert autotune.main(["--quick", "--shapes", str(shapes), "--family", "group_norm", "--out", str(out)]) == 1
    assert "group_norm shape [1, 6, 2, 2, 4, 0, 0]: C = 6 is not a multiple of G = 4" in capsys.readouterr().err
    assert not out.exists()


def test_quick_or_interpreter_runs_need_out(autotune, capsys):
    with pytest.raises(SystemExit) as exit_info:
        autotune.main(["--quick"])
    assert exit_info.value.code == 2 and "need --out" in capsys.readouterr().err


@pytest.mark.parametrize("content, match", [
    ("{not json", "unreadable"),
    (json.dumps(dict(format=2, entries={})), "not a format-1 tuning table"),
    (json.dumps(dict(format=1, gpu="NVIDIA A100", triton=triton.__version__, entries={})), "holds the table of"),
])
def test_a_table_it_cannot_merge_with_is_left_alone(autotune, tmp_path, capsys, content, match):
    out = tmp_path / "t.json"
    out.write_text(content)
    assert autotune.main(["--quick", "--out", str(out)]) == 1
    assert match in capsys.readouterr().err and out.read_text() == content


def test_entries_of_another_release_are_retuned_when_met_and_kept_with_their_release(autotune, tmp_path,
                                                                                      monkeypatch, capsys):
    met = dict(key=[24, 40, 16, 1], config=dict(BAD, BLOCK_M=128), ms=1.0, default_ms=1.0)
    other = dict(key=[999, 999, 999, 1], config=BAD, ms=1.0, default_ms=2.0)
    mine = dict(key=[40, 16, 24, 1], config=BAD, ms=1.0, default_ms=2.0, triton=triton.__version__)
    out = _table(tmp_path / "t.json", {"matmul": {"bfloat16": [met, other, mine]}}, triton="2.1.0")
    screened = []
    real_time = autotune.time_ms

    def time_ms(fn, **kw):
        screened.append(tune.config("matmul", (1, 1, 1, 1), "float32", dict(BAD, BLOCK_M=1)))
        return real_time(fn, **kw)

    monkeypatch.setattr(autotune, "time_ms", time_ms)
    assert autotune.main(["--quick", "--family", "matmul", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "entries tuned with Triton 2.1.0" in text and "1 already in the table" in text, text
    assert met["config"] in screened  # the old config competes with the other candidates
    doc = _load(out)
    rows = {tuple(e["key"]): e for e in doc["entries"]["matmul"]["bfloat16"]}
    assert doc["triton"] == triton.__version__ and set(rows) == MM_KEYS | {(999, 999, 999, 1)}
    assert rows[999, 999, 999, 1] == dict(other, triton="2.1.0")  # not met: kept, with its provenance
    assert "triton" not in rows[24, 40, 16, 1] and rows[24, 40, 16, 1]["ms"] != 1.0  # tuned now, this release
    assert rows[40, 16, 24, 1] == {k: v for k, v in mine.items() if k != "triton"}  # this release's: kept
    table, problems = tune._parse(doc, GPU)
    assert problems == [] and table.exact["matmul", "bfloat16", (999, 999, 999, 1)].triton == "2.1.0"


@pytest.mark.extended  # the stage's logic with stub workers: the two tests below
def test_jobs_compile_candidates_ahead_in_worker_processes(tmp_path):
    """--jobs: worker processes run each stage's candidates once before they are timed; the table
    is the same kind of table as without them."""
    import subprocess
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "scripts/autotune.py", "--quick", "--family", "layer_norm", "--jobs", "2",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "candidates compiled ahead by 2 worker processes" in r.stdout
    doc = _load(out)
    assert {k: _keys(doc, k) for k in ("layer_norm_fwd", "layer_norm_bwd")} == dict(layer_norm_fwd=LN_KEYS,
                                                                                    layer_norm_bwd=LN_KEYS)


def test_compile_workers_that_fail_leave_the_stage_to_the_timing_process(autotune, capsys):
    """A worker pool that breaks or raises costs the compile-ahead of that stage, never the run."""
    import concurrent.futures.process

    class Pool:
        def __init__(self, error):
            self.error, self.shut = error, False

        def map(self, *args):
            raise self.error

        def shutdown(self, cancel_futures):
            self.shut = True

    args = autotune.parse_args(["--quick", "--family", "layer_norm", "--out", "unused.json", "--jobs", "2"])
    ahead = autotune.CompileAhead(2, args, autotune.Ctx(dtype=torch.bfloat16, quick=True, smem=None))
    for error in (concurrent.futures.process.BrokenProcessPool("gone"), MemoryError("out of memory")):
        pool = ahead.pool = Pool(error)
        ahead(0, "layer_norm_fwd", [dict(BLOCK_M=1), dict(BLOCK_M=2)])
        assert pool.shut and ahead.pool is None and ahead.compiled == 0
    assert "compile workers failed on layer_norm_fwd (MemoryError" in capsys.readouterr().err


def test_compile_workers_never_hold_more_copies_of_a_problem_than_fit(autotune, monkeypatch, capsys):
    """A problem too big for every worker to hold a copy (the 4096x128256 cross-entropy took 8-12
    GiB a process and ran 8 workers on an 80 GB H100 out of memory) is compiled by as many workers
    at once as the free memory holds, each freeing it after its candidate; none fit: the stage
    compiles while timing, with a note."""
    class Pool:
        def __init__(self):
            self.waves = []

        def map(self, fn, *columns):
            self.waves.append(list(zip(*columns)))
            return [None] * len(columns[0])

        def shutdown(self, cancel_futures):
            pass

    args = autotune.parse_args(["--quick", "--family", "layer_norm", "--out", "unused.json", "--jobs", "4"])
    ahead = autotune.CompileAhead(4, args, autotune.Ctx(dtype=torch.bfloat16, quick=True, smem=None))
    configs = [dict(BLOCK_M=m) for m in (1, 2, 4, 8, 16)]
    gib = 2**30
    for free, footprint, waves, keep in ((80 * gib, 1 * gib, [5], True), (24 * gib, 8 * gib, [2, 2, 1], False),
                                         (80 * gib, 0, [5], True)):
        monkeypatch.setattr(autotune.torch.cuda, "mem_get_info", lambda free=free: (free, 80 * gib))
        pool = ahead.pool = Pool()
        ahead(3, "cross_entropy_bwd", configs, footprint=footprint)
        assert [len(w) for w in pool.waves] == waves
        calls = [call for w in pool.waves for call in w]
        assert {c[3] for c in calls} == {keep}
        assert [c[2] for c in calls] == configs and {c[0] for c in calls} == {3}
    pool = ahead.pool = Pool()
    monkeypatch.setattr(autotune.torch.cuda, "mem_get_info", lambda: (12 * gib, 80 * gib))
    ahead(3, "cross_entropy_bwd", configs, footprint=8 * gib)
    assert pool.waves == []
    assert "cross_entropy_bwd's problem takes 8.0 GiB" in capsys.readouterr().err
    assert autotune._workers_that_fit(8 * gib, 24 * gib) == 2 and autotune._workers_that_fit(gib, 0) == 0


def test_launches_are_timed_as_graph_replays(autotune, monkeypatch):
    # every launch takes the CUDA-graph replay time (device time, as bench.py reports), or
    # do_bench's when it cannot be captured
    monkeypatch.setattr(autotune.flame, "is_interpreter", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: 0.5)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: 0.004)
    assert autotune.time_ms(lambda: None, warmup=1, rep=1) == 0.004

    def not_capturable(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", not_capturable)
    monkeypatch.setattr(autotune.torch.cuda, "synchronize", lambda: None)
    assert autotune.time_ms(lambda: None, warmup=1, rep=1) == 0.5


def test_kernels_lists_every_registered_spec(autotune, capsys):
    from flame import tune
    assert autotune.main(["--kernels"]) == 0
    out = capsys.readouterr().out
    assert all(f"| `{name}` |" in out for name in tune.SPECS)
    readme = (ROOT / "configs" / "autotune" / "README.md").read_text()
    block = readme.split("<!-- kernels: python3 scripts/autotune.py --kernels -->\n")[1].split("\n<!-- /kernels -->")[0]
    assert block == autotune.kernel_table(), "configs/autotune/README.md: paste `scripts/autotune.py --kernels` again"

