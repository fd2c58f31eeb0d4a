"""``omnitide convert`` on a Qwen3-Omni folder: 4-bit experts through MLX's gathered quantised matmul, the routers,
encoders and norms kept in float, and the folder loads back to exactly the in-memory quantisation.

The CLI finds the port through its family record (models/qwen3_omni/family.py)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from omnitide_mlx.cli import main as cli_main
from omnitide_mlx.models.qwen3_omni import load

GROUP = 32  # the tiny experts are 32 wide; the released ones (768) take the default 64


@pytest.fixture(scope="module")
def inputs(q3):
    _, proc = q3
    rng = np.random.default_rng(5)
    img = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    return proc("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe it.<|im_end|>\n"
                "<|im_start|>assistant\n", images=[img])


def test_four_bit_conversion_round_trips(tmp_path, q3_ckpt, q3, inputs):
    out = tmp_path / "q4"
    assert cli_main(["convert", "--model", str(q3_ckpt), "--mlx-path", str(out), "-q", "--q-group-size",
                     str(GROUP)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["omnitide_converted"]
    model, proc = load(out)
    layer0 = model.language_model.layers[0]
    assert type(layer0.mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"  # gather_qmm
    assert type(layer0.mlp.switch_mlp.down_proj).__name__ == "QuantizedSwitchLinear"
    assert type(layer0.self_attn.q_proj).__name__ == "QuantizedLinear"
    assert type(model.language_model.layers[1].mlp.up_proj).__name__ == "QuantizedLinear"  # the dense layer
    assert type(layer0.mlp.gate).__name__ == "Linear"  # the router stays in float
    assert type(model.visual.blocks[0].attn.qkv).__name__ == "Linear"
    assert type(model.audio_tower.layers[0].fc1).__name__ == "Linear"

    float_model, _ = q3
    mem, _ = load(q3_ckpt)
    nn.quantize(mem, group_size=GROUP, bits=4, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % GROUP == 0 and mem.quant_predicate(p, m))
    logits = np.array(model(**inputs))
    np.testing.assert_array_equal(logits, np.array(mem(**inputs)))
    ref = np.array(float_model(**inputs))
    diff = np.abs(logits - ref)
    assert diff.max() < 2.5 and diff.mean() < 0.35, (diff.max(), diff.mean())  # measured 1.70 / 0.22 (embeddings and head 4-bit too)
    assert proc.encode("hello world") == q3[1].encode("hello world")


def test_quantised_experts_match_a_dequantised_reference(q3):
    """The gathered quantised matmul computes what a per-expert loop over the dequantised weights computes."""
    from mlx_lm.models.switch_layers import SwitchGLU

    model, _ = q3
    glu: SwitchGLU = model.language_model.layers[0].mlp.switch_mlp
    x = mx.array(np.random.default_rng(2).standard_normal((1, 6, 64)).astype(np.float32))
    inds = mx.array(np.random.default_rng(3).integers(0, 8, (1, 6, 2)).astype(np.int32))
    q = SwitchGLU(64, 32, 8)
    q.update(glu.parameters())
    nn.quantize(q, group_size=GROUP, bits=4)
    got = np.array(q(x, inds))
    want = np.zeros_like(got)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(q, name)
        setattr(q, f"_{name}", np.array(mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=GROUP,
                                                      bits=4)))
    xs = np.array(x)
    for t in range(6):
        for j, e in enumerate(np.array(inds)[0, t]):
            g = q._gate_proj[e] @ xs[0, t]
            u = q._up_proj[e] @ xs[0, t]
            want[0, t, j] = q._down_proj[e] @ (g / (1 + np.exp(-g)) * u)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_converted_folder_speaks(tmp_path, q3_ckpt, q3):
    """``omnitide convert`` writes the thinker and, through the family record's ``convert_extra``, the talker and
    Code2Wav under ``speech/``, from where ``load_speech`` reads them; a -Thinking folder converts without."""
    from omnitide_mlx.models.family import get_family
    from omnitide_mlx.models.qwen3_omni.speech import SPEECH_DIR, load_speech

    out = tmp_path / "f"
    assert cli_main(["convert", "--model", str(q3_ckpt), "--mlx-path", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (out / SPEECH_DIR / "model.safetensors").is_file()
    thinking = get_family("qwen3_omni").write_tiny(tmp_path / "thinking")
    assert cli_main(["convert", "--model", str(thinking), "--mlx-path", str(tmp_path / "t")]) == 0
    assert not (tmp_path / "t" / SPEECH_DIR).exists()
    model, proc = load(out)
    inputs = proc("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    reply = [40, 41, 42, 1002]
    ref = load_speech(q3_ckpt, cfg).reply(q3[0], inputs, reply, max_new_tokens=6, eos_ids=(1002,))
    got = load_speech(out, cfg).reply(model, inputs, reply, max_new_tokens=6, eos_ids=(1002,))
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
