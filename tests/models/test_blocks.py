"""The decoder blocks are written once (models/blocks.py) and every language model builds its layers from them,
under the checkpoints' parameter names."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from omnitide_mlx.models import blocks

LAYER_PARAMS = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight", "self_attn.o_proj.weight"}


def _layers():
    from omnitide_mlx.models.llama_gguf.gguf_file import LlamaConfig
    from omnitide_mlx.models.llama_gguf.model import LanguageModel as Llama
    from omnitide_mlx.models.minicpmo.config import TextConfig as MiniCPMText
    from omnitide_mlx.models.minicpmo.language import LanguageModel as MiniCPM
    from omnitide_mlx.models.qwen2_5_omni.config import TextConfig as QwenText
    from omnitide_mlx.models.qwen2_5_omni.language import LanguageModel as Qwen
    from omnitide_mlx.models.qwen2_5_omni.talker import Talker, TalkerConfig

    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    return {
        "qwen2_5_omni": Qwen(QwenText(vocab_size=16, mrope_section=[1, 1, 2], **small)).layers[0],
        "talker": Talker(TalkerConfig(vocab_size=16, embedding_size=32, head_dim=8, mrope_section=[1, 1, 2],
                                      **small)).model.layers[0],
        "minicpmo": MiniCPM(MiniCPMText(vocab_size=16, **small)).layers[0],
        "llama_gguf": Llama(LlamaConfig(16, 32, 48, 1, 4, 2, 8, 1e4, 1e-5, 64, False)).layers[0],
    }


def test_every_decoder_builds_its_layers_from_the_shared_block_with_checkpoint_names():
    extra = {"qwen2_5_omni": {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"},
             "minicpmo": {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}}
    extra["talker"] = extra["qwen2_5_omni"]
    for name, layer in _layers().items():
        assert isinstance(layer, blocks.DecoderLayer) and type(layer.mlp) is blocks.MLP, name
        assert {k for k, _ in tree_flatten(layer.parameters())} == LAYER_PARAMS | extra.get(name, set()), name


def test_the_shared_layer_is_a_pre_norm_swiglu_residual_block():
    class Scale(nn.Module):  # a stand-in attention: whatever the layer passes on reaches it
        def __call__(self, x, factor):
            return x * factor

    mx.random.seed(0)
    layer = blocks.DecoderLayer(Scale(), 8, 12, 1e-6)
    x = mx.random.normal((1, 3, 8))
    got = np.array(layer(x, 2.0))

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * w

    p = {k: np.array(v) for k, v in tree_flatten(layer.parameters())}
    xn = np.array(x)
    h = xn + 2.0 * rms(xn, p["input_layernorm.weight"])
    n = rms(h, p["post_attention_layernorm.weight"])
    g, u = n @ p["mlp.gate_proj.weight"].T, n @ p["mlp.up_proj.weight"].T
    want = h + (g / (1 + np.exp(-g)) * u) @ p["mlp.down_proj.weight"].T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
