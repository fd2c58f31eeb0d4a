"""Streaming sessions over the WebSocket API of a real ``omnitide serve`` on loopback (tiny checkpoint): units in
(binary and JSON, JPEG and raw frames, PCM at any rate), streamed answers and per-update KV figures out, bad input
rejected without harming the session, the queue limit, a client leaving mid-answer, cancel, save / restore, guards."""

import base64
import json
import time

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from omnitide_mlx.serve.decode import pack_binary


class Client:
    def __init__(self, server, sid, **kw):
        self.ws = ws_connect(f"{server.ws_url}/v1/sessions/{sid}/ws", **kw)
        self.ready = self.recv()
        assert self.ready["type"] == "ready", self.ready

    def send(self, msg):
        self.ws.send(msg if isinstance(msg, bytes) else json.dumps(msg))

    def recv(self, timeout=60):
        return json.loads(self.ws.recv(timeout=timeout))

    def until(self, pred, timeout=60):
        """Messages up to and including the first one for which ``pred`` holds."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            m = self.recv(timeout=max(0.1, deadline - time.monotonic()))
            out.append(m)
            if pred(m):
                return out

    def close(self):
        self.ws.close()


def binary_unit(seq, jpeg, pcm, t=None):
    header = {"type": "unit", "seq": seq, "frame": {"format": "jpeg", "bytes": len(jpeg)},
              "audio": {"format": "pcm_s16le", "sample_rate": 16000, "bytes": len(pcm)}}
    if t is not None:
        header["t"] = t
    return pack_binary(header, jpeg, pcm)


def json_unit(seq, rgb, audio_f32, rate):
    return {"type": "unit", "seq": seq,
            "frame": {"format": "rgb", "width": rgb.shape[1], "height": rgb.shape[0],
                      "data": base64.b64encode(rgb.tobytes()).decode()},
            "audio": {"format": "pcm_f32le", "sample_rate": rate,
                      "data": base64.b64encode(audio_f32.astype("<f4").tobytes()).decode()}}


def ws_connect(url, **kw):
    """A sync websockets connection (entered as websockets asks, closed by the caller)."""
    return connect(url, open_timeout=30, **kw).__enter__()


def new_session(http, **body):
    r = http.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_units_answers_and_kv_updates(server, http, clip_units):
    sid = new_session(http)
    c = Client(server, sid)
    assert c.ready["stats"]["high"] == 150 and c.ready["limits"]["max_queued"] == 3  # the server's defaults
    updates, pushed = [], []
    for i, (jpeg, pcm, rgb) in enumerate(clip_units[:6]):
        if i % 2 == 0:
            c.send(binary_unit(i, jpeg, pcm, t=float(i)))
        else:  # JSON with base64: a raw RGB frame and float audio at 24 kHz (resampled by the session)
            a16 = np.frombuffer(pcm, "<i2").astype(np.float32) / 32767
            c.send(json_unit(i, rgb, np.interp(np.arange(24000) / 1.5, np.arange(16000), a16), 24000))
        msgs = c.until(lambda m: m["type"] in ("pushed", "error"))
        assert msgs[-1]["type"] == "pushed" and msgs[-1]["seq"] == i, msgs[-1]
        pushed.append(msgs[-1])
        updates += [m for m in msgs if m["type"] == "update"]
    assert [p["updates"] for p in pushed] == [1] * 6 and len(updates) == 6
    assert [u["seq"] for u in updates] == list(range(6))
    assert all(u["record"]["kind"] == "media" for u in updates)
    assert [u["record"]["t"] for u in updates][::2] == [0.0, 2.0, 4.0]
    assert max(u["record"]["evicted_tokens"] for u in updates) > 0, [  # the tiny watermarks make retention work
        (u["record"]["tokens"], u["record"]["retained_cells"]) for u in updates]
    assert updates[-1]["record"]["retained_cells"] <= 150

    c.send({"type": "ask", "id": "q1", "question": "What colour is the square?", "max_tokens": 5})
    msgs = c.until(lambda m: m["type"] == "answer_end")
    kinds = [m["type"] for m in msgs]
    assert kinds[:2] == ["answer_start", "update"] and msgs[1]["record"]["kind"] == "user"
    pieces = [m["text"] for m in msgs if m["type"] == "piece"]
    end = msgs[-1]
    assert end["id"] == "q1" and end["text"] == "".join(pieces) and pieces
    assert end["tokens"] == 5 and end["finish_reason"] == "length"
    c.send({"type": "stats"})
    stats = c.until(lambda m: m["type"] == "stats")[-1]
    assert stats["counts"]["units_pushed"] == 6 and stats["counts"]["answers"] == 1
    assert stats["stats"]["units"] >= 3 and stats["stats"]["retained_cells"] <= 150
    c.send({"type": "ping", "id": 9})
    assert c.until(lambda m: m["type"] == "pong")[-1]["id"] == 9
    c.close()
    info = http.get(f"/v1/sessions/{sid}").json()
    assert info["connected"] is False and info["stats"]["evictions"] > 0
    http.delete(f"/v1/sessions/{sid}")


def test_bad_messages_are_rejected_and_the_session_goes_on(server, http, clip_units):
    sid = new_session(http)
    c = Client(server, sid)
    jpeg, pcm, rgb = clip_units[0]
    c.send(binary_unit(0, jpeg, pcm))
    c.until(lambda m: m["type"] == "pushed")
    units_before = http.get(f"/v1/sessions/{sid}").json()["stats"]["units"]
    nan = np.full(16000, np.nan, "<f4").tobytes()
    bad = [
        (1, pack_binary({"type": "unit", "seq": 1, "frame": {"format": "jpeg", "bytes": 10}}, b"not a jpeg"),
         "bad_frame"),
        (2, {"type": "unit", "seq": 2, "frame": {"format": "rgb", "width": 8, "height": 8,
                                                 "data": base64.b64encode(b"x" * 10).decode()}}, "bad_frame"),
        (3, pack_binary({"type": "unit", "seq": 3, "audio": {"format": "pcm_f32le", "sample_rate": 16000,
                                                             "bytes": len(nan)}}, nan), "bad_media"),
        (4, pack_binary({"type": "unit", "seq": 4, "audio": {"format": "pcm_s16le", "sample_rate": 0,
                                                             "bytes": len(pcm)}}, pcm), "bad_audio"),
        (5, {"type": "unit", "seq": 5, "frame": {"format": "rgb", "width": 200, "height": 120,
                                                 "data": base64.b64encode(bytes(200 * 120 * 3)).decode()}},
         "frame_too_large"),
        (6, pack_binary({"type": "unit", "seq": 6, "audio": {"format": "pcm_s16le", "sample_rate": 16000,
                                                             "bytes": 300000}}, bytes(300000)), "message_too_large"),
        (7, pack_binary({"type": "unit", "seq": 7, "audio": {"format": "pcm_s16le", "sample_rate": 1000,
                                                             "bytes": 30000}}, bytes(30000)), "audio_too_long"),
        (8, {"type": "unit", "seq": 8}, "bad_request"),
        (9, {"type": "launch", "seq": 9}, "bad_request"),
        (10, {"type": "ask", "seq": 10, "question": "hi", "max_tokens": 10**6}, "bad_request"),
    ]
    for seq, msg, code in bad:
        c.send(msg)
        err = c.until(lambda m: m["type"] in ("error", "pushed"))[-1]
        assert err["type"] == "error" and err["seq"] == seq and err["code"] == code, (seq, err)
        assert err["message"]
    c.send("{not json")
    assert c.until(lambda m: m["type"] == "error")[-1]["code"] == "bad_request"
    c.send(binary_unit(11, *clip_units[1][:2]))
    assert c.until(lambda m: m["type"] in ("error", "pushed"))[-1] == {"type": "pushed", "seq": 11, "updates": 1}
    info = http.get(f"/v1/sessions/{sid}").json()
    assert info["stats"]["units"] == units_before + 1  # nothing of the bad messages reached the cache
    assert info["counts"]["rejected"] >= 7
    c.close()
    http.delete(f"/v1/sessions/{sid}")


def test_queue_limit_answers_every_unit(server, http, clip_units):
    sid = new_session(http)
    c = Client(server, sid)
    n = 10
    for seq in range(n):
        jpeg, pcm, _ = clip_units[seq % len(clip_units)]
        c.send(binary_unit(seq, jpeg, pcm))
    replies = {}
    while len(replies) < n:
        m = c.recv()
        if m["type"] in ("pushed", "error"):
            assert m["seq"] not in replies
            replies[m["seq"]] = m
    full = [m for m in replies.values() if m["type"] == "error"]
    assert full and all(m["code"] == "queue_full" and "--max-queued" in m["message"] for m in full)
    done = sum(m["type"] == "pushed" for m in replies.values())
    assert done >= 3 and http.get(f"/v1/sessions/{sid}").json()["counts"]["units_pushed"] == done
    c.close()
    http.delete(f"/v1/sessions/{sid}")


def test_leaving_mid_answer_stops_it_and_the_session_goes_on(server, http, clip_units):
    sid = new_session(http)
    c = Client(server, sid)
    c.send(binary_unit(0, *clip_units[0][:2]))
    c.until(lambda m: m["type"] == "pushed")
    c.send({"type": "ask", "id": "long", "question": "Tell a long story.", "max_tokens": 2000})
    c.until(lambda m: m["type"] == "piece")
    c.close()  # gone mid-answer
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        info = http.get(f"/v1/sessions/{sid}").json()
        if not info["answering"] and info["counts"]["cancelled_answers"]:
            break
        time.sleep(0.05)
    assert not info["answering"] and info["counts"]["cancelled_answers"] == 1 and not info["connected"]
    assert info["stats"]["timings"]["decode_tokens"] < 2000 if "decode_tokens" in info["stats"]["timings"] else True
    # the partial reply is history; the session takes the next client
    c = Client(server, sid)
    c.send({"type": "ask", "id": "short", "question": "And now?", "max_tokens": 3})
    end = c.until(lambda m: m["type"] == "answer_end")[-1]
    assert end["finish_reason"] == "length" and end["tokens"] == 3
    # cancel from the client: the answer ends early, marked as such
    c.send({"type": "ask", "id": "long2", "question": "Tell a long story.", "max_tokens": 2000})
    c.until(lambda m: m["type"] == "piece")
    c.send({"type": "cancel", "id": "long2"})
    end = c.until(lambda m: m["type"] == "answer_end")[-1]
    assert end["finish_reason"] == "cancelled" and end["tokens"] < 2000
    c.close()
    http.delete(f"/v1/sessions/{sid}")


def test_save_restore_and_delete(server, http, clip_units):
    sid = new_session(http)
    c = Client(server, sid)
    for seq in range(3):
        c.send(binary_unit(seq, *clip_units[seq][:2]))
    c.until(lambda m: m["type"] == "pushed" and m["seq"] == 2)
    c.send({"type": "save", "id": "s", "name": "three-units"})
    assert c.until(lambda m: m["type"] in ("saved", "error"))[-1] == {"type": "saved", "name": "three-units"}
    c.send({"type": "save", "id": "t", "name": "../escape"})
    assert c.until(lambda m: m["type"] == "error")[-1]["code"] == "bad_request"
    r = http.post("/v1/sessions", json={"restore": "three-units"})
    assert r.status_code == 201, r.text
    before, after = http.get(f"/v1/sessions/{sid}").json()["stats"], r.json()["stats"]
    for k in ("units", "retained_cells", "physical_span", "next_position", "evictions"):
        assert after[k] == before[k], k
    assert http.post("/v1/sessions", json={"restore": "nothing-here"}).json()["error"]["code"] == "no_saved_session"
    http.delete(f"/v1/sessions/{r.json()['id']}")
    # a second client on a driven session is refused; deleting the session closes its socket
    with pytest.raises(ConnectionClosed):
        d = Client.__new__(Client)
        d.ws = ws_connect(f"{server.ws_url}/v1/sessions/{sid}/ws")
        assert json.loads(d.ws.recv(timeout=30))["code"] == "session_busy"
        d.ws.recv(timeout=30)
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204
    assert c.until(lambda m: m["type"] == "session_deleted")
    with pytest.raises(ConnectionClosed):
        c.recv(timeout=10)


def test_ephemeral_sessions_end_with_their_socket_and_origins_are_checked(server, http):
    sid = new_session(http, ephemeral=True)
    c = Client(server, sid)
    c.close()
    deadline = time.monotonic() + 10
    while http.get(f"/v1/sessions/{sid}").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get(f"/v1/sessions/{sid}").status_code == 404
    sid = new_session(http)
    with pytest.raises(InvalidStatus) as e:
        ws_connect(f"{server.ws_url}/v1/sessions/{sid}/ws", origin="http://evil.example")
    assert e.value.response.status_code == 403
    c = Client(server, sid, origin=server.url)  # the page's own origin
    c.close()
    http.delete(f"/v1/sessions/{sid}")


def test_speak_on_a_model_without_a_talker_is_a_clear_error(server, http):
    sid = new_session(http)
    c = Client(server, sid)
    c.send({"type": "ask", "id": "s1", "question": "Say hi.", "max_tokens": 3, "speak": True})
    err = c.until(lambda m: m["type"] in ("error", "answer_end"))[-1]
    assert err["type"] == "error" and err["code"] == "speech_unavailable" and err["id"] == "s1"
    c.send({"type": "ask", "id": "s2", "question": "Say hi.", "speak": "yes"})
    assert c.until(lambda m: m["type"] == "error")[-1]["code"] == "bad_request"
    for bad, says in (({"top_p": 0}, "top_p must be in (0, 1]"), ({"temp": 1}, "unknown fields ['temp']"),
                      ([0.5], "must be an object")):
        c.send({"type": "ask", "id": "s3", "question": "Say hi.", "speak": True, "speech_sampling": bad})
        err = c.until(lambda m: m["type"] == "error")[-1]
        assert err["code"] == "bad_request" and says in err["message"], err
    c.send({"type": "ask", "id": "s4", "question": "Say hi.", "speech_sampling": {"temperature": 0}})
    err = c.until(lambda m: m["type"] == "error")[-1]
    assert err["code"] == "bad_request" and "needs speak" in err["message"]
    c.send({"type": "ask", "id": "t", "question": "Say hi.", "max_tokens": 2})  # the session still answers
    assert c.until(lambda m: m["type"] == "answer_end")[-1]["tokens"] == 2
    c.close()
    http.delete(f"/v1/sessions/{sid}")


@pytest.mark.slow
def test_spoken_answers_stream_audio_chunks(tmp_path, make_server, data_dir):
    import httpx

    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny-speech", vocab="real", speech=True,
                                tokenizer_dir=data_dir / "tokenizers/qwen2")
    srv = make_server("--model", str(ckpt))
    sid = httpx.post(f"{srv.url}/v1/sessions", json={}, timeout=60).json()["id"]
    c = Client(srv, sid)
    # seeded: unseeded, the random tiny talker sometimes stops before its first code (no audio, 1 run in 6 here)
    c.send({"type": "ask", "id": "v", "question": "Hello?", "max_tokens": 8, "speak": True, "seed": 0})
    msgs = c.until(lambda m: m["type"] in ("answer_end", "error"), timeout=240)
    assert msgs[-1]["type"] == "answer_end", msgs[-1]
    audio = [m for m in msgs if m["type"] == "audio"]
    assert audio and audio[-1]["final"] and not any(a["final"] for a in audio[:-1])
    assert [a["index"] for a in audio] == sorted(a["index"] for a in audio)
    assert all(a["sample_rate"] == 24000 and a["id"] == "v" for a in audio)
    pcm = np.concatenate([np.frombuffer(base64.b64decode(a["data"]), "<i2") for a in audio])
    assert pcm.size > 0
    # audio comes while the text streams, not only after it
    kinds = [m["type"] for m in msgs]
    assert kinds.index("audio") < max(i for i, k in enumerate(kinds) if k == "piece")
    assert msgs[-1]["text"] == "".join(m["text"] for m in msgs if m["type"] == "piece")
    # a cancelled spoken answer still ends its audio with a final message, as the protocol promises
    c.send({"type": "ask", "id": "w", "question": "Tell a long story.", "max_tokens": 400, "speak": True, "seed": 0})
    c.until(lambda m: m["type"] in ("piece", "error"), timeout=240)
    c.send({"type": "cancel", "id": "w"})
    msgs = c.until(lambda m: m["type"] in ("answer_end", "error"), timeout=240)
    assert msgs[-1]["type"] == "answer_end" and msgs[-1]["finish_reason"] == "cancelled", msgs[-1]
    audio = [m for m in msgs if m["type"] == "audio"]
    assert audio and audio[-1]["final"] and audio[-1]["id"] == "w" and not any(a["final"] for a in audio[:-1])
    assert [a["index"] for a in audio] == sorted(a["index"] for a in audio)
    # the talker's own sampling settings ride on the ask (temperature 0: a greedy talker)
    c.send({"type": "ask", "id": "g", "question": "Hello?", "max_tokens": 4, "speak": True, "seed": 0,
            "speech_sampling": {"temperature": 0, "repetition_penalty": 1.1}})
    msgs = c.until(lambda m: m["type"] in ("answer_end", "error"), timeout=240)
    assert msgs[-1]["type"] == "answer_end", msgs[-1]
    assert [m for m in msgs if m["type"] == "audio"][-1]["final"]
    c.close()


def _spoken_clip_messages(step_s=0.25):
    """The bundled spoken-questions soundtrack as audio-only unit messages of ``step_s`` seconds (16-bit PCM)."""
    import pathlib

    import soundfile as sf

    audio, rate = sf.read(pathlib.Path(__file__).resolve().parents[2] / "assets/media/spoken_questions_10s.flac",
                          dtype="int16")
    n = int(step_s * rate)
    for seq, i in enumerate(range(0, audio.shape[0], n)):
        pcm = audio[i:i + n].astype("<i2").tobytes()
        yield {"type": "unit", "seq": 1000 + seq,
               "audio": {"format": "pcm_s16le", "sample_rate": rate, "data": base64.b64encode(pcm).decode()}}


def test_spoken_turns_over_the_websocket(server, http):
    sid = new_session(http)
    c = Client(server, sid)
    c.send({"type": "voice", "hangover": -1})
    err = c.until(lambda m: m["type"] == "error")[-1]
    assert err["code"] == "bad_request" and "hangover" in err["message"]
    c.send({"type": "voice", "enabled": True, "max_tokens": 3})
    assert c.until(lambda m: m["type"] == "voice")[-1]["enabled"] is True
    seen = []
    for msg in _spoken_clip_messages():
        c.send(msg)
        seen += c.until(lambda m, s=msg["seq"]: m.get("seq") == s and m["type"] in ("pushed", "error"))
    c.send({"type": "flush"})
    seen += c.until(lambda m: m["type"] == "flushed")
    deadline = time.monotonic() + 60
    while sum(m.get("event") == "reply_done" for m in seen) < 2 and time.monotonic() < deadline:
        seen += c.until(lambda m: m["type"] == "turn", timeout=max(1, deadline - time.monotonic()))
    turns = [m for m in seen if m["type"] == "turn"]
    events = [m["event"] for m in turns]
    assert events.count("speech_started") == 2 and events.count("speech_ended") == 2, events
    assert events.count("reply_done") == 2, events
    starts = [m["speech_start"] for m in turns if m["event"] == "speech_started"]
    assert abs(starts[0] - 0.8) < 0.35 and abs(starts[1] - 5.2) < 0.35
    assert [m["id"] for m in seen if m["type"] == "piece"][:1] == ["turn-1"]
    assert not [m for m in seen if m["type"] == "error"]
    c.send({"type": "voice", "enabled": False})
    assert c.until(lambda m: m["type"] == "voice")[-1]["enabled"] is False
    c.close()


def test_a_client_leaving_mid_turn_loses_nothing_of_the_server(server, http):
    sid = new_session(http, ephemeral=False)
    c = Client(server, sid)
    c.send({"type": "voice", "enabled": True, "max_tokens": 3000, "stop": ["\u0000never"]})
    c.until(lambda m: m["type"] == "voice")
    for msg in list(_spoken_clip_messages())[:16]:  # the first question, then silence: a long reply starts
        c.send(msg)
        c.until(lambda m, s=msg["seq"]: m.get("seq") == s and m["type"] in ("pushed", "error"))
    c.until(lambda m: m["type"] == "piece", timeout=60)
    c.close()  # the client goes away while the reply streams
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = http.get(f"/v1/sessions/{sid}").json()
        if not info.get("answering"):
            break
        time.sleep(0.2)
    assert not info.get("answering")
    c2 = Client(server, sid)  # the session is still there and takes a typed question
    c2.send({"type": "ask", "id": "after", "question": "Still there?", "max_tokens": 2})
    assert c2.until(lambda m: m["type"] == "answer_end")[-1]["id"] == "after"
    c2.close()
    http.delete(f"/v1/sessions/{sid}")
