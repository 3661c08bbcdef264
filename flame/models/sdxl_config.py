"""The SDXL UNet's architecture (``SDXLUNetConfig``), apart from the model so that the checkpoint
name map (``flame.models.sdxl_keys``) and the model (``flame.models.sdxl_unet``) both read it."""
from __future__ import annotations

import dataclasses

from .checkpoints import sort_config

_DOWN_TYPES = ("DownBlock2D", "CrossAttnDownBlock2D")
_UP_TYPES = ("UpBlock2D", "CrossAttnUpBlock2D")

# diffusers config keys whose value must be what SDXL uses (anything else is another architecture).
_FIXED = {
    "act_fn": ("silu",), "addition_embed_type": ("text_time",), "attention_type": ("default",),
    "center_input_sample": (False,), "class_embed_type": (None,), "class_embeddings_concat": (False,),
    "conv_in_kernel": (3,), "conv_out_kernel": (3,), "cross_attention_norm": (None,), "downsample_padding": (1,),
    "dropout": (0.0,), "dual_cross_attention": (False,), "encoder_hid_dim": (None,),
    "encoder_hid_dim_type": (None,), "mid_block_only_cross_attention": (None, False),
    "mid_block_type": ("UNetMidBlock2DCrossAttn",), "num_attention_heads": (None,), "num_class_embeds": (None,),
    "only_cross_attention": (False,), "resnet_skip_time_act": (False,), "resnet_time_scale_shift": ("default",),
    "reverse_transformer_layers_per_block": (None,), "time_cond_proj_dim": (None,),
    "time_embedding_act_fn": (None,), "time_embedding_dim": (None,), "time_embedding_type": ("positional",),
    "timestep_post_act": (None,), "use_linear_projection": (True,),
}
# keys that change nothing here: addition_embed_type_num_heads only matters for other embed types, and
# upcast_attention only for diffusers' non-SDPA attention path (flame's kernels keep softmax in fp32).
_IGNORED = ("addition_embed_type_num_heads", "upcast_attention")


def _per_block(value, n, name):
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
    if len(values) != n:
        raise ValueError(f"SDXLUNetConfig: {name} has {len(values)} entries, expected one per block ({n})")
    return values


@dataclasses.dataclass(frozen=True)
class SDXLUNetConfig:
    """The UNet's architecture, with diffusers' config names; the defaults are stable-diffusion-xl-base-1.0.

    ``attention_head_dim`` keeps diffusers' legacy meaning: the **number of heads** per block (head
    size = channels / heads, 64 in SDXL). ``projection_class_embeddings_input_dim`` = pooled text
    embedding width + 6 x ``addition_time_embed_dim`` (the six size/crop ids).

    ``SDXLUNetConfig.tiny()`` is the test/CPU-demo config: the same block structure (DownBlock2D, two
    CrossAttnDownBlock2D, the cross-attention mid block, two CrossAttnUpBlock2D, UpBlock2D; two resnets
    per down block, three per up block, so the LDM name map is SDXL's) with small widths:

    - block_out_channels (32, 48, 64): three different widths, so a wrong skip or channel wiring is a
      shape error rather than a silent bug; up-block resnet inputs 128, 128, 112 / 112, 96, 80 / 80, 64, 64;
    - norm_num_groups 8 (4 to 16 channels per group, as SDXL's 10 to 80 keeps statistics over
      several channels; 32 groups would leave one channel per group at width 32);
    - attention_head_dim (1, 2, 4) heads: head sizes 24 (not a power of two: exercises the attention
      kernel's masks) and 16; transformer depth 1 everywhere (11 transformer blocks, SDXL 70): the
      forward is depth-agnostic and SDXL's per-level depths (1, 2, 10) are checked through the
      full config's names, so the tiny one saves the launches (a CPU test or demo step is bound
      by the interpreter's per-launch cost);
    - cross_attention_dim 32, pooled text embedding 16, addition_time_embed_dim 8 (input 16 + 6 x 8 = 64);
      time embedding 4 x 32 = 128 wide;
    - sample_size 16 (latent 16x16 -> 8x8 -> 4x4).
    About 2.1 M parameters (500 tensors). Through Triton's interpreter a forward is about 550 kernel
    launches and costs 5 to 10 s whatever the latent size (per-launch cost dominates); tests use 8x8
    latents.
    """

    sample_size: int = 128
    in_channels: int = 4
    out_channels: int = 4
    down_block_types: tuple = ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
    up_block_types: tuple = ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")
    block_out_channels: tuple = (320, 640, 1280)
    layers_per_block: int = 2
    transformer_layers_per_block: tuple = (1, 2, 10)
    attention_head_dim: tuple = (5, 10, 20)
    cross_attention_dim: int = 2048
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    addition_time_embed_dim: int = 256
    projection_class_embeddings_input_dim: int = 2816
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    mid_block_scale_factor: float = 1.0
    resnet_out_scale_factor: float = 1.0

    def __post_init__(self):
        n = len(self.block_out_channels)
        fix = {"down_block_types": tuple(self.down_block_types), "up_block_types": tuple(self.up_block_types),
               "block_out_channels": tuple(int(c) for c in self.block_out_channels),
               "transformer_layers_per_block": _per_block(self.transformer_layers_per_block, n,
                                                          "transformer_layers_per_block"),
               "attention_head_dim": _per_block(self.attention_head_dim, n, "attention_head_dim")}
        for k, v in fix.items():
            object.__setattr__(self, k, v)
        if n == 0 or len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ValueError(f"SDXLUNetConfig: down_block_types {self.down_block_types}, up_block_types "
                             f"{self.up_block_types} and block_out_channels {self.block_out_channels} "
                             "must have the same non-zero length")
        bad = [t for t in self.down_block_types if t not in _DOWN_TYPES] + \
              [t for t in self.up_block_types if t not in _UP_TYPES]
        if bad:
            raise ValueError(f"SDXLUNetConfig: unsupported block type(s) {bad}; down blocks are one of "
                             f"{_DOWN_TYPES}, up blocks one of {_UP_TYPES}")
        if isinstance(self.layers_per_block, (tuple, list)) or self.layers_per_block < 1:
            raise ValueError(f"SDXLUNetConfig: layers_per_block must be a positive int (the same for every "
                             f"block), got {self.layers_per_block!r}")
        g = self.norm_num_groups
        widths = set(self.block_out_channels)
        for level, (c, heads) in enumerate(zip(self.block_out_channels, self.attention_head_dim)):
            if c % heads:
                raise ValueError(f"SDXLUNetConfig: block {level} has {c} channels, not divisible by "
                                 f"{heads} attention heads")
        for cin, _ in self.up_resnet_channels():
            widths.add(cin)
        if any(w % g for w in widths):
            raise ValueError(f"SDXLUNetConfig: norm_num_groups={g} must divide every GroupNorm width, got "
                             f"{sorted(widths)}")
        if self.pooled_dim <= 0:
            raise ValueError(f"SDXLUNetConfig: projection_class_embeddings_input_dim "
                             f"({self.projection_class_embeddings_input_dim}) must exceed 6 x addition_time_embed_dim "
                             f"({6 * self.addition_time_embed_dim})")

    @classmethod
    def tiny(cls) -> SDXLUNetConfig:
        """The small SDXL-shaped config documented in the class docstring."""
        return cls(sample_size=16, block_out_channels=(32, 48, 64), transformer_layers_per_block=(1, 1, 1),
                   attention_head_dim=(1, 2, 4), cross_attention_dim=32, norm_num_groups=8,
                   addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8)

    # ---- derived sizes -----------------------------------------------------------------------
    @property
    def pooled_dim(self) -> int:
        """Width of the pooled text embedding (1280 for SDXL's CLIP-G)."""
        return self.projection_class_embeddings_input_dim - 6 * self.addition_time_embed_dim

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.block_out_channels[0]

    def up_resnet_channels(self):
        """(input, output) channels of every up-block resnet, in module order (skip concat included)."""
        out = []
        rev = self.block_out_channels[::-1]
        prev = rev[0]
        for i, c in enumerate(rev):
            skip_last = rev[min(i + 1, len(rev) - 1)]
            for j in range(self.layers_per_block + 1):
                cin = (prev if j == 0 else c) + (skip_last if j == self.layers_per_block else c)
                out.append((cin, c))
            prev = c
        return out

    # ---- diffusers interop -------------------------------------------------------------------
    def to_diffusers(self) -> dict:
        """kwargs for ``diffusers.UNet2DConditionModel(**...)`` building the same model."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("down_block_types", "up_block_types", "block_out_channels", "transformer_layers_per_block",
                  "attention_head_dim"):
            d[k] = list(d[k])
        d.update(act_fn="silu", addition_embed_type="text_time", mid_block_type="UNetMidBlock2DCrossAttn",
                 use_linear_projection=True, downsample_padding=1)
        return d

    @classmethod
    def from_diffusers(cls, config: dict) -> SDXLUNetConfig:
        """From a diffusers ``unet/config.json`` dict; raises ValueError for settings this model
        does not implement (another addition embedding, conv projections, class embeddings, ...)."""
        kwargs, problems = sort_config(cls, config, _FIXED, ignored=_IGNORED)
        for k in ("layers_per_block", "cross_attention_dim"):  # diffusers allows one per block
            v = kwargs.get(k)
            if isinstance(v, (tuple, list)):
                if len(set(v)) != 1:
                    problems.append(f"{k}={v!r} (must be the same for every block)")
                else:
                    kwargs[k] = v[0]
        if problems:
            raise ValueError("SDXLUNetConfig.from_diffusers: unsupported UNet config: " + "; ".join(problems))
        return cls(**kwargs)
