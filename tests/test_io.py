"""safetensors read/write (bit-exact, interoperable with the safetensors package) and LoRA files."""
import json
import struct

import numpy as np
import pytest
import torch

import flame
from flame import io, nn
from flame.nn.lora import LoRALinear
from helpers import DEVICE


def _tensors():
    g = torch.Generator().manual_seed(0)
    t = {
        "a.f32": torch.randn(3, 5, generator=g),
        "b.f16": torch.randn(7, generator=g).half(),
        "c.bf16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "d.i64": torch.randint(-2**40, 2**40, (6,), generator=g),
        "e.i32": torch.randint(-100, 100, (2, 2), dtype=torch.int32, generator=g),
        "f.bool": torch.rand(5, generator=g) > 0.5,
        "g.scalar": torch.tensor(2.5),
        "h.empty": torch.empty(0, 3),
    }
    t["c.bf16"][0, 0, 0] = float("nan")
    t["a.f32"][1, 1] = float("-inf")
    return t


def _bits(x):
    x = x.detach().cpu().contiguous()
    return x.reshape(-1).view(torch.uint8) if x.numel() else x.reshape(-1).to(torch.uint8)


def test_round_trip_bit_exact(tmp_path):
    src = _tensors()
    ft = {k: flame.from_torch(v.to(DEVICE)) for k, v in src.items()}
    # a non-contiguous flame tensor is written in row-major order
    ft["i.transposed"] = flame.from_torch(src["a.f32"].to(DEVICE)).t()
    p = tmp_path / "x.safetensors"
    io.save_safetensors(ft, p, metadata={"hello": "world"})
    got = io.load_safetensors(p)
    assert set(got) == set(ft)
    for k, v in src.items():
        assert got[k].dtype == v.dtype and got[k].shape == tuple(v.shape), k
        assert torch.equal(_bits(got[k].to_torch()), _bits(v)), k
    assert torch.equal(got["i.transposed"].to_torch().cpu(), src["a.f32"].t().contiguous())
    assert io.read_metadata(p) == {"hello": "world"}
    # the file layout: 8-byte length, JSON header padded to 8, offsets cover the data exactly
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header["a.f32"]["dtype"] == "F32" and header["c.bf16"]["dtype"] == "BF16"
    assert max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") == len(raw) - 8 - n


def test_load_options(tmp_path):
    src = _tensors()
    p = tmp_path / "x.safetensors"
    io.save_safetensors(src, p)
    got = io.load_safetensors(p, keys=["a.f32", "b.f16"], dtype=torch.float32)
    assert set(got) == {"a.f32", "b.f16"} and got["b.f16"].dtype == torch.float32
    np.testing.assert_array_equal(got["b.f16"].numpy(), src["b.f16"].float().numpy())
    with pytest.raises(KeyError, match="nope"):
        io.load_safetensors(p, keys=["nope"])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="not a safetensors"):
        io.load_safetensors(bad)


def test_interop_with_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    src = _tensors()
    p = tmp_path / "flame.safetensors"
    io.save_safetensors(src, p, metadata={"k": "v"})
    theirs = st.load_file(str(p))
    for k, v in src.items():
        assert theirs[k].dtype == v.dtype and torch.equal(_bits(theirs[k]), _bits(v)), k
    q = tmp_path / "theirs.safetensors"
    st.save_file({k: v.contiguous() for k, v in src.items()}, str(q), metadata={"format": "pt"})
    mine = io.load_safetensors(q)
    for k, v in src.items():
        assert torch.equal(_bits(mine[k].to_torch()), _bits(v)), k


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        blk = nn.Module()
        blk.attn1 = nn.Module()
        for n in ("to_q", "to_k", "to_v"):
            setattr(blk.attn1, n, nn.Linear(6, 6, bias=False))
        blk.attn1.to_out = nn.ModuleList([nn.Linear(6, 6)])
        tr = nn.Module()
        tr.transformer_blocks = nn.ModuleList([blk])
        self.down_blocks = nn.ModuleList([nn.Module(), nn.Module()])
        self.down_blocks[1].attentions = nn.ModuleList([tr])


def _random_lora(alpha):
    m = Net()
    nn.inject_lora(m, "attn", rank=3, alpha=alpha)
    for p in nn.lora_parameters(m):
        nn.init.normal_(p, 0.0, 0.5)
    return m


@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_lora_file_round_trip(tmp_path, fmt):
    m = _random_lora(alpha=1.5)
    p = tmp_path / f"lora_{fmt}.safetensors"
    io.save_lora(m, p, format=fmt)
    keys = set(io.load_safetensors(p))
    q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    if fmt == "peft":
        assert f"unet.{q}.lora_A.weight" in keys and len(keys) == 8
        meta = json.loads(io.read_metadata(p)["lora_adapter_metadata"])
        assert meta["unet.lora_alpha"] == 1.5 and meta["unet.r"] == 3
    else:
        assert f"lora_unet_{q.replace('.', '_')}.alpha" in keys and len(keys) == 12
    # into a fresh model with adapters (other init, other alpha) and into a plain model (injected)
    fresh = Net()
    nn.inject_lora(fresh, "attn", rank=3, alpha=7.0)
    plain = Net()
    plain.load_state_dict(m.state_dict(), strict=False)
    fresh.load_state_dict(m.state_dict(), strict=False)
    x = flame.randn(2, 6)
    want = m.get_submodule(q)(x).numpy()
    for target in (fresh, plain):
        loaded = io.load_lora(target, p)
        assert len(loaded) == 4
        layer = target.get_submodule(q)
        assert isinstance(layer, LoRALinear) and layer.alpha == 1.5 and layer.rank == 3
        np.testing.assert_array_equal(layer.lora_A.numpy(), m.get_submodule(q).lora_A.numpy())
        np.testing.assert_allclose(layer(x).numpy(), want, rtol=1e-6, atol=1e-6)


def test_lora_load_errors(tmp_path):
    m = _random_lora(alpha=3)
    p = tmp_path / "l.safetensors"
    io.save_lora(m, p)
    other = Net()
    nn.inject_lora(other, "attn", rank=2)
    with pytest.raises(ValueError, match="rank 3"):
        io.load_lora(other, p)
    io.save_safetensors({"unet.nowhere.lora_A.weight": flame.zeros(3, 6),
                         "unet.nowhere.lora_B.weight": flame.zeros(6, 3)}, p)
    with pytest.raises(KeyError, match="nowhere"):
        io.load_lora(Net(), p)


def test_peft_file_readable_by_safetensors_and_peft_layout(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    m = _random_lora(alpha=6)
    p = tmp_path / "l.safetensors"
    io.save_lora(m, p, format="peft")
    sd = st.load_file(str(p))
    q = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0"
    assert tuple(sd[f"{q}.lora_A.weight"].shape) == (3, 6) and tuple(sd[f"{q}.lora_B.weight"].shape) == (6, 3)
    with st.safe_open(str(p), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert meta["unet.lora_alpha"] == 6


@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_conv_lora_file_round_trip(tmp_path, fmt):
    from flame.nn.lora import LoRAConv2d

    def make():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.SiLU(), nn.Conv2d(4, 2, 1))

    m = make()
    nn.inject_lora(m, [], rank=2, alpha=3.0, conv=True)
    for p in nn.lora_parameters(m):
        nn.init.normal_(p, 0.0, 0.5)
    path = tmp_path / f"conv_{fmt}.safetensors"
    io.save_lora(m, path, format=fmt)
    shapes = {k: tuple(v.shape) for k, v in io.load_safetensors(path).items()}
    down, up = ("lora_A", "lora_B") if fmt == "peft" else ("lora_down", "lora_up")
    key = "unet.0" if fmt == "peft" else "lora_unet_0"
    assert shapes[f"{key}.{down}.weight"] == (2, 3, 3, 3) and shapes[f"{key}.{up}.weight"] == (4, 2, 1, 1)
    plain = make()
    plain.load_state_dict(m.state_dict(), strict=False)
    assert sorted(io.load_lora(plain, path)) == ["0", "2"]
    assert isinstance(plain[0], LoRAConv2d) and plain[0].alpha == 3.0
    x = flame.randn(1, 3, 5, 5)
    np.testing.assert_array_equal(plain(x).numpy(), m(x).numpy())
    wrong = nn.Sequential(nn.Conv2d(3, 4, 5, padding=2), nn.SiLU(), nn.Conv2d(4, 2, 1))
    with pytest.raises(ValueError, match=r"expected A \(2, 3, 5, 5\)"):
        io.load_lora(wrong, path)


def _model_state(model):
    """Each module's type and each adapter's alpha and the bits of its A and B: what a failed
    load must leave as it was."""
    state = {name: type(m).__name__ for name, m in model.named_modules()}
    for name, m in nn.lora.lora_modules(model):
        state[name] = (state[name], m.alpha, _bits(m.lora_A._data), _bits(m.lora_B._data))
    return state


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], tuple):
            assert a[k][:2] == b[k][:2] and all(torch.equal(x, y) for x, y in zip(a[k][2:], b[k][2:])), k
        else:
            assert a[k] == b[k], k


Q = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1"  # to_v: the file's last adapter


_BAD_LOADS = [
    ("wrong-shape", ValueError, r"to_v: A \(3, 6\) and B \(6, 4\) don't fit", False),
    ("int-weight", TypeError, r"to_v.lora_A.weight is torch.int32, not a floating-point", False),
    ("no-B", KeyError, r"to_v' lacks its B/up weight", False),
    ("missing-adapter", KeyError, r"1 adapter\(s\) of the model get no weights \(strict\)", True),
    ("unknown-key", KeyError, r"1 key\(s\) are not peft LoRA weights \(strict\)", True),
    ("truncated", ValueError, r"truncated or damaged \(safetensors: .*not fully covered\)", False),
]


@pytest.mark.parametrize("case, error, match, strict, loader", [
    (*bad, loader) for bad in _BAD_LOADS for loader in ("file", "state_dict")
    if not (bad[0] == "truncated" and loader == "state_dict")])  # a state dict has no file
def test_a_lora_load_that_fails_leaves_the_model_untouched(tmp_path, case, error, match, strict, loader):
    src = tmp_path / "lora.safetensors"
    io.save_lora(_random_lora(alpha=1.5), src)
    sd = {k: v.to_torch() for k, v in io.load_safetensors(src).items()}
    if case == "wrong-shape":
        sd[f"{Q}.to_v.lora_B.weight"] = torch.zeros(6, 4, device=DEVICE)
    elif case == "int-weight":
        sd[f"{Q}.to_v.lora_A.weight"] = sd[f"{Q}.to_v.lora_A.weight"].to(torch.int32)
    elif case == "no-B":
        del sd[f"{Q}.to_v.lora_B.weight"]
    elif case == "missing-adapter":
        del sd[f"{Q}.to_v.lora_A.weight"], sd[f"{Q}.to_v.lora_B.weight"]
    elif case == "unknown-key":
        sd["unet.extra.weight"] = torch.zeros(2, device=DEVICE)
    path = tmp_path / "bad.safetensors"
    io.save_safetensors(sd, path, metadata=io.read_metadata(src))
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:-5])
    if case in ("missing-adapter", "unknown-key"):  # loads without strict
        assert len(io.load_lora(Net(), path)) == 3 + (case == "unknown-key")
    with_adapters = Net()
    nn.inject_lora(with_adapters, "attn", rank=3, alpha=7.0)
    for p in nn.lora_parameters(with_adapters):
        nn.init.normal_(p, 0.0, 0.5)
    targets = [with_adapters] + ([] if strict else [Net()])  # strict: the model's adapters must all be loaded
    kw = dict(strict=True) if strict else {}
    for model in targets:
        before = _model_state(model)
        with pytest.raises(error, match=match) as e:
            if loader == "file":
                io.load_lora(model, path, **kw)
            else:
                nn.lora.load_lora_state_dict(model, sd, alpha=1.5, **kw)
        if case == "truncated":
            assert str(path) in str(e.value)
        _same_state(before, _model_state(model))  # no adapter written, none injected


def test_kohya_alpha_of_more_than_one_value_is_refused_before_loading(tmp_path):
    p = tmp_path / "k.safetensors"
    io.save_lora(_random_lora(alpha=2.0), p, format="kohya")
    sd = {k: v.to_torch() for k, v in io.load_safetensors(p).items()}
    key = f"lora_unet_{Q[5:].replace('.', '_')}_to_v.alpha"
    sd[key] = torch.ones(2, device=DEVICE)
    io.save_safetensors(sd, p)
    plain = Net()
    before = _model_state(plain)
    with pytest.raises(ValueError, match=rf"{key} is a torch.float32 tensor of shape \(2,\), not one number"):
        io.load_lora(plain, p)
    _same_state(before, _model_state(plain))
