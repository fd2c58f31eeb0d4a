"""The OmniSession adapter: unit layouts, typed spans, positions, the reply protocol, media validation, state."""

import mlx.core as mx
import numpy as np
import pytest

from omnitide_mlx.core.units import SpanKind, UnitKind
from omnitide_mlx.models.base import MediaError, StreamAdapter

from ._helpers import max_diff

UNK, UNIT, UNIT_END, IMAGE, IMAGE_END, SLICE, SLICE_END = 128244, 151683, 151684, 151669, 151670, 151679, 151680
USER_OPEN = [151644, 872, 198]  # <|im_start|>user\n
REPLY_OPEN = [151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]  # ...assistant\n<think>\n\n</think>\n\n
TTS_BOS, TTS_EOS, IM_END = 151703, 151704, 151645


def frame(seed=0, h=240, w=320):
    return (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)


def second(seed=0, n=16000):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def kinds(unit):
    return [(s.kind, s.length) for s in unit.spans]


@pytest.fixture()
def adapter(tiny):
    model, proc = tiny
    return model.stream_adapter(proc)


def test_is_a_stream_adapter(adapter, tiny):
    model, _ = tiny
    assert isinstance(adapter, StreamAdapter)
    assert adapter.kv_spec == model.kv_spec() and adapter.sample_rate == 16000
    assert adapter.stop_token_ids == {IM_END, 151643, TTS_EOS}


def test_system_unit_uses_the_chat_template(adapter):
    u = adapter.system_unit("Be brief.", 0)
    assert adapter.tok.decode(u.input_ids, skip_special_tokens=False) == "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert u.kind is UnitKind.SYSTEM and kinds(u) == [(SpanKind.SYSTEM, u.length)]
    default = adapter.system_unit(None, 0)
    assert "You are a helpful assistant." in adapter.decode(default.input_ids)
    u.to_unit(0)  # a valid core Unit


def test_streaming_media_units(adapter, tiny):
    model, _ = tiny
    sys_u = adapter.system_unit(None, 0)
    start = sys_u.length
    u1 = adapter.media_unit(frame(1), second(1), 0.0, start)
    ids = u1.input_ids.tolist()
    assert ids == USER_OPEN + [UNIT, IMAGE] + [UNK] * 64 + [IMAGE_END] + [UNK] * 10 + [UNIT_END]
    assert u1.length == 81 and u1.kind is UnitKind.MEDIA and u1.t == 0.0
    assert kinds(u1) == [(SpanKind.BOUNDARY, 5), (SpanKind.IMAGE, 64), (SpanKind.BOUNDARY, 1),
                         (SpanKind.AUDIO, 10), (SpanKind.BOUNDARY, 1)]
    np.testing.assert_array_equal(u1.positions, np.arange(start, start + 81)[None])
    u2 = adapter.media_unit(frame(2), second(2), 1.0, start + 81)
    assert u2.length == 78 and u2.input_ids[0] == UNIT  # the user turn is open: no opener
    u3 = adapter.media_unit(None, second(3), 2.0, start + 159)
    assert u3.input_ids.tolist() == [UNIT] + [UNK] * 10 + [UNIT_END]
    u4 = adapter.media_unit(frame(4), None, 3.0, start + 171)
    assert u4.length == 68
    # the image slots hold the resampler output of the processor's unsliced frame
    img = adapter.processor.process_image(frame(1), max_slice_nums=1)
    ref = model.vision_embeddings(img.slices, img.tgt_sizes)[0]
    assert max_diff(u1.inputs_embeds[5:69], ref) < 1e-6
    # boundary tokens carry their token embeddings
    assert max_diff(u1.inputs_embeds[:5], model.language_model.embed_tokens(mx.array(ids[:5]))) == 0.0


def test_offline_mode_types_source_image_and_slices(tiny):
    model, proc = tiny
    ad = model.stream_adapter(proc, mode="offline")
    u = ad.media_unit(frame(5, 480, 640), None, None, 0)  # 640x480: a 2x1 grid, 3 images
    assert kinds(u) == [(SpanKind.BOUNDARY, 5), (SpanKind.IMAGE_SOURCE, 64), (SpanKind.BOUNDARY, 2),
                        (SpanKind.IMAGE_SLICE, 64), (SpanKind.BOUNDARY, 2), (SpanKind.IMAGE_SLICE, 64),
                        (SpanKind.BOUNDARY, 2)]
    ids = u.input_ids.tolist()
    assert ids[3:6] == [UNIT, IMAGE, UNK] and ids[69:72] == [IMAGE_END, SLICE, UNK] and ids[-2:] == [SLICE_END,
                                                                                                    UNIT_END]
    img = proc.process_image(frame(5, 480, 640))
    ref = model.vision_embeddings(img.slices, img.tgt_sizes)
    assert max_diff(u.inputs_embeds[137:201], ref[2]) < 1e-6
    small = ad.media_unit(frame(6, 200, 300), None, None, u.length)  # below 448^2: no slices
    assert [k for k, _ in kinds(small)] == [SpanKind.BOUNDARY, SpanKind.IMAGE, SpanKind.BOUNDARY]


def test_question_reply_and_next_turn(adapter):
    adapter.system_unit(None, 0)
    adapter.media_unit(frame(), second(), 0.0, 30)
    q = adapter.user_unit("What is it?", 111)
    ids = q.input_ids.tolist()
    assert ids[-10:] == REPLY_OPEN + [TTS_BOS] and adapter.decode(ids).startswith("What is it?")
    assert kinds(q) == [(SpanKind.TEXT, len(ids) - 10), (SpanKind.BOUNDARY, 10)] and q.kind is UnitKind.USER
    closing = adapter.finish_reply([9707, 0], stopped=True)
    assert closing == [TTS_EOS, IM_END, 198]
    nxt = adapter.media_unit(None, second(1), 1.0, 200)
    assert nxt.input_ids[:4].tolist() == USER_OPEN + [UNIT]
    ctx = adapter.context_unit("a note", 212)
    assert ctx.input_ids[0] == UNIT and ctx.input_ids[-1] == UNIT_END
    assert [k for k, _ in kinds(ctx)] == [SpanKind.BOUNDARY, SpanKind.TEXT, SpanKind.BOUNDARY]


def test_without_tts_template(tiny):
    model, proc = tiny
    ad = model.stream_adapter(proc, tts_template=False)
    q = ad.user_unit("Hi", 0)
    assert q.input_ids.tolist() == USER_OPEN + [13048] + REPLY_OPEN
    assert ad.finish_reply([], stopped=False) == [IM_END, 198]


@pytest.mark.parametrize("bad_frame, bad_audio, message", [
    (None, None, "needs a frame, audio or both"),
    (np.zeros((10, 10), np.uint8), None, "expected HxWx3"),
    (np.zeros((10, 10, 3), np.float32), None, "expected uint8"),
    (np.zeros((1, 10, 3), np.uint8), None, "too small"),
    (None, np.zeros((2, 8000), np.float32), "expected mono"),
    (None, np.zeros(0, np.float32), "expected mono"),
    (None, np.zeros(16000, np.int16), "expected float32"),
    (None, np.full(16000, np.nan, np.float32), "NaN"),
    (None, np.zeros(4000, np.float32), "not enough for a unit"),
])
def test_bad_media_raise_before_anything_changes(adapter, bad_frame, bad_audio, message):
    adapter.media_unit(None, second(0), 0.0, 0)
    before = adapter.state()
    with pytest.raises(MediaError, match=message):
        adapter.media_unit(bad_frame, bad_audio, 1.0, 12)
    after = adapter.state()
    assert before[0] == after[0]
    for k in before[1]:
        np.testing.assert_array_equal(np.array(before[1][k]), np.array(after[1][k]))


def test_bad_text_raises(adapter):
    for bad in ("", "   ", None, 3):
        with pytest.raises(MediaError):
            adapter.user_unit(bad, 0)


def test_short_audio_is_buffered_until_a_chunk(adapter):
    # the first audio is left-padded to 1035 ms whatever its length, as the official duplex session does
    u = adapter.media_unit(None, second(0, 9000), 0.0, 0)
    assert [k for k, _ in kinds(u)] == [SpanKind.BOUNDARY, SpanKind.AUDIO, SpanKind.BOUNDARY]
    assert len(adapter.audio_buffer) == 80  # 16560 padded samples, 16480 consumed
    u = adapter.media_unit(frame(), second(1, 9000), 1.0, 15)
    assert SpanKind.AUDIO not in [s.kind for s in u.spans]  # 9080 < 16000: kept for the next unit
    u = adapter.media_unit(None, second(2, 9000), 2.0, 15 + u.length)
    assert [k for k, _ in kinds(u)] == [SpanKind.BOUNDARY, SpanKind.AUDIO, SpanKind.BOUNDARY]
    assert len(adapter.audio_buffer) == 2080


def test_state_round_trip_continues_the_stream(tiny):
    model, proc = tiny
    a = model.stream_adapter(proc)
    a.media_unit(frame(1), second(1), 0.0, 0)
    a.media_unit(frame(2), second(2, 12000), 1.0, 81)  # a frame, the audio stays buffered
    meta, arrays = a.state()
    b = model.stream_adapter(proc)
    b.load_state(meta, arrays)
    ua = a.media_unit(frame(3), second(3), 2.0, 149)
    ub = b.media_unit(frame(3), second(3), 2.0, 149)
    np.testing.assert_array_equal(ua.input_ids, ub.input_ids)
    assert max_diff(ua.inputs_embeds, ub.inputs_embeds) == 0.0
