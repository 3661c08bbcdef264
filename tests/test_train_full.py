"""Full fine-tuning in the trainer (``train.mode: full`` or a list of expressions, ``train.shard``,
``train.master_weights``): every bad combination refused in one line before any work; on the stand-in
UNet in one process, every selected weight trained and the others left as they were, with fp32
weights, fp32 master weights (a ``ShardedOptimizer`` of one rank) and bf16 weights with stochastic
rounding, an exact resume; the run's file, the whole model under diffusers' names, loaded by
diffusers' ``UNet2DConditionModel`` and ``FluxTransformer2DModel`` with the same tensors; and two
processes on gloo (``tests/dist_worker.py``) at ``train.shard: gradients`` training the weights of
one process at the global batch, their sharded checkpoint resumed by one process.
The tiny SDXL UNet and Flux transformer trained end to end are extended tests (a step of each takes
tens of seconds on the interpreter; the stand-in covers the same trainer paths)."""
import pathlib
import shutil

import numpy as np
import pytest
import torch
import yaml

import flame
from flame import sharding
from flame.data import write_synthetic_cache
from flame.io import load_safetensors, read_metadata
from flame.models import SDXLUNet
from flame.models.flux import FluxConfig, FluxTransformer2DModel
from flame.train import ConfigError, Trainer, build_config, families
from flame.train.trained import FullWeights
from tests.standin import DIMS, StandInUNet
from tests.test_distributed import _launch, _rank_file, needs_two

pytestmark = pytest.mark.slow  # minutes in all: started first by the parallel workers (conftest)

SMALL_FLUX = FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                        axes_dims_rope=(4, 6, 6))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """3 samples: batches of 2 and 1, so that with 2 processes one of them has no sample in a step."""
    path = tmp_path_factory.mktemp("full") / "cache"
    write_synthetic_cache(path, 3, DIMS.in_channels, 6, DIMS.cross_attention_dim, DIMS.pooled_dim,
                          latent_sizes=[(4, 4)], val_samples=0, concepts=3, seed=1)
    return path


def _raw(cache, out, **train):
    return {"model": {"config": "tiny"}, "data": {"cache_dir": str(cache), "batch_size": 2},
            "train": {"mode": "full", "steps": 2, "lr": 1e-2, "precision": "fp32", "seed": 3, **train},
            "output": {"dir": str(out), "save_every": 0, "log_every": 1}}


def _config(cache, out, *overrides, **train):
    return build_config(_raw(cache, out, **train), overrides)


def _weights(model):
    return {k: v.clone().to(flame.float32).numpy() for k, v in model.named_parameters()}


def _run(cfg, dtype=None, log=lambda *a: None):
    """Train the stand-in of ``dtype``: (its weights before, after, the run's result, the trainer)."""
    flame.manual_seed(cfg.train.seed)
    model = StandInUNet(dtype=dtype)
    before = _weights(model)
    trainer = Trainer(cfg, model=model, progress=False, log=log)
    result = trainer.train()
    return before, _weights(model), result, trainer


# ---- config ---------------------------------------------------------------------------------------

REFUSED = [  # (overrides, what the one line says)
    (["train.mode=lora", "train.shard=gradients"], "train.shard: gradients applies to train.mode full"),
    (["train.mode=lora", "train.master_weights=bf16_stochastic"], "train.master_weights: bf16_stochastic applies"),
    (["lora.rank=8", "lora.dropout=0.1"], "lora.rank, lora.dropout: set for LoRA adapters"),
    (["train.precision=fp16", "train.master_weights=bf16_stochastic"], "rounds updates to bf16 weights"),
    (["train.precision=bf16", "train.master_weights=bf16_stochastic", "train.shard=optimizer"],
     "bf16_stochastic updates every process's whole bf16 weights"),
    (["train.optimizer=adafactor", "train.shard=gradients"], "adafactor factors each weight's second moments"),
    (["train.optimizer=prodigy", "train.precision=bf16"], "set train.master_weights bf16_stochastic"),
    (["ema.decay=0.99", "train.shard=optimizer"], "ema.decay: the moving average is an fp32 copy"),
    (["model.weight_dtype=fp8_e4m3"], "model.weight_dtype: 'fp8_e4m3' stores the frozen Linear weights in fp8"),
    (["train.offload=blocks"], "train.offload: 'blocks' streams frozen weights"),
    (["train.memory_budget_gb=8"], "train.memory_budget_gb: 8.0 plans a LoRA run's memory"),
    (["train.mode=attn"], "train.mode: expected lora, full or a list of regular expressions"),
    (["train.mode=['to_q(']"], "train.mode: not a valid regular expression: 'to_q('"),
    (["train.shard=zero3"], "train.shard: expected one of none, optimizer, gradients, parameters"),
    (["train.shard=optimizer", "train.shard_reduce_dtype=bf16"], "train.shard_reduce_dtype: bf16 is the dtype"),
    (["train.mode=lora", "train.shard_reduce_dtype=bf16"], "train.shard_reduce_dtype: bf16 applies to train.mode"),
    (["train.mode=lora", "train.shard_overlap=false"], "train.shard_overlap: False applies to train.mode"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_every_bad_combination_is_one_clear_config_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        _config("cache", tmp_path, *overrides)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and message in lines[1], str(e.value)


def test_what_is_allowed_resolves_and_what_needs_processes_is_refused_before_loading(cache_dir, tmp_path):
    cfg = _config("cache", tmp_path, "train.optimizer=adafactor", "train.precision=bf16",
                  "train.master_weights=bf16_stochastic", "ema.decay=0.99")
    assert cfg.output.name == "model" and cfg.train.mode == "full"
    assert _config("cache", tmp_path, "train.mode=lora").output.name == "lora"
    assert _config("cache", tmp_path, "train.mode=[attn2, '^proj_out']").train.mode == ["attn2", "^proj_out"]
    with pytest.raises(ConfigError, match=r"train.shard: parameters frees each block's weights.*one process has no "
                                          r"others"):
        Trainer(_config(cache_dir, tmp_path / "p", "train.shard=parameters"), model=StandInUNet(), progress=False,
                log=lambda *a: None)
    assert not (tmp_path / "p").exists()  # the folder made for the run went again
    with pytest.raises(ConfigError, match=r"train.mode: \['to_z'\] matches none of the model's 11 parameter names"):
        Trainer(_config(cache_dir, tmp_path / "z", "train.mode=[to_z]"), model=StandInUNet(), progress=False,
                log=lambda *a: None)


# ---- one process, the stand-in ------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank(cache_dir, tmp_path_factory):
    """2 steps of one process at batch 2 with train.shard gradients (a ShardedOptimizer of one rank)
    and clipping: (weights before, after, result, trainer, the lines it said)."""
    lines = []
    out = tmp_path_factory.mktemp("one")
    return (*_run(_config(cache_dir, out, shard="gradients", max_grad_norm=1.0), log=lines.append), lines)


def test_a_full_fine_tune_trains_every_weight_and_writes_the_whole_model(one_rank):
    before, after, result, trainer, lines = one_rank
    assert len(result["losses"]) == 2 and np.isfinite(result["losses"]).all()
    assert [k for k in before if (before[k] == after[k]).all()] == []
    text = "\n".join(lines)
    assert ("training every weight of the UNet2DConditionModel (1,348 params; fp32 master weights, train.shard "
            "gradients over 1 process)") in text
    assert "model.load_state_dict(safetensors.torch.load_file(" in text
    path = pathlib.Path(result["model"])
    assert path.name == "model.safetensors" and read_metadata(path)["format"] == "pt"
    saved = load_safetensors(path)  # the trained weights exported from the checkpoint's fp32 master weights
    assert saved.keys() == after.keys()
    for k, v in saved.items():
        np.testing.assert_array_equal(v.numpy(), after[k], err_msg=k)
    step = pathlib.Path(result["checkpoint"])
    assert sorted(p.name for p in step.iterdir()) == ["COMPLETE", "shard-00000-of-00001.safetensors", "shards.json",
                                                      "trainer_state.json"]
    assert trainer.trained.shards.stage == "gradients"


def test_expressions_train_the_weights_they_match_and_leave_the_rest(cache_dir, tmp_path):
    """fp32 weights and train.shard none: the optimizer updates the weights themselves."""
    before, after, result, trainer = _run(_config(cache_dir, tmp_path, mode=["attn2", r"^proj_out\.bias$"]))
    trained = [k for k in before if (before[k] != after[k]).any()]
    assert trained == ["attn2.to_q.weight", "attn2.to_k.weight", "attn2.to_v.weight", "attn2.to_out.0.weight",
                       "attn2.to_out.0.bias", "proj_out.bias"]
    assert trainer.trained.names == trained and not trainer.trained.sharded
    saved = load_safetensors(result["model"])  # the whole model: the frozen weights too
    for k in before:
        np.testing.assert_array_equal(saved[k].numpy(), after[k])
    step = pathlib.Path(result["checkpoint"])
    assert sorted(p.name for p in step.iterdir()) == ["COMPLETE", "model.safetensors", "optimizer.safetensors",
                                                      "trainer_state.json"]
    assert load_safetensors(step / "model.safetensors").keys() == set(trained)


def _bf16(cache, out, master, *overrides):
    return _config(cache, out, "output.save_every=1", *overrides, precision="bf16", master_weights=master, lr=1e-4)


@pytest.fixture(scope="module")
def master_run(cache_dir, tmp_path_factory):
    """2 steps of the bf16 stand-in with fp32 master weights, checkpoints after each."""
    out = tmp_path_factory.mktemp("master")
    return out, _run(_bf16(cache_dir, out, "fp32"), dtype=flame.bfloat16)


@pytest.mark.parametrize("master", ["fp32", "bf16_stochastic"])
def test_bf16_weights_train_with_fp32_master_weights_or_stochastic_rounding(cache_dir, tmp_path, master, master_run):
    before, after, result, trainer = master_run[1] if master == "fp32" else \
        _run(_bf16(cache_dir, tmp_path, master), dtype=flame.bfloat16)
    assert np.isfinite(result["losses"]).all()
    assert trainer.trained.sharded == (master == "fp32")
    assert all(p.dtype == flame.bfloat16 for p in trainer.model.parameters())
    # lr 1e-4 moves a weight by about 1e-4, below half a bf16 ulp of most: rounding to nearest would keep
    # them; the master weights (or stochastic rounding) make them move
    changed = np.mean([np.mean(before[k] != after[k]) for k in before])
    assert changed > 0.2, changed
    if master == "fp32":
        shards = trainer.trained.shards
        assert shards.world == 1 and shards.stage == "optimizer"
        saved = load_safetensors(result["model"])  # output.save_dtype fp32: the master weights
        for k, v in sharding.weights(result["checkpoint"]):
            np.testing.assert_array_equal(saved[k].numpy(), v.numpy())
            assert np.abs(v.numpy() - after[k]).max() <= 2 ** -7 * np.abs(v.numpy()).max()


def test_fp32_master_weights_resume_exactly_from_their_shards(master_run, cache_dir, tmp_path):
    out, straight = master_run
    shutil.copytree(out, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-00000002")
    resumed = _run(_bf16(cache_dir, tmp_path / "run", "fp32", "resume=latest"), dtype=flame.bfloat16)
    assert resumed[2]["losses"] == straight[2]["losses"][1:]
    for k, v in straight[1].items():
        np.testing.assert_array_equal(resumed[1][k], v, err_msg=k)


@pytest.mark.extended  # the optimizer over the weights, checkpointed as LoRA's (test_train.py's resume tests)
def test_fp32_weights_resume_exactly(cache_dir, tmp_path):
    straight = _run(_config(cache_dir, tmp_path / "a", "output.save_every=1"))
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "step-00000002")
    resumed = _run(_config(cache_dir, tmp_path / "a", "resume=latest"))
    assert resumed[2]["losses"] == straight[2]["losses"][1:]
    for k, v in straight[1].items():
        np.testing.assert_array_equal(resumed[1][k], v, err_msg=k)


# ---- the model file in diffusers --------------------------------------------------------------------

def _diffusers(cls_name, cls_kwargs, path):
    """diffusers' model ``cls_name`` holding the file at ``path`` (a strict load): its state dict."""
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import load_file
    with torch.device("meta"):  # no random init: the file's tensors are assigned
        ref = getattr(diffusers, cls_name)(**cls_kwargs)
    ref.load_state_dict(load_file(path), strict=True, assign=True)
    return {k: v.detach().numpy() for k, v in ref.state_dict().items()}


def test_the_flux_model_file_loads_into_diffusers_transformer_with_the_same_tensors(tmp_path):
    """The fused q/k/v and single-block inputs split, the final modulation's halves swapped (the SDXL
    UNet's names are diffusers' already: the extended test below loads its file)."""
    flame.manual_seed(0)
    model = FluxTransformer2DModel(SMALL_FLUX)
    cfg = build_config({"model": {"family": "flux", "config": "tiny"}, "data": {"cache_dir": "c"},
                        "train": {"mode": "full", "steps": 1, "precision": "fp32"}, "output": {"dir": str(tmp_path)}})
    full = FullWeights(cfg, families.get("flux", cfg), model, torch.float32)
    full.save(tmp_path / "model.safetensors", torch.float32, full.metadata(1, 4, 0.0, 1.0, [], "AdamW"))
    got = _diffusers("FluxTransformer2DModel", SMALL_FLUX.to_diffusers(), tmp_path / "model.safetensors")
    want = {k: v.numpy() for k, v in model.diffusers_state_dict().items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


# ---- two processes (gloo on the interpreter, NCCL on 2 GPUs) -----------------------------------------

@pytest.fixture(scope="module")
def two_ranks(cache_dir, tmp_path_factory):
    """``one_rank``'s run by 2 processes at batch 1 each (the same global batch), a checkpoint after
    each step."""
    root = tmp_path_factory.mktemp("two_full")
    raw = _raw(cache_dir, root / "run", shard="gradients", max_grad_norm=1.0)
    raw["data"]["batch_size"], raw["output"]["save_every"] = 1, 1
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    results = _launch(config, root / "ranks")
    assert [r[0] for r in results] == [0, 0], [r[1][-3000:] for r in results]
    return root, raw, [_rank_file(root / "ranks", r) for r in range(2)]


@needs_two
def test_two_processes_sharding_gradients_train_the_weights_of_one_process(two_ranks, one_rank):
    root, _, ranks = two_ranks
    for key in ranks[0].files:  # the ranks hold the very same weights
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key])
    _, after, result, _, _ = one_rank
    np.testing.assert_allclose(ranks[0]["losses"], result["losses"], rtol=1e-5)
    for k, v in after.items():  # the sum of two gradients in another order, and AdamW: fp32 rounding
        np.testing.assert_allclose(ranks[0][f"w/{k}"], v, rtol=1e-5, atol=1e-6, err_msg=k)
    step = root / "run" / "checkpoints" / "step-00000002"
    assert {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors", "shards.json",
            "trainer_state.json", "COMPLETE"} == {p.name for p in step.iterdir()}
    saved = load_safetensors(root / "run" / "model.safetensors")  # rank 0's export of the shards
    for k, v in saved.items():
        np.testing.assert_array_equal(v.numpy(), ranks[0][f"w/{k}"], err_msg=k)


@needs_two
def test_a_two_process_sharded_checkpoint_resumes_in_one_process(two_ranks, tmp_path):
    root, raw, _ = two_ranks
    shutil.copytree(root / "run", tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000001"
    cfg = build_config(dict(raw, resume=str(checkpoint)), [f"output.dir={tmp_path / 'run'}"])
    lines = []
    flame.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, model=StandInUNet(), progress=False, log=lines.append)
    trainer.load(*trainer.resume_from)  # what the run does first: the 2 ranks' shards re-sliced for one
    loaded = _weights(trainer.model)
    for name, value in sharding.weights(checkpoint):
        np.testing.assert_array_equal(loaded[name], value.numpy(), err_msg=name)
    result = trainer.train()
    assert result["step"] == 2 and len(result["losses"]) == 1 and np.isfinite(result["losses"]).all()
    assert all((loaded[k] != v).any() for k, v in _weights(trainer.model).items())
    assert any("was trained by 2 processes, this run has 1" in str(line) for line in lines)


@needs_two
@pytest.mark.extended  # the gradients stage above runs the same trainer paths; this adds the gathers
def test_two_processes_sharding_parameters_train_the_weights_of_one_process(two_ranks, tmp_path):
    _, raw, ranks = two_ranks
    raw = dict(raw, train=dict(raw["train"], shard="parameters"), output=dict(raw["output"], dir=str(tmp_path / "r")))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    results = _launch(config, tmp_path / "ranks")
    assert [r[0] for r in results] == [0, 0], [r[1][-3000:] for r in results]
    gathered = _rank_file(tmp_path / "ranks", 0)
    np.testing.assert_allclose(gathered["losses"], ranks[0]["losses"], rtol=1e-6)
    for key in ranks[0].files:
        if key.startswith("w/"):
            np.testing.assert_allclose(gathered[key], ranks[0][key], rtol=1e-6, atol=1e-7, err_msg=key)


# ---- the tiny SDXL UNet and Flux transformer, end to end ------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("master", ["fp32", "bf16_stochastic"])
def test_a_bf16_sdxl_unet_fine_tunes_in_a_cuda_graph(tmp_path, master):
    """bf16 weights with fp32 master weights or stochastic rounding, the step replayed from a CUDA graph:
    every weight moves at lr 1e-4 and diffusers loads the file."""
    from tests.tiny_sdxl import UNET
    flame.manual_seed(0)
    lines = []
    before, after, result = _fine_tune(SDXLUNet(UNET, dtype=flame.bfloat16), "sdxl", "full", tmp_path, [8, 8],
                                       log=lines.append, precision="bf16", master_weights=master, lr=1e-4, steps=3,
                                       cuda_graph=True)
    assert not any("cuda_graph: off" in str(line) for line in lines)
    changed = np.mean([np.mean(before[k] != after[k]) for k in before])
    assert changed > 0.2, changed
    got = _diffusers("UNet2DConditionModel", UNET.to_diffusers(), result["model"])
    for k, v in after.items():  # the file holds the fp32 master weights (or the bf16 weights themselves)
        np.testing.assert_allclose(got[k], v, rtol=2 ** -7, atol=1e-6, err_msg=k)


def _fine_tune(model, family, mode, tmp_path, latent_size, log=lambda *a: None, **train):
    """One step (``train``: other settings) of ``model`` at ``train.mode`` ``mode`` on a synthetic cache:
    (weights before, after, the run's result)."""
    raw = {"model": {"family": family, "config": "tiny"},
           "data": {"cache_dir": str(tmp_path / "cache"), "batch_size": 2, "synthetic_samples": 2,
                    "synthetic_latent_sizes": [latent_size]},
           "train": {"mode": mode, "steps": 1, "lr": 1e-3, "precision": "fp32", "seed": 0, **train},
           "output": {"dir": str(tmp_path / "run"), "save_every": 0}}
    before = _weights(model)
    result = Trainer(build_config(raw), model=model, progress=False, log=log).train()
    assert len(result["losses"]) == train.get("steps", 1) and np.isfinite(result["losses"]).all()
    return before, _weights(model), result


@pytest.mark.extended  # a step of the tiny UNet takes about 25 s on the interpreter; the stand-in covers the trainer
def test_the_tiny_sdxl_unet_fine_tunes_its_attention_and_diffusers_loads_the_result(tmp_path):
    from tests.tiny_sdxl import UNET
    flame.manual_seed(0)
    before, after, result = _fine_tune(SDXLUNet(UNET), "sdxl", [r"\.attentions\.", "^conv_out"], tmp_path, [8, 8])
    selected = [k for k in before if ".attentions." in k or k.startswith("conv_out")]
    assert [k for k in before if (before[k] != after[k]).any()] == selected
    got = _diffusers("UNet2DConditionModel", UNET.to_diffusers(), result["model"])
    assert got.keys() == after.keys()
    for k, v in after.items():  # the conv weights (channels-last in flame) in diffusers' layout
        np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.extended  # as above, for the Flux transformer (a step of about 10 s)
def test_the_tiny_flux_transformer_fine_tunes_every_weight_and_diffusers_loads_the_result(tmp_path):
    flame.manual_seed(0)
    model = FluxTransformer2DModel(SMALL_FLUX)
    before, after, result = _fine_tune(model, "flux", "full", tmp_path, [4, 6])
    assert [k for k in before if (before[k] == after[k]).all()] == []
    got = _diffusers("FluxTransformer2DModel", SMALL_FLUX.to_diffusers(), result["model"])
    for k, v in model.diffusers_state_dict().items():
        np.testing.assert_array_equal(got[k], v.numpy(), err_msg=k)


def test_the_full_fine_tune_configs_are_valid():
    from flame.train import load_config
    root = pathlib.Path(__file__).resolve().parents[1] / "configs"
    for name, mode, shard in (("sdxl_full", "full", "gradients"), ("sdxl_full_tiny", "full", "gradients"),
                              ("flux_full", "full", "parameters")):
        cfg = load_config(root / f"{name}.yaml")
        assert (cfg.train.mode, cfg.train.shard, cfg.output.name) == (mode, shard, "model")


@pytest.mark.extended  # two steps of the small Flux transformer twice (about 30 s on the interpreter)
def test_the_parameters_stage_gathers_each_flux_block_around_its_checkpointed_forward_and_backward(tmp_path):
    """ZeRO-3's block hooks on the real model, with gradient checkpointing inside them, on one rank
    (the trainer refuses the stage there; ``FullWeights`` takes it): the weights of the gradients
    stage after two steps, and every block's weights in one of the ring's two slots."""
    from flame.models.flux import latent_image_ids, text_ids
    from flame.ops.loss import mse_loss
    gen = np.random.RandomState(0)
    B, h, w, n_txt = 1, 4, 6, 5
    inputs = dict(hidden_states=flame.tensor(gen.randn(B, h // 2 * (w // 2), 16).astype(np.float32)),
                  encoder_hidden_states=flame.tensor(gen.randn(B, n_txt, 32).astype(np.float32)),
                  pooled_projections=flame.tensor(gen.randn(B, 16).astype(np.float32)),
                  timestep=flame.tensor(np.array([0.4], np.float32)), img_ids=latent_image_ids(h, w),
                  txt_ids=text_ids(n_txt), guidance=flame.tensor(np.array([1.0], np.float32)))
    target = flame.tensor(gen.randn(B, h // 2 * (w // 2), 16).astype(np.float32))
    out = {}
    for stage in ("gradients", "parameters"):
        flame.manual_seed(0)
        model = FluxTransformer2DModel(SMALL_FLUX).enable_gradient_checkpointing(True)
        cfg = build_config({"model": {"family": "flux", "config": "tiny"}, "data": {"cache_dir": "c"},
                            "train": {"mode": "full", "shard": stage, "steps": 1, "precision": "fp32", "lr": 1e-3},
                            "output": {"dir": str(tmp_path)}})
        full = FullWeights(cfg, families.get("flux", cfg), model, torch.float32)
        full.make_optimizer(cfg.train)
        for _ in range(2):
            with full.computing():
                grads = mse_loss(model(**inputs), target).backward()
            full.shards.pack(grads)
            full.shards.step(max_norm=1.0)
        if stage == "parameters":
            slots = {p._data.untyped_storage().data_ptr() for b in (*model.double_blocks, *model.single_blocks)
                     for p in b.parameters()}
            assert len(slots) == 2
        with full.shards.gathered(model):
            out[stage] = _weights(model)
    for k, v in out["gradients"].items():
        np.testing.assert_array_equal(out["parameters"][k], v, err_msg=k)
