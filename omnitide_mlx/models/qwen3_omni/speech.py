"""Spoken replies of Qwen3-Omni on MLX: the thinker's states -> talker and code predictor (16 codebooks at 12.5 Hz)
-> Code2Wav (24 kHz), as transformers 5.24's ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)``
computes them with greedy decoding (talker.py, code2wav.py).

``load_speech(folder, config)`` -> :class:`Speech`; ``speech.reply(model, inputs, generated, speaker)`` -> (codes
``[16, frames]``, waveform ``[samples]``) for a reply the thinker already generated; :func:`generate` runs both
stages like transformers' ``generate``; ``speech.stream(model, inputs, tokens, speaker)`` speaks a reply while its
tokens arrive (the talker one frame per reply token, Code2Wav one chunk at a time), yielding PCM pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .code2wav import Code2Wav, Code2WavStream, load_code2wav
from .talker import Talker, TalkerStream, load_talker, talker_prompt


@dataclass
class Speech:
    talker: Talker
    code2wav: Code2Wav
    config: dict  # the full config.json (token ids of the talker prompt)

    @property
    def sample_rate(self) -> int:
        return 24000

    def quantize(self, bits: int = 4, group_size: int = 64) -> None:
        """Quantise the talker's and code predictor's projections, experts (``gather_qmm``), embeddings and heads in
        memory; the routers (``mlp.gate``, ``shared_expert_gate``: the same expert-choice argument as the
        thinker's), norms and Code2Wav stay in float. At the released sizes the talker is ~3.3 B parameters, 6.2 GiB
        in bf16 and ~2.1 GiB this way; Code2Wav adds 0.4 GiB in float (docs/models/qwen3_omni.md)."""
        import mlx.nn as nn

        def predicate(path: str, module) -> bool:
            return (hasattr(module, "to_quantized") and not path.endswith(("mlp.gate", "shared_expert_gate"))
                    and module.weight.shape[-1] % group_size == 0)

        nn.quantize(self.talker, group_size=group_size, bits=bits, class_predicate=predicate)
        mx.eval(self.talker.parameters())

    def thinker_states(self, model, inputs: dict, generated: list[int]) -> tuple[mx.array, mx.array]:
        """The thinker's input embeddings and its ``accept_hidden_layer`` output over the prompt and the reply but
        its last token (what transformers' generate recorded), batch 1."""
        embeds, positions, _, _, deepstack = model.prepare(**inputs)
        if embeds.shape[0] != 1:
            raise ValueError("spoken replies take one sequence (batch 1)")
        pos = positions[:, 0]
        prev = list(generated[:-1])
        if prev:
            embeds = mx.concatenate([embeds, model.language_model.embed(mx.array([prev]))], axis=1)
            nxt = pos.max() + 1 + np.arange(len(prev), dtype=np.float32)
            pos = np.concatenate([pos, np.broadcast_to(nxt, (3, len(prev)))], axis=1)
        layer = self.talker.config.accept_hidden_layer
        _, kept = model.language_model.hidden_states(embeds, None, pos, deepstack=deepstack, return_layers=(0, layer))
        return kept[0], kept[layer]

    def talker_positions(self, model, talker_ids: np.ndarray, inputs: dict) -> np.ndarray:
        """M-RoPE positions of the talker prompt: the thinker's rule over the talker's ids when media are present
        (transformers' ``compute_3d_position_ids``), else sequential."""
        media = any(inputs.get(k) is not None for k in ("image_grid_thw", "video_grid_thw", "feature_attention_mask"))
        n = talker_ids.shape[0]
        if not media:
            return np.broadcast_to(np.arange(n, dtype=np.float32), (3, n))
        pos, _ = model.get_rope_index(talker_ids[None], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                      None, inputs.get("use_audio_in_video", False),
                                      inputs.get("feature_attention_mask"), inputs.get("video_second_per_grid"))
        return pos[:, 0]

    def reply(self, model, inputs: dict, generated: list[int], speaker: str = "Ethan", *,
              max_new_tokens: int = 4096, eos_ids=None, stream_joins: bool = True, sampling=None,
              predictor_sampling=None) -> tuple[np.ndarray, np.ndarray]:
        """(codes ``[num_code_groups, frames]``, waveform ``[samples]`` float32 at 24 kHz) for ``generated`` (the
        thinker's reply ids, its stop token included) to the prompt ``inputs``. ``stream_joins``: decode with
        :meth:`Code2Wav.decode_stream` (no holes at 300-frame joins) rather than transformers' ``chunked_decode``;
        both are the same below 300 frames (24 s). ``sampling`` / ``predictor_sampling``: see
        :meth:`Talker.generate` (default greedy)."""
        if eos_ids is None:
            eos_ids = (self.config["im_end_token_id"],)
        embeds0, hidden = self.thinker_states(model, inputs, generated)
        prompt, talker_ids, trailing, pad = talker_prompt(model, self.talker, self.config, inputs["input_ids"],
                                                          generated, embeds0, hidden, speaker, eos_ids=eos_ids)
        positions = self.talker_positions(model, talker_ids, inputs)
        codes = self.talker.generate(prompt, positions, trailing, pad, max_new_tokens=max_new_tokens,
                                     sampling=sampling, predictor_sampling=predictor_sampling)
        if codes.shape[1] == 0:
            return codes, np.zeros(0, dtype=np.float32)
        if stream_joins:
            wav = mx.concatenate(list(self.code2wav.decode_stream(codes[None])), axis=-1)
        else:
            wav = self.code2wav.chunked_decode(codes[None])
        return codes, np.array(wav.astype(mx.float32)).reshape(-1)


    def stream(self, model, inputs: dict, tokens, speaker: str = "Ethan", *, chunk_size: int = 25,
               left_context_size: int = 25, max_new_tokens: int = 4096, eos_ids=None, sampling=None,
               predictor_sampling=None):
        """Yield float32 PCM pieces (24 kHz) of the reply whose token ids ``tokens`` yields one by one, as they
        come: the talker starts once the first token exists and then makes one frame per further token (then
        reads ``tts_eos`` and ``tts_pad`` after the stop token) until its ``codec_eos``; Code2Wav emits every
        ``chunk_size`` frames (25 = 2 s). The concatenated pieces equal ``reply`` with the same chunking
        (``decode_stream``), except that a reply cut by a token limit has its last token spoken too (transformers
        drops it). ``.codes`` of the generator's return value: no; read ``self.last_codes`` after it ends."""
        if eos_ids is None:
            eos_ids = (self.config["im_end_token_id"],)
        eos_ids = set(eos_ids)
        it = iter(tokens)
        first = next(it, None)
        self.last_codes = np.zeros((self.talker.config.num_code_groups, 0), dtype=np.int64)
        if first is None or first in eos_ids:
            return
        embeds0, hidden = self.thinker_states(model, inputs, [first, next(iter(eos_ids))])
        prompt, talker_ids, _, pad = talker_prompt(model, self.talker, self.config, inputs["input_ids"],
                                                   [first, next(iter(eos_ids))], embeds0, hidden, speaker,
                                                   eos_ids=tuple(eos_ids))
        special = mx.array([[self.config["tts_eos_token_id"]]])
        eos_row = self.talker.text_projection(model.language_model.embed(special))
        talker = TalkerStream(self.talker, max_new_tokens=max_new_tokens, sampling=sampling,
                              predictor_sampling=predictor_sampling)
        talker.start(prompt, self.talker_positions(model, talker_ids, inputs))
        audio = Code2WavStream(self.code2wav, chunk_size, left_context_size)
        frames, text_ended = [], False
        while not talker.done:
            if not text_ended:
                token = next(it, None)
                if token is None or token in eos_ids:
                    text_ended, row = True, eos_row
                else:
                    row = self.talker.text_projection(model.language_model.embed(mx.array([[token]])))
            else:
                row = pad
            frame = talker.step(row)
            if frame is not None:
                frames.append(frame)
                pcm = audio.add(frame)
                if pcm.size:
                    yield pcm
        pcm = audio.finish()
        if pcm.size:
            yield pcm
        self.last_codes = np.asarray(frames, dtype=np.int64).T.reshape(self.talker.config.num_code_groups, -1)


SPEECH_DIR = "speech"  # in a converted folder: the talker and Code2Wav tensors, float, released names


def load_speech(path, config: dict) -> Speech:
    """The talker, code predictor and Code2Wav of a released checkpoint folder (a -Thinking one has none), or of a
    converted folder's ``speech/`` (see :func:`save_speech`)."""
    path = Path(path)
    if (path / SPEECH_DIR / "model.safetensors").is_file():
        path = path / SPEECH_DIR
    return Speech(load_talker(path, config), load_code2wav(path, config), config)


def save_speech(src, dst) -> Path:
    """Copy the ``talker.*`` and ``code2wav.*`` tensors of checkpoint folder ``src`` to ``dst/speech/`` unchanged
    (float, released names), so that a folder written by ``omnitide convert`` (thinker only) can still speak
    (:meth:`Speech.quantize` quantises the talker after loading)."""
    from ..loading import load_safetensors

    weights = {k: v for k, v in load_safetensors(Path(src)).items() if k.startswith(("talker.", "code2wav."))}
    if not weights:
        raise ValueError(f"{src} has no talker or code2wav weights")
    out = Path(dst) / SPEECH_DIR
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def generate(model, speech: Speech, inputs: dict, *, speaker: str = "Ethan", thinker_max_new_tokens: int = 1024,
             talker_max_new_tokens: int = 4096, eos_ids=None) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Both stages, greedy, as transformers' ``generate(return_audio=True, talker_do_sample=False)``: (reply ids,
    codes, waveform)."""
    if eos_ids is None:
        eos_ids = (speech.config["im_end_token_id"],)
    generated = model.generate(max_new_tokens=thinker_max_new_tokens, stop_token_ids=eos_ids, **inputs)
    codes, wav = speech.reply(model, inputs, generated, speaker, max_new_tokens=talker_max_new_tokens,
                              eos_ids=eos_ids, stream_joins=False)
    return generated, codes, wav
