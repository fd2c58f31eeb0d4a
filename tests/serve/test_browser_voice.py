"""Talking to the live page in a real headless Chromium: the fake microphone plays the bundled spoken questions,
the page streams audio every 250 ms in a conversation, the server's voice-activity detector hears each question,
the tiny speaking checkpoint answers it aloud, and the page plays the reply (and stops it when the user speaks)."""

import pathlib

import numpy as np
import pytest

from tests.serve.test_browser import ARTIFACTS, CHROMIUM, DRIVER, wait_for, write_y4m

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason="Chromium or chromedriver is absent"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def speaking_server(tmp_path_factory):
    from omnitide_mlx.models.qwen2_5_omni.tiny import make_tiny_checkpoint

    from tests.serve.conftest import Server

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("talk") / "tiny", speech=True, seed=1,
                                tokenizer_dir=REPO / "tests/data/tokenizers/qwen2")
    s = Server(["--model", str(ckpt), "--high", "400", "--low", "300"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def voice_browser(tmp_path_factory):
    import os

    import soundfile as sf
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    root = tmp_path_factory.mktemp("fake_voice")
    frames = [np.full((120, 160, 3), (40 * k) % 255, np.uint8) for k in range(10) for _ in range(5)]
    write_y4m(root / "camera.y4m", frames, fps=5)
    audio, rate = sf.read(REPO / "assets/media/spoken_questions_10s.flac", dtype="float32")
    sf.write(root / "mic.wav", audio, rate, subtype="PCM_16")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900",
              "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
              f"--use-file-for-fake-video-capture={root / 'camera.y4m'}",
              f"--use-file-for-fake-audio-capture={root / 'mic.wav'}", "--autoplay-policy=no-user-gesture-required"]:
        opts.add_argument(a)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    driver = webdriver.Chrome(service=Service(DRIVER, env=env), options=opts)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def test_talk_to_the_page_and_hear_the_answer(voice_browser, speaking_server):
    from selenium.webdriver.common.by import By

    d = voice_browser
    d.get(f"{speaking_server.url}/?width=160&max_tokens=16")
    d.find_element(By.ID, "speak").click()
    d.find_element(By.ID, "start").click()
    wait_for(d, "return window.omnitide.units >= 2")
    d.find_element(By.ID, "talk").click()
    # the fake microphone loops the clip: questions at 0.8 s and 5.2 s of every 10 s
    wait_for(d, "return window.omnitide.turns.some(t => t.event === 'speech_started')", timeout=60)
    wait_for(d, "return window.omnitide.turns.some(t => t.event === 'reply_done' || "
                "t.event === 'reply_interrupted')", timeout=120)
    state = d.execute_script("return {turns: window.omnitide.turns, audio: window.omnitide.audioChunks, "
                             "answers: window.omnitide.answers, errors: window.omnitide.errors}")
    events = [t["event"] for t in state["turns"]]
    assert "speech_ended" in events and "reply_started" in events, events
    assert state["audio"] >= 1  # the reply was spoken and reached the page's player
    assert state["answers"] and state["answers"][0]["question"] == "(spoken)"
    assert not [e for e in state["errors"] if "queue_full" not in e], state["errors"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    d.save_screenshot(str(ARTIFACTS / "serve_page_voice.png"))
    d.find_element(By.ID, "stop").click()
