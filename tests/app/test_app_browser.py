"""`python -m jaxsora.app` in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, driven by
Selenium) opens the page of the demo's trained model and uses it as a person would.

The model is the demo's EMA weights as Open-Sora's state dict in bf16 (tests/fixtures/demo_ema_bf16.safetensors,
its recipe in tests/fixtures/README.md), converted back with `jaxsora.convert from-torch` and opened with the
demo's config as a user opens a converted checkpoint: `python -m jaxsora.app configs/demo.py --ckpt-path CKPT`.

- text-to-video: a typed caption, Generate, the video and its settings downloaded through the page's links, and
  `data_tools.judge` finds the caption's colour, direction and shape in the downloaded video's pixels;
- image-to-video: an uploaded image becomes the video's first frame (compared pixel by pixel);
- bad inputs (an empty prompt, more frames than the model takes, an unreadable image) are messages in the page,
  and the server keeps serving;
- two requests sent at once from two tabs both finish, one after the other (the sidecars' times), the second of
  a shape reusing the sampler compiled for it (the pipeline's trace counts, in the sidecar and the page);
- the progress bar counts the steps; nothing leaves the machine (the server's audit log, the page's resources).

A screenshot of the page with its first video is taken (JAXSORA_APP_SCREENSHOT=FILE keeps it: docs/app.png is
one). Without Chromium the tests skip locally and fail in CI (CI=true): `make test` installs it as root.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from tests.conftest import FIXTURES, REPO
from tests.ports import free_port
from tests.xla_flags import cpu_flags
from tests.zygote import PYTHON

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Chromium on a machine without a network: no background services, no QUIC, a fresh profile.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1500")
WEIGHTS = FIXTURES / "demo_ema_bf16.safetensors"
EXAMPLES = FIXTURES / "demo_prompts.txt"
CAPTION = "a white square moving right on a dark background"  # held out: the demo set never shows it
STEPS = 12  # the page's first value (--steps): few, and the judge still finds every word of CAPTION
SERVER_START_S = 600  # a cold start on a busy 2-core machine: import, restore, Gradio
REQUEST_S = 300       # a first request compiles its sampler


def _need(what: str, ok: bool):
    if not ok:
        msg = f"no {what}: apt-get install chromium chromium-driver; pip install -e '.[app]' (make test " \
              "installs both)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg, allow_module_level=True)


_need("/usr/bin/chromium and /usr/bin/chromedriver", os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER))
try:
    import gradio  # noqa: F401
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    _need("gradio or selenium (the app and dev extras)", False)

pytestmark = pytest.mark.slow(seconds=150)


class Server:
    def __init__(self, work: pathlib.Path):
        self.work = work
        self.out = work / "videos"
        self.log = work / "app.log"
        self.connections = work / "connections.txt"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("app")
    srv = Server(work)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(1)}
    ckpt = work / "ckpt"
    r = subprocess.run([PYTHON, "-m", "jaxsora.convert", "from-torch", str(WEIGHTS), str(ckpt), "--model", "demo",
                        "--set", "input_sq_size=32", "--strict"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # the server exactly as a user starts it, with an audit hook logging connections that leave the machine
    env.update(PYTHONPATH=f"{pathlib.Path(__file__).parent / 'netlog'}{os.pathsep}{REPO}",
               JAXSORA_TEST_CONNECTIONS=str(srv.connections), GRADIO_TEMP_DIR=str(work / "gradio"))
    cmd = [sys.executable, "-m", "jaxsora.app", "configs/demo.py", "--ckpt-path", str(ckpt), "--port", str(srv.port),
           "--output", str(srv.out), "--prompt-path", str(EXAMPLES), "--steps", str(STEPS)]
    with open(srv.log, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert proc.poll() is None, f"the app exited with {proc.returncode}:\n{srv.log_tail()}"
            assert time.monotonic() < deadline, f"the app did not answer in {SERVER_START_S} s:\n{srv.log_tail()}"
            try:
                with urllib.request.urlopen(srv.url, timeout=5) as page:
                    if page.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser(server):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={server.work / 'chromium-profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


# ---- the page, as a person uses it --------------------------------------------------------------------------
def _wait(driver, until, seconds=60, what=""):
    return WebDriverWait(driver, seconds, poll_frequency=0.2).until(until, what)


def open_page(driver, server):
    driver.get(server.url)
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#prompt textarea"), what="the page's prompt box")
    # every step count the progress bar shows ("3/12 steps"), recorded as the page changes
    driver.execute_script("""
        window.stepsShown = new Set();
        new MutationObserver(() => {
            for (const m of document.body.innerText.matchAll(/(\\d+)\\/(\\d+) steps/g)) window.stepsShown.add(m[0]);
        }).observe(document.body, {subtree: true, childList: true, characterData: true});""")


def type_prompt(driver, text):
    box = driver.find_element(By.CSS_SELECTOR, "#prompt textarea")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    if text:
        box.send_keys(text)


def set_length(driver, text):
    field = driver.find_element(By.CSS_SELECTOR, "#length input")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(text)
    field.send_keys(Keys.ENTER)
    driver.find_element(By.CSS_SELECTOR, "#prompt textarea").click()  # leave the field: the value is taken


def uploaded(driver, name: str, present: bool = True):
    """Wait until the reference box lists the file `name` (or no longer does)."""
    css = f"#reference td.filename[aria-label='{name}']"
    _wait(driver, lambda d: bool(d.find_elements(By.CSS_SELECTOR, css)) == present, 30,
          f"{name} {'in' if present else 'gone from'} the reference box")


def set_number(driver, elem_id: str, value):
    """Type a value into a slider's number box and leave it (the value is taken on leaving)."""
    field = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input[type=number]")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(str(value))
    driver.find_element(By.CSS_SELECTOR, "#prompt textarea").click()
    _wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, f"#{elem_id} input[type=number]").get_attribute("value")
          == str(value), 10, f"{elem_id} = {value}")


def status(driver) -> str:
    return driver.find_element(By.ID, "status").text.strip()


def generate(driver, seconds=REQUEST_S) -> str:
    """Press Generate and wait for this request's answer in the status line (a video's name or the reason)."""
    before = status(driver)
    driver.find_element(By.ID, "generate").click()
    return wait_answer(driver, before, seconds)


def wait_answer(driver, before, seconds=REQUEST_S) -> str:
    _wait(driver, lambda d: status(d) != before and (status(d).startswith("sample_") or
                                                     status(d).startswith("Not sampled")),
          seconds, "the request's answer")
    return status(driver)


def download(driver, folder: pathlib.Path) -> list[pathlib.Path]:
    """Click every link of the page's download box; the files as the browser saved them."""
    folder.mkdir(parents=True, exist_ok=True)
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(folder)})
    links = driver.find_elements(By.CSS_SELECTOR, "#files a[download]")
    names = sorted(a.get_attribute("download") for a in links)
    for a in links:
        a.click()
    _wait(driver, lambda d: sorted(p.name for p in folder.iterdir() if not p.name.endswith(".crdownload")) == names,
          30, f"the downloads {names}")
    return [folder / n for n in names]


def read_video(path) -> np.ndarray:
    from data_tools.judge import read_video as judge_read

    return judge_read(str(path))


def sidecar(server, answer: str) -> dict:
    name = answer.split()[0].removesuffix(".mp4").removesuffix(".png")
    return json.loads((server.out / f"{name}.json").read_text())


# ---- the tests -----------------------------------------------------------------------------------------------
def test_text_to_video_follows_the_typed_caption(server, browser, tmp_path):
    from data_tools.judge import judge_folder

    open_page(browser, server)
    type_prompt(browser, CAPTION)
    answer = generate(browser)
    assert answer.startswith("sample_") and f"{STEPS} steps" in answer, answer + server.log_tail()
    shot = server.work / "app.png"
    browser.save_screenshot(str(shot))
    if os.environ.get("JAXSORA_APP_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["JAXSORA_APP_SCREENSHOT"])
    from PIL import Image

    with Image.open(shot) as im:
        assert im.size[0] == 1280 and np.asarray(im.convert("L")).std() > 10  # a page, not a blank
    # the progress bar counted the steps
    shown = browser.execute_script("return Array.from(window.stepsShown)")
    assert any(s.endswith(f"/{STEPS} steps") for s in shown), shown

    files = download(browser, tmp_path / "downloads")
    assert [f.suffix for f in files] == [".json", ".mp4"], files
    meta = json.loads(files[0].read_text())
    assert meta["prompt"] == CAPTION and meta["settings"]["num_sampling_steps"] == STEPS
    assert (meta["frames"], meta["height"], meta["width"]) == (8, 32, 32)
    video = read_video(files[1])
    assert video.shape == (8, 32, 32, 3)
    # the downloaded video is the one saved with its settings on the server
    np.testing.assert_array_equal(video, read_video(server.out / files[1].name))
    judged = judge_folder(str(files[0].parent))
    assert len(judged) == 1
    j = judged[0]
    assert (j.colour_ok, j.motion_ok, j.shape_ok) == (True, True, True), (j.asked, j.verdict)


def _reference_image(path: pathlib.Path) -> np.ndarray:
    """A 32×32 image as the demo's set draws them: a green square on the set's background, on the 2×2 grid of the
    demo's pixel-space VAE (its 2×2 average pooling keeps it as it is)."""
    from PIL import Image

    from data_tools.synthetic import BACKGROUND, COLORS

    img = np.empty((32, 32, 3), np.uint8)
    img[:] = BACKGROUND
    img[12:20, 6:14] = COLORS["green"]
    Image.fromarray(img).save(path)
    return img


def test_image_to_video_starts_from_the_uploaded_image(server, browser, tmp_path):
    open_page(browser, server)
    image = _reference_image(tmp_path / "first.png")
    browser.find_element(By.CSS_SELECTOR, "#reference input[type=file]").send_keys(str(tmp_path / "first.png"))
    uploaded(browser, "first.png")
    type_prompt(browser, "a green square moving right on a dark background")
    answer = generate(browser)
    assert answer.startswith("sample_") and "from the reference" in answer, answer + server.log_tail()
    files = download(browser, tmp_path / "downloads")
    video = read_video(files[1]).astype(np.float32)
    first = np.abs(video[0] - image).mean()
    later = np.abs(video[-1] - image).mean()
    # the first frame is the image, up to the mp4's rounding; the last one has moved on
    print(f"first frame off the image by {first:.2f} (mean |difference|, of 255), the last by {later:.2f}")
    assert first < 4.0 and later > 3 * first, (first, later)
    meta = json.loads(files[0].read_text())
    assert meta["settings"]["mask_strategy"] == "0"
    kept = pathlib.Path(meta["settings"]["reference_path"])  # the upload, kept beside the video
    assert kept.parent == server.out and kept.read_bytes() == (tmp_path / "first.png").read_bytes()


def test_bad_inputs_are_answered_in_the_page_and_the_server_keeps_serving(server, browser, tmp_path):
    open_page(browser, server)
    assert generate(browser, 60).startswith("Not sampled: the prompt is empty")
    type_prompt(browser, CAPTION)
    set_length(browser, "64")
    assert generate(browser, 60).startswith("Not sampled: 64 frames is more than this checkpoint takes at demo32")
    set_length(browser, "8 frames")
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    browser.find_element(By.CSS_SELECTOR, "#reference input[type=file]").send_keys(str(tmp_path / "broken.png"))
    uploaded(browser, "broken.png")
    answer = generate(browser, 60)
    assert answer.startswith("Not sampled: reference: cannot read image"), answer
    assert "Traceback" not in browser.find_element(By.TAG_NAME, "body").text
    browser.find_element(By.CSS_SELECTOR, "#reference button[aria-label='Clear']").click()
    uploaded(browser, "broken.png", present=False)
    assert generate(browser).startswith("sample_")  # still serving


def test_two_requests_at_once_both_finish_one_after_the_other(server, browser):
    captions = ["a blue square moving left on a dark background", "a yellow bar moving down on a dark background"]
    steps = 40  # long enough (a second or more) for the second press to come while the first request samples
    first = browser.current_window_handle
    open_page(browser, server)
    type_prompt(browser, captions[0])
    set_number(browser, "steps", steps)
    browser.switch_to.new_window("tab")
    second = browser.current_window_handle
    open_page(browser, server)
    type_prompt(browser, captions[1])
    set_number(browser, "steps", steps)
    before, pressed = {}, []
    for tab in (first, second):  # both pressed before either is done
        browser.switch_to.window(tab)
        before[tab] = status(browser)
        browser.find_element(By.ID, "generate").click()
        pressed.append(time.time())
    answers = []
    for tab in (first, second):
        browser.switch_to.window(tab)
        answers.append(wait_answer(browser, before[tab]))
    browser.close()
    browser.switch_to.window(first)
    assert all(a.startswith("sample_") for a in answers), answers
    metas = [sidecar(server, a) for a in answers]
    assert [m["prompt"] for m in metas] == captions
    assert [m["settings"]["num_sampling_steps"] for m in metas] == [steps, steps]
    a, b = sorted((m["app"] for m in metas), key=lambda x: x["started"])
    # both sent before the first was done, and sampled one after the other
    assert pressed[1] < a["finished"] <= b["started"], (pressed, a, b)
    # one shape, one sampler: a request of a shape sampled before compiles nothing (the pipeline's trace counts)
    assert not b["compiled"], (a, b)
    assert "reused the sampler compiled for this shape" in answers[captions.index(
        next(m["prompt"] for m in metas if m["app"] is b))]


def test_nothing_leaves_the_machine(server, browser):
    open_page(browser, server)
    outside = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
        ".filter(u => !u.startsWith('http://127.0.0.1') && !u.startsWith('data:') && !u.startsWith('blob:'))")
    assert outside == [], outside
    logged = server.connections.read_text().splitlines() if server.connections.exists() else []
    assert logged == [], logged
