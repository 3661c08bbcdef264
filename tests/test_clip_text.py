"""SDXL's text encoders on flame: parity with transformers' CLIPTextModel(WithProjection) (penultimate
and last states, pooled, projection; both pooling rules), state-dict names, the single-file (SGM)
name maps, tokenization with kohya's long-caption windows, ``encode`` against diffusers'
``StableDiffusionXLPipeline.encode_prompt``, and the errors.

``write_tiny_clip_tokenizer`` and ``write_tiny_text_encoders`` are importable by other tests (a
tiny SDXL pipeline folder's tokenizer/, tokenizer_2/, text_encoder/, text_encoder_2/)."""
import json
import math
import pathlib
import shutil
import warnings

import numpy as np
import pytest
import torch

import flame
from flame.models.clip_text import SGM_PREFIXES, CLIPTextConfig, CLIPTextModel, find_eos, openclip_to_transformers
from flame.models.sdxl_text import SDXLTextEncoders, load_tokenizer

transformers = pytest.importorskip("transformers")

LETTERS = "abcdefghijklmnopqrstuvwxyz"
MERGES = (("t", "h"), ("th", "e</w>"), ("c", "a"), ("ca", "t</w>"))  # "the" and "cat" are one token each
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
RTOL = 1e-5 if flame.is_interpreter() else 1e-2  # GPU: fp32 GEMMs run as tf32


def write_tiny_clip_tokenizer(folder, pad_token=EOS):
    """A CLIPTokenizer folder (vocab.json, merges.txt, tokenizer_config.json, as SDXL's) knowing the
    letters, "!" (id 0, as in CLIP), "the" and "cat"; start and end tokens have the largest ids
    (57, 58), as in CLIP's vocabulary. ``pad_token``: CLIP-L pads with the end token, SDXL's
    tokenizer_2 with "!". Returns the folder."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = ["!"] + [t for c in LETTERS for t in (c, c + "</w>")] + [a + b for a, b in MERGES] + [BOS, EOS]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "do_lower_case": True,
        "bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": pad_token}))
    return folder


def write_tiny_text_encoders(pipeline_folder):
    """Write tokenizer/, tokenizer_2/ (pads with "!"), text_encoder/ (transformers CLIPTextModel of
    ``CLIPTextConfig.tiny()``: quick_gelu, SDXL's legacy eos_token_id 2) and text_encoder_2/
    (CLIPTextModelWithProjection of ``tiny_g()``: gelu, eos_token_id the real end token 58) into
    ``pipeline_folder``; seeded, LayerNorm parameters and biases perturbed so that a swapped weight
    and bias show. Returns the two transformers models (eval mode)."""
    root = pathlib.Path(pipeline_folder)
    write_tiny_clip_tokenizer(root / "tokenizer")
    write_tiny_clip_tokenizer(root / "tokenizer_2", pad_token="!")
    torch.manual_seed(0)
    models = []
    for name, cfg, cls in (("text_encoder", CLIPTextConfig.tiny(), transformers.CLIPTextModel),
                           ("text_encoder_2", CLIPTextConfig.tiny_g(eos_token_id=58),
                            transformers.CLIPTextModelWithProjection)):
        model = cls(transformers.CLIPTextConfig(**cfg.to_transformers())).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.2 * torch.randn_like(p))
        model.save_pretrained(root / name, safe_serialization=True)
        models.append(model)
    return tuple(models)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers models, flame SDXLTextEncoders loaded from the folder)."""
    root = tmp_path_factory.mktemp("sdxl_text")
    refs = write_tiny_text_encoders(root)
    return root, refs, SDXLTextEncoders.from_pretrained(root)


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids), output_hidden_states=True)


def _close(got, want):
    """Largest difference within RTOL of the reference's largest magnitude."""
    got = got.to_torch().detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    err = (got.double() - want.double()).abs().max().item() / want.abs().max().item()
    assert err <= RTOL, f"relative error {err:.3g}"


def _sgm_state_dict(refs):
    """The two transformers models' weights renamed as an SDXL single-file (SGM) checkpoint: CLIP-L
    under its prefix with transformers 4's names (and the position_ids buffer it saved); bigG with
    OpenCLIP's names, q/k/v fused in one in_proj, the projection stored as the (hidden, proj)
    matrix; OpenCLIP's logit_scale and other components' tensors beside them."""
    clip_l, clip_g = ({k: v.detach().clone() for k, v in m.state_dict().items()} for m in refs)
    out = {SGM_PREFIXES["text_encoder"] + "text_model." + k: v for k, v in clip_l.items()}
    out[SGM_PREFIXES["text_encoder"] + "text_model.embeddings.position_ids"] = torch.arange(77)[None]
    g = SGM_PREFIXES["text_encoder_2"]
    t = "text_model."
    out[g + "token_embedding.weight"] = clip_g[t + "embeddings.token_embedding.weight"]
    out[g + "positional_embedding"] = clip_g[t + "embeddings.position_embedding.weight"]
    out[g + "text_projection"] = clip_g["text_projection.weight"].t().contiguous()
    out[g + "logit_scale"] = torch.tensor(4.6)
    for p in ("weight", "bias"):
        out[g + f"ln_final.{p}"] = clip_g[t + f"final_layer_norm.{p}"]
    for i in range(CLIPTextConfig.tiny_g().num_hidden_layers):
        src, dst = f"{t}encoder.layers.{i}.", f"{g}transformer.resblocks.{i}."
        for p in ("weight", "bias"):
            out[dst + f"attn.in_proj_{p}"] = torch.cat([clip_g[src + f"self_attn.{x}_proj.{p}"] for x in "qkv"])
            for a, b in (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("attn.out_proj", "self_attn.out_proj"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[dst + f"{a}.{p}"] = clip_g[src + f"{b}.{p}"]
    out["model.diffusion_model.conv_in.weight"] = torch.zeros(2, 2)
    return out


# ---- the encoders against transformers -------------------------------------------------------------

def test_encoders_match_transformers(tiny):
    # SDXL's encoders by their sizes (nothing allocated): CLIP-L's text tower 123.06 M parameters, bigG's 694.66 M
    for cfg, proj, count in ((CLIPTextConfig.sdxl_clip_l(), False, 123_060_480),
                             (CLIPTextConfig.sdxl_clip_g(), True, 694_659_840)):
        assert sum(math.prod(s) for s in CLIPTextModel.parameter_shapes(cfg, proj).values()) == count
        assert cfg.head_dim == 64
    _, refs, enc = tiny
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 57, (3, 77), generator=g)  # no end token yet: the legacy rule pools at the largest id
    ids[0, 5], ids[1, 76], ids[2, 9], ids[2, 40] = 58, 58, 58, 58  # the other pools at the first end token
    for model, ref in zip((enc.text_encoder, enc.text_encoder_2), refs):
        want_keys = {k if k.startswith(("text_model.", "text_projection")) else "text_model." + k: tuple(v.shape)
                     for k, v in ref.state_dict().items()}  # transformers 5 saves CLIPTextModel without text_model.
        got = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        assert dict(got) == want_keys
        assert got == list(CLIPTextModel.parameter_shapes(model.config, model.with_projection).items())
        r = _reference(ref, ids)
        eos = find_eos(ids.numpy(), model.config.eos_token_id)
        assert eos == ([5, 76, 9] if model.with_projection else ids.argmax(-1).tolist())
        # precomputed positions (on the host, or on the device as a CUDA graph takes them), or read back
        for given in (eos, flame.tensor(np.asarray(eos, dtype=np.int64)), None):
            out = model(flame.tensor(ids.numpy()), eos_positions=given)
            _close(out.penultimate, r.hidden_states[-2])
            _close(out.last_hidden_state, r.last_hidden_state)
            if model.with_projection:
                _close(out.text_embeds, r.text_embeds)
                _close(out.pooled, r.last_hidden_state[torch.arange(3), eos])
            else:
                assert out.text_embeds is None
                _close(out.pooled, r.pooler_output)


def test_single_file_names_and_projection_choice(tiny, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    root, refs, enc = tiny
    assert openclip_to_transformers("transformer.resblocks.3.attn.in_proj_bias") == tuple(
        f"text_model.encoder.layers.3.self_attn.{x}_proj.bias" for x in "qkv")
    assert openclip_to_transformers("transformer.resblocks.0.mlp.c_fc.weight") == (
        "text_model.encoder.layers.0.mlp.fc1.weight",)
    assert openclip_to_transformers("positional_embedding") == ("text_model.embeddings.position_embedding.weight",)
    assert openclip_to_transformers("logit_scale") == ()
    assert openclip_to_transformers("visual.proj") == ("visual.proj",)  # reported as unexpected
    file = tmp_path / "sdxl.safetensors"
    safetensors_torch.save_file(_sgm_state_dict(refs), file)
    single = SDXLTextEncoders.from_pretrained(file, tokenizer_path=root, configs=(CLIPTextConfig.tiny(),
                                                                                CLIPTextConfig.tiny_g(eos_token_id=58)))
    for name in ("text_encoder", "text_encoder_2"):
        cfg = getattr(enc, name).config
        alone = CLIPTextModel.from_pretrained(file, name, config=cfg)  # projection when the file has one
        assert alone.with_projection == (name == "text_encoder_2")
        for loaded in (alone, getattr(single, name)):
            want = getattr(enc, name).state_dict()
            got = loaded.state_dict()
            assert list(got) == list(want)
            for k, v in got.items():
                assert torch.equal(v.to_torch(), want[k].to_torch()), k
    bare = CLIPTextModel.from_pretrained(root, "text_encoder_2", with_projection=False)
    assert not bare.with_projection and "text_projection.weight" not in bare.state_dict()


# ---- tokenization and encode -------------------------------------------------------------------------

def _kohya_windows(tok, caption, max_tokens):
    """kohya's long-caption ids, written from its description: the caption tokenized to
    max_tokens + 2 (BOS ... EOS padding), cut into BOS + 75 tokens + the sequence's last token; for
    a tokenizer that pads with another token than EOS, a window full of caption tokens ends in EOS
    and one that starts with padding starts with EOS."""
    ids = tok(caption, padding="max_length", truncation=True, max_length=max_tokens + 2)["input_ids"]
    rows = []
    for i in range(1, max_tokens + 1, 75):
        row = [ids[0], *ids[i:i + 75], ids[-1]]
        if tok.pad_token_id != tok.eos_token_id:
            if row[-2] not in (tok.eos_token_id, tok.pad_token_id):
                row[-1] = tok.eos_token_id
            if row[1] == tok.pad_token_id:
                row[1] = tok.eos_token_id
        rows.append(row)
    return rows


def test_tokenize_windows_as_kohya_and_truncation_warns_once(tiny):
    _, _, enc = tiny
    fresh = SDXLTextEncoders(enc.text_encoder, enc.text_encoder_2, *enc.tokenizers)  # its own warning state
    captions = {n: " ".join(["a"] * n) for n in (0, 74, 75, 76, 149, 150, 151, 230)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for max_tokens in (75, 150, 225):
            ids = fresh.tokenize(list(captions.values()), max_tokens)
            assert len(ids) == 2 and all(a.shape == (len(captions), max_tokens // 75, 77) for a in ids)
            for tok, a in zip(fresh.tokenizers, ids):
                for row, caption in zip(a, captions.values()):
                    assert row.tolist() == _kohya_windows(tok, caption, max_tokens), (max_tokens, caption.count("a"))
    assert [str(w.message) for w in caught] == [
        "SDXLTextEncoders: a caption of 230 tokens was cut to max_tokens=75 (155 tokens dropped; max_tokens=225 "
        "keeps up to 225). Shown once per SDXLTextEncoders."]
    pad_g = fresh.tokenizers[1]
    assert pad_g.pad_token_id == 0 and fresh.tokenizers[0].pad_token_id == pad_g.eos_token_id == 58
    assert [SDXLTextEncoders.sequence_length(m) for m in (75, 150, 225)] == [77, 152, 227]
    assert (enc.text_dim, enc.pooled_dim) == (32, 16)  # SDXLUNetConfig.tiny()'s cross_attention_dim, pooled_dim


def test_encode_matches_diffusers_encode_prompt(tiny):
    diffusers = pytest.importorskip("diffusers")
    root, refs, enc = tiny
    tokenizers = [transformers.CLIPTokenizer.from_pretrained(root / n) for n in ("tokenizer", "tokenizer_2")]
    pipe = diffusers.StableDiffusionXLPipeline(vae=None, text_encoder=refs[0], text_encoder_2=refs[1],
                                               tokenizer=tokenizers[0], tokenizer_2=tokenizers[1], unet=None,
                                               scheduler=diffusers.EulerDiscreteScheduler())
    prompts = ["the cat", "a cat sat on the mat " * 20]  # the second is cut to 75 tokens by both
    want, _, want_pooled, _ = pipe.encode_prompt(prompts, device=torch.device("cpu"), do_classifier_free_guidance=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        embeds, pooled = enc.encode(prompts)
    assert embeds.shape == (2, 77, enc.text_dim) and pooled.shape == (2, enc.pooled_dim)
    _close(embeds, want)
    _close(pooled, want_pooled)


def test_long_captions_stitch_windows(tiny):
    """150 tokens: each caption's two windows encoded by transformers, stitched by hand (BOS state of
    window 0, inner 75 states of each, last state of window 1) equal ``encode``'s 152 states."""
    _, refs, enc = tiny
    prompts = ["the cat " * 50, "a b c"]  # 100 tokens: two windows; 5 tokens: the second window empty
    ids = enc.tokenize(prompts, max_tokens=150)
    embeds, pooled = enc.encode_tokens(ids)
    assert embeds.shape == (2, 152, 32) and pooled.shape == (2, 16)
    parts = []
    for ref, a in zip(refs, ids):
        h = _reference(ref, a.reshape(4, 77)).hidden_states[-2].reshape(2, 2, 77, -1)
        parts.append(torch.cat([h[:, 0, :1], h[:, 0, 1:76], h[:, 1, 1:76], h[:, 1, 76:]], 1))
    _close(embeds, torch.cat(parts, -1))
    _close(pooled, _reference(refs[1], ids[1][:, 0]).text_embeds)  # the first window's projection


# ---- errors --------------------------------------------------------------------------------------

def test_clear_errors(tiny, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    root, _, enc = tiny
    write_tiny_clip_tokenizer(tmp_path / "p" / "tokenizer")
    (tmp_path / "p" / "tokenizer_2").mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer_2 has no vocab.json or merges.txt"):
        SDXLTextEncoders.from_pretrained(tmp_path / "p")
    with pytest.raises(FileNotFoundError, match="tokenizer does not exist"):
        load_tokenizer(tmp_path / "tokenizer")
    other = tmp_path / "unet.safetensors"
    safetensors_torch.save_file({"model.diffusion_model.conv_in.weight": torch.zeros(2, 2)}, other)
    with pytest.raises(FileNotFoundError, match="single file, which holds no tokenizers"):
        SDXLTextEncoders.from_pretrained(other)
    with pytest.raises(RuntimeError, match=r"holds no CLIP text encoder tensors .*conditioner\.embedders\.1\.model"):
        CLIPTextModel.from_pretrained(other, "text_encoder_2")
    with pytest.raises(ValueError, match="subfolder='vae' has no SDXL default config"):
        CLIPTextModel.from_pretrained(other, "vae")
    config = json.loads((root / "text_encoder" / "config.json").read_text())
    for change, message in (({"model_type": "t5"}, "model_type 't5' is not a CLIP text encoder's"),
                            ({"hidden_act": "gelu_new"}, "hidden_act='gelu_new' is not supported"),
                            ({"architectures": ["CLIPModel"]}, "architectures=.*CLIPModel"),
                            ({"dropout": 0.1, "d_model": 8}, "dropout=0.1 .*unknown key 'd_model'")):
        with pytest.raises(ValueError, match=message):
            CLIPTextConfig.from_transformers({**config, **change})
    deeper = tmp_path / "text_encoder"
    shutil.copytree(root / "text_encoder", deeper)
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) \(16\): \"text_model\.encoder\.layers\.2\."):
        CLIPTextModel.from_pretrained(deeper)
    with pytest.raises(ValueError, match=r"max_tokens must be one of \(75, 150, 225\)"):
        enc.tokenize("a cat", max_tokens=100)
    model = enc.text_encoder
    ids = flame.tensor(np.zeros((2, 77), np.int64))
    with pytest.raises(ValueError, match=r"eos_positions must give one position in \[0, 77\) per row"):
        model(ids, eos_positions=[3])
    with pytest.raises(ValueError, match="integer"):
        model(flame.zeros(2, 77))
    with pytest.raises(ValueError, match="1 to 77"):
        model(flame.tensor(np.zeros((1, 78), np.int64)))
