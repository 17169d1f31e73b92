"""The router's web page in a real browser: Debian's Chromium, headless, driven through
chromium-driver by selenium, against real routers and experts on loopback serving the shipped
DDMs (`examples/digits.yaml`: two label groups; `examples/mnist.yaml`: four k-means clusters),
planned as `ddm up` plans them, a tiny Paris text DDM (its prompt box, guidance, previews and
the decoded image), and the shipped text DDM (`checkpoints/text2img`: its digit visible in the
preview at half the steps, its experts' cards saying what each was trained on). The page must
run under its own Content-Security-Policy with no violation and no console error, play a
generation live to its end, ask for a token only when the router wants one, offer only the
strategies the DDM can serve, and show what an ingress in front of the router said when it
refused a stream, the router's description or its readiness probe, or asked for a token (its
HTML or plain-text page, not JSON).

With ``DDM_SCREENSHOTS=DIR`` the browser saves the page idle, mid-generation and done in DIR
(``page-idle.png``, ``page-generating.png``, ``page-done.png``: the README's pictures, made
with ``DDM_SCREENSHOTS=docs``), and the shipped text DDM mid-way and scrubbed to half its
steps (``page-text2img-generating.png``, ``page-text2img-half.png``). ``make test`` installs
``chromium`` and ``chromium-driver``.
"""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ddm.deploy.plan import plan_deployment
from ddm.deploy.router_config import Auth, RouterConfigFile, StaticDiscovery
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import REPOSITORY_ROOT, resolve_checkpoint
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running, wait_ready
from tests.support.text_router import served_text_ddm, text_config

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER) and not os.environ.get("CI"),
                                 reason="needs Debian's chromium and chromium-driver "
                                        "(make test installs them; under CI their absence fails)")]

GENERATION_S = 240.0  # a whole generation on two busy cores
TOKEN = "page-test-token"
#: Records, from before the page's own script runs, every CSP violation the browser reports.
VIOLATIONS = """window.__violations = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.__violations.push(`${e.violatedDirective} blocked ${e.blockedURI}`));"""
#: Records every caption the viewer shows while a generation plays.
WATCH_CAPTIONS = """window.__captions = [];
new MutationObserver(() => window.__captions.push(document.getElementById("caption").textContent))
  .observe(document.getElementById("caption"), {childList: true, characterData: true,
                                                subtree: true});"""


@contextmanager
def _ddm(manifest: str, auth: Auth | None = None) -> Iterator[str]:
    """A router and an in-process server per expert for ``examples/<manifest>``, planned as
    ``ddm up`` plans them, but every expert on torch (JAX compiles for a minute on a busy
    machine, and the page does not care); yields the router's base URL."""
    plan = plan_deployment(load_manifest(REPOSITORY_ROOT / "examples" / manifest).spec)
    with ExitStack() as stack:
        discovery = {}
        for expert in plan.experts:
            base = stack.enter_context(running(create_model_app(
                resolve_checkpoint(expert.checkpoint), ServingOptions(backend="torch",
                                                                      max_batch=8))))
            wait_ready(base)
            discovery[expert.name] = StaticDiscovery((base.removeprefix("http://"),))
        config: RouterConfigFile = plan.router_config(
            discovery, str(resolve_checkpoint(plan.router.checkpoint)), auth=auth)
        router = stack.enter_context(running(create_router_app(config)))
        wait_ready(router)  # the probes stay open when auth is on
        yield router


@pytest.fixture(scope="module")
def digits() -> Iterator[str]:
    with _ddm("digits.yaml") as router:
        yield router


@pytest.fixture(scope="module")
def mnist() -> Iterator[str]:
    with _ddm("mnist.yaml") as router:
        yield router


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": VIOLATIONS})
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_plays_a_generation_live_to_the_end(browser, digits):
    _open(browser, digits)
    assert not browser.find_element(By.ID, "login").is_displayed()  # auth is off
    assert _options(browser, "strategy") == ["oracle", "top1", "top2", "threshold:0.2",
                                             "ensemble"]  # a label partition: oracle too
    browser.find_element(By.XPATH, "//button[text()='none']").click()
    for label in ("3", "8"):
        browser.find_element(By.XPATH, f"//div[@id='labels']//span[text()='{label}']").click()
    _set(browser, "count", "2")
    _set(browser, "steps", "12")
    browser.execute_script(WATCH_CAPTIONS)
    browser.find_element(By.ID, "go").click()

    _wait(browser, lambda b: b.find_element(By.ID, "status").text == "4 images done")
    tiles = browser.find_elements(By.CSS_SELECTOR, "#gallery .tile")
    assert [t.find_element(By.TAG_NAME, "span").text for t in tiles] == [
        "label 3, seed 0", "label 3, seed 1", "label 8, seed 0", "label 8, seed 1"]
    assert all(t.find_element(By.TAG_NAME, "progress").get_property("value") == 12
               for t in tiles)
    # Frames arrived one by one: the viewer showed the first image at several steps before
    # it was done, each step in order.
    shown = [int(m.group(1)) for c in browser.execute_script("return window.__captions")
             if (m := re.search(r"step (\d+)/12", c)) and "done" not in c]
    assert len(set(shown)) > 1 and shown == sorted(shown)
    caption = browser.find_element(By.ID, "caption").text
    assert caption.startswith("label 3, seed 0 · step 12/12") and "done in" in caption
    frame = browser.find_element(By.ID, "frame")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth",
                                  frame) == 16
    thumbs = browser.find_elements(By.CSS_SELECTOR, "#filmstrip img")
    assert len(thumbs) == 12 and frame.get_attribute("src") == thumbs[-1].get_attribute("src")

    browser.execute_script("const s = document.getElementById('scrub'); s.value = 3; "
                           "s.dispatchEvent(new Event('input'));")
    assert "step 3/12" in browser.find_element(By.ID, "caption").text
    assert frame.get_attribute("src") == thumbs[2].get_attribute("src")
    assert not browser.find_element(By.ID, "download").get_property("disabled")
    _assert_no_errors(browser)


#: What an ingress answers itself when the router behind it fails: nginx's 502 page, Envoy's
#: plain-text 504.
NGINX_502 = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
             "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
             "</body>\r\n</html>\r\n")
ENVOY_504 = "upstream request timeout"


@pytest.mark.parametrize("status, content_type, body, shown", [
    (502, "text/html", NGINX_502, "502 Bad Gateway: 502 Bad Gateway nginx"),
    (504, "text/plain", ENVOY_504, "504 Gateway Timeout: upstream request timeout")],
    ids=["html", "plain-text"])
def test_a_stream_refused_by_an_ingress_shows_its_status_and_words(browser, digits, status,
                                                                     content_type, body, shown):
    with _ingress(digits, "/v1/generate/stream", Response(body, status,
                                                           media_type=content_type)) as page:
        _open(browser, page)
        browser.find_element(By.XPATH, "//button[text()='none']").click()
        browser.find_element(By.XPATH, "//div[@id='labels']//span[text()='3']").click()
        browser.find_element(By.ID, "go").click()
        _wait(browser, lambda b: b.find_element(By.ID, "status").text
              == "1 of 1 images done, 1 failed")
    caption = browser.find_element(By.ID, "caption")
    assert caption.text == f"label 3, seed 0 · waiting… · {shown}"
    assert caption.get_attribute("class") == "error"
    tile = browser.find_element(By.CSS_SELECTOR, "#gallery .tile")
    assert tile.get_attribute("title") == shown and "failed" in tile.get_attribute("class")
    _assert_no_errors(browser, allowed=f"status of {status}")


#: ingress-nginx's answer while no replica of the router behind it is ready, and its
#: basic-auth refusal.
NGINX_503 = NGINX_502.replace("502 Bad Gateway", "503 Service Temporarily Unavailable")
NGINX_401 = NGINX_502.replace("502 Bad Gateway", "401 Authorization Required")


@pytest.mark.parametrize("code, body, shown, asks_for_token", [
    (502, NGINX_502, "502 Bad Gateway: 502 Bad Gateway nginx", False),
    (401, NGINX_401, "the router needs an API token "
                     "(401 Unauthorized: 401 Authorization Required nginx)", True)],
    ids=["502", "401"])
def test_the_routers_description_refused_by_an_ingress_shows_its_status_and_words(
        browser, digits, code, body, shown, asks_for_token):
    """An ingress's own 401 (its basic-auth page, not the router's JSON) still asks for a
    token."""
    with _ingress(digits, "/v1/info", Response(body, code, media_type="text/html")) as page:
        browser.get(f"{page}/")
        status = browser.find_element(By.ID, "status")
        _wait(browser, lambda _: status.text)
        assert status.text == shown
        assert status.get_attribute("class") == "error"
        assert browser.find_element(By.ID, "login").is_displayed() == asks_for_token
        _assert_no_errors(browser, allowed=f"status of {code}")


def test_a_readiness_probe_refused_by_an_ingress_shows_not_ready_and_its_words(browser,
                                                                              digits):
    with _ingress(digits, "/readyz", Response(NGINX_503, 503, media_type="text/html")) as page:
        browser.get(f"{page}/")
        readiness, status = (browser.find_element(By.ID, i) for i in ("readiness", "status"))
        _wait(browser, lambda _: "error" in readiness.get_attribute("class") or status.text)
        assert status.text == ""
        assert readiness.text == ("not ready: 503 Service Unavailable: "
                                  "503 Service Temporarily Unavailable nginx")
        assert _options(browser, "strategy")  # the rest of the page came from /v1/info
        _assert_no_errors(browser, allowed="status of 503")


def test_restart_mid_generation_waits_for_the_slots_the_old_streams_held(browser, digits):
    # As many streams as the router lets one client run (four, as many as images): a
    # restart's new streams ask for slots the aborted ones still hold until the router sees
    # them go, and are told 429 with Retry-After.
    _open(browser, digits)
    assert browser.execute_script("return info.limits.max_concurrent_per_client") == 4
    _set(browser, "steps", "40")
    browser.find_element(By.ID, "go").click()
    _wait(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#filmstrip img")) >= 2)
    browser.find_element(By.ID, "go").click()  # Restart

    _wait(browser, lambda b: b.find_element(By.ID, "go").text == "Generate")
    assert browser.find_element(By.ID, "status").text == "4 images done"
    assert [t.get_attribute("title") for t in
            browser.find_elements(By.CSS_SELECTOR, "#gallery .tile")] == ["done"] * 4
    _assert_no_errors(browser, allowed="status of 429")


def test_the_token_form_shows_only_when_the_router_wants_a_token(browser, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with _ddm("digits.yaml", auth=Auth(str(token_file))) as router:
        browser.get(f"{router}/")
        login = browser.find_element(By.ID, "login")
        _wait(browser, lambda _: login.is_displayed())
        assert browser.find_element(By.ID, "status").text == (
            "the router needs an API token (401: missing Authorization header; "
            "send Authorization: Bearer <token>)")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        login.find_element(By.TAG_NAME, "button").click()
        _wait(browser, lambda b: _options(b, "strategy") and not login.is_displayed())
        # the 401 that asked for the token is the one error the console may show
        _assert_no_errors(browser, allowed="v1/info - Failed to load resource: the server "
                                           "responded with a status of 401")


def test_a_k_means_ddm_offers_no_oracle_and_its_experts_are_clusters(browser, mnist):
    _open(browser, mnist)
    assert "oracle" not in _options(browser, "strategy")
    cards = browser.find_elements(By.CSS_SELECTOR, "#cards .card")
    assert [c.find_element(By.TAG_NAME, "h3").text.split("\n")[0] for c in cards] == [
        f"mnist-cluster-{k}" for k in range(4)]
    for k, card in enumerate(cards):
        text = card.text
        assert f"k-means cluster {k} of 4 (HOG features): every label" in text
        framework = ['torch', 'jax'][k % 2]  # alternating, as examples/mnist.yaml says
        assert "1/1 replicas ready" in text and f"trained with\n{framework}" in text
        assert "runs on\ntorch " in text
    _screenshot(browser, "idle")
    browser.find_element(By.ID, "go").click()  # the page's defaults: four labels, 40 steps
    _wait(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#filmstrip img")) >= 20)
    _screenshot(browser, "generating")
    _wait(browser, lambda b: b.find_element(By.ID, "status").text == "4 images done")
    browser.find_elements(By.CSS_SELECTOR, "#gallery .tile")[2].click()
    assert browser.find_element(By.ID, "caption").text.startswith("label 2, seed 0 · step 40/40")
    _screenshot(browser, "done")
    _assert_no_errors(browser)


@pytest.fixture(scope="module")
def paris(tmp_path_factory) -> Iterator[str]:
    """A tiny Paris DDM: experts on expert servers, the other stages in the router."""
    with served_text_ddm(tmp_path_factory.mktemp("paris")) as (router, _):
        yield router


def test_a_text_ddm_gets_a_prompt_box_and_latent_previews_then_its_decoded_image(browser,
                                                                                 paris):
    _open(browser, paris)
    assert browser.find_elements(By.ID, "labels") == []  # no label chips: prompts
    # this DDM's text encoder declares no example prompt: the box starts empty
    assert browser.find_element(By.ID, "prompts").get_property("value") == ""
    assert "oracle" not in _options(browser, "strategy")
    assert browser.find_element(By.ID, "guidance").get_property("value") == "7.5"
    prompts = browser.find_element(By.ID, "prompts")
    prompts.clear()
    prompts.send_keys("a photo of a red car\n" + " ".join(["photo"] * 100))
    _set(browser, "negative", "sunset")
    _set(browser, "steps", "3")
    browser.execute_script(WATCH_CAPTIONS)
    browser.find_element(By.ID, "go").click()

    _wait(browser, lambda b: b.find_element(By.ID, "status").text == "2 images done")
    # While it ran, the frames were the decoder's images of each step's prediction...
    captions = browser.execute_script("return window.__captions")
    assert any("(predicted image)" in c for c in captions)
    thumbs = browser.find_elements(By.CSS_SELECTOR, "#filmstrip img")
    assert len(thumbs) == 3
    # ... and once done, the last frame is the decoded 16x16 image.
    frame = browser.find_element(By.ID, "frame")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth",
                                  frame) == 16
    caption = browser.find_element(By.ID, "caption").text
    assert caption.startswith("“a photo of a red car”, seed 0 · step 3/3") and "done in" in caption
    browser.find_elements(By.CSS_SELECTOR, "#gallery .tile")[1].click()
    assert "longer than the text encoder takes; its last 25 token(s) ignored" in (
        browser.find_element(By.ID, "caption").text)  # the answer's warning
    _assert_no_errors(browser)


@pytest.fixture(scope="module")
def text2img() -> Iterator[str]:
    """The shipped coloured-MNIST text DDM (checkpoints/text2img): its four experts on expert
    servers (torch), its text encoder, decoder and router network in the router."""
    root = REPOSITORY_ROOT / "checkpoints" / "text2img"
    with ExitStack() as stack:
        experts = {}
        for k in range(4):
            base = stack.enter_context(running(create_model_app(
                root / f"expert_{k}", ServingOptions(backend="torch", max_batch=8))))
            wait_ready(base)
            experts[f"expert-{k}"] = base.removeprefix("http://")
        router = stack.enter_context(running(create_router_app(text_config(root, experts))))
        wait_ready(router)
        yield router


def test_the_shipped_text_ddm_shows_its_digit_forming_by_half_the_steps(browser, text2img):
    _open(browser, text2img)
    cards = browser.find_elements(By.CSS_SELECTOR, "#cards .card")
    digits, images = ["0, 5, 8, 9", "4, 6", "1", "2, 3, 7"], ["23,251", "11,762", "6,744",
                                                              "18,243"]
    for k, card in enumerate(cards):  # what each declares it was trained on
        assert (f"k-means cluster {k} of 4 (CLIP IMAGE features): digits {digits[k]}; "
                f"{images[k]} images of coloured MNIST") in card.text.replace("\n", " ")
    prompts = browser.find_element(By.ID, "prompts")
    prompts.clear()
    browser.find_element(By.ID, "go").click()  # nothing to draw: refused until fixed
    assert browser.find_element(By.ID, "status").text == "choose at least one input"
    prompts.send_keys("a red seven")
    assert browser.find_element(By.ID, "status").text == ""
    _set(browser, "count", "1")
    _set(browser, "steps", "30")
    _set(browser, "guidance", "4")
    Select(browser.find_element(By.ID, "strategy")).select_by_value("top1")
    browser.find_element(By.ID, "go").click()
    _wait(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#filmstrip img")) >= 15)
    _screenshot(browser, "text2img-generating")
    _wait(browser, lambda b: b.find_element(By.ID, "status").text == "1 images done")
    # Step 15 of 30, as the page shows it, is already the final image's digit: the old
    # linear map of x_t correlated 0.27 with it (-0.27 for "a thick blue two").
    half, final = (_pixels(browser.execute_script(f"return {image}")) for image in (
        "runs[0].frames[14].image", "runs[0].done.image"))
    assert half.shape == final.shape == (32, 32, 3)
    assert np.corrcoef(half.ravel(), final.ravel())[0, 1] > 0.9
    browser.find_element(By.ID, "scrub").send_keys(Keys.HOME)  # the scrubber at step 1 ...
    for _ in range(14):
        browser.find_element(By.ID, "scrub").send_keys(Keys.ARROW_RIGHT)  # ... then at 15
    assert "step 15/30" in browser.find_element(By.ID, "caption").text
    _screenshot(browser, "text2img-half")
    _assert_no_errors(browser)


# ------------------------------------------------------------------------------ helpers


def _pixels(png: str) -> np.ndarray:
    """A base64 PNG from the page -> (H, W, 3) float32."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB"), np.float32)



@contextmanager
def _ingress(router: str, path: str, answer: Response) -> Iterator[str]:
    """A stand-in for an ingress in front of ``router``: passes every GET through but ``path``,
    which it answers with ``answer`` itself, as an ingress does when the router behind it
    fails; yields its base URL."""

    async def forward(request: Request) -> Response:
        if request.url.path == path:
            return answer
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"{router}{request.url.path}", params=request.query_params)
        headers = {name: value for name, value in reply.headers.items()
                   if name not in ("content-length", "content-encoding", "transfer-encoding")}
        return Response(reply.content, reply.status_code, headers=headers)

    with running(Starlette(routes=[Route("/{path:path}", forward)])) as base:
        yield base


def _open(browser, base: str) -> None:
    """Load the page until it says the DDM is ready, or the browser refused part of it."""
    browser.get(f"{base}/")
    _wait(browser, lambda b: b.execute_script("return window.__violations.length") or
          "ok" in b.find_element(By.ID, "readiness").get_attribute("class"))
    assert browser.execute_script("return window.__violations") == []


def _options(browser, select: str) -> list[str]:
    return [o.get_attribute("value")
            for o in browser.find_elements(By.CSS_SELECTOR, f"#{select} option")]


def _set(browser, field: str, value: str) -> None:
    element = browser.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)


def _wait(browser, condition) -> None:
    WebDriverWait(browser, GENERATION_S, poll_frequency=0.05).until(condition)


def _assert_no_errors(browser, allowed: str | None = None) -> None:
    """No CSP violation and no console error (the CSP's refusals are console errors too)."""
    assert browser.execute_script("return window.__violations") == []
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert [m for m in errors if allowed is None or allowed not in m] == []


def _screenshot(browser, name: str) -> None:
    directory = os.environ.get("DDM_SCREENSHOTS")
    if not directory:
        return
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False})
    browser.save_screenshot(str(Path(directory) / f"page-{name}.png"))
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


