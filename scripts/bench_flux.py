#!/usr/bin/env python3
"""Flux.1 LoRA training step: flame against diffusers + peft, same card, same run.

    PYTHONPATH=. python3 scripts/bench_flux.py --batch 1 --checkpointing off --framework all
    PYTHONPATH=. python3 scripts/bench_flux.py --batch 1 --resolution 512 --checkpointing both
    python scripts/bench_flux.py --config tiny --resolution 64 --batch 1 --checkpointing off --steps 2 --warmup 1
    PYTHONPATH=. python3 scripts/bench_flux.py --framework flame --batch 1 --checkpointing on --weight-dtype fp8_e4m3 \
        --offload 20                                     # the memory settings of a smaller card (flame alone)
    PYTHONPATH=. python3 scripts/bench_flux.py --framework flame --batch 1 --checkpointing on --weight-dtype fp8_e4m3 \
        --checkpoint-blocks 30 --memory-cap 24           # a 24 GiB card: 30 of the 57 blocks recomputed

Both sides build Flux.1-dev's transformer (19 double and 38 single blocks, hidden 3072; random bf16
weights: nothing can be downloaded here), frozen, with LoRA rank 16 on the attention and MLP linears
of every block (flame's ``attn-mlp`` preset; peft's adapters on the same diffusers modules: to_q/k/v,
to_out.0, add_q/k/v_proj, to_add_out, ff and ff_context, proj_mlp and the single blocks' proj_out),
AdamW on the adapters, the rectified-flow MSE against ``noise - latents`` at a random noise level,
512 T5 tokens of 4096, the pooled 768 vector and guidance 1.0. diffusers runs under
``torch.autocast(bf16)`` with SDPA's flash backend (PyTorch 2.11's default cuDNN attention fails in
this model's backward on the H200), as its training scripts run it; flame runs its own step, eagerly
or replayed from a CUDA graph (``--capture``). The driver, the settings (``--framework``: diffusers
eager, diffusers-graph, diffusers-compile) and the report are ``bench_sdxl.py``'s.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sdxl as driver
from bench_sdxl import STARTED, _profile, _time_steps

CHECKPOINT_SCOPES = {"on": "blocks"}
# peft's target modules on diffusers' Flux that equal flame's attn-mlp preset on the fused layers
PEFT_TARGETS = (r".*\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|ff\.net\.0\.proj|ff\.net\.2"
                r"|ff_context\.net\.0\.proj|ff_context\.net\.2|proj_mlp)$|single_transformer_blocks\.\d+\.proj_out$")
TEXT_TOKENS = 512


def _config(name):
    from flame.models.flux import FluxConfig
    return FluxConfig.tiny() if name == "tiny" else FluxConfig()


def inputs_shape(args, cfg):
    """Shapes of a step's inputs: packed latents, T5 states, pooled vector (+ the latent side)."""
    side = args.resolution // 16  # 8x VAE, then 2x2 patches
    text = 8 if args.config == "tiny" else TEXT_TOKENS
    return (args.batch, side * side, cfg.in_channels), (args.batch, text, cfg.joint_attention_dim), \
        (args.batch, cfg.pooled_projection_dim), side


def run_flame(args):
    import flame
    from flame import amp, nn, optim
    from flame.graphs import CapturedStep
    from flame.models.flux import FluxTransformer2DModel, latent_image_ids, text_ids
    from flame.train.families.flux import FluxFamily
    flame.testing.simulate_shared_memory_limit()  # the portable setting's smaller card

    if args.memory_budget is not None:  # as the trainer does for train.memory_budget_gb
        flame.runtime.use_expandable_segments()
    cfg = _config(args.config)
    flame.manual_seed(0)
    model = FluxTransformer2DModel(cfg, dtype=flame.bfloat16 if not flame.is_interpreter() else flame.float32)
    model.requires_grad_(False)
    nn.inject_lora(model, FluxFamily().lora_targets("attn-mlp"), rank=args.rank, alpha=args.rank,
                   dora=args.dora == "on")
    family = FluxFamily()
    side = args.resolution // 8
    text = inputs_shape(args, cfg)[1][1]
    memory_plan = driver.memory_settings(model, args, family, family.lora_targets("attn-mlp"),
                                         args.batch * family.tokens((side, side), text), CHECKPOINT_SCOPES)
    params = nn.lora_parameters(model)
    opt = optim.AdamW(params, lr=1e-4)
    (x_shape, t_shape, p_shape, side) = inputs_shape(args, cfg)
    latents, context, pooled = flame.randn(*x_shape), flame.randn(*t_shape), flame.randn(*p_shape)
    img_ids, txt_ids = latent_image_ids(2 * side, 2 * side), text_ids(t_shape[1])
    guidance = flame.full((args.batch,), 1.0) if cfg.guidance_embeds else None
    adapter_casts = amp.ParameterCasts(params, model.dtype)  # as the trainer: one launch casts them

    def fwd_bwd(latents, noise, sigmas):
        with adapter_casts:
            s = sigmas.reshape(-1, 1, 1)
            noisy = latents * (1.0 - s) + noise * s
            pred = model(hidden_states=noisy, encoder_hidden_states=context, pooled_projections=pooled,
                         timestep=sigmas, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance)
            loss = flame.nn.functional.mse_loss(pred.to(flame.float32), noise - latents)
            return loss, loss.backward()

    step_fn = CapturedStep(fwd_bwd, enabled=args.capture == "on")

    def step(i):
        noise, sigmas = flame.randn(*x_shape), flame.rand(args.batch)
        loss, grads = step_fn(latents, noise, sigmas)
        opt.step(grads)
        return loss

    step(0)
    flame.synchronize()
    first_step_s = time.perf_counter() - STARTED
    flame.reset_peak_memory_stats()
    times = _time_steps(step, args, flame.synchronize)
    return {"framework": "flame", "capture": args.capture, "times_s": times, "profile": _profile(step, args),
            "first_step_s": first_step_s, "peak_bytes": flame.max_memory_allocated(),
            "reserved_bytes": driver.reserved_bytes(),
            "lora_params": sum(p.numel() for p in params), "device": flame.device_name(), "graphs": step_fn.num_graphs,
            "memory_plan": memory_plan}


def diffusers_lora_flux(cfg, rank, checkpointing, dev, dora=False):
    """diffusers' Flux transformer of ``cfg`` (random weights, frozen in bf16) with peft's LoRA on the
    attention and MLP linears in fp32: ``(model, LoRA parameters)``."""
    # isort: off
    import torch
    from diffusers import FluxTransformer2DModel
    # isort: on
    torch.manual_seed(0)
    with torch.device(dev):
        model = FluxTransformer2DModel(**cfg.to_diffusers())
    return driver.with_peft_lora(model, rank, PEFT_TARGETS, checkpointing, dora)


def run_diffusers(args):
    """diffusers + peft: eager, the whole step in one CUDA graph, or torch.compile inside it (as
    ``bench_sdxl.run_diffusers``)."""
    # isort: off
    import flame  # noqa: F401  (flame first: it picks the backend before triton is imported)
    import torch
    # isort: on
    cfg = _config(args.config)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    graph = args.worker != "diffusers"
    if graph and dev != "cuda":
        raise SystemExit(f"{args.worker} needs a CUDA GPU")
    model, params = diffusers_lora_flux(cfg, args.rank, args.checkpointing == "on", dev, dora=args.dora == "on")
    opt = torch.optim.AdamW(params, lr=1e-4, capturable=graph)
    x_shape, t_shape, p_shape, side = inputs_shape(args, cfg)
    latents, context, pooled = (torch.randn(*s, device=dev) for s in (x_shape, t_shape, p_shape))
    rows, cols = torch.meshgrid(torch.arange(side, device=dev), torch.arange(side, device=dev), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    txt_ids = torch.zeros(t_shape[1], 3, device=dev)
    guidance = torch.ones(args.batch, device=dev) if cfg.guidance_embeds else None
    run = torch.compile(model) if args.worker == "diffusers-compile" else model
    attention = (torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION) if dev == "cuda"
                 else contextlib.nullcontext())

    def body(zero_grad=True):
        noise, sigmas = torch.randn_like(latents), torch.rand(args.batch, device=dev)
        s = sigmas.view(-1, 1, 1)
        with torch.autocast(latents.device.type, dtype=torch.bfloat16):
            pred = run(hidden_states=latents * (1 - s) + noise * s, encoder_hidden_states=context,
                       pooled_projections=pooled, timestep=sigmas, img_ids=img_ids, txt_ids=txt_ids,
                       guidance=guidance).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise - latents)
        loss.backward()
        opt.step()
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        return loss

    with attention:
        timed = driver.time_torch_step(args, body, opt, dev)
    return {"framework": args.worker.replace("diffusers", "diffusers+peft"), **timed,
            "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else 0,
            "lora_params": sum(p.numel() for p in params),
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}


def parse_args(argv):
    args = driver.parse_args(argv, configs=("dev", "tiny"), doc=__doc__)
    if args.checkpointing == "ff":
        raise SystemExit("--checkpointing ff is SDXL's GEGLU scope; Flux has on (each block) or off")
    if args.mode != "lora":
        raise SystemExit("--mode full is measured on SDXL (bench_sdxl.py); this bench trains LoRA adapters")
    return args


def main(argv=None):
    return driver.main(argv, workers=(run_flame, run_diffusers), script=__file__, parse=parse_args)


if __name__ == "__main__":
    sys.exit(main())
