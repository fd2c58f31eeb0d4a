"""Spoken output of Qwen2.5-Omni: the talker, token2wav and the voices, loaded on demand from the checkpoint folder.

``load_speech(folder)`` reads the ``talker.*`` / ``token2wav.*`` weights (from the folder's safetensors, or from
``speech/`` in a converted folder) and the voices, so a text-only user pays nothing for them. ``generate`` is the
offline path that transformers' ``Qwen2_5OmniForConditionalGeneration.generate(return_audio=True)`` defines
(thinker greedy decode with its hidden states, talker, token2wav), used by the parity tests and ``omnitide
generate --speak``; the streaming engine drives the same pieces step by step (``omnitide_mlx/speech.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..loading import CheckpointError, load_weights_strict
from .speakers import SPEAKERS_FILE, Speaker, load_speakers, save_speakers
from .talker import CodecSampling, Talker, TalkerConfig, TalkerStream
from .token2wav import SAMPLE_RATE, Token2Wav, sanitize_token2wav

SPEECH_DIR = "speech"


class SpeechUnavailable(CheckpointError):
    """The checkpoint has no talker / token2wav weights (or no config for them): text only."""


@dataclass
class Speech:
    talker: Talker
    token2wav: Token2Wav
    speakers: dict[str, Speaker]
    config: dict  # talker_config + token2wav_config, as in config.json

    sample_rate = SAMPLE_RATE

    @property
    def default_speaker(self) -> str:
        return "Chelsie" if "Chelsie" in self.speakers else next(iter(self.speakers))

    def voice(self, name: str | None) -> Speaker:
        name = self.default_speaker if name is None else name
        if name not in self.speakers:
            raise ValueError(f"unknown speaker {name!r} (this checkpoint has: {', '.join(sorted(self.speakers))})")
        return self.speakers[name]

    # --- talker ---------------------------------------------------------------------------------------------
    def talker_stream(self, thinker, prompt_ids, prompt_hidden: mx.array, prompt_embeds: mx.array,
                      positions: np.ndarray, speaker: str | None = None, sampling: CodecSampling | None = None,
                      max_codes: int = 4096, codec_prompt: bool = True) -> TalkerStream:
        """A talker for one reply. ``prompt_hidden`` / ``prompt_embeds`` ``[T, H]``: the thinker's final-norm hidden
        states and input embeddings of the prompt ``prompt_ids``, at ``positions`` ``[3, T]``; media placeholder
        rows of the embeddings are zeroed here, as transformers does."""
        c, tc = thinker.config, self.talker.config
        ids = np.asarray(prompt_ids).reshape(-1)
        media = np.isin(ids, [c.audio_token_id, c.image_token_id, c.video_token_id])
        if media.any():
            prompt_embeds = prompt_embeds * mx.array((~media).astype(np.float32))[:, None].astype(prompt_embeds.dtype)
        voice = self.voice(speaker)
        special = thinker.language_model.embed(mx.array([voice.bos_token, tc.tts_text_end_token_id,
                                                         tc.tts_text_pad_token_id]))
        return TalkerStream(self.talker, prompt_hidden + prompt_embeds, positions, special[0], special[1],
                            special[2], sampling=sampling, max_codes=max_codes, codec_prompt=codec_prompt)

    # --- token2wav ------------------------------------------------------------------------------------------
    def noise(self, codes: int, seed: int | None = None) -> mx.array:
        dit = self.token2wav.dit.config
        key = mx.random.key(seed) if seed is not None else None
        return mx.random.normal((1, codes * dit.repeats, dit.mel_dim), key=key)

    def mel(self, codes, speaker: str | None = None, noise: mx.array | None = None, **kw) -> mx.array:
        voice = self.voice(speaker)
        codes = mx.array(np.asarray(codes, dtype=np.int32).reshape(1, -1))
        noise = self.noise(codes.shape[1]) if noise is None else mx.array(noise)
        return self.token2wav.dit.sample(codes, mx.array(voice.cond)[None], mx.array(voice.ref_mel)[None],
                                         noise.astype(mx.float32), **kw)

    def wav(self, codes, speaker: str | None = None, noise: mx.array | None = None, **kw) -> np.ndarray:
        """Float32 waveform (24 kHz, [-1, 1]) of ``codes``: ``len(codes) * samples_per_code`` samples."""
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        wav = self.token2wav.vocoder(self.mel(codes, speaker, noise, **kw))
        mx.eval(wav)
        return np.array(wav[0])


def has_speech(folder: Path, config: dict) -> bool:
    return bool(config.get("talker_config")) and bool(config.get("token2wav_config")) and (
        (Path(folder) / SPEECH_DIR).is_dir() or (Path(folder) / "spk_dict.pt").exists())


def load_speech(folder, config: dict | None = None) -> Speech:
    """The talker, token2wav and voices of a checkpoint folder. Raises :class:`SpeechUnavailable` when the folder
    has none (a thinker-only checkpoint), CheckpointError when they do not match the config."""
    folder = Path(folder)
    if config is None:
        with open(folder / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    if not config.get("talker_config") or not config.get("token2wav_config"):
        raise SpeechUnavailable(f"{folder} has no talker (config.json has no talker_config / token2wav_config): "
                                "this checkpoint answers in text only")
    talker = Talker(TalkerConfig.from_dict(config["talker_config"]))
    token2wav = Token2Wav.from_dict(config["token2wav_config"])
    sub = folder / SPEECH_DIR
    if sub.is_dir():
        weights = dict(mx.load(str(sub / "model.safetensors")))
        t_w = {k[len("talker."):]: v for k, v in weights.items() if k.startswith("talker.")}
        w_w = {k[len("token2wav."):]: v for k, v in weights.items() if k.startswith("token2wav.")}
    else:
        t_w, w_w = {}, {}
        for f in sorted(folder.glob("*.safetensors")):
            part = mx.load(str(f))
            for k, v in part.items():
                if k.startswith("talker."):
                    t_w[k[len("talker."):]] = v
                elif k.startswith("token2wav."):
                    w_w[k[len("token2wav."):]] = v
        if not t_w or not w_w:
            raise SpeechUnavailable(f"{folder} holds no talker / token2wav weights: this checkpoint answers in "
                                    "text only")
        w_w = sanitize_token2wav(w_w)
    load_weights_strict(talker, t_w, what=f"talker in {folder}")
    load_weights_strict(token2wav, {k: v.astype(mx.float32) for k, v in w_w.items()}, what=f"token2wav in {folder}")
    mx.eval(talker.parameters(), token2wav.parameters())
    talker.eval()
    token2wav.eval()
    speakers = load_speakers(folder)
    return Speech(talker, token2wav, speakers, {k: config[k] for k in ("talker_config", "token2wav_config")})


def save_speech(speech: Speech, dst: Path) -> None:
    """Write the talker and token2wav (MLX layout) and the voices to ``dst/speech/`` (``omnitide convert``)."""
    from mlx.utils import tree_flatten

    sub = Path(dst) / SPEECH_DIR
    sub.mkdir(parents=True, exist_ok=True)
    weights = {f"talker.{k}": v for k, v in tree_flatten(speech.talker.parameters())}
    weights.update({f"token2wav.{k}": v for k, v in tree_flatten(speech.token2wav.parameters())})
    mx.save_safetensors(str(sub / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_speakers(speech.speakers, sub / SPEAKERS_FILE)


@dataclass
class SpokenReply:
    text_ids: list[int]
    codes: list[int]
    wav: np.ndarray
    sample_rate: int = SAMPLE_RATE


def generate(model, speech: Speech, *, speaker: str | None = None, max_new_tokens: int = 64, stop_token_ids=(),
             sampling: CodecSampling | None = None, max_codes: int = 4096, noise: mx.array | None = None,
             token2wav_kwargs: dict | None = None, codec_prompt: bool = True, **inputs) -> SpokenReply:
    """Text and speech for one prompt (processor outputs, batch 1), as transformers' ``generate`` with audio:
    the thinker decodes greedily, keeping its final-norm hidden state of every token it feeds back; the talker
    reads the prompt's and the reply's (one text token per code); token2wav turns the codes into a waveform.
    ``noise``: the DiT's initial state ``[1, 2 * codes, mel]`` (drawn when None). ``codec_prompt=False``: as
    transformers 5.24's ``generate`` runs the talker (see :class:`~.talker.TalkerStream`)."""
    lm = model.language_model
    embeds, positions, _, _ = model.prepare(**inputs)
    if embeds.shape[0] != 1:
        raise ValueError("generate() takes one sequence (batch 1)")
    ids = np.asarray(inputs["input_ids"]).reshape(-1)
    cache = model.make_cache()
    hidden = lm.hidden_states(embeds, cache, positions[:, 0])
    logits = lm.logits(hidden[:, -1:])
    nxt = int(positions.max()) + 1
    text, tracks = [], []
    while len(text) < max_new_tokens:
        token = int(mx.argmax(logits[0, -1]).item())
        text.append(token)
        if token in stop_token_ids or len(text) == max_new_tokens:
            break
        e = lm.embed(mx.array([[token]]))
        h = lm.hidden_states(e, cache, np.array([nxt]))
        nxt += 1
        tracks.append(h[0, 0] + e[0, 0])
        logits = lm.logits(h)
    if not tracks:
        return SpokenReply(text, [], np.zeros(0, dtype=np.float32))
    stream = speech.talker_stream(model, ids, hidden[0], embeds[0], positions[:, 0], speaker, sampling, max_codes,
                                codec_prompt)
    stream.start(tracks[0])
    k = 1
    while not stream.done:
        stream.step(tracks[k] if k < len(tracks) else None)
        k += 1
    wav = speech.wav(stream.codes, speaker, noise, **(token2wav_kwargs or {}))
    return SpokenReply(text, list(stream.codes), wav)
