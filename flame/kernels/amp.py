"""Loss-scaler kernels: a multi-tensor non-finite check (optionally unscaling in place) and the
device-side scale update, so a training step with dynamic loss scaling never syncs with the host.

The check reuses the optimizer's multi-tensor tables (``flame.kernels.optim.Tables``: per tensor a
row whose slot 1 is the gradient pointer and slot 4 its element count, and one work item per
``CHUNK`` elements): one launch per gradient dtype covers every gradient.
"""
import triton
import triton.language as tl

from .launch import launch
from .optim import ROW, Tables, tl_dtype

_ROW = tl.constexpr(ROW)


@triton.jit
def _check_kernel(tensors_ptr, work_ptr, found_ptr, inv_ptr,
                  G_DTYPE: tl.constexpr, UNSCALE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # found[0] = 1 if any g is inf or NaN (programs only ever write 1: the flag is cleared by the
    # update kernel); with UNSCALE, g *= inv_scale in place (fp32 math, stored in g's dtype).
    w = tl.program_id(0).to(tl.int64)
    row = tensors_ptr + _ROW * tl.load(work_ptr + 2 * w)
    start = tl.load(work_ptr + 2 * w + 1)
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    n = tl.load(row + 4)
    bad = tl.zeros((BLOCK,), tl.int32)
    if UNSCALE:
        inv = tl.load(inv_ptr)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        nonfinite = (g != g) | (tl.abs(g) == float("inf"))
        bad = tl.where(nonfinite, 1, bad)
        if UNSCALE:
            tl.store(g_ptr + idx, (g * inv).to(G_DTYPE), mask=mask)
    any_bad = tl.max(bad, axis=0)
    tl.store(found_ptr, any_bad, mask=any_bad > 0)


@triton.jit
def _f64(hi, lo):
    return tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit(do_not_specialize=["g_hi", "g_lo", "b_hi", "b_lo", "interval"])
def _update_kernel(scale_ptr, inv_ptr, tracker_ptr, found_ptr, g_hi, g_lo, b_hi, b_lo, interval):
    # PyTorch's _amp_update_scale_, then found[1] = found[0] (the last verdict) and found[0] = 0:
    #   found:  scale *= backoff; tracker = 0
    #   clean:  tracker += 1; if tracker == interval: scale *= growth (only if finite); tracker = 0
    # and inv_scale = fp32(1 / fp64(scale)), the reciprocal every unscale multiplies by.
    s = tl.load(scale_ptr)
    t = tl.load(tracker_ptr)
    f = tl.load(found_ptr)
    s64 = s.to(tl.float64)
    backed = (s64 * _f64(b_hi, b_lo)).to(tl.float32)
    grown = (s64 * _f64(g_hi, g_lo)).to(tl.float32)
    successful = t + 1
    grow = successful == interval
    finite = tl.abs(grown) < float("inf")
    new_s = tl.where(f != 0, backed, tl.where(grow & finite, grown, s))
    new_t = tl.where((f != 0) | grow, 0, successful)
    tl.store(scale_ptr, new_s)
    tl.store(tracker_ptr, new_t)
    tl.store(inv_ptr, (1.0 / new_s.to(tl.float64)).to(tl.float32))
    tl.store(found_ptr + 1, f)
    tl.store(found_ptr, f * 0)


def check_(tables, g_dtype, found, inv_scale=None):
    """found[0] = 1 if any gradient in ``tables`` is non-finite; with ``inv_scale`` (fp32, one
    element) also multiply every gradient by it in place. One launch."""
    if tables.num_work == 0:
        return
    launch(_check_kernel, (tables.num_work,), tables.tensors, tables.work, found,
           inv_scale if inv_scale is not None else found, G_DTYPE=tl_dtype(g_dtype), UNSCALE=inv_scale is not None,
           CHUNK=tables.chunk, BLOCK=tables.block, num_warps=4)


def update_(scale, inv_scale, tracker, found, growth_hilo, backoff_hilo, interval):
    """The device-side scale update (one launch of one program)."""
    launch(_update_kernel, (1,), scale, inv_scale, tracker, found, *growth_hilo, *backoff_hilo, int(interval))


__all__ = ["Tables", "check_", "update_"]
