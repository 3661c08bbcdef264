"""A stand-in for the SDXL UNet in trainer tests: ``SDXLUNet``'s forward signature and LoRA target
names on a few layers, so a training step is a handful of kernels (fast on the interpreter)."""
from types import SimpleNamespace

import flame
import flame.nn.functional as F
from flame import nn

DIMS = SimpleNamespace(in_channels=4, cross_attention_dim=16, pooled_dim=8, sample_size=4)


class _Attention(nn.Module):
    def __init__(self, dim, context_dim):
        super().__init__()
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x, context):
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        return self.to_out[0](F.scaled_dot_product_attention(q, k, v))


class StandInUNet(nn.Module):
    """``SDXLUNet``'s forward signature on a few layers: latent pixels as tokens, a timestep and
    pooled embedding added, one cross-attention block (to_q/to_k/to_v/to_out.0) over the text."""

    def __init__(self, dims=DIMS, width=16, dtype=None):
        super().__init__()
        self.config = dims
        self.proj_in = nn.Linear(dims.in_channels, width, dtype=dtype)
        self.cond = nn.Linear(dims.pooled_dim + 1, width, dtype=dtype)
        self.attn2 = _Attention(width, dims.cross_attention_dim)
        self.proj_out = nn.Linear(width, dims.in_channels, dtype=dtype)
        self.attn2.to(dtype or flame.float32)

    @property
    def dtype(self):
        return self.proj_in.weight.dtype

    def enable_gradient_checkpointing(self, enabled=True):
        self.checkpointing = enabled
        return self

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        B, C, H, W = sample.shape
        dt = self.dtype
        x = sample.to(dt).permute(0, 2, 3, 1).reshape(B, H * W, C)
        t = (timestep.to(flame.float32) * 0.001).reshape(B, 1)
        cond = self.cond(flame.cat([text_embeds.to(flame.float32), t], -1).to(dt)).reshape(B, 1, -1)
        h = self.proj_in(x) + cond
        h = h + self.attn2(h, encoder_hidden_states.to(dt))
        return self.proj_out(h).reshape(B, H, W, C).permute(0, 3, 1, 2)
