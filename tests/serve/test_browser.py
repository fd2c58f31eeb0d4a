"""The live page in a real headless Chromium (Debian's chromium + chromium-driver) against a real server: a fake
camera and microphone fed from the bundled clip, units arriving in the session, an answer streaming into the page,
the KV chart updating; a screenshot is kept as a test artifact."""

import os
import pathlib
import shutil
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = pathlib.Path(os.environ.get("OMNITIDE_TEST_ARTIFACTS", REPO / "test-artifacts"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="Chromium or chromedriver is absent: `scripts/setup.sh --dev` installs Debian's chromium and "
           "chromium-driver (as root)")


def write_y4m(path: pathlib.Path, frames: list[np.ndarray], fps: int) -> None:
    """Frames as a YUV4MPEG2 (4:2:0) file: what Chromium's --use-file-for-fake-video-capture plays in a loop."""
    import cv2

    h, w = frames[0].shape[:2]
    with open(path, "wb") as f:
        f.write(f"YUV4MPEG2 W{w} H{h} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for rgb in frames:
            f.write(b"FRAME\n" + cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420).tobytes())


@pytest.fixture(scope="module")
def fake_media(tmp_path_factory, media_dir):
    """The bundled clip as a fake camera (160x120, 5 fps) and a fake microphone (its audio track as 16-bit WAV)."""
    import cv2
    import soundfile as sf

    from omnitide_mlx.media import iter_chunks

    root = tmp_path_factory.mktemp("fake_media")
    frames, audio = [], []
    for c in iter_chunks(media_dir / "video_10s_av.mp4"):
        frames += [cv2.resize(c.frame, (160, 120), interpolation=cv2.INTER_AREA)] * 5
        audio.append(c.audio)
    write_y4m(root / "camera.y4m", frames, fps=5)
    sf.write(root / "mic.wav", np.concatenate(audio), 16000, subtype="PCM_16")
    return root / "camera.y4m", root / "mic.wav"


@pytest.fixture(scope="module")
def browser(fake_media):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    camera, mic = fake_media
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900",
              "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
              f"--use-file-for-fake-video-capture={camera}", f"--use-file-for-fake-audio-capture={mic}",
              "--autoplay-policy=no-user-gesture-required"]:
        opts.add_argument(a)
    # scripts/blas_env.sh preloads OpenBLAS for MLX; Chromium crashes with it preloaded
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    driver = webdriver.Chrome(service=Service(DRIVER, env=env), options=opts)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait_for(driver, script: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    state = driver.execute_script("const s = window.omnitide; return {sent: s.sent, units: s.units, "
                                  "updates: s.updates, errors: s.errors, answers: s.answers};")
    raise AssertionError(f"timed out waiting for `{script}`; page state {state}")


def test_the_page_streams_camera_and_microphone_and_answers(browser, server, http):
    from selenium.webdriver.common.by import By

    d = browser
    d.get(f"{server.url}/?width=160&max_tokens=12")
    assert d.title == "omnitide live"
    d.find_element(By.ID, "start").click()
    wait_for(d, "return window.omnitide.units >= 3")  # units went out, the session took them, a second each

    sessions = http.get("/v1/sessions").json()["sessions"]
    assert len(sessions) == 1 and sessions[0]["connected"] and sessions[0]["ephemeral"]
    assert sessions[0]["counts"]["units_pushed"] >= 3 and sessions[0]["counts"]["rejected"] == 0
    errors = d.execute_script("return window.omnitide.errors")
    assert not errors, errors  # the microphone was there: no camera-only fallback, no rejected unit

    updates_before = d.execute_script("return window.omnitide.updates")
    d.find_element(By.ID, "question").send_keys("What colour is the square?")
    d.find_element(By.ID, "ask").click()
    wait_for(d, "return window.omnitide.answers.length >= 1")
    state = d.execute_script("return window.omnitide")
    answer = state["answers"][0]
    assert answer["question"] == "What colour is the square?" and answer["text"]
    assert state["pieces"] >= 2  # it streamed in pieces, not as one block
    shown = d.execute_script("return document.getElementById('answer').textContent")
    assert shown == answer["text"]  # the page shows the whole answer (textContent: .text folds whitespace)

    # the chart keeps drawing as units go on: more points, and lines of the chart's colours on the canvas
    wait_for(d, f"return window.omnitide.updates >= {updates_before + 3}")
    points = int(d.find_element(By.ID, "kv").get_attribute("data-points"))
    assert points >= updates_before + 3
    coloured = d.execute_script("""
        const c = document.getElementById('kv'), px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let blue = 0, orange = 0;
        for (let i = 0; i < px.length; i += 4) {
          if (px[i] < 120 && px[i + 2] > 200) blue++;
          if (px[i] > 200 && px[i + 1] > 140 && px[i + 1] < 200 && px[i + 2] < 110) orange++;
        }
        return [blue, orange];""")
    assert coloured[0] > 50 and coloured[1] > 50, coloured
    assert d.find_element(By.ID, "retained").text.isdigit()

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "serve_page.png"
    d.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")

    d.find_element(By.ID, "stop").click()  # the page's session is ephemeral: it ends with the socket
    deadline = time.monotonic() + 10
    while http.get("/v1/sessions").json()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get("/v1/sessions").json()["sessions"] == []
