"""SDXL's and Flux.1's VAE: diffusers 0.42's ``AutoencoderKL`` on flame's modules and ops.

Parameter names and shapes are diffusers' (``state_dict`` keys match 1:1), so a diffusers ``vae/``
folder loads by name; original LDM checkpoints (a full SDXL file's ``first_stage_model.`` part, or
a standalone VAE file such as Black Forest Labs' ``ae.safetensors``) load through ``ldm_to_diffusers_vae``.
Flux.1's VAE is SDXL's architecture with 16 latent channels, no quant convs and shifted latents
(``AutoencoderKLConfig.flux()``).

Architecture (n = len(block_out_channels) levels; every GroupNorm has eps 1e-6):

- encoder: conv_in 3x3 -> per level ``layers_per_block`` resnets and, except at the last level, a
  downsampler (zero padding of one row at the bottom and one column at the right, then a 3x3
  stride-2 convolution without padding) -> mid block (resnet, single-head self-attention over the
  h*w positions, resnet) -> GroupNorm+SiLU -> conv_out 3x3 to 2 x latent_channels (mean and log
  variance) -> quant_conv 1x1;
- decoder: post_quant_conv 1x1 -> conv_in 3x3 -> mid block -> per level, widest first,
  ``layers_per_block + 1`` resnets and, except at the last, an upsampler (nearest x2, 3x3 conv)
  -> GroupNorm+SiLU -> conv_out 3x3;
- resnet: x + conv2(silu(norm2(conv1(silu(norm1(x)))))), x through a 1x1 ``conv_shortcut`` when
  the width changes (no time embedding);
- attention: GroupNorm, then q/k/v/out projections with bias, softmax(q k^T / sqrt(C)) v with one
  head of size C (512 in SDXL), plus the input.

Layout: activations are (B, C, H, W) with channels-last strides end to end, as in
``flame.models.sdxl_unet`` (the leaf-layer factory and layout helpers of ``flame.models.blocks``):
convolutions, GroupNorm(+SiLU, one fused kernel) and upsampling read and write that layout;
residual adds, padding and tile blending run on the (B, H, W, C) permuted view so their outputs
stay channels-last; the attention projections use its (B, H*W, C) view without a copy.

Precision: fp32 and bf16. SDXL's VAE overflows fp16's range (activations above 65504 in the
decoder give inf/NaN images), which its config marks with ``force_upcast: true``: such a config
refuses an fp16 model with a ValueError (build it in fp32 or bf16); a VAE fine-tuned for fp16
(``force_upcast: false``, e.g. the "fp16-fix" SDXL VAE) may be fp16.

Tiling (``tiled_encode``, ``tiled_decode`` and the ``tile`` argument of the helpers) runs the
network on overlapping tiles and blends the seams linearly, as diffusers' ``tiled_encode`` /
``tiled_decode`` do, so memory is bounded by one tile's activations whatever the image size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import re
from collections import OrderedDict

import numpy as np

from .. import nn, runtime
from ..nn import functional as F
from ..ops.creation import randn_like, tensor
from ..ops.elementwise import clamp, exp, to
from ..ops.shape import cat
from ..tensor import Tensor, check_dtype, float16
from .blocks import LeafLayers, Upsample2D, nchw, nhwc, norm_silu, skeleton_shapes
from .checkpoints import Source, load_pretrained, sort_config, stored_tensors

_EPS = 1e-6  # every GroupNorm of diffusers' VAE encoder and decoder
_LOGVAR_RANGE = (-30.0, 20.0)  # diffusers' DiagonalGaussianDistribution clamps the log variance to this

# diffusers config keys whose value must be the one this model implements; the block types are
# checked per block in from_diffusers.
_FIXED = {"act_fn": ("silu",), "latents_mean": (None,), "latents_std": (None,)}
_BLOCK_TYPES = {"down_block_types": "DownEncoderBlock2D", "up_block_types": "UpDecoderBlock2D"}
# what Flux.1's VAE changes in SDXL's (black-forest-labs/FLUX.1-dev vae/config.json)
_FLUX_LATENTS = {"latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
                 "use_post_quant_conv": False}


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig:
    """The VAE's architecture and latent scaling, with diffusers' config names; the defaults are
    SDXL's (``stabilityai/sdxl-vae``: 4 levels of 128, 256, 512, 512 channels, 2 resnets per
    encoder level, 8x downsampling, 4 latent channels, scaling factor 0.13025); ``flux()`` is Flux.1's.

    ``sample_size`` is the default tile size (in pixels) of the tiled paths, as in diffusers.
    ``scaling_factor`` and ``shift_factor`` relate the VAE's latents z to the diffusion model's:
    scaled = (z - shift_factor) * scaling_factor (no shift when None). ``force_upcast`` marks a VAE
    that overflows in fp16 (see the module docstring)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 4
    block_out_channels: tuple = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    sample_size: int = 1024
    scaling_factor: float = 0.13025
    shift_factor: float | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self):
        object.__setattr__(self, "block_out_channels", tuple(self.block_out_channels))
        problems = []
        for name in ("in_channels", "out_channels", "latent_channels", "layers_per_block", "norm_num_groups",
                     "sample_size"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                problems.append(f"{name} must be a positive int, got {v!r}")
        widths = self.block_out_channels
        if not widths or any(not isinstance(c, numbers.Integral) or isinstance(c, bool) or c < 1 for c in widths):
            problems.append(f"block_out_channels must be a non-empty sequence of positive ints, got {widths!r}")
        elif isinstance(self.norm_num_groups, numbers.Integral) and self.norm_num_groups > 0 \
                and any(c % self.norm_num_groups for c in widths):
            problems.append(f"norm_num_groups={self.norm_num_groups} must divide every block width {widths}")
        if not isinstance(self.scaling_factor, numbers.Real) or not self.scaling_factor > 0:
            problems.append(f"scaling_factor must be a positive number, got {self.scaling_factor!r}")
        if self.shift_factor is not None and not isinstance(self.shift_factor, numbers.Real):
            problems.append(f"shift_factor must be a number or None, got {self.shift_factor!r}")
        if problems:
            raise ValueError("AutoencoderKLConfig: " + "; ".join(problems))

    @classmethod
    def sdxl(cls) -> AutoencoderKLConfig:
        """SDXL's VAE (the defaults)."""
        return cls()

    @classmethod
    def tiny(cls) -> AutoencoderKLConfig:
        """The test/CPU-demo config: two levels of 8 and 16 channels (2x downsampling, so every
        kind of block and a width-changing resnet in each half), one resnet per encoder level,
        4 groups (2 to 4 channels per group), SDXL's latent channels and scaling; sample_size 16
        (the default tile). 43,711 parameters (124 tensors); through Triton's interpreter an
        encode is about 60 kernel launches and a decode about 75, each GroupNorm three of them."""
        return cls(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, sample_size=16)

    @classmethod
    def flux(cls) -> AutoencoderKLConfig:
        """Flux.1's VAE (``black-forest-labs/FLUX.1-dev``'s ``vae/``, BFL's ``ae.safetensors``): SDXL's
        architecture with 16 latent channels and neither quant conv; scaled latents (z - 0.1159) * 0.3611."""
        return cls(**_FLUX_LATENTS)

    @classmethod
    def tiny_flux(cls) -> AutoencoderKLConfig:
        """``tiny()`` with Flux.1's latents: 16 channels, no quant convs, Flux's shift and scaling."""
        return dataclasses.replace(cls.tiny(), **_FLUX_LATENTS)

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent pixel along each side (8 in SDXL)."""
        return 2 ** (len(self.block_out_channels) - 1)

    # ---- diffusers interop -------------------------------------------------------------------
    def to_diffusers(self) -> dict:
        """kwargs for ``diffusers.AutoencoderKL(**...)`` building the same model."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        n = len(self.block_out_channels)
        d["block_out_channels"] = list(self.block_out_channels)
        d.update({k: [t] * n for k, t in _BLOCK_TYPES.items()}, act_fn="silu")
        return d

    @classmethod
    def from_diffusers(cls, config: dict) -> AutoencoderKLConfig:
        """From a diffusers ``vae/config.json`` dict; raises ValueError for settings this model does
        not implement (other block types or activations, per-channel latent statistics, ...)."""
        kwargs, problems = sort_config(cls, config, _FIXED, ignored=_BLOCK_TYPES)
        n = len(kwargs.get("block_out_channels", cls.block_out_channels))
        for k, block in _BLOCK_TYPES.items():
            types = list(config.get(k, [block] * n))
            if types != [block] * n:
                problems.append(f"{k}={types!r} (supported: {n} x {block!r}, one per block_out_channels entry)")
        size = kwargs.get("sample_size")
        if isinstance(size, (list, tuple)):  # diffusers allows (h, w); tiles here are square
            if len(set(size)) != 1:
                problems.append(f"sample_size={size!r} (tiles are square: give one size)")
            else:
                kwargs["sample_size"] = size[0]
        if problems:
            raise ValueError("AutoencoderKLConfig.from_diffusers: unsupported VAE config: " + "; ".join(problems))
        return cls(**kwargs)


# ---- blocks ---------------------------------------------------------------------------------------

class ResnetBlock2D(nn.Module):
    """GroupNorm+SiLU -> conv3x3 -> GroupNorm+SiLU -> conv3x3, plus the input (through a 1x1
    ``conv_shortcut`` when the width changes)."""

    def __init__(self, L, cin, cout, groups):
        super().__init__()
        self.norm1 = L.group_norm(groups, cin, _EPS)
        self.conv1 = L.conv(cin, cout, 3, padding=1)
        self.norm2 = L.group_norm(groups, cout, _EPS)
        self.conv2 = L.conv(cout, cout, 3, padding=1)
        self.conv_shortcut = L.conv(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv1(norm_silu(self.norm1, x))
        h = self.conv2(norm_silu(self.norm2, h))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return nchw(nhwc(x) + nhwc(h))


class Attention(nn.Module):
    """The mid block's single-head self-attention over the H*W positions, residual. ``to_out.1``
    is diffusers' dropout (p = 0, no parameters)."""

    def __init__(self, L, c, groups):
        super().__init__()
        self.group_norm = L.group_norm(groups, c, _EPS)
        self.to_q = L.linear(c, c)
        self.to_k = L.linear(c, c)
        self.to_v = L.linear(c, c)
        self.to_out = nn.ModuleList([L.linear(c, c), nn.Dropout(0.0)])

    def forward(self, x):
        B, C, H, W = x.shape
        n = self.group_norm
        h = F.group_norm(x, n.num_groups, n.weight, n.bias, n.eps)
        h = nhwc(h).reshape(B, H * W, C)  # a view of the channels-last output
        # one head of size C: (B, 1, H*W, C); scale 1/sqrt(C), as diffusers
        q, k, v = (proj(h).reshape(B, 1, H * W, C) for proj in (self.to_q, self.to_k, self.to_v))
        o = self.to_out[0](F.scaled_dot_product_attention(q, k, v).reshape(B, H * W, C))
        return nchw(o.reshape(B, H, W, C) + nhwc(x))


class Downsample2D(nn.Module):
    """Pad one zero row at the bottom and one zero column at the right, then a 3x3 stride-2
    convolution without padding: (H, W) -> (H/2, W/2)."""

    def __init__(self, L, c):
        super().__init__()
        self.conv = L.conv(c, c, 3, stride=2)

    def forward(self, x):
        # F.pad lists the last dim first: on the (B, H, W, C) view that is C (none), W and H (0 before, 1 after)
        return self.conv(nchw(F.pad(nhwc(x), (0, 0, 0, 1, 0, 1))))


class _Block(nn.Module):
    """DownEncoderBlock2D / UpDecoderBlock2D: resnets (the first one changing the width), then the
    optional resampler registered under ``resampler_name``."""

    def __init__(self, L, cin, cout, count, groups, resampler, resampler_name):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(L, cin if j == 0 else cout, cout, groups) for j in range(count)])
        self.resampler_name = resampler_name
        setattr(self, resampler_name, nn.ModuleList([resampler(L, cout)]) if resampler is not None else None)

    def forward(self, h):
        for resnet in self.resnets:
            h = resnet(h)
        resamplers = getattr(self, self.resampler_name)
        return resamplers[0](h) if resamplers is not None else h


class UNetMidBlock2D(nn.Module):
    """resnet -> attention (when ``add_attention``) -> resnet, at constant width."""

    def __init__(self, L, c, groups, add_attention):
        super().__init__()
        self.attentions = nn.ModuleList([Attention(L, c, groups)]) if add_attention else None
        self.resnets = nn.ModuleList([ResnetBlock2D(L, c, c, groups) for _ in range(2)])

    def forward(self, h):
        h = self.resnets[0](h)
        if self.attentions is not None:
            h = self.attentions[0](h)
        return self.resnets[1](h)


class Encoder(nn.Module):
    def __init__(self, L, cfg):
        super().__init__()
        widths, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = L.conv(cfg.in_channels, widths[0], 3, padding=1)
        self.down_blocks = nn.ModuleList([
            _Block(L, widths[max(i - 1, 0)], c, cfg.layers_per_block, g,
                   Downsample2D if i < len(widths) - 1 else None, "downsamplers")
            for i, c in enumerate(widths)])
        self.mid_block = UNetMidBlock2D(L, widths[-1], g, cfg.mid_block_add_attention)
        self.conv_norm_out = L.group_norm(g, widths[-1], _EPS)
        self.conv_out = L.conv(widths[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.down_blocks:
            h = block(h)
        h = self.mid_block(h)
        return self.conv_out(norm_silu(self.conv_norm_out, h))


class Decoder(nn.Module):
    def __init__(self, L, cfg):
        super().__init__()
        rev, g = cfg.block_out_channels[::-1], cfg.norm_num_groups
        self.conv_in = L.conv(cfg.latent_channels, rev[0], 3, padding=1)
        # registered before the mid block, as diffusers does: state_dict order is diffusers'
        self.up_blocks = nn.ModuleList([
            _Block(L, rev[max(i - 1, 0)], c, cfg.layers_per_block + 1, g,
                   Upsample2D if i < len(rev) - 1 else None, "upsamplers")
            for i, c in enumerate(rev)])
        self.mid_block = UNetMidBlock2D(L, rev[0], g, cfg.mid_block_add_attention)
        self.conv_norm_out = L.group_norm(g, rev[-1], _EPS)
        self.conv_out = L.conv(rev[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z):
        h = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(norm_silu(self.conv_norm_out, h))


class DiagonalGaussian:
    """The encoder's posterior: independent normals per latent element. ``mean`` and ``logvar``
    (clamped to [-30, 20], as diffusers) are the two channel halves of the moments; ``std`` =
    exp(logvar / 2)."""

    def __init__(self, moments: Tensor):
        c = moments.shape[1] // 2
        self.mean = moments[:, :c]
        self.logvar = clamp(moments[:, c:], *_LOGVAR_RANGE)
        self.std = exp(self.logvar * 0.5)

    def sample(self, noise: Tensor | None = None) -> Tensor:
        """mean + std * noise, ``noise`` standard normal of the mean's shape: the caller's, or drawn
        with flame's RNG (``flame.manual_seed``) when None."""
        if noise is None:
            noise = randn_like(self.mean)
        elif not isinstance(noise, Tensor):
            raise TypeError(f"DiagonalGaussian.sample: noise must be a flame Tensor or None, got "
                            f"{type(noise).__name__}")
        elif noise.shape != self.mean.shape:
            raise ValueError(f"DiagonalGaussian.sample: noise must have the latents' shape {self.mean.shape}, "
                             f"got {noise.shape}")
        return self.mean + self.std * to(noise, self.mean.dtype)

    def mode(self) -> Tensor:
        """The most likely latents: the mean."""
        return self.mean


# ---- tiles ----------------------------------------------------------------------------------------

def _blend(a: Tensor, b: Tensor, extent: int, dim: int) -> Tensor:
    """``b`` with its first e = min(extent, both sizes) positions along ``dim`` (1: rows, 2:
    columns of (B, H, W, C) tiles) faded in from ``a``'s last e, which cover the same pixels:
    b'[y] = a[-e + y] * (1 - y/e) + b[y] * y/e, computed in fp32 (the weights rounded once from
    float64, as diffusers' Python scalars are)."""
    e = min(a.shape[dim], b.shape[dim], extent)
    if e == 0:
        return b
    ramp = np.arange(e) / e
    shape = [1, 1, 1, 1]
    shape[dim] = e
    fade_out, fade_in = (tensor(w.astype(np.float32).reshape(shape)) for w in (1 - ramp, ramp))
    mixed = a.narrow(dim, a.shape[dim] - e, e) * fade_out + b.narrow(dim, 0, e) * fade_in
    return cat([to(mixed, b.dtype), b.narrow(dim, e, b.shape[dim] - e)], dim)


def _tiled(run, x: Tensor, size: int, stride: int, blend: int, keep: int) -> Tensor:
    """``run`` over the ``size`` x ``size`` tiles of ``x`` (B, C, H, W) starting every ``stride``
    input pixels (the last ones in each direction smaller), assembled as diffusers does: each output
    tile is blended over ``blend`` output pixels with the (already blended) tile above and the one
    to its left, then its top-left ``keep`` x ``keep`` is kept. Only the previous row of tiles is
    held; each tile's activations are released when ``run`` returns (unless autograd records them)."""
    above, rows = None, []
    for i in range(0, x.shape[2], stride):
        row, pieces = [], []
        for col, j in enumerate(range(0, x.shape[3], stride)):
            t = nhwc(run(x[:, :, i:i + size, j:j + size]))
            if above is not None:
                t = _blend(above[col], t, blend, 1)
            if row:
                t = _blend(row[-1], t, blend, 2)
            row.append(t)
            pieces.append(t[:, :keep, :keep])
        rows.append(cat(pieces, 2))
        above = row
    return nchw(cat(rows, 1))


# ---- the model ------------------------------------------------------------------------------------

class AutoencoderKL(nn.Module):
    """The VAE with diffusers' parameter names.

    ``AutoencoderKL(config=None, dtype=None)``: random init in ``dtype`` (flame's default when None;
    fp16 is refused when ``config.force_upcast``); ``config`` defaults to SDXL's.

    Images are (B, in_channels, H, W) in [-1, 1] with H and W multiples of ``downsample_factor``
    (8 in SDXL); latents are (B, latent_channels, H/8, W/8). Inputs of any float dtype are cast to
    the model's; outputs are in the model's dtype, channels-last. ``encode``/``decode`` work on the
    VAE's own (unscaled) latents; ``encode_latents``/``decode_latents`` on the diffusion model's
    (scaled) ones. Converting images to uint8 (clamping to [-1, 1] first) is the caller's.
    """

    def __init__(self, config: AutoencoderKLConfig | None = None, dtype=None, *, _layers: LeafLayers | None = None):
        super().__init__()
        cfg = config if config is not None else AutoencoderKLConfig()
        if not isinstance(cfg, AutoencoderKLConfig):
            raise TypeError(f"AutoencoderKL: config must be an AutoencoderKLConfig, got {type(cfg).__name__}")
        if _layers is None:
            dtype = check_dtype(dtype or runtime.get_default_dtype())
            if dtype == float16 and cfg.force_upcast:
                raise ValueError("AutoencoderKL: this VAE's config has force_upcast=True: it overflows in float16 "
                                 "(SDXL's VAE gives inf/NaN images); use float32 or bfloat16, or a VAE fine-tuned "
                                 "for float16 (force_upcast=False)")
        self.config = cfg
        L = _layers or LeafLayers(dtype)
        latent2 = 2 * cfg.latent_channels
        self.encoder = Encoder(L, cfg)
        self.decoder = Decoder(L, cfg)
        self.quant_conv = L.conv(latent2, latent2, 1) if cfg.use_quant_conv else None
        self.post_quant_conv = L.conv(cfg.latent_channels, cfg.latent_channels, 1) if cfg.use_post_quant_conv else None

    # ---- structure without memory ----------------------------------------------------------------
    @classmethod
    def parameter_shapes(cls, config: AutoencoderKLConfig | None = None) -> OrderedDict:
        """{state-dict name: shape} of ``config``'s model in ``state_dict`` order, without allocating."""
        return skeleton_shapes(cls(config, _layers=LeafLayers(shapes_only=True)))

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, dtype=None, config: AutoencoderKLConfig | None = None) -> AutoencoderKL:
        """Load a diffusers ``vae/`` folder (or a pipeline folder holding one): config.json plus
        ``diffusion_pytorch_model[.fp16].safetensors`` or its sharded index; or one ``.safetensors``
        file with diffusers or LDM names (a full checkpoint's ``first_stage_model.`` part is taken,
        the rest ignored; BFL's ``ae.safetensors`` has LDM names without the prefix), for which
        ``config`` gives the architecture: when None, ``single_file_config`` reads Flux.1's or SDXL's
        from the file. Weights are cast to ``dtype`` (flame's default when None). Missing, unexpected
        or misshapen tensors raise RuntimeError before anything is loaded."""
        return load_pretrained(cls, path, dtype, config,
                               subfolder="vae", what="VAE", config_class=AutoencoderKLConfig,
                               index=checkpoint_index, default=single_file_config)

    # ---- inputs ----------------------------------------------------------------------------------
    @property
    def dtype(self):
        return self.encoder.conv_in.weight.dtype

    def _check(self, x, what, channels, op):
        """``x`` cast to the model's dtype after checking it is (B, channels, H, W) floating point,
        with H and W positive multiples of the downsampling factor for images."""
        if not isinstance(x, Tensor):
            raise TypeError(f"AutoencoderKL.{op}: {what} must be a flame Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"AutoencoderKL.{op}: {what} must be floating point, got {x.dtype}")
        if x.ndim != 4 or x.shape[1] != channels:
            raise ValueError(f"AutoencoderKL.{op}: {what} must be (B, {channels}, H, W), got shape {x.shape}")
        f = self.config.downsample_factor if what == "images" else 1
        if x.shape[2] < f or x.shape[3] < f or x.shape[2] % f or x.shape[3] % f:
            rule = f"positive multiples of {f}" if f > 1 else "positive"
            raise ValueError(f"AutoencoderKL.{op}: {what} height and width must be {rule}, got "
                             f"{x.shape[2]}x{x.shape[3]}")
        return to(x, self.dtype)

    def _images(self, images, op):
        return self._check(images, "images", self.config.in_channels, op)

    def _latents(self, latents, op):
        return self._check(latents, "latents", self.config.latent_channels, op)

    def _tile_geometry(self, tile, overlap, op):
        """(latent tile, latent stride, latent blend) for a ``tile``-pixel tile overlapping its
        neighbour by the fraction ``overlap``, rounded down to whole latent pixels so that the tiles'
        outputs line up exactly in both spaces (diffusers' sizes whenever tile * overlap is a whole
        number of latent pixels, as SDXL's 1024 x 0.25)."""
        f = self.config.downsample_factor
        tile = self.config.sample_size if tile is None else tile
        if not isinstance(tile, numbers.Integral) or isinstance(tile, bool) or tile < f or tile % f:
            raise ValueError(f"AutoencoderKL.{op}: tile must be a positive multiple of {f} pixels, got {tile!r}")
        if not isinstance(overlap, numbers.Real) or not 0 <= overlap < 1:
            raise ValueError(f"AutoencoderKL.{op}: overlap must be a fraction in [0, 1), got {overlap!r}")
        lt = tile // f
        blend = int(lt * overlap)
        return lt, lt - blend, blend

    # ---- encoding and decoding -------------------------------------------------------------------
    def _moments(self, x):
        h = self.encoder(x)
        return self.quant_conv(h) if self.quant_conv is not None else h

    def _decode(self, z):
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def encode(self, images: Tensor) -> DiagonalGaussian:
        """The posterior over the (unscaled) latents of ``images`` (B, in_channels, H, W) in [-1, 1]."""
        return DiagonalGaussian(self._moments(self._images(images, "encode")))

    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, out_channels, 8h, 8w), about [-1, 1], from unscaled ``latents`` (B, latent_channels, h, w)."""
        return self._decode(self._latents(latents, "decode"))

    def tiled_encode(self, images: Tensor, tile: int | None = None, overlap: float = 0.25) -> DiagonalGaussian:
        """``encode`` on ``tile`` x ``tile``-pixel tiles (default ``config.sample_size``) overlapping by
        ``overlap`` of a tile, their moments blended linearly across the overlap (diffusers'
        ``tiled_encode``). Not equal to ``encode``: each tile's GroupNorm and attention see only the tile."""
        x = self._images(images, "tiled_encode")
        lt, stride, blend = self._tile_geometry(tile, overlap, "tiled_encode")
        f = self.config.downsample_factor
        return DiagonalGaussian(_tiled(self._moments, x, lt * f, stride * f, blend, stride))

    def tiled_decode(self, latents: Tensor, tile: int | None = None, overlap: float = 0.25) -> Tensor:
        """``decode`` on latent tiles of ``tile`` / 8 (default ``config.sample_size`` / 8) overlapping by
        ``overlap`` of a tile, the decoded tiles blended linearly across the overlap (diffusers'
        ``tiled_decode``): memory of one tile's activations, so a 2048 x 2048 decode fits where an
        untiled one would not."""
        z = self._latents(latents, "tiled_decode")
        lt, stride, blend = self._tile_geometry(tile, overlap, "tiled_decode")
        f = self.config.downsample_factor
        return _tiled(self._decode, z, lt, stride, blend * f, stride * f)

    # ---- the diffusion model's latents -----------------------------------------------------------
    def _helper_tile(self, tile, overlap, op):
        """The tile size (pixels) of a helper's ``tile`` argument, checked, or None for no tiling:
        None or False -> None; True -> ``config.sample_size``; an int -> itself."""
        if tile is None or tile is False:
            return None
        size = self.config.sample_size if tile is True else tile
        self._tile_geometry(size, overlap, op)
        return size

    def encode_latents(self, images: Tensor, sample: bool = True, noise: Tensor | None = None,
                       tile: bool | int | None = None, overlap: float = 0.25) -> Tensor:
        """Scaled latents (z - shift_factor) * scaling_factor of ``images``: z sampled from the
        posterior (``noise``, or flame's RNG when None) or its mean when ``sample`` is False.

        ``tile``: None or False (the default, as diffusers without ``enable_tiling``) never tiles;
        True tiles (``tiled_encode``) images larger than ``config.sample_size`` pixels on a side
        with tiles of that size (diffusers' ``enable_tiling``); an int, larger than that many pixels
        with tiles of that size."""
        images = self._images(images, "encode_latents")
        size = self._helper_tile(tile, overlap, "encode_latents")
        if size is not None and max(images.shape[2:]) > size:
            dist = self.tiled_encode(images, size, overlap)
        else:
            dist = DiagonalGaussian(self._moments(images))
        z = dist.sample(noise) if sample else dist.mode()
        if self.config.shift_factor is not None:
            z = z - self.config.shift_factor
        return z * self.config.scaling_factor

    def decode_latents(self, latents: Tensor, tile: bool | int | None = None, overlap: float = 0.25) -> Tensor:
        """Images in about [-1, 1] from the diffusion model's scaled ``latents``: decodes
        latents / scaling_factor + shift_factor. ``tile`` as in ``encode_latents``, for the decoded
        size: True tiles (``tiled_decode``) the latents of images larger than ``config.sample_size``
        pixels (SDXL: above 1024)."""
        z = self._latents(latents, "decode_latents") / self.config.scaling_factor
        if self.config.shift_factor is not None:
            z = z + self.config.shift_factor
        size = self._helper_tile(tile, overlap, "decode_latents")
        if size is not None and max(z.shape[2:]) * self.config.downsample_factor > size:
            return self.tiled_decode(z, size, overlap)
        return self._decode(z)


# ---- checkpoint names -----------------------------------------------------------------------------

LDM_VAE_PREFIX = "first_stage_model."

# diffusers <-> LDM, one rule per kind of module: (diffusers prefix, LDM prefix, {diffusers leaf: LDM leaf}).
# {i}, {j}: level and resnet indices; {u}: decoder level, numbered from the widest in diffusers'
# up_blocks and from the narrowest in LDM's up (so u <-> n - 1 - u); {p}: encoder or decoder.
_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "conv_shortcut": "nin_shortcut"}
_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_RULES = (
    ("encoder.down_blocks.{i}.resnets.{j}", "encoder.down.{i}.block.{j}", _RESNET),
    ("encoder.down_blocks.{i}.downsamplers.0", "encoder.down.{i}.downsample", {"conv": "conv"}),
    ("decoder.up_blocks.{u}.resnets.{j}", "decoder.up.{u}.block.{j}", _RESNET),
    ("decoder.up_blocks.{u}.upsamplers.0", "decoder.up.{u}.upsample", {"conv": "conv"}),
    ("{p}.mid_block.resnets.0", "{p}.mid.block_1", _RESNET),
    ("{p}.mid_block.resnets.1", "{p}.mid.block_2", _RESNET),
    ("{p}.mid_block.attentions.0", "{p}.mid.attn_1", _ATTENTION),
    ("{p}", "{p}", {"conv_in": "conv_in", "conv_norm_out": "norm_out", "conv_out": "conv_out"}),
    ("", "", {"quant_conv": "quant_conv", "post_quant_conv": "post_quant_conv"}),
)
_FIELDS = {"i": r"(?P<i>\d+)", "j": r"(?P<j>\d+)", "u": r"(?P<u>\d+)", "p": r"(?P<p>encoder|decoder)"}


@functools.cache
def _rule_pattern(prefix: str, leaves: tuple) -> re.Pattern:
    head = re.escape(prefix).replace(r"\{", "{").replace(r"\}", "}").format(**_FIELDS)
    leaf = "|".join(re.escape(x) for x in leaves)
    return re.compile((head + r"\." if prefix else "") + rf"(?P<leaf>{leaf})\.(?P<param>weight|bias)")


def _translate(key: str, config, to_ldm: bool) -> str:
    n = len((config if config is not None else AutoencoderKLConfig()).block_out_channels)
    for diffusers_prefix, ldm_prefix, leaves in _RULES:
        src, dst = (diffusers_prefix, ldm_prefix) if to_ldm else (ldm_prefix, diffusers_prefix)
        table = leaves if to_ldm else {v: k for k, v in leaves.items()}
        m = _rule_pattern(src, tuple(table)).fullmatch(key)
        if m is None:
            continue
        fields = m.groupdict()
        leaf, param = table[fields.pop("leaf")], fields.pop("param")
        if "u" in fields:
            if int(fields["u"]) >= n:
                raise ValueError(f"{key!r}: decoder level {fields['u']} is out of range for {n} levels")
            fields["u"] = n - 1 - int(fields["u"])
        head = dst.format(**fields)
        return f"{head}.{leaf}.{param}" if head else f"{leaf}.{param}"
    raise ValueError(f"no {'LDM' if to_ldm else 'diffusers'} name for {key!r}")


def diffusers_to_ldm_vae(key: str, config: AutoencoderKLConfig | None = None) -> str:
    """The LDM name (without ``first_stage_model.``) of a diffusers VAE state-dict key; ``config``
    (default SDXL's) gives the number of levels. Raises ValueError for a key outside the map.
    LDM stores the attention projections q/k/v/proj_out as 1x1 convolutions (C, C, 1, 1)."""
    return _translate(key, config, to_ldm=True)


def ldm_to_diffusers_vae(key: str, config: AutoencoderKLConfig | None = None) -> str:
    """The diffusers name of an LDM VAE key (a leading ``first_stage_model.`` is dropped);
    ``config`` (default SDXL's) gives the number of levels. Raises ValueError for a key outside the map."""
    return _translate(key.removeprefix(LDM_VAE_PREFIX), config, to_ldm=False)


# diffusers' names before 0.14 for the mid-block attention (still found in older vae/ folders)
_LEGACY_ATTENTION = re.compile(r"(.+\.mid_block\.attentions\.0\.)(query|key|value|proj_attn)(\.weight|\.bias)")
_LEGACY_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_PROJECTION = re.compile(r".+\.mid_block\.attentions\.0\.(to_q|to_k|to_v|to_out\.0)\.weight")
_LDM_ROOTS = ("encoder.down.", "encoder.mid.", "decoder.up.", "decoder.mid.")


def checkpoint_index(files, config: AutoencoderKLConfig | None = None) -> dict:
    """{diffusers name: ``Source``} for the VAE tensors of ``files``, whose naming (diffusers, LDM,
    or a full checkpoint's ``first_stage_model.`` part) is detected from the keys. Attention
    projections stored as 1x1 convolutions are read as linear weights. An LDM file's ``loss.``
    tensors (the training loss's discriminator and LPIPS weights) are skipped; other keys outside
    the map keep their name (and so are reported as unexpected)."""
    stored = stored_tensors(files)
    names = list(stored)
    if any(k.startswith(LDM_VAE_PREFIX) for k in names):
        names, ldm = [k for k in names if k.startswith(LDM_VAE_PREFIX)], True
    else:
        ldm = any(k.startswith(_LDM_ROOTS) for k in names)
    if ldm:
        names = [k for k in names if not k.removeprefix(LDM_VAE_PREFIX).startswith("loss.")]
    out = {}
    for k in names:
        file, shape = stored[k]
        name = k
        if ldm:
            with contextlib.suppress(ValueError):  # outside the map: kept, reported as unexpected
                name = ldm_to_diffusers_vae(k, config)
        else:
            m = _LEGACY_ATTENTION.fullmatch(k)
            if m:
                name = m.group(1) + _LEGACY_NAMES[m.group(2)] + m.group(3)
        if _PROJECTION.fullmatch(name) and len(shape) == 4 and shape[2:] == (1, 1):
            shape = shape[:2]
        out[name] = Source(file, k, shape)
    return out


def single_file_config(files) -> AutoencoderKLConfig:
    """The config of a VAE file given without one: ``AutoencoderKLConfig.flux()`` when its tensors
    are Flux.1's (16 latent channels, i.e. a 32-channel ``encoder.conv_out``, and no ``quant_conv``),
    else SDXL's. Only the latent width and the quant convs are read: any other architecture, or
    another VAE with Flux's tensors but its own latent scaling (SD3's), needs its config given."""
    index = checkpoint_index(files)
    flux = AutoencoderKLConfig.flux()
    conv_out = index.get("encoder.conv_out.weight")
    if conv_out is not None and conv_out.shape[0] == 2 * flux.latent_channels and "quant_conv.weight" not in index:
        return flux
    return AutoencoderKLConfig.sdxl()
