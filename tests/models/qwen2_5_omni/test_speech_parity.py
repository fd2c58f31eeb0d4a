"""Spoken output against transformers 5.24 on one tiny random checkpoint with a talker, token2wav and two voices.

- spk_dict.pt: the opcode reader gives what torch.load gives;
- talker: greedy codes identical to a step-by-step transformers reference (the talker's forward with its attention
  mask, fed exactly as ``Qwen2_5OmniForConditionalGeneration.generate`` feeds it);
- token2wav: mel and waveform for a fixed initial noise;
- end to end: ``generate(return_audio=True)`` as a whole (text, codes, waveform). transformers 5.24's ``generate``
  drops the codec pad / bos embeddings from the talker's prompt (an all-ones mask becomes None, see
  ``TalkerStream``), so that comparison runs the port with ``codec_prompt=False``; a test shows the two differ.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")

from omnitide_mlx.models import load  # noqa: E402
from omnitide_mlx.models.qwen2_5_omni import speech as sp_mod  # noqa: E402
from omnitide_mlx.models.qwen2_5_omni.speakers import read_torch_zip  # noqa: E402
from omnitide_mlx.models.qwen2_5_omni.talker import CodecSampling  # noqa: E402
from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint  # noqa: E402

from ._util import prompt  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
GREEDY = CodecSampling(greedy=True)
STEPS = 4  # ODE steps in the token2wav comparisons (10 in use): the same solver, a faster reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, qwen_tokenizer_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen_speech") / "tiny", tokenizer_dir=qwen_tokenizer_dir,
                                speech=True, seed=3)


@pytest.fixture(scope="module")
def ours(ckpt):
    model, proc = load(ckpt)
    return model, proc, sp_mod.load_speech(ckpt)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids(ours):
    return np.array([ours[1].encode(prompt("", "Say something nice about the weather."))])


def test_transformers_loads_every_speech_weight(ckpt, hf):
    from safetensors.numpy import load_file

    file = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items()
            if k.startswith(("talker.", "token2wav."))}
    state = hf.state_dict()
    assert set(file) == {k for k in state if k.startswith(("talker.", "token2wav."))}
    assert all(np.array_equal(state[k].numpy(), v) for k, v in file.items())


def test_speaker_reader_matches_torch_load(ckpt, hf):
    ours_ = read_torch_zip(ckpt / "spk_dict.pt")
    ref = torch.load(ckpt / "spk_dict.pt", weights_only=True)
    assert set(ours_) == set(ref) == set(hf.speaker_map)
    for name, voice in ref.items():
        assert ours_[name]["bos_token"] == voice["bos_token"]
        for k in ("cond", "ref_mel"):
            np.testing.assert_array_equal(ours_[name][k], voice[k].numpy())


def test_speaker_reader_runs_no_code(tmp_path):
    import pickle
    import zipfile

    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps({"a": Boom()}, protocol=2))
    from omnitide_mlx.models.loading import CheckpointError

    with pytest.raises(CheckpointError, match="calls __builtin__.print, which this reader does not run"):
        read_torch_zip(path)


def _hf_thinker(hf, ids, n):
    out = hf.thinker.generate(input_ids=torch.tensor(ids), max_new_tokens=n, do_sample=False,
                              output_hidden_states=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), out.hidden_states


def _hf_talker_reference(hf, ids, gen, hidden, speaker, steps):
    """Greedy codes from transformers' talker forward, one call per step with the growing attention mask, fed as
    ``Qwen2_5OmniForConditionalGeneration.generate`` builds the tracks (repetition penalty 1.05, bos suppressed)."""
    tk, emb = hf.talker, hf.thinker.get_input_embeddings()
    voice = hf.speaker_map[speaker]
    tok, hid = [h[0] for h in hidden], [h[-1] for h in hidden]
    reply = torch.cat(hid[1:], 1) + torch.cat(tok[1:], 1)
    x = torch.cat([hid[0] + tok[0], emb(torch.tensor([[voice["bos_token"]]])), reply[:, :1]], 1)
    tail = torch.cat([reply[:, 1:], emb(torch.tensor([[tk.text_eos_token]])), emb(torch.tensor([[tk.text_pad_token]]))], 1)
    text_ids = torch.cat([torch.tensor(ids), torch.tensor([[voice["bos_token"], gen[0]]])], 1)
    seen = [tk.codec_mask_token] * ids.shape[1] + [tk.codec_pad_token, tk.codec_bos_token]
    from transformers import DynamicCache

    cache, tk.rope_deltas, codes = DynamicCache(), None, []
    mask = torch.ones(1, len(seen), dtype=torch.long)
    with torch.no_grad():
        out = tk(input_ids=torch.tensor([seen]), input_text_ids=text_ids, inputs_embeds=x, attention_mask=mask,
                 cache=cache, use_cache=True, thinker_reply_part=tail)
        for _ in range(steps):
            lg = out.logits[0, -1].clone()
            prev = torch.tensor(sorted(set(seen)))
            s = lg[prev]
            lg[prev] = torch.where(s < 0, s * 1.05, s / 1.05)
            lg[tk.codec_bos_token] = -float("inf")
            code = int(lg.argmax())
            seen.append(code)
            if code in (tk.codec_pad_token, tk.codec_eos_token):
                break
            codes.append(code)
            mask = torch.ones(1, len(seen), dtype=torch.long)
            out = tk(input_ids=torch.tensor([[code]]), input_text_ids=text_ids, attention_mask=mask, cache=cache,
                     use_cache=True, thinker_reply_part=out.thinker_reply_part)
    return codes


def test_talker_greedy_codes_match_step_by_step_reference(ours, hf, ids):
    model, _, speech = ours
    gen, hidden = _hf_thinker(hf, ids, 10)
    ref = _hf_talker_reference(hf, ids, gen, hidden, "Ethan", 40)
    r = sp_mod.generate(model, speech, speaker="Ethan", max_new_tokens=10, sampling=GREEDY, max_codes=40,
                        noise=None, input_ids=ids)
    assert r.text_ids == gen
    assert len(ref) >= 5  # a stretch of speech, not an immediate stop
    assert r.codes == ref


@pytest.mark.slow
def test_token2wav_mel_and_waveform_match(ours, hf):
    _, _, speech = ours
    codes = np.random.default_rng(0).integers(0, 32, size=12)
    voice = hf.speaker_map["Chelsie"]
    torch.manual_seed(7)
    noise = torch.randn(1, 24, 80)
    dit, vocoder = hf.token2wav.code2wav_dit_model, hf.token2wav.code2wav_bigvgan_model
    torch.manual_seed(7)  # sample() draws the same noise
    with torch.no_grad():
        mel_ref = dit.sample(voice["cond"].float(), voice["ref_mel"].float(), torch.tensor(codes)[None], num_steps=STEPS)
        wav_ref = vocoder(mel_ref).numpy()
    mel = speech.mel(codes, "Chelsie", mx.array(noise.numpy()), num_steps=STEPS)
    np.testing.assert_allclose(np.array(mel[0]).T, mel_ref[0].numpy(), atol=2e-5, rtol=0)  # mel values up to ~4
    wav = speech.wav(codes, "Chelsie", mx.array(noise.numpy()), num_steps=STEPS)
    assert wav.shape == wav_ref.shape == (12 * 480,)
    assert np.abs(wav).max() > 0.01
    np.testing.assert_allclose(wav, wav_ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_generate_with_audio_matches_transformers_as_a_whole(ours, hf, ids):
    model, _, speech = ours
    kw = dict(speaker="Chelsie", thinker_max_new_tokens=12, thinker_do_sample=False, talker_do_sample=False,
              talker_max_new_tokens=16, talker_eos_token_id=[32, 34], token2wav_num_steps=STEPS)
    torch.manual_seed(11)
    seq, wav_ref = hf.generate(input_ids=torch.tensor(ids), **kw)
    text = seq[0, ids.shape[1]:].tolist()
    codes = wav_ref.shape[0] // 480
    torch.manual_seed(11)
    noise = torch.randn(1, 2 * codes, 80)
    r = sp_mod.generate(model, speech, speaker="Chelsie", max_new_tokens=12, sampling=GREEDY, max_codes=16,
                        noise=mx.array(noise.numpy()), codec_prompt=False, input_ids=ids,
                        token2wav_kwargs={"num_steps": STEPS})
    assert r.text_ids == text
    assert len(r.codes) == codes >= 3
    np.testing.assert_allclose(r.wav, wav_ref.numpy(), atol=1e-4, rtol=0)
    # the talker's own prompt (codec pad / bos embeddings added, as its forward does with a mask) speaks otherwise
    fixed = sp_mod.generate(model, speech, speaker="Chelsie", max_new_tokens=12, sampling=GREEDY, max_codes=16,
                            input_ids=ids)
    assert fixed.codes != r.codes


def test_unknown_speaker_is_a_clear_error(ours):
    with pytest.raises(ValueError, match="unknown speaker 'Nobody'.*Chelsie, Ethan"):
        ours[2].voice("Nobody")


def test_thinker_only_checkpoint_has_no_speech(tiny_ckpt):
    with pytest.raises(sp_mod.SpeechUnavailable, match="text only"):
        sp_mod.load_speech(tiny_ckpt)
