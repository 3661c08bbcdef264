"""Tiny Flux transformers for tests: a seeded diffusers ``FluxTransformer2DModel`` of a flame
``FluxConfig`` (biases and norm scales perturbed, so that a swapped or misplaced vector shows), its
weights in Black Forest Labs' single-file layout (written out here from the BFL names, independently
of ``flame.models.flux_keys``), and matching inputs."""
import torch

# diffusers module -> BFL module, for the tensors that are renamed only
_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer"}
_DOUBLE = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin", "attn.to_out.0": "img_attn.proj",
           "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
           "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
           "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2", "attn.norm_q": "norm.query_norm",
           "attn.norm_k": "norm.key_norm"}
# BFL module -> the diffusers modules stacked into it, in row order
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}


def diffusers_flux(cfg, seed=0):
    """A seeded diffusers FluxTransformer2DModel of ``cfg`` (fp32, eval) with its 1-D tensors perturbed."""
    import diffusers
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**cfg.to_diffusers()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _renamed(sd, prefix, bfl_prefix, table, fused, out):
    for d, b in table.items():
        for k in ("weight", "bias"):
            if f"{prefix}{d}.{k}" in sd:
                out[f"{bfl_prefix}{b}.{'scale' if b.endswith('_norm') else k}"] = sd[f"{prefix}{d}.{k}"]
    for b, parts in fused.items():
        for k in ("weight", "bias"):
            out[f"{bfl_prefix}{b}.{k}"] = torch.cat([sd[f"{prefix}{d}.{k}"] for d in parts])


def bfl_state_dict(sd, cfg):
    """diffusers' state dict ``sd`` of ``cfg``'s model in the BFL single-file layout: fused q/k/v (and
    a single block's MLP input) stacked, the final modulation's (scale, shift) halves as (shift, scale)."""
    out = {}
    _renamed(sd, "", "", _TOP, {}, out)
    for k in ("weight", "bias"):
        scale, shift = sd[f"norm_out.linear.{k}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{k}"] = torch.cat([shift, scale])
    for i in range(cfg.num_layers):
        _renamed(sd, f"transformer_blocks.{i}.", f"double_blocks.{i}.", _DOUBLE, _DOUBLE_FUSED, out)
    for i in range(cfg.num_single_layers):
        _renamed(sd, f"single_transformer_blocks.{i}.", f"single_blocks.{i}.", _SINGLE, _SINGLE_FUSED, out)
    return {k: v.contiguous() for k, v in out.items()}


def flux_inputs(cfg, batch=2, n_txt=5, height=6, width=10, guidance=True, seed=1, dtype=torch.float32):
    """diffusers-convention inputs (torch, CPU) for ``cfg``'s model: packed latents of a
    ``height`` x ``width`` latent, ``n_txt`` text tokens, timesteps in [0, 1], ids, guidance."""
    import diffusers
    g = torch.Generator().manual_seed(seed)
    c = cfg.latent_channels
    latents = torch.randn(batch, c, height, width, generator=g)
    inp = {"hidden_states": diffusers.FluxPipeline._pack_latents(latents, batch, c, height, width),
           "encoder_hidden_states": torch.randn(batch, n_txt, cfg.joint_attention_dim, generator=g),
           "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, generator=g),
           "timestep": torch.tensor([0.3, 0.9, 0.55, 0.1])[:batch],
           "img_ids": diffusers.FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, "cpu",
                                                                        torch.float32),
           "txt_ids": torch.zeros(n_txt, 3)}
    if guidance:
        inp["guidance"] = torch.tensor([3.5, 1.0, 2.0, 4.0])[:batch]
    return {k: v.to(dtype) if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v
            for k, v in inp.items()}


# ---- a whole tiny Flux pipeline folder ------------------------------------------------------------

FLUX_MODEL_INDEX = {  # what diffusers' FluxPipeline.save_pretrained writes for these parts
    "_class_name": "FluxPipeline", "feature_extractor": [None, None], "image_encoder": [None, None],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def tiny_pipeline_config():
    """The tiny transformer of the pipeline: ``FluxConfig.tiny()`` taking the tiny CLIP's 12-wide pooled vector."""
    import dataclasses

    from flame.models import FluxConfig
    return dataclasses.replace(FluxConfig.tiny(), pooled_projection_dim=12)


def write_tiny_t5_tokenizer(folder):
    """A fast T5 tokenizer (tokenizer.json only, as transformers saves one built from a ``tokenizers``
    Unigram model; no sentencepiece needed) knowing the letters, "the", "cat" and "a": pad 0, end 1,
    unknown 2, as T5's. Returns the folder."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("\u2581the", -1.0), ("\u2581cat", -1.0),
                                                                     ("\u2581a", -1.5)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    transformers.T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                 extra_ids=0, model_max_length=512).save_pretrained(folder)
    return folder


def write_tiny_flux_pipeline(path, guidance=True):
    """A tiny Flux pipeline folder in diffusers' layout (``path``, created; returned): the tiny
    transformer (``tiny_pipeline_config``; ``guidance``: dev-like, else schnell-like), a two-level
    8-channel VAE with Flux's form (no quant convs, shift and scale, 4 latent channels for the tiny
    transformer's 16 inputs), ``test_clip_text``'s tiny CLIP-L and letter tokenizer, a tiny
    transformers T5 encoder (``T5Config.tiny()``, 32 wide as the transformer's text input) with
    ``write_tiny_t5_tokenizer``'s tokenizer, and Flux-dev's scheduler config. All seeded random."""
    import dataclasses
    import json

    import diffusers
    import transformers
    from test_clip_text import write_tiny_clip_tokenizer

    from flame.diffusion.samplers import FLUX_SCHEDULER_CONFIG
    from flame.models.clip_text import CLIPTextConfig
    from flame.models.t5 import T5Config

    path.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(tiny_pipeline_config(), guidance_embeds=guidance)
    diffusers_flux(cfg).save_pretrained(path / "transformer")
    torch.manual_seed(1)
    diffusers.AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=cfg.in_channels // 4,
                            norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
                            use_quant_conv=False, use_post_quant_conv=False).save_pretrained(path / "vae")
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIPTextConfig.tiny().to_transformers()))
    t5 = transformers.T5EncoderModel(transformers.T5Config(**T5Config.tiny().to_transformers()))
    for model, name in ((clip, "text_encoder"), (t5, "text_encoder_2")):
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.2 * torch.randn_like(p))
        model.eval().save_pretrained(path / name, safe_serialization=True)
    write_tiny_clip_tokenizer(path / "tokenizer")
    write_tiny_t5_tokenizer(path / "tokenizer_2")
    scheduler = {k: v for k, v in FLUX_SCHEDULER_CONFIG.items() if k != "_class_name"}
    diffusers.FlowMatchEulerDiscreteScheduler(**scheduler).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps(FLUX_MODEL_INDEX))
    return path
