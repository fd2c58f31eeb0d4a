"""The Qwen2.5-Omni stream adapter on MLX: the unit layouts of layout.py composed with embeddings from the MLX port's
token embeddings, vision encoder and audio encoder (the PyTorch path uses the same layouts with transformers'
encoders: omnitide_mlx/torch/qwen2_5_omni.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .layout import FRAME_MAX_PIXELS, FRAME_MIN_PIXELS, QwenOmniLayout

__all__ = ["FRAME_MAX_PIXELS", "FRAME_MIN_PIXELS", "MlxQwenOmniEmbedder", "QwenOmniAdapter"]


class MlxQwenOmniEmbedder:
    """The MLX thinker's arrays for the unit layouts (layout.py: ``QwenOmniEmbedder``)."""

    def __init__(self, model):
        self.model = model

    def embed_tokens(self, ids) -> mx.array:
        return self.model.language_model.embed(mx.array(np.asarray(ids, dtype=np.int32)))

    def vision_features(self, rows: np.ndarray, grid) -> mx.array:
        return self.model.visual(mx.array(rows).astype(self.model.dtype), np.asarray([grid]))

    def audio_features(self, mel: np.ndarray) -> mx.array:
        return self.model.audio_tower(mx.array(mel).astype(self.model.dtype), [mel.shape[1]])

    def scatter(self, embeds: mx.array, slots: np.ndarray, feats: mx.array) -> mx.array:
        embeds[mx.array(slots.astype(np.int32))] = feats.astype(embeds.dtype)
        return embeds


class QwenOmniAdapter(QwenOmniLayout):
    """One session's view of the MLX thinker: the unit layouts of :class:`~.layout.QwenOmniLayout` with an
    :class:`MlxQwenOmniEmbedder`."""

    def __init__(self, model, processor, **kw):
        super().__init__(model, processor, MlxQwenOmniEmbedder(model), **kw)
