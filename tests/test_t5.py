"""Flux's T5 text encoder on flame: parity with transformers' T5EncoderModel (gated-GELU and ReLU,
padding, a sequence longer than the largest exact distance and max_distance), the relative position
buckets against transformers' static method, the checkpoint layouts (folder, pipeline folder, single
file with or without the tied table, a full T5's decoder left out) and the errors."""
import json

import numpy as np
import pytest
import safetensors.torch as st
import torch

import flame
from flame.models import T5Config, T5EncoderModel
from flame.models.t5 import relative_position_bucket
from tests.helpers import DEVICE

transformers = pytest.importorskip("transformers")
from transformers.models.t5 import modeling_t5  # noqa: E402

RTOL = 1e-5 if flame.is_interpreter() else 1e-2  # GPU: fp32 GEMMs run as tf32


def reference(cfg: T5Config, seed=0, full=False):
    """transformers' encoder (or full T5 with ``full``) of ``cfg``, seeded, layer norm weights
    perturbed so that a misplaced one shows."""
    torch.manual_seed(seed)
    tcfg = transformers.T5Config(**cfg.to_transformers(), dropout_rate=0.0)
    model = (transformers.T5ForConditionalGeneration if full else transformers.T5EncoderModel)(tcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def ids_and_mask(cfg, batch=2, length=11, pad_from=7):
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.int64)
    mask[1, pad_from:] = 0
    return ids, mask


def expected(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def encode(model, ids, mask=None):
    with flame.no_grad():
        out = model(flame.from_torch(ids.to(DEVICE)), None if mask is None else flame.from_torch(mask.to(DEVICE)))
    return out.to_torch().cpu()


@pytest.mark.parametrize("proj", ["gated-gelu", "relu"])
def test_t5_matches_transformers_with_padding(tmp_path, proj):
    cfg = T5Config.tiny(feed_forward_proj=proj)
    ref = reference(cfg)
    ref.save_pretrained(tmp_path / "text_encoder_2")
    model = T5EncoderModel.from_pretrained(tmp_path, dtype=torch.float32)  # a pipeline folder
    assert model.config == cfg
    ids, mask = ids_and_mask(cfg)  # 11 tokens: distances past max_distance 16's half and the log buckets
    want = expected(ref, ids, mask)
    got = encode(model, ids, mask)
    assert got.shape == (2, 11, cfg.d_model)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL)
    if proj == "gated-gelu":  # no mask: every key attends; one row alone equals its row in the batch
        torch.testing.assert_close(encode(model, ids), expected(ref, ids), rtol=RTOL, atol=RTOL)


def test_t5_long_sequence_and_state_dict_names(tmp_path):
    cfg = T5Config.tiny(num_layers=1, relative_attention_max_distance=8)
    ref = reference(cfg, seed=3)
    ref.save_pretrained(tmp_path)  # the component folder itself
    model = T5EncoderModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert list(model.state_dict()) == list(T5EncoderModel.parameter_shapes(cfg))
    assert set(model.state_dict()) | {"encoder.embed_tokens.weight"} == set(ref.state_dict())
    assert model.encoder.embed_tokens is model.shared
    ids = torch.randint(0, cfg.vocab_size, (1, 23))  # distances up to 22 > max_distance 8: the capped bucket
    torch.testing.assert_close(encode(model, ids), expected(ref, ids), rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 16), (16, 40), (64, 256)])
def test_t5_relative_position_buckets_match_transformers(num_buckets, max_distance):
    for length in (1, 2, 7, 11, 64, 77, 300, 512):
        pos = torch.arange(length)
        rel = pos[None, :] - pos[:, None]
        want = modeling_t5.T5Attention._relative_position_bucket(rel, True, num_buckets, max_distance).numpy()
        got = relative_position_bucket(rel.numpy(), num_buckets, max_distance)
        np.testing.assert_array_equal(got, want)


def test_t5_single_file_and_tied_table(tmp_path):
    cfg = T5Config.tiny(num_layers=1)
    full = reference(cfg, seed=5, full=True)  # decoder and lm_head in the file are left out
    tensors = {k: v.clone() for k, v in full.state_dict().items()}  # the tied tables apart
    tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"].clone()
    st.save_file(tensors, tmp_path / "t5_full.safetensors")
    only_tied = {k: v for k, v in tensors.items() if k.startswith("encoder.")}  # the table under its tied name
    st.save_file(only_tied, tmp_path / "t5_tied.safetensors")
    ids, mask = ids_and_mask(cfg, length=9, pad_from=4)
    want = expected(full.encoder, ids, mask)
    for name in ("t5_full.safetensors", "t5_tied.safetensors"):
        model = T5EncoderModel.from_pretrained(tmp_path / name, config=cfg, dtype=torch.float32)
        torch.testing.assert_close(encode(model, ids, mask), want, rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_t5_float8_file_is_upcast_on_load(tmp_path, fp8):
    cfg = T5Config.tiny(num_layers=1)
    ref = reference(cfg, seed=3)
    stored = {k: v.to(fp8) for k, v in ref.state_dict().items() if k != "encoder.embed_tokens.weight"}
    st.save_file(stored, tmp_path / "t5xxl_fp8.safetensors")
    model = T5EncoderModel.from_pretrained(tmp_path / "t5xxl_fp8.safetensors", config=cfg, dtype=torch.float32)
    for name, value in stored.items():  # every float8 value is exact in fp32: the decode must be exact
        torch.testing.assert_close(model.state_dict()[name].to_torch().cpu(), value.float(), rtol=0, atol=0)
    with torch.no_grad():  # the upcast weights run as transformers' model does with the same weights
        ref.load_state_dict({k: v.float() for k, v in stored.items()}, strict=False)
    ids, mask = ids_and_mask(cfg, length=7, pad_from=5)
    torch.testing.assert_close(encode(model, ids, mask), expected(ref, ids, mask), rtol=RTOL, atol=RTOL)


def test_t5_checkpoint_and_input_errors(tmp_path):
    cfg = T5Config.tiny(num_layers=1)
    ref = reference(cfg)
    ref.save_pretrained(tmp_path)
    tensors = st.load_file(tmp_path / "model.safetensors")
    tensors.pop("encoder.block.0.layer.1.DenseReluDense.wi_1.weight")
    st.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) \(1\): \"encoder.block.0.layer.1.DenseReluDense.wi_1"):
        T5EncoderModel.from_pretrained(tmp_path, dtype=torch.float32)
    scaled = {k: v.to(torch.float8_e4m3fn) for k, v in tensors.items()}
    scaled["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    st.save_file(scaled, tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors")
    with pytest.raises(ValueError, match="scaled float8 checkpoint"):
        T5EncoderModel.from_pretrained(tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors", config=cfg)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="feed_forward_proj='gated-silu'"):
        T5Config.from_transformers({**config, "feed_forward_proj": "gated-silu"})
    with pytest.raises(ValueError, match="is_decoder=True"):
        T5Config.from_transformers({**config, "is_decoder": True})
    with pytest.raises(ValueError, match="model_type 'bert'"):
        T5Config.from_transformers({**config, "model_type": "bert"})
    with pytest.raises(ValueError, match="unknown key 'rope_theta'"):
        T5Config.from_transformers({**config, "rope_theta": 1.0})
    model = T5EncoderModel(cfg, dtype=torch.float32)
    ids = flame.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="input_ids must be a flame int64 Tensor"):
        model(np.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        model(ids, flame.tensor([[1, 1]]))


@pytest.mark.gpu
def test_t5_bf16_matches_transformers(tmp_path):
    cfg = T5Config.tiny(d_model=256, d_kv=64, num_heads=4, d_ff=640, num_layers=3, vocab_size=1000,
                        relative_attention_num_buckets=32, relative_attention_max_distance=128)
    ref = reference(cfg).to("cuda", torch.bfloat16)
    ref.save_pretrained(tmp_path)
    model = T5EncoderModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids, mask = ids_and_mask(cfg, batch=2, length=300, pad_from=170)
    want = expected(ref.float(), ids.cuda(), mask.cuda()).cpu()
    got = encode(model, ids, mask).float()
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 2e-2  # bf16 activations through 3 blocks
