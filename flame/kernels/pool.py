"""2-D max and average pooling, forward and backward, over (n, c, h, w) strides.

Each program owns BLOCK consecutive elements of the buffer it writes, in that buffer's memory order
(``CL``: (n, h, w, c), channels innermost, as ``torch.channels_last``; else (n, c, h, w)), so its
stores are contiguous and, for channels-last data, so is each window tap's load. Reads go through
any strides.

Window of output (oh, ow): rows ``ih = oh * sh - ph + kh * dh`` for kh in [0, KH) that fall in
[0, H) (same for columns); average pooling has dh = dw = 1.

Forward (``_pool_fwd_kernel``): max keeps the first largest value (a NaN wins, later NaNs
replace earlier ones) and its flat index ``ih * W + iw`` in the (H, W) plane, starting from the
window's first in-bounds position, as PyTorch does; average sums the in-bounds taps and divides
by ``_avg_divisor``.

Backward (``_pool_bwd_kernel``), scatter-free and deterministic: each input element gathers from
the outputs whose window may contain it, ``oh`` in [lo, hi) with
``lo = max(0, floor((ih + ph - ext) / sh) + 1)``, ``hi = min(floor((ih + ph) / sh) + 1, OH)``,
``ext = (KH - 1) * dh + 1``: at most ``cdiv(ext, sh)`` rows (one when windows do not overlap):
    max:      dx[ih, iw] = sum over those (oh, ow) with index[oh, ow] == ih * W + iw of dy[oh, ow]
    average:  dx[ih, iw] = sum over those (oh, ow) of dy[oh, ow] / divisor(oh, ow)

Every integer ``//`` and ``%`` here has a non-negative numerator (and a positive divisor), so
floor and truncating division agree: compiled Triton truncates toward zero, as C does, where
Python and numpy floor; the window offsets that can be negative are clamped first.
"""
import torch
import triton
import triton.language as tl

from .. import runtime
from .elementwise import _index, _pow2, cdiv
from .launch import launch


@triton.jit
def _decode(offs, C, D2, D3, CL: tl.constexpr):
    """(n, c, h, w) of flat offsets in memory order over an (N, C, D2, D3) buffer."""
    if CL:  # dims (n, h, w, c) outer to inner
        s1, s2, s3 = D2, D3, C
    else:
        s1, s2, s3 = C, D2, D3
    i3 = offs % s3
    t = offs // s3
    i2 = t % s2
    t = t // s2
    i1 = t % s1
    n = t // s1
    if CL:
        c, h, w = i3, i1, i2
    else:
        c, h, w = i1, i2, i3
    return n, c, h, w


@triton.jit
def _avg_divisor(oh, ow, H, W, KH, KW, sh, sw, ph, pw, DIVISOR, COUNT_PAD: tl.constexpr):
    """PyTorch's divisor of window (oh, ow): ``DIVISOR`` when not 0 (divisor_override), else the
    window's area clipped to the padded input (count_include_pad) or to the input itself."""
    h0 = oh * sh - ph
    w0 = ow * sw - pw
    h1 = tl.minimum(h0 + KH, H + ph)
    w1 = tl.minimum(w0 + KW, W + pw)
    if not COUNT_PAD:
        h0 = tl.maximum(h0, 0)
        w0 = tl.maximum(w0, 0)
        h1 = tl.minimum(h1, H)
        w1 = tl.minimum(w1, W)
    area = (h1 - h0) * (w1 - w0)
    return tl.where(DIVISOR != 0, DIVISOR, tl.maximum(area, 1))


@triton.jit
def _pool_fwd_kernel(x_ptr, out_ptr, idx_ptr, total, C, H, W, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, DIVISOR,
                     sx_n, sx_c, sx_h, sx_w, so_n, so_c, so_h, so_w,
                     MAX: tl.constexpr, COUNT_PAD: tl.constexpr, CL: tl.constexpr, CD: tl.constexpr,
                     WIDE: tl.constexpr, BLOCK: tl.constexpr):
    offs = _index(tl.program_id(0), BLOCK, WIDE)  # int32 unless WIDE: cheap _decode
    mask = offs < total
    n, c, oh, ow = _decode(offs, C, OH, OW, CL)
    base = x_ptr + n * sx_n + c * sx_c
    h0 = oh * sh - ph
    w0 = ow * sw - pw
    if MAX:
        best = tl.full((BLOCK,), float("-inf"), CD)
        # PyTorch starts from the window's first tap with ih >= 0 and iw >= 0 (kept when every
        # value is -inf): h0 + ceil(max(-h0, 0) / dh) * dh, a non-negative numerator
        fh = h0 + (tl.maximum(-h0, 0) + dh - 1) // dh * dh
        fw = w0 + (tl.maximum(-w0, 0) + dw - 1) // dw * dw
        best_i = fh * W + fw
    else:
        acc = tl.zeros((BLOCK,), CD)
    for kh in range(0, KH):
        ih = h0 + kh * dh
        ok_h = mask & (ih >= 0) & (ih < H)
        for kw in range(0, KW):
            iw = w0 + kw * dw
            ok = ok_h & (iw >= 0) & (iw < W)
            v = tl.load(base + ih * sx_h + iw * sx_w, mask=ok, other=0.0).to(CD)
            if MAX:
                take = ok & ((v > best) | (v != v))
                best = tl.where(take, v, best)
                best_i = tl.where(take, ih * W + iw, best_i)
            else:
                acc += v
    o_off = n * so_n + c * so_c + oh * so_h + ow * so_w
    if MAX:
        tl.store(out_ptr + o_off, best.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(idx_ptr + o_off, best_i, mask=mask)
    else:
        div = _avg_divisor(oh, ow, H, W, KH, KW, sh, sw, ph, pw, DIVISOR, COUNT_PAD)
        tl.store(out_ptr + o_off, (acc / div.to(CD)).to(out_ptr.dtype.element_ty), mask=mask)


# max:  dx[n, c, ih, iw] = sum_{(oh, ow) whose window holds (ih, iw), idx[n, c, oh, ow] == ih * W + iw} dy[n, c, oh, ow]
# avg:  dx[n, c, ih, iw] = sum_{(oh, ow) whose window holds (ih, iw)} dy[n, c, oh, ow] / divisor(oh, ow)
# (the candidate (oh, ow) ranges are in the module docstring; NH x NW bounds their sizes)
@triton.jit
def _pool_bwd_kernel(dy_ptr, idx_ptr, dx_ptr, total, C, H, W, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, DIVISOR,
                     NH, NW, sy_n, sy_c, sy_h, sy_w, si_n, si_c, si_h, si_w, sx_n, sx_c, sx_h, sx_w,
                     MAX: tl.constexpr, COUNT_PAD: tl.constexpr, CL: tl.constexpr, CD: tl.constexpr,
                     WIDE: tl.constexpr, BLOCK: tl.constexpr):
    offs = _index(tl.program_id(0), BLOCK, WIDE)  # int32 unless WIDE: cheap _decode
    mask = offs < total
    n, c, ih, iw = _decode(offs, C, H, W, CL)
    # lo = max(0, floor((i + p - ext) / s) + 1) = max(i + p - ext + s, 0) // s: numerators >= 0
    lo_h = tl.maximum(ih + ph - (KH - 1) * dh - 1 + sh, 0) // sh
    hi_h = tl.minimum((ih + ph) // sh + 1, OH)
    lo_w = tl.maximum(iw + pw - (KW - 1) * dw - 1 + sw, 0) // sw
    hi_w = tl.minimum((iw + pw) // sw + 1, OW)
    here = ih * W + iw
    dy_base = dy_ptr + n * sy_n + c * sy_c
    idx_base = idx_ptr + n * si_n + c * si_c
    acc = tl.zeros((BLOCK,), CD)
    for i in range(0, NH):
        oh = lo_h + i
        ok_h = mask & (oh < hi_h)
        for j in range(0, NW):
            ow = lo_w + j
            ok = ok_h & (ow < hi_w)
            if MAX:
                ok = ok & (tl.load(idx_base + oh * si_h + ow * si_w, mask=ok, other=-1) == here)
            g = tl.load(dy_base + oh * sy_h + ow * sy_w, mask=ok, other=0.0).to(CD)
            if not MAX:
                g = g / _avg_divisor(oh, ow, H, W, KH, KW, sh, sw, ph, pw, DIVISOR, COUNT_PAD).to(CD)
            acc += g
    tl.store(dx_ptr + n * sx_n + c * sx_c + ih * sx_h + iw * sx_w, acc.to(dx_ptr.dtype.element_ty), mask=mask)


def _span(t):
    """Elements between ``t``'s first and last element, plus one (0 when empty)."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))


def _meta(buf, *reads):
    """Memory order, compute dtype, offset width and block of a launch writing ``buf`` (N, C, H, W)
    and reading ``reads``."""
    cl = buf.shape[1] > 1 and buf.stride(1) == 1
    cd = tl.float64 if buf.dtype == torch.float64 else tl.float32
    n = buf.numel()
    block = _pow2(min(n, 1 << 14)) if runtime.INTERPRETER else 1024
    wide = max(_span(t) for t in (buf, *reads)) + block >= 1 << 31
    return cdiv(n, block), dict(CL=cl, CD=cd, WIDE=wide, BLOCK=block, num_warps=4)


def pool2d_forward_(out, idx, x, kernel, stride, padding, dilation, divisor=0, count_include_pad=True):
    """``out`` (N, C, OH, OW) = max pool (``idx`` an int64 buffer shaped like ``out`` receiving
    the flat (H, W) index of each maximum) or, with ``idx`` None, average pool of ``x`` (N, C, H, W).
    ``idx`` must have ``out``'s strides (dense NCHW or channels-last: contiguous stores)."""
    if out.numel() == 0:
        return out
    grid, meta = _meta(out, x, *(() if idx is None else (idx,)))
    launch(_pool_fwd_kernel, (grid,), x, out, out if idx is None else idx, out.numel(), x.shape[1], x.shape[2],
           x.shape[3], out.shape[2], out.shape[3], *kernel, *stride, *padding, *dilation, divisor,
           *x.stride(), *out.stride(), MAX=idx is not None, COUNT_PAD=count_include_pad, **meta)
    return out


def pool2d_backward_(dx, dy, idx, kernel, stride, padding, dilation, divisor=0, count_include_pad=True):
    """``dx`` (N, C, H, W) = the input gradient of max pool (``idx`` from the forward) or, with
    ``idx`` None, of average pool, from ``dy`` (N, C, OH, OW) with any strides. Every element of
    ``dx`` is written (no zero fill); its stores are contiguous when it is dense NCHW or
    channels-last."""
    if dx.numel() == 0:
        return dx
    grid, meta = _meta(dx, dy, *(() if idx is None else (idx,)))
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    nh, nw = cdiv((kh - 1) * dh + 1, sh), cdiv((kw - 1) * dw + 1, sw)
    launch(_pool_bwd_kernel, (grid,), dy, dy if idx is None else idx, dx, dx.numel(), dx.shape[1], dx.shape[2],
           dx.shape[3], dy.shape[2], dy.shape[3], *kernel, *stride, *padding, *dilation, divisor, nh, nw,
           *dy.stride(), *(dy if idx is None else idx).stride(), *dx.stride(),
           MAX=idx is not None, COUNT_PAD=count_include_pad, **meta)
    return dx
