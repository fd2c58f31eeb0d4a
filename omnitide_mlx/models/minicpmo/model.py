"""MiniCPM-o 4.5 in MLX: SigLIP + resampler and Whisper + projector feeding a Qwen3 language model.

``Model.__call__`` takes the arrays the official processor produces (numpy or MLX) and returns the logits of the
official forward; ``embed_inputs`` is the official ``get_vllm_embedding`` + ``get_omni_embedding`` (resampler
outputs written over the ``<unk>`` slots of ``image_bound``, audio tokens over ``audio_bounds``).
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base import KVSpec
from .audio import AudioProjector, WhisperEncoder, WhisperStreamCache, avg_pool, chunk_visibility
from .layout import audio_token_count, conv_output_length
from .config import ModelConfig
from .language import LanguageModel
from .resampler import Resampler
from .tts import MiniCPMTTS
from .vision import VisionTower, pad_slices


def _np(x) -> np.ndarray:
    if isinstance(x, mx.array):
        return np.array(x)
    if hasattr(x, "detach"):  # a torch tensor from the official processor
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _flat_lengths(lens) -> list[int]:
    """``audio_feature_lens`` as the official code gets it (a list per sample of lengths) -> one flat list."""
    out: list[int] = []
    if lens is None:
        return out
    if isinstance(lens, (mx.array, np.ndarray)) or hasattr(lens, "detach"):
        return [int(v) for v in _np(lens).reshape(-1)]
    for item in lens:
        if isinstance(item, (list, tuple)) or (hasattr(item, "shape") and len(getattr(item, "shape", ())) > 0):
            out.extend(int(v) for v in _np(item).reshape(-1))
        else:
            out.append(int(item))
    return out


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.language_model = LanguageModel(config.text)
        if config.vision is not None:
            self.vision_tower = VisionTower(config)
            self.resampler = Resampler(config.query_num, config.text.hidden_size, config.resampler_heads,
                                       config.vision.hidden_size)
        if config.audio is not None:
            self.audio_tower = WhisperEncoder(config.audio)
            self.audio_projection_layer = AudioProjector(config.audio.encoder_ffn_dim // 4, config.text.hidden_size)
        # the speech-output TTS (tts.py) when the checkpoint has one (the loader sets config.tts), else None
        self.tts = MiniCPMTTS(config.tts) if config.tts is not None else None
        self.tts_unavailable_reason = None if config.tts is not None else (
            "config.json has init_tts=false" if config.tts_config is None else "the checkpoint holds no tts.* weights")

    def require_tts(self) -> MiniCPMTTS:
        """The TTS, or ``SpeechUnavailable`` saying why this checkpoint answers in text only."""
        if self.tts is None:
            from ..qwen2_5_omni.speech import SpeechUnavailable

            raise SpeechUnavailable(f"this MiniCPM-o checkpoint has no TTS ({self.tts_unavailable_reason}): "
                                    "it answers in text only")
        return self.tts

    # --- engine contract ----------------------------------------------------------------------------------------
    def kv_spec(self) -> KVSpec:
        t = self.config.text
        return KVSpec(num_layers=t.num_hidden_layers, kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                      rope=self.language_model.rope_spec(), position_axes=1)

    def simplex_session(self, processor, seed: int | None = None):
        """The official simplex API (``streaming_prefill`` / ``streaming_generate``) on a fresh session."""
        from .simplex import SimplexSession

        return SimplexSession(self, processor, seed=seed)

    def duplex_session(self, processor, greedy: bool = False, seed: int | None = None, speak: bool = False,
                       speaker: str | None = None, window: tuple[int, int] | None = None, **kw):
        """A full-duplex session (duplex.py, the official ``MiniCPMODuplex``); call its ``prepare`` first.
        ``greedy``: argmax decisions and TTS tokens; ``speak``: voice the speaking units with the checkpoint's
        token2wav (``SpeechUnavailable`` saying what is missing); ``window``: the official basic window (high, low)."""
        from .duplex import BasicWindow, DuplexDecoding, DuplexSession

        speech = None
        if speak:
            from .speech import load_minicpm_speech

            speech = load_minicpm_speech(self, getattr(self, "checkpoint_path", None))
        decoding = DuplexDecoding(mode="greedy", tts_greedy=True) if greedy else DuplexDecoding()
        return DuplexSession(self, processor, decoding, speech=speech, speaker=speaker, seed=seed,
                             window=BasicWindow(*window) if window is not None else None, **kw)

    def stream_adapter(self, processor, **kw):
        from .adapter import MiniCPMOStreamAdapter

        return MiniCPMOStreamAdapter(self, processor, **kw)

    # --- vision -------------------------------------------------------------------------------------------------
    def vision_embeddings(self, slices: list, tgt_sizes) -> mx.array:
        """Slices in the official layout ``(3, 14, L*14)`` -> resampler outputs ``[n, query_num, hidden]``,
        batched ``vision_batch_size`` at a time (padded, with patch masks)."""
        if self.config.vision is None:
            raise ValueError("this checkpoint has no vision tower (init_vision is false)")
        tgt = _np(tgt_sizes).astype(np.int64).reshape(-1, 2)
        slices = [_np(s).astype(np.float32) for s in slices]
        if len(slices) != len(tgt):
            raise ValueError(f"{len(slices)} slices but {len(tgt)} tgt_sizes")
        p = self.config.vision.patch_size
        for s, (h, w) in zip(slices, tgt):
            if s.shape != (3, p, h * w * p):
                raise ValueError(f"a slice of {h}x{w} patches must have shape (3, {p}, {h * w * p}), got {s.shape}")
        outs = []
        bs = self.config.vision_batch_size
        for i in range(0, len(slices), bs):
            batch = mx.array(pad_slices(slices[i:i + bs], p)).astype(self.vision_tower.dtype)
            feats = self.vision_tower(batch, tgt[i:i + bs])
            outs.append(self.resampler(feats, tgt[i:i + bs]))
        return mx.concatenate(outs, axis=0)

    # --- audio --------------------------------------------------------------------------------------------------
    def audio_embeddings(self, features, feature_lens, chunk_length: float | None = None) -> list[mx.array]:
        """The official ``get_audio_embedding``: one ``[n_tokens, hidden]`` array per audio (row of
        ``features`` [N, 80, T]). ``chunk_length`` > 0 applies the block-causal chunk mask (default: the
        config's ``audio_chunk_length``, 1 s); <= 0 gives full attention."""
        if self.config.audio is None:
            raise ValueError("this checkpoint has no audio tower (init_audio is false)")
        chunk_length = self.config.audio_chunk_length if chunk_length is None else chunk_length
        x = mx.array(_np(features).astype(np.float32)).astype(self.audio_tower.dtype)
        lens = _flat_lengths(feature_lens)
        n, _, t = x.shape
        if len(lens) != n:
            raise ValueError(f"{n} audio feature rows but {len(lens)} lengths")
        t_enc = conv_output_length(t)
        # the official padding mask compares encoder frames with *mel* lengths (so it rarely masks anything)
        visible = np.arange(t_enc)[None, None, :] < np.asarray(lens)[:, None, None]
        visible = np.broadcast_to(visible, (n, t_enc, t_enc))
        if chunk_length > 0:
            visible = visible & chunk_visibility(t_enc, int(chunk_length * 50))[None]
        states = self.audio_tower(x, mask=mx.array(visible[:, None]))
        pooled = avg_pool(self.audio_projection_layer(states), self.config.audio_pool_step)
        return [pooled[i, : audio_token_count(lens[i], self.config.audio_pool_step)] for i in range(n)]

    def audio_embeddings_streaming(self, features, cache: WhisperStreamCache, prefix_extra_frames: int = 0,
                                   suffix_extra_frames: int = 0) -> tuple[mx.array, WhisperStreamCache]:
        """The official ``get_audio_embedding_streaming`` for one chunk ``[1, 80, T]`` (T mel frames including
        the extra context frames): returns the chunk's tokens and the (possibly reset) Whisper cache."""
        x = mx.array(_np(features).astype(np.float32)).astype(self.audio_tower.dtype)
        if x.ndim == 2:
            x = x[None]
        t = x.shape[-1]
        if cache.length and cache.length + conv_output_length(t) >= self.audio_tower.max_positions:
            cache = WhisperStreamCache()  # the official encoder restarts after 30 s of cached audio
        head = (prefix_extra_frames + 1) // 2 if prefix_extra_frames > 0 else 0
        tail = (suffix_extra_frames + 1) // 2 if suffix_extra_frames > 0 else 0
        states = self.audio_tower(x, cache=cache, trim=(head, tail))
        pooled = avg_pool(self.audio_projection_layer(states), self.config.audio_pool_step)
        return pooled[0, : audio_token_count(t, self.config.audio_pool_step)], cache

    # --- merged inputs ------------------------------------------------------------------------------------------
    def embed_inputs(self, input_ids, pixel_values=None, tgt_sizes=None, image_bound=None, audio_features=None,
                     audio_feature_lens=None, audio_bounds=None, chunk_length: float | None = None) -> mx.array:
        ids = _np(input_ids).astype(np.int32)
        if ids.ndim == 1:
            ids = ids[None]
        bsz = ids.shape[0]
        embeds = [self.language_model.embed_tokens(mx.array(row)) for row in ids]
        if pixel_values is not None and any(len(p) for p in pixel_values):
            per_image = [len(p) for p in pixel_values]
            tgt = [_np(t).reshape(-1, 2) for t in tgt_sizes if len(_np(t).reshape(-1))]
            flat = [s for p in pixel_values for s in p]
            vis = self.vision_embeddings(flat, np.concatenate(tgt) if tgt else np.zeros((0, 2)))
            start = 0
            for b in range(bsz):
                n = per_image[b] if b < len(per_image) else 0
                if n == 0:
                    continue
                bounds = _np(image_bound[b]).reshape(-1, 2)
                if len(bounds):
                    idx = np.concatenate([np.arange(s, e) for s, e in bounds])
                    vals = vis[start:start + n].reshape(-1, vis.shape[-1])
                    if len(idx) != vals.shape[0]:
                        raise ValueError(f"image_bound covers {len(idx)} tokens for {n} slices of "
                                         f"{vis.shape[1]} tokens")
                    embeds[b][mx.array(idx)] = vals.astype(embeds[b].dtype)
                start += n
        if audio_features is not None and len(_np(audio_features)):
            tokens = self.audio_embeddings(audio_features, audio_feature_lens, chunk_length)
            counts = [len(_np(x).reshape(-1)) for x in audio_feature_lens] if bsz > 1 else [len(tokens)]
            k = 0
            for b in range(bsz):
                mine, k = tokens[k:k + counts[b]], k + counts[b]
                bounds = _np(audio_bounds[b]).reshape(-1, 2)
                if self.config.stream_input:  # all audio of the sample laid consecutively over the bounds
                    cat = mx.concatenate(mine) if mine else None
                    pos = 0
                    for s, e in bounds:
                        embeds[b][int(s):int(e)] = cat[pos:pos + e - s].astype(embeds[b].dtype)
                        pos += e - s
                    continue
                for emb, (s, e) in zip(mine, bounds):
                    if emb.shape[0] != e - s:
                        raise ValueError(f"audio bound [{s}, {e}) has {e - s} slots for {emb.shape[0]} tokens")
                    embeds[b][int(s):int(e)] = emb.astype(embeds[b].dtype)
        return mx.stack(embeds)

    def __call__(self, input_ids, pixel_values=None, tgt_sizes=None, image_bound=None, audio_features=None,
                 audio_feature_lens=None, audio_bounds=None, positions=None, cache=None,
                 chunk_length: float | None = None, attention_mask=None, **processor_extras) -> mx.array:
        """The official forward: merged embeddings through the LLM at ``positions`` (default 0..T-1 or after the
        cache) -> logits [B, T, vocab]. Takes the processor's output as keyword arguments (its ``image_sizes``,
        ``grids``, ``spk_bounds`` are not used by the forward)."""
        unknown = set(processor_extras) - {"image_sizes", "grids", "spk_bounds"}
        if unknown:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(unknown))}")
        if attention_mask is not None and not _np(attention_mask).all():
            raise ValueError("left-padded batches are not supported: run the prompts one at a time")
        embeds = self.embed_inputs(input_ids, pixel_values, tgt_sizes, image_bound, audio_features,
                                   audio_feature_lens, audio_bounds, chunk_length)
        return self.language_model(embeds, cache=cache, positions=positions)

    # --- weights ------------------------------------------------------------------------------------------------
    def quant_predicate(self, path: str, module) -> bool:
        """``omnitide convert -q`` quantises the language model only; SigLIP, the resampler, Whisper and the
        projector stay in float (they are small and run once per frame / second)."""
        return path.startswith("language_model.")

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Official checkpoint names and PyTorch layouts -> this module's (``llm.`` -> ``language_model.``,
        ``vpm.`` -> ``vision_tower.``, ``apm.`` -> ``audio_tower.``, conv kernels channels-last; ``tts.`` through
        ``MiniCPMTTS.sanitize``, weight_norm materialised). Dropped: the TTS weights when the model has no TTS,
        buffers, the vision layer ``drop_vision_last_layer`` removes, and towers the config disables."""
        cfg = self.config
        out = {}
        tts = {k[4:]: v for k, v in weights.items() if k.startswith("tts.")}
        if tts and cfg.tts is not None:
            out.update({f"tts.{k}": v for k, v in MiniCPMTTS.sanitize(tts).items()})
        dropped_layer = None
        if cfg.vision is not None and cfg.drop_vision_last_layer:
            dropped_layer = f"vision_tower.encoder.layers.{cfg.vision.num_hidden_layers - 1}."
        for k, v in weights.items():
            if k.startswith("tts.") or k.startswith("audio_avg_pooler.") or k.endswith("rotary_emb.inv_freq") \
                    or k.endswith("position_ids"):
                continue
            k = re.sub(r"^llm\.", "language_model.", k)
            k = re.sub(r"^vpm\.", "vision_tower.", k)
            k = re.sub(r"^apm\.", "audio_tower.", k)
            if cfg.vision is None and (k.startswith("vision_tower.") or k.startswith("resampler.")):
                continue
            if cfg.audio is None and (k.startswith("audio_tower.") or k.startswith("audio_projection_layer.")):
                continue
            if dropped_layer and k.startswith(dropped_layer):
                continue
            if cfg.text.tie_word_embeddings and k == "language_model.lm_head.weight":
                continue
            if k == "vision_tower.embeddings.patch_embedding.weight" and v.ndim == 4 \
                    and v.shape[1] == cfg.vision.num_channels and v.shape[-1] != cfg.vision.num_channels:
                v = v.transpose(0, 2, 3, 1)  # OIHW -> OHWI
            if k in ("audio_tower.conv1.weight", "audio_tower.conv2.weight") and v.ndim == 3 and v.shape[2] == 3 \
                    and v.shape[1] != 3:
                v = v.transpose(0, 2, 1)  # OIK -> OKI
            out[k] = v
        return out
