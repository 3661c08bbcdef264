"""The trainer on Flux.1: the family chosen from the model, rectified-flow training of a small random
Flux end to end, the LoRA file read by diffusers with the same effect as in flame, exact resume."""
import dataclasses
import json
import os
import pathlib
import signal

import numpy as np
import pytest
import torch

import flame
from flame.io import save_safetensors
from flame.models.flux import FluxConfig, FluxTransformer2DModel, latent_image_ids, text_ids
from flame.train import ConfigError, Trainer, build_config
from flame.train.families import detect

pytestmark = pytest.mark.slow  # minutes in all: started first by the parallel workers (conftest)

SMALL = FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))


def _config(out, *overrides, cache=None):
    raw = {"model": {"family": "flux", "config": "tiny"},
           "data": {"cache_dir": str(cache or pathlib.Path(out) / "cache"), "batch_size": 2,
                    "synthetic_samples": 6, "synthetic_latent_sizes": [[4, 6]]},
           "lora": {"rank": 4, "alpha": 8, "targets": "attn-mlp"},
           "train": {"steps": 2, "lr": 2e-2, "precision": "fp32", "seed": 5, "lr_scheduler": "constant"},
           "diffusion": {"timestep_sampling": "logit_normal", "resolution_shift": True},
           "output": {"dir": str(out), "save_every": 0, "log_every": 1, "overwrite": True}}
    return build_config(raw, overrides)


def _seeded(seed=5):
    """``SMALL`` initialised from ``seed`` (the configs' train.seed)."""
    flame.manual_seed(seed)
    return FluxTransformer2DModel(SMALL)


def _trainer(cfg, **kw):
    return Trainer(cfg, model=_seeded(cfg.train.seed), progress=False, log=lambda *a: None, **kw)


# ---- the family ------------------------------------------------------------------------------------

def test_family_is_detected_from_folders_files_and_names(tmp_path):
    pipe = tmp_path / "pipe"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert detect(str(pipe), "sdxl") == "flux"
    (pipe / "model_index.json").unlink()
    (pipe / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    assert detect(str(pipe), "sdxl") == detect(str(pipe / "transformer"), "sdxl") == "flux"
    single = tmp_path / "flux1-dev.safetensors"
    save_safetensors({"double_blocks.0.img_attn.qkv.weight": flame.zeros(6, 2)}, single)
    assert detect(str(single), "sdxl") == "flux"
    assert detect(None, "flux-dev") == detect(None, "flux-schnell") == "flux"
    assert detect(None, "tiny") == detect(None, "sdxl") == "sdxl"
    cfg = build_config({"model": {"config": "flux-schnell"}, "data": {"cache_dir": "c"}, "train": {"steps": 1},
                        "output": {"dir": str(tmp_path / "o")}})
    assert cfg.model.family == "flux"


def test_options_of_the_other_objective_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"min_snr_gamma=5\.0.*lora\.lr_up=0\.5"):
        _config(tmp_path, "diffusion.min_snr_gamma=5", "lora.lr_up=0.5")
    with pytest.raises(ConfigError, match=r"model\.config: a flux model's config is tiny, flux-dev, flux-schnell"):
        _config(tmp_path, "model.config=sdxl")
    with pytest.raises(ConfigError, match=r"resolution_shift=True.*rectified-flow models \(Flux\) only"):
        _config(tmp_path, "model.family=sdxl")


# ---- training --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("flux_run")
    trainer = _trainer(_config(out))
    return trainer, trainer.train()


def test_flux_lora_trains_and_diffusers_reads_the_file_with_the_same_effect(trained):
    diffusers = pytest.importorskip("diffusers")
    trainer, result = trained
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    model = trainer.model
    dev = flame.device
    ref = diffusers.FluxTransformer2DModel(**SMALL.to_diffusers()).to(dev)
    ref.load_state_dict({k: v.to_torch().clone() for k, v in model.diffusers_state_dict().items()})
    folder, name = os.path.split(result["lora"])
    ref.load_lora_adapter(folder, weight_name=name, prefix="transformer", use_safetensors=True)
    B, h, w, n_txt = 2, 4, 6, 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, (h // 2) * (w // 2), SMALL.in_channels, generator=gen).to(dev)
    txt = torch.randn(B, n_txt, SMALL.joint_attention_dim, generator=gen).to(dev)
    pooled = torch.randn(B, SMALL.pooled_projection_dim, generator=gen).to(dev)
    t, g = torch.tensor([0.3, 0.8], device=dev), torch.tensor([1.0, 3.5], device=dev)
    img_ids, txt_ids = latent_image_ids(h, w), text_ids(n_txt)
    with torch.no_grad():
        want = ref(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled, timestep=t,
                   img_ids=img_ids.to_torch(), txt_ids=txt_ids.to_torch(), guidance=g).sample
    model.eval()
    with flame.no_grad():
        got = model(hidden_states=flame.from_torch(x), encoder_hidden_states=flame.from_torch(txt),
                    pooled_projections=flame.from_torch(pooled), timestep=flame.from_torch(t),
                    img_ids=img_ids, txt_ids=txt_ids, guidance=flame.from_torch(g)).to_torch()
    base = ref.disable_adapters() or ref(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled,
                                         timestep=t, img_ids=img_ids.to_torch(), txt_ids=txt_ids.to_torch(),
                                         guidance=g).sample.detach()
    assert (want - base).norm() > 1e-3 * base.norm()  # the LoRA changes the output
    # fp32 GEMMs: exact products on the interpreter, tf32 on a GPU (flame's fp32 GEMMs run in tf32 there)
    assert (got - want).norm() <= (1e-5 if flame.is_interpreter() else 3e-3) * want.norm()


def test_streamed_blocks_train_as_resident_ones(trained, tmp_path):
    """train.offload: blocks (one of the two blocks) gives the resident run's losses exactly."""
    lines = []
    streamed = Trainer(_config(tmp_path / "s", "train.offload=blocks", "train.offload_blocks=1"), model=_seeded(),
                       progress=False, log=lines.append)
    assert streamed.train()["losses"] == trained[1]["losses"]
    assert any("1 of 2 blocks streamed" in line for line in lines), lines


@pytest.mark.extended  # fp8 files: test_fp8_files.py; streamed loading: test_offload.py
def test_a_checkpoint_loads_its_streamed_blocks_to_the_host_and_fp8_as_it_loads(tmp_path):
    """With model.path, train.offload's blocks load straight into host memory and fp8 weights quantise
    as they load (flame/models/placement.py; its own tests compare it with converting a loaded model):
    the same run as without streaming."""
    from tiny_flux import diffusers_flux
    pytest.importorskip("diffusers")
    folder = tmp_path / "transformer"
    diffusers_flux(SMALL).save_pretrained(folder)
    from flame.ops.quant import Fp8Weight
    settings = ("model.weight_dtype=fp8_e4m3", "train.offload=blocks", "train.steps=1")
    lines = []
    loaded = Trainer(_config(tmp_path / "p", f"model.path={folder}", *settings), progress=False, log=lines.append)
    assert any("2 of 2 blocks streamed" in line for line in lines), lines
    assert any("frozen Linear weights stored as fp8_e4m3" in line for line in lines), lines
    assert isinstance(loaded.model.double_blocks[0].img_attn.qkv.weight, Fp8Weight)
    assert not isinstance(loaded.model.img_in.weight, Fp8Weight) and not isinstance(loaded.model.txt_in.weight,
                                                                                   Fp8Weight)
    streamed = loaded.train()["losses"]  # before the next trainer's setup draws from the same generator
    resident = Trainer(_config(tmp_path / "r", f"model.path={folder}", settings[0], settings[2]), progress=False,
                       log=lambda *a: None)
    assert streamed == resident.train()["losses"]
    full = Trainer(_config(tmp_path / "b", f"model.path={folder}", "train.steps=1"), progress=False,
                   log=lambda *a: None)
    np.testing.assert_allclose(streamed, full.train()["losses"], rtol=0.05)  # fp8 trains close to full precision


def test_w8a8_rounds_the_fp8_layers_inputs(tmp_path):
    """model.fp8_gemm: w8a8 marks every fp8 weight (their forward products round the inputs to e4m3: on a
    Hopper GPU's fp8 tensor cores, emulated on the interpreter; the numerics: test_quant.py) and says
    which; without fp8 weights it is refused."""
    from flame.ops.quant import Fp8Weight
    lines = []
    cfg = _config(tmp_path / "w8a8", "model.weight_dtype=fp8_e4m3", "model.fp8_gemm=w8a8", "train.steps=1")
    trainer = Trainer(cfg, model=_seeded(), progress=False, log=lines.append)
    fp8 = [w for w in trainer.model.parameters() if isinstance(w, Fp8Weight)]
    assert fp8 and all(w.w8a8 for w in fp8)
    how = "emulated" if flame.is_interpreter() else "fp8 tensor cores"
    assert any("model.fp8_gemm: w8a8: the inputs of" in line and how in line for line in lines), lines
    assert np.isfinite(trainer.train()["losses"]).all()
    with pytest.raises(ConfigError, match=r"model\.fp8_gemm w8a8: needs fp8 weights"):
        _config(tmp_path, "model.fp8_gemm=w8a8")


def test_offload_and_fp8_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.offload_blocks: set train\.offload: blocks to stream blocks"):
        _config(tmp_path, "train.offload_blocks=2")
    with pytest.raises(ConfigError, match=r"set at most one of them"):
        _config(tmp_path, "train.offload=blocks", "train.offload_blocks=2", "train.offload_budget_gb=4")
    with pytest.raises(ConfigError, match=r"model\.weight_dtype fp8_e4m3: DoRA needs"):
        _config(tmp_path, "model.weight_dtype=fp8_e4m3", "lora.dora=true")
    with pytest.raises(ConfigError, match=r"fp8_base: unknown option \(did you mean model\.weight_dtype\?\)"):
        _config(tmp_path, "fp8_base=true")
    with pytest.raises(ConfigError, match=r"train\.offload: plan_offload: count 3 is more than the 2 blocks"):
        Trainer(_config(tmp_path / "o", "train.offload=blocks", "train.offload_blocks=3"), model=_seeded(),
                progress=False, log=lambda *a: None)
    with pytest.raises(ConfigError, match=r"train\.offload: plan_offload: the weights need at least"):
        Trainer(_config(tmp_path / "b", "train.offload=blocks", "train.offload_budget_gb=1e-6"), model=_seeded(),
                progress=False, log=lambda *a: None)

def test_a_memory_budget_picks_fp8_then_checkpointing_then_streaming(tmp_path):
    """train.memory_budget_gb: the run as configured when it fits, else fp8 weights, then the fewest
    checkpointed blocks, then streamed ones (flame/train/memory.py), applied to the model (runs with
    these settings: the tests above); too little is refused naming the least."""
    from flame.models.blocks import Checkpointed
    from flame.ops.quant import Fp8Weight
    from flame.train.families.flux import FluxFamily
    from flame.train.memory import GIB, USABLE, plan_memory
    family = FluxFamily()
    tokens = 2 * family.tokens((4, 6), 8)  # batch 2 of the config's synthetic 4x6 latents, tiny T5's 8 tokens
    six = dataclasses.replace(SMALL, num_layers=2, num_single_layers=4)  # streaming saves more than its 2 slots

    def plan(budget):
        return plan_memory(budget, profile=family.activation_profile, config=six, dtype=flame.float32,
                           tokens=tokens, targets=family.lora_targets("attn-mlp"), rank=4, weight_dtype=None,
                           allow_fp8=True, fp8_skip=family.full_precision_layers)

    def below(p):  # the largest budget p does not fit in
        return int((p.total - 1) / USABLE)

    roomy = plan(2**40)
    assert (roomy.weight_dtype, roomy.checkpoint_blocks, roomy.offload_blocks) == (None, 0, 0)
    assert roomy.total <= USABLE * plan(int(roomy.total / USABLE) + 1).budget
    fp8 = plan(below(roomy))
    assert (fp8.weight_dtype, fp8.checkpoint_blocks, fp8.offload_blocks) == ("fp8_e4m3", 0, 0)
    assert fp8.weights < roomy.weights and fp8.activations == roomy.activations
    one = plan(below(fp8))
    assert (one.checkpoint_blocks, one.offload_blocks) == (1, 0) and one.activations < fp8.activations
    every = one
    while every.checkpoint_blocks < 6:
        every = plan(below(every))
    streamed = plan(below(every))  # below every block checkpointed
    assert (streamed.weight_dtype, streamed.checkpoint_blocks, streamed.blocks) == ("fp8_e4m3", 6, 6)
    assert streamed.offload_blocks >= 1 and streamed.total <= USABLE * streamed.budget
    with pytest.raises(ConfigError, match=r"train\.memory_budget_gb: 0\.0 MiB is too little: the least this run can "
                                          r"take is about \d+\.\d MiB: weights fp8_e4m3, every block checkpointed "
                                          r"and streamed"):
        plan(1000)

    lines = []
    flame.manual_seed(5)
    trainer = Trainer(_config(tmp_path / "m", f"train.memory_budget_gb={streamed.budget / GIB!r}"),
                      model=FluxTransformer2DModel(six), progress=False, log=lines.append)
    assert streamed.summary() in lines, lines
    assert sum(m.gradient_checkpointing for m in trainer.model.modules() if isinstance(m, Checkpointed)) == 6
    assert isinstance(trainer.model.double_blocks[0].img_attn.qkv.weight, Fp8Weight)
    assert trainer.streamer is not None and len(trainer.streamer.plan.streamed) == streamed.offload_blocks
    for setting in ("train.offload=blocks", "train.checkpoint_blocks=1", "train.checkpoint_scope=feed_forward"):
        with pytest.raises(ConfigError, match=r"train\.memory_budget_gb chooses it"):
            _config(tmp_path, "train.memory_budget_gb=8", setting)


@pytest.mark.extended  # exact resume: tests/test_train.py; Flux's step state: the runs above

def test_flux_resume_continues_exactly(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    straight = _trainer(_config(tmp_path / "a", "train.steps=3", cache=cache)).train()["losses"]
    cut = _trainer(_config(tmp_path / "b", "train.steps=3", cache=cache))
    real_step = cut.train_step

    def step_then_interrupt():
        real_step()
        if cut.step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cut, "train_step", step_then_interrupt)
    with pytest.raises(Exception, match="interrupted"):
        cut.train()
    resumed = _trainer(_config(tmp_path / "b", "train.steps=3", "resume=latest", cache=cache)).train()["losses"]
    np.testing.assert_array_equal(resumed, straight[1:])  # the run after the checkpoint of step 1


def test_compile_ahead_list_is_flux_1s_own():
    from flame.train.families.flux import FluxFamily
    family = FluxFamily()
    assert family.kernel_list(FluxConfig()) == family.kernel_list(FluxConfig(guidance_embeds=False)) == "flux"
    assert family.kernel_list(FluxConfig.tiny()) is None and family.kernel_list(SMALL) is None


@pytest.mark.extended  # the data-parallel step: tests/test_distributed.py; Flux's own parts: one process
def test_two_processes_train_flux_as_one_process_at_the_global_batch(tmp_path):
    """Data-parallel Flux (2 processes on gloo through the CLI, batch 1 each) is the one-process run at batch 2."""
    import yaml
    from test_distributed import TWO_DEVICES, _launch, _rank_file
    if not TWO_DEVICES:
        pytest.skip("needs 2 GPUs (or the interpreter)")
    raw = {"model": {"family": "flux", "config": "tiny"},
           "data": {"cache_dir": str(tmp_path / "cache"), "batch_size": 1, "synthetic_samples": 4,
                    "synthetic_latent_sizes": [[4, 4]]},
           "lora": {"rank": 2, "targets": "attn"},
           "train": {"steps": 2, "lr": 1e-2, "precision": "fp32", "seed": 7, "lr_scheduler": "constant"},
           "output": {"dir": str(tmp_path / "run"), "save_every": 0, "log_every": 1}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    results = _launch(config, tmp_path / "ranks", "--cli")
    assert [r[0] for r in results] == [0, 0], results
    ranks = [_rank_file(tmp_path / "ranks", r) for r in range(2)]
    for key in ranks[0].files:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])
    cfg = build_config({**raw, "data": {**raw["data"], "batch_size": 2},
                        "output": {**raw["output"], "dir": str(tmp_path / "one")}})
    one = Trainer(cfg, progress=False, log=lambda *a: None).train()
    np.testing.assert_allclose(ranks[0]["losses"], one["losses"], rtol=1e-5)


@pytest.mark.extended  # Flux sampling: test_flux_pipeline.py; samples while training: test_train.py
# ---- sample images while training --------------------------------------------------------------------

def test_flux_run_writes_sample_images_from_its_pipeline_folder(tmp_path):
    pytest.importorskip("diffusers")
    from PIL import Image
    from tiny_flux import write_tiny_flux_pipeline
    folder = write_tiny_flux_pipeline(tmp_path / "pipe")
    cfg = _config(tmp_path / "o", f"model.path={folder}", "model.family=auto", "train.steps=1",
                  "data.synthetic_latent_sizes=[[8, 8]]", "sample.prompts=[a cat]", "sample.steps=1",
                  "sample.width=16", "sample.height=16", "sample.max_sequence_length=8")
    assert cfg.model.family == "flux"
    flame.manual_seed(cfg.train.seed)
    result = Trainer(cfg, progress=False, log=lambda *a: None).train()
    assert np.isfinite(result["losses"]).all()
    image = tmp_path / "o" / "samples" / "step-1" / "00.png"
    with Image.open(image) as im:
        assert im.size == (16, 16)
        text = im.text["parameters"]
    assert text.startswith("a cat") and "Sampler: flow_euler" in text and "Guidance: 3.5" in text
    assert "Training step: 1" in text


def test_sample_options_of_the_other_family_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"sample\.sampler='euler' \(Flux: flow_euler"):
        _config(tmp_path, "sample.sampler=euler")
    with pytest.raises(ConfigError, match=r"sample\.max_tokens=150"):
        _config(tmp_path, "sample.max_tokens=150")
    with pytest.raises(ConfigError, match=r"sample\.width: Flux images are multiples of 16"):
        _config(tmp_path, "sample.prompts=[a]", "sample.width=24", f"sample.model={tmp_path}")
    with pytest.raises(ConfigError, match=r"sample\.guidance=2\.0.*\(Flux\) only"):
        build_config({"model": {"config": "tiny"}, "data": {"cache_dir": "c"}, "train": {"steps": 1},
                      "sample": {"guidance": 2.0}, "output": {"dir": str(tmp_path / "o")}})


def test_a_flux_checkpoint_brings_its_own_config(tmp_path):
    from tiny_flux import bfl_state_dict, diffusers_flux
    pytest.importorskip("diffusers")
    sd = diffusers_flux(SMALL).state_dict()
    single = tmp_path / "flux-small.safetensors"
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in bfl_state_dict(sd, SMALL).items()}, single)
    raw = {"model": {"path": str(single)}, "data": {"cache_dir": "c"}, "train": {"steps": 1},
           "output": {"dir": str(tmp_path / "o")}}
    with pytest.raises(ConfigError, match="axes_dims_rope"):  # head dim 16: the rotary axes cannot be read
        Trainer(build_config(raw), progress=False, log=lambda *a: None)
    folder = tmp_path / "transformer"
    diffusers_flux(SMALL).save_pretrained(folder)
    cfg = build_config({**raw, "model": {"path": str(folder)}})
    assert cfg.model.family == "flux" and cfg.model.config == str(folder)
