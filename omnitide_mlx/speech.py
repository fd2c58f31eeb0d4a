"""Spoken replies on MLX: the talker runs in lockstep with the thinker, token2wav turns the codec stream into audio
chunk by chunk, so the first audio comes while the text is still streaming.

``OmniSession.ask(question, speak=True, speaker="Ethan")`` returns an iterator of text pieces (``str``) and
:class:`AudioChunk` objects. How one reply is spoken:

1. The engine calls ``on_forward`` for the question unit and for every reply token it feeds back, with the
   thinker's final-norm hidden states of those tokens (captured in the same forward that streams the text; no
   second pass). The talker's prompt is the question unit (``<|im_start|>user ... <|im_start|>assistant\\n``) at
   positions 0.. (the thinker's hidden states carry the rest of the history; feeding the whole history through the
   talker would cost a talker prefill of all of it per answer); then codec step k reads reply token k.
2. Between text pieces the talker makes one code per new text token; after the text it reads the text-eos and
   text-pad embeddings until it emits a stop code (or ``max_codes``).
3. Codes are decoded in chunks of DiT attention blocks (:class:`ChunkedToken2Wav`): each chunk's mel comes from a
   window reaching ``left_blocks`` blocks back and one block ahead (the DiT's look-ahead), and the noise of every
   frame is fixed for the reply, so a chunk's window differs from the whole-reply decode only through the ODE
   steps' reach beyond the window. The vocoder runs on the chunk's mel plus a margin and keeps the chunk's samples.
4. The talker's KV cache belongs to the reply and is dropped when the iterator ends.

A reply whose text is blank (no token, or a stop string cut it all) has nothing to speak: the last item is then an
empty final chunk with a ``note``. The talker starts at the first non-blank text piece.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import numpy as np

from .models.qwen2_5_omni.speech import Speech, SpeechUnavailable, load_speech
from .models.qwen2_5_omni.talker import CodecSampling

__all__ = ["AudioChunk", "ChunkedToken2Wav", "SpeechOptions", "SpeechUnavailable", "speech_for", "spoken_reply"]


@dataclass
class AudioChunk:
    """A piece of a spoken reply: float32 PCM in [-1, 1] (mono) at ``sample_rate``. ``final`` marks the last chunk
    of the reply (its ``pcm`` may be empty); ``note`` says why a reply was not spoken."""

    pcm: np.ndarray
    sample_rate: int
    index: int = 0
    final: bool = False
    note: str = ""

    @property
    def seconds(self) -> float:
        return self.pcm.shape[0] / self.sample_rate

    def int16(self) -> np.ndarray:
        return (np.clip(self.pcm, -1.0, 1.0) * 32767).astype(np.int16)


@dataclass
class SpeechOptions:
    """How a reply is spoken. Chunk sizes are in DiT attention blocks (``block_size`` mel frames: 12 codes,
    240 ms of audio in the released model): a small first chunk for latency, larger ones after."""

    speaker: str | None = None
    sampling: CodecSampling = field(default_factory=CodecSampling)
    max_codes: int = 4096
    max_codes_per_token: int = 30  # a cap after the text ends too (50 codes/s; speech runs ~10 codes per token)
    first_chunk_blocks: int = 1
    chunk_blocks: int = 4
    left_blocks: int = 2
    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
    seed: int | None = None
    tts_sampling: "TTSSampling | None" = None  # MiniCPM-o's TTS sampling (default: the official TTSSamplingParams)
    token2wav_version: str | None = None  # MiniCPM-o: "1.0.6" / "1.0.7" token2wav (None: from the folder's files)

    def with_sampling(self, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                      repetition_penalty: float | None = None, greedy: bool | None = None) -> "SpeechOptions":
        """These options with the speech sampler's settings changed where a value is given, for whichever model
        speaks: Qwen2.5-Omni's talker (``sampling``, official defaults temperature 0.9, top-k 40, top-p 0.8,
        repetition penalty 1.05) and MiniCPM-o's TTS (``tts_sampling``, official temperature 0.8, top-k 25,
        top-p 0.85, repetition penalty 1.05); None keeps each model's official default. ``temperature`` 0 (or
        ``greedy=True``) takes the arg-max of the penalised logits. Speech sampling is separate from the text's:
        ``ask(temp=0)`` makes the text greedy, not the speech. ``ValueError`` for out-of-range values."""
        from dataclasses import replace

        from .models.minicpmo.tts import TTSSampling

        checks = [(temperature is None or (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                                           and temperature >= 0), f"temperature must be >= 0, got {temperature!r}"),
                  (top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1),
                   f"top_k must be an integer >= 1, got {top_k!r}"),
                  (top_p is None or (isinstance(top_p, (int, float)) and not isinstance(top_p, bool)
                                     and 0 < top_p <= 1), f"top_p must be in (0, 1], got {top_p!r}"),
                  (repetition_penalty is None or (isinstance(repetition_penalty, (int, float))
                                                  and not isinstance(repetition_penalty, bool)
                                                  and repetition_penalty > 0),
                   f"repetition_penalty must be > 0, got {repetition_penalty!r}"),
                  (greedy is None or isinstance(greedy, bool), f"greedy must be true or false, got {greedy!r}")]
        bad = [why for ok, why in checks if not ok]
        if bad:
            raise ValueError("speech sampling: " + "; ".join(bad))
        if temperature == 0:
            temperature, greedy = None, True
        given = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                       repetition_penalty=repetition_penalty, greedy=greedy).items() if v is not None}
        if not given:
            return self
        if "temperature" in given and "greedy" not in given:
            given["greedy"] = False  # a temperature asks for sampling
        given = {k: (float(v) if k in ("temperature", "top_p", "repetition_penalty") else v) for k, v in given.items()}
        return replace(self, sampling=replace(self.sampling, **given),
                       tts_sampling=replace(self.tts_sampling or TTSSampling(), **given))


class ChunkedToken2Wav:
    """token2wav over a growing code stream: ``add(codes)`` then ``ready(final)`` returns the waveform of every
    chunk that can be decoded now. The waveform has exactly ``len(codes) * samples_per_code`` samples in all."""

    VOCODER_MARGIN = 8  # mel frames of context on each side of a chunk for the vocoder's receptive field

    def __init__(self, speech: Speech, options: SpeechOptions):
        self.speech, self.o = speech, options
        t2w = speech.token2wav
        self.dit_cfg = t2w.dit.config
        self.codes_per_block = max(1, self.dit_cfg.block_size // self.dit_cfg.repeats)
        voice = speech.voice(options.speaker)
        self.cond, self.ref = mx.array(voice.cond)[None], mx.array(voice.ref_mel)[None]
        self.codes: list[int] = []
        self.emitted = 0  # codes whose audio has been returned
        self._noise = mx.zeros((1, 0, self.dit_cfg.mel_dim))
        self._key = mx.random.key(options.seed if options.seed is not None else int(np.random.randint(2 ** 31)))

    def add(self, codes) -> None:
        self.codes.extend(int(c) for c in codes)

    def _noise_for(self, frames: int) -> mx.array:
        """The reply's initial noise, frame by frame (drawn in blocks as the reply grows, never redrawn)."""
        while self._noise.shape[1] < frames:
            self._key, sub = mx.random.split(self._key)
            block = mx.random.normal((1, 64, self.dit_cfg.mel_dim), key=sub)
            self._noise = mx.concatenate([self._noise, block], axis=1)
        return self._noise

    def _decode(self, start: int, end: int, final: bool) -> np.ndarray:
        cpb, rep = self.codes_per_block, self.dit_cfg.repeats
        ws = max(0, (start // cpb - self.o.left_blocks) * cpb)
        we = len(self.codes) if final else min(len(self.codes), end + cpb)
        codes = mx.array(np.asarray(self.codes[ws:we], dtype=np.int32))[None]
        noise = self._noise_for(we * rep)[:, ws * rep:we * rep]
        mel = self.speech.token2wav.dit.sample(codes, self.cond, self.ref, noise, num_steps=self.o.num_steps,
                                               guidance_scale=self.o.guidance_scale,
                                               sway_coefficient=self.o.sway_coefficient)
        a, b = (start - ws) * rep, (end - ws) * rep  # the chunk's frames inside the window
        va, vb = max(0, a - self.VOCODER_MARGIN), min(mel.shape[1], b + self.VOCODER_MARGIN)
        wav = self.speech.token2wav.vocoder(mel[:, va:vb])
        mx.eval(wav)
        hop = self.speech.token2wav.vocoder.config.hop
        return np.array(wav[0, (a - va) * hop:(b - va) * hop])

    def ready(self, final: bool = False) -> list[np.ndarray]:
        out = []
        cpb = self.codes_per_block
        while self.emitted < len(self.codes):
            size = (self.o.first_chunk_blocks if self.emitted == 0 else self.o.chunk_blocks) * cpb
            end = min(len(self.codes), self.emitted + size)
            if not final and (end - self.emitted < size or len(self.codes) < end + cpb):
                break  # wait for a full chunk and its look-ahead block
            out.append(self._decode(self.emitted, end, final and end == len(self.codes)))
            self.emitted = end
        return out


def speech_for(session, token2wav_version: str | None = None) -> "Speech | MiniCPMSpeech":
    """The session's speech models, loaded on first use from the model's checkpoint folder: Qwen2.5-Omni's talker +
    token2wav + voices, or MiniCPM-o's TTS + StepAudio2 token2wav + voices (``token2wav_version`` overrides the
    version its files say; asking for another one reloads token2wav)."""
    speech = getattr(session, "_speech", None)
    if speech is not None and token2wav_version is not None and \
            getattr(getattr(speech, "token2wav", None), "version", token2wav_version) != token2wav_version:
        speech = None
    if speech is None:
        path = getattr(session.model, "checkpoint_path", None)
        if hasattr(session.model, "require_tts"):  # MiniCPM-o: its TTS loads with the model, token2wav here
            from .models.minicpmo.speech import load_minicpm_speech

            speech = load_minicpm_speech(session.model, path, token2wav_version)
        elif path is None or not hasattr(session.model, "language_model"):
            raise SpeechUnavailable(f"{type(session.model).__name__} has no talker: this model answers in text only")
        else:
            speech = load_speech(path)
        session._speech = speech
    return speech


def spoken_reply(session, ask, question: str, speech, options: SpeechOptions,
                 **ask_kwargs) -> Iterator[str | AudioChunk]:
    """Text pieces and audio chunks of one reply. ``ask(question, on_forward=..., **ask_kwargs)`` is the engine's
    text ask; ``speech`` and the speaker were checked by the caller before anything ran."""
    if not isinstance(speech, Speech):
        from .models.minicpmo.speech import MiniCPMSpeech

        if isinstance(speech, MiniCPMSpeech):
            return minicpm_spoken_reply(session, ask, question, speech, options, **ask_kwargs)
        raise TypeError(f"no spoken-reply driver for {type(speech).__name__}")
    return _qwen_spoken_reply(session, ask, question, speech, options, **ask_kwargs)


def _qwen_spoken_reply(session, ask, question: str, speech: Speech, options: SpeechOptions,
                       **ask_kwargs) -> Iterator[str | AudioChunk]:
    thinker = session.model
    tracks: list[mx.array] = []
    prompt: dict = {}
    lm = thinker.language_model

    def on_forward(ids, embeds, hidden):
        if hidden is None:
            raise RuntimeError("the session backend did not capture hidden states")
        if not prompt:
            prompt.update(ids=np.asarray(ids), embeds=embeds, hidden=hidden)
        else:
            tracks.append(hidden[0] + embeds.reshape(-1, embeds.shape[-1])[0].astype(hidden.dtype))

    decoder = ChunkedToken2Wav(speech, options)
    sr = speech.sample_rate
    state = {"stream": None, "fed": 0, "chunks": 0, "said": ""}

    def pump(final: bool) -> list[AudioChunk]:
        """Run the talker over the tracks that arrived (once the reply has shown some non-blank text), then decode
        what is ready."""
        stream = state["stream"]
        if stream is None and tracks and state["said"].strip():
            n = prompt["ids"].shape[0]
            positions = np.broadcast_to(np.arange(n), (3, n))
            stream = speech.talker_stream(thinker, prompt["ids"], prompt["hidden"], prompt["embeds"], positions,
                                          options.speaker, options.sampling, options.max_codes)
            state["stream"] = stream
            code = stream.start(tracks[0])
            state["fed"] = 1
            if code is not None:
                decoder.add([code])
        if stream is not None:
            if final:  # the text is complete: bound the speech by its length
                stream.max_codes = min(stream.max_codes, options.max_codes_per_token * len(tracks) + 50)
                stream.done = stream.done or len(stream.codes) >= stream.max_codes
            while not stream.done and (state["fed"] < len(tracks) or final):
                vec = tracks[state["fed"]] if state["fed"] < len(tracks) else None
                state["fed"] += 1
                code = stream.step(vec)
                if code is not None:
                    decoder.add([code])
        out = []
        done = final or (stream is not None and stream.done)
        for pcm in decoder.ready(final=done):
            out.append(AudioChunk(pcm.astype(np.float32), sr, state["chunks"]))
            state["chunks"] += 1
        return out

    try:
        for piece in ask(question, on_forward=on_forward, **ask_kwargs):
            state["said"] += piece
            yield piece
            yield from pump(final=False)
        chunks = pump(final=True)
        if state["stream"] is None:
            yield AudioChunk(np.zeros(0, np.float32), sr, state["chunks"], final=True,
                             note="the reply has no text to speak: text only")
            return
        if chunks:
            chunks[-1].final = True
            yield from chunks
        else:
            note = "" if decoder.codes else "no speech: the talker ended the reply before its first codec token"
            yield AudioChunk(np.zeros(0, np.float32), sr, state["chunks"], final=True, note=note)
    finally:
        state["stream"] = None  # the talker's KV cache goes with the reply
        session._hidden = None


class MiniCPMVoicer:
    """One MiniCPM-o reply spoken as the official ``streaming_generate`` does (modeling_minicpmo.py at 28b60cf):
    the reply's tokens, with the final-norm hidden state of the forward that fed each one back, go to the TTS in
    text chunks of 10; the TTS hands out audio tokens 25 at a time; token2wav streams windows of 25 fresh tokens
    plus 3 of lookahead behind 3 silence tokens, every full window alike (the reply's last ones too), and the
    tokens left after the last full window go in one final push.

    The reply's end, as officially: a reply that ended at a terminator feeds its last text chunk with the TTS's text
    eos (``feed(..., last=True)``); a reply cut by the token limit feeds it as an ordinary chunk and then flushes
    what the TTS holds (``finish()``), without an end-of-text chunk. The official loop could in principle send a
    full window marked last and its 3 leftover tokens marked last again; the TTS never hands out a last chunk of
    25 (a full chunk is always handed out unmarked first), so that cannot happen and is not modelled."""

    def __init__(self, speech, options: SpeechOptions):
        from .models.minicpmo.speech import SILENCE_PREFIX, SILENCE_TOKEN
        from .models.minicpmo.tts import TTSSampling

        self.speech = speech
        voice = speech.voice(options.speaker)
        speech.token2wav.n_timesteps = int(options.num_steps)
        self.reply = speech.tts.start_reply(options.tts_sampling or TTSSampling(), seed=options.seed)
        self.stream = speech.token2wav.start_stream(voice)
        self.ids: list[int] = []
        self.hidden: list[mx.array] = []
        self.fed = 0
        self.audio_tokens = 0
        self.buffer = [SILENCE_TOKEN] * SILENCE_PREFIX
        self._prompt_seen = False
        self.finished = False

    def on_forward(self, ids, embeds, hidden) -> None:
        if hidden is None:
            raise RuntimeError("the session backend did not capture hidden states")
        if not self._prompt_seen:  # the question unit: the TTS reads the reply only
            self._prompt_seen = True
            return
        self.ids.extend(int(i) for i in np.asarray(ids).reshape(-1))
        self.hidden.append(hidden.reshape(-1, hidden.shape[-1]))

    def _text_chunk(self, a: int, b: int):
        h = mx.concatenate(self.hidden, axis=0)[a:b] if b > a else mx.zeros((0, self.hidden[0].shape[-1]))
        return np.asarray(self.ids[a:b], dtype=np.int64), h

    def _vocode(self, chunks: list[list[int]], last: bool) -> list[np.ndarray]:
        from .models.minicpmo.speech import T2W_CHUNK

        look = self.speech.token2wav.flow.cfg.encoder.pre_lookahead_len
        out = []
        for chunk in chunks:
            self.audio_tokens += len(chunk)
            self.buffer += [int(t) for t in chunk]
            while len(self.buffer) >= T2W_CHUNK + look:
                out.append(self.stream.push(self.buffer[:T2W_CHUNK + look]))
                self.buffer = self.buffer[T2W_CHUNK:]
        if last:
            out.append(self.stream.push(self.buffer, last=True))
            self.buffer = []
        return [np.asarray(x, dtype=np.float32).reshape(-1) for x in out]

    def pump(self, final: bool, terminated: bool = True) -> list[np.ndarray]:
        """Feed the complete text chunks (all of the rest when ``final``) and return the audio ready now.
        ``terminated``: the reply ended at a terminator (False: at the token limit; see the class docstring)."""
        from .models.minicpmo.speech import TEXT_CHUNK

        out = []
        while len(self.ids) - self.fed >= TEXT_CHUNK:
            ids, h = self._text_chunk(self.fed, self.fed + TEXT_CHUNK)
            self.fed += TEXT_CHUNK
            out += self._vocode(self.reply.feed(ids, h), last=False)
        if final and not self.finished:
            ids, h = self._text_chunk(self.fed, len(self.ids))
            self.fed = len(self.ids)
            if terminated:
                out += self._vocode(self.reply.feed(ids, h, last=True), last=True)
            else:
                chunks = self.reply.feed(ids, h) if len(ids) else []
                out += self._vocode(chunks + self.reply.finish(), last=True)
            self.finished = True
        return [x for x in out if x.size]


def minicpm_spoken_reply(session, ask, question: str, speech, options: SpeechOptions,
                         **ask_kwargs) -> Iterator[str | AudioChunk]:
    """MiniCPM-o's text pieces and audio chunks of one reply (:class:`MiniCPMVoicer`)."""
    voicer = MiniCPMVoicer(speech, options)
    sr = speech.sample_rate
    said, index = "", 0
    # the engine feeds back every generated token and stops before max_tokens + 1: a reply that reached max_tokens
    # tokens was cut by the limit (a terminator is never fed back)
    params = inspect.signature(ask).parameters
    limit = ask_kwargs.get("max_tokens", params["max_tokens"].default if "max_tokens" in params else None)
    try:
        for piece in ask(question, on_forward=voicer.on_forward, **ask_kwargs):
            said += piece
            yield piece
            if said.strip():
                for pcm in voicer.pump(final=False):
                    yield AudioChunk(pcm, sr, index)
                    index += 1
        if not said.strip():
            yield AudioChunk(np.zeros(0, np.float32), sr, index, final=True,
                             note="the reply has no text to speak: text only")
            return
        chunks = voicer.pump(final=True, terminated=limit is None or len(voicer.ids) < limit)
        if chunks:
            for j, pcm in enumerate(chunks):
                yield AudioChunk(pcm, sr, index, final=j == len(chunks) - 1)
                index += 1
        else:
            note = "" if voicer.audio_tokens else "no speech: the TTS ended the reply before its first audio token"
            yield AudioChunk(np.zeros(0, np.float32), sr, index, final=True, note=note)
    finally:
        session._hidden = None


# --- output: wav files and playback ------------------------------------------------------------------------------

class WavWriter:
    """A 16-bit mono wav written chunk by chunk (stdlib ``wave``: no dependency); the header is final at close."""

    def __init__(self, path, sample_rate: int):
        import wave

        self.path = path
        self.sample_rate = sample_rate
        self.samples = 0
        self._w = wave.open(str(path), "wb")
        self._w.setnchannels(1)
        self._w.setsampwidth(2)
        self._w.setframerate(sample_rate)

    def write(self, chunk: AudioChunk) -> None:
        if chunk.pcm.size:
            self._w.writeframes(chunk.int16().tobytes())
            self.samples += chunk.pcm.shape[0]

    def close(self) -> None:
        self._w.close()

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate


class Player:
    """Plays audio chunks as they come through ``sounddevice`` (the ``speech`` extra); ``Player.open()`` returns
    None where it is not installed or there is no output device (headless: the wav files are the output)."""

    def __init__(self, stream):
        self._stream = stream

    @classmethod
    def open(cls, sample_rate: int) -> "Player | None":
        try:
            import sounddevice as sd

            stream = sd.OutputStream(samplerate=sample_rate, channels=1, dtype="float32")
            stream.start()
        except Exception:  # not installed, no PortAudio, no device
            return None
        return cls(stream)

    def play(self, chunk: AudioChunk) -> None:
        if chunk.pcm.size:
            self._stream.write(chunk.pcm.reshape(-1, 1))

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()
