"""``ddm up`` on the shipped example: the README's main command, end to end, then abused.

One module-scoped run of examples/digits.yaml as real processes (two expert servers and the
router on loopback). The generated digits must be read as the asked ones, and a thousand
malformed bodies to an expert and to the router must each get a 4xx (a mutation that is
still a valid request gets its answer) while both keep serving.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.support.local_runtime import Log as _Log
from tests.support.local_runtime import ddm_up as _ddm_up
from tests.support.processes import listening_pid
from ddm.evaluation.commands import evaluate_images
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import LocalPlan, free_port, run_local
from ddm.serving.wire.protocol import CONTENT_TYPE, Limits, ProtocolError, decode_request
from tests.support.label_wire import post_call, send, velocity_call

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
STARTUP_TIMEOUT_S = 300
HOSTILE = settings(max_examples=1000, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def local_ddm() -> Iterator[LocalPlan]:
    ready, stop, log = threading.Event(), threading.Event(), _Log()
    plans: list[LocalPlan] = []

    def on_ready(plan: LocalPlan) -> None:
        plans.append(plan)
        ready.set()

    outcome: list[int] = []
    thread = threading.Thread(
        target=lambda: outcome.append(run_local(load_manifest(EXAMPLE), router_port=free_port(),
                                                out=log, on_ready=on_ready, stop=stop)))
    thread.start()
    try:
        while not ready.wait(0.5):
            assert thread.is_alive(), f"ddm up stopped before it was ready:\n{log.getvalue()}"
            assert len(log.getvalue()) < 1e7
        yield plans[0]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert outcome == [0], log.getvalue()
    for spec in (*plans[0].experts, plans[0].router):  # every process is gone
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", spec.port)) != 0, f"{spec.name} still listens"


def _decode(images_b64: list[str]) -> np.ndarray:
    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) for b in images_b64])


def test_the_router_generates_the_asked_digits(local_ddm: LocalPlan) -> None:
    labels = np.repeat(np.arange(10), 10)
    images, experts = [], []
    for half in (labels[:50], labels[50:]):  # a request holds at most 64 labels
        answer = httpx.post(f"{local_ddm.url}/v1/generate", timeout=300,
                            json={"labels": half.tolist(), "steps": 40, "seed": 0,
                                  "strategy": "top1"})
        assert answer.status_code == 200, answer.text
        images.append(_decode(answer.json()["images"]))
        experts += answer.json()["experts"]
    images = np.concatenate(images)
    assert images.shape == (100, 16, 16) and images.dtype == np.uint8
    metrics = evaluate_images(images, labels)
    assert metrics["accuracy"] >= 0.95, metrics
    assert experts == [["digits-0-4"] if y < 5 else ["digits-5-9"] for y in labels]


_valid_call = velocity_call(
    7, np.zeros((1, 1, 16, 16), np.float32), np.full(1, 0.5, np.float32), np.zeros(1, np.int64))
#: The call's body; the test sends its label context first.
_valid_request = _valid_call.call
_mutations = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda cut: _valid_request[:cut], st.integers(0, len(_valid_request) - 1)),
    st.builds(lambda i, b: _valid_request[:i] + bytes([b]) + _valid_request[i + 1:],
              st.integers(0, 63), st.integers(0, 255)).filter(lambda body: body != _valid_request),
)
#: What the digits-0-4 expert accepts (``ddm up`` serves it with the default max batch).
_EXPERT_LIMITS = Limits(max_batch=64, image_shape=(1, 16, 16), allowed_labels=frozenset(range(5)))


def _acceptable(body: bytes) -> bool:
    """A mutation can land on the request id or a pixel and stay a valid request."""
    try:
        decode_request(body, _EXPERT_LIMITS)
    except ProtocolError:
        return False
    return True


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def test_an_expert_answers_1000_malformed_bodies_with_4xx_and_keeps_serving(
        local_ddm: LocalPlan, client: httpx.Client) -> None:
    url = f"http://127.0.0.1:{local_ddm.experts[0].port}/v1/velocity"
    assert post_call(url.removesuffix("/v1/velocity"), _valid_call).status_code == 200

    @HOSTILE
    @given(_mutations)
    def hostile(body: bytes) -> None:
        answer = client.post(url, content=body, headers={"Content-Type": CONTENT_TYPE})
        if _acceptable(body):
            assert answer.status_code == 200, (answer.status_code, body[:64])
        else:
            assert 400 <= answer.status_code < 500, (answer.status_code, body[:64])

    hostile()
    good = client.post(url, content=_valid_request, headers={"Content-Type": CONTENT_TYPE})
    assert good.status_code == 200


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=5),
    max_leaves=20)
_requests = st.one_of(
    st.binary(max_size=512),
    st.fixed_dictionaries({}, optional={
        "labels": _json_values | st.lists(st.integers(-5, 20), max_size=80),
        "steps": _json_values | st.integers(-5, 2000),
        "seed": _json_values,
        "strategy": _json_values | st.sampled_from(["top1", "top9", "random", "threshold:2"]),
        "solver": _json_values | st.sampled_from(["euler", "rk4"]),
        "delegate_steps": _json_values | st.integers(-5, 2000),
        "extra": _json_values,
    }).map(lambda d: json.dumps(d).encode()),
)


def test_the_router_answers_1000_malformed_requests_with_4xx_and_keeps_serving(
        local_ddm: LocalPlan, client: httpx.Client) -> None:
    url = f"{local_ddm.url}/v1/generate"
    refused: list[bytes] = []

    @HOSTILE
    @given(_requests)
    def hostile(body: bytes) -> None:
        answer = client.post(url, content=body, headers={"Content-Type": "application/json"})
        if answer.status_code == 200:  # the rare generated body that is a correct request
            assert len(answer.json()["images"]) == len(json.loads(body)["labels"])
        else:
            assert 400 <= answer.status_code < 500, (answer.status_code, body[:200], answer.text)
            assert answer.json()["detail"], answer.text
            refused.append(body)

    hostile()
    assert len(refused) >= 900, f"only {len(refused)} of the bodies were malformed"
    assert client.get(f"{local_ddm.url}/healthz").status_code == 200
    good = client.post(url, json={"labels": [3], "steps": 4})
    assert good.status_code == 200, good.text


#: Runs the Python command line it is given with SIGINT back at its default: exec keeps a
#: signal ignored if it was, as it is in a job CI starts in the background (a ``preexec_fn``
#: would do it between fork and exec, which Python warns against in a threaded process).
_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _ddm_up_process() -> tuple[subprocess.Popen[str], str, list[str]]:
    """`ddm up` (the MNIST DDM) as a user runs it from a terminal (Ctrl-C's SIGINT not
    ignored, as it is for a job CI starts in the background), its output piped here, once it
    says it is up: the process, what it said, and its five children (four experts, router)."""
    command = subprocess.Popen([sys.executable, "-c", _FROM_A_TERMINAL, "-m", "ddm", "up",
                                "--port", str(free_port())],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert command.stdout is not None
    lines = []
    for line in command.stdout:  # the command says when it is up; no sleeping
        lines.append(line)
        if "is up" in line:
            break
    assert command.poll() is None, "".join(lines)
    children = subprocess.run(["pgrep", "-P", str(command.pid)], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 5, "".join(lines)
    return command, "".join(lines), children


def _running(pids: list[str]) -> list[str]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()
            and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]


def test_ddm_up_reports_progress_and_ends_terminated_143_on_sigterm() -> None:
    """`kill` of the command, not only Ctrl-C, must leave no server behind, and say it was
    terminated with the status a shell expects of it (143, not Ctrl-C's), so that `make demo`
    stopped by a service manager is not reported as interrupted. On its way up it names each
    process as it starts and as it becomes ready."""
    command, up, children = _ddm_up_process()
    names = [f"mnist-cluster-{k}/0" for k in range(4)] + ["router"]
    for name in names:
        assert f"started {name} (pid " in up and f"{name} is ready (" in up, up
    command.send_signal(signal.SIGTERM)
    assert command.stdout is not None
    rest = command.stdout.read()
    assert command.wait(timeout=60) == 143, up + rest
    assert "stopping 5 process(es)..." in rest and "ddm: terminated (SIGTERM)" in rest, rest
    # the last line before the exit's confirms that nothing is left running
    assert rest.rstrip().splitlines()[-2:] == ["all 5 process(es) stopped",
                                               "ddm: terminated (SIGTERM)"], rest
    assert _running(children) == []


def test_a_second_sigterm_while_ddm_up_stops_leaves_no_server_behind() -> None:
    """A service manager, or `timeout` forwarding its own, may send SIGTERM again while the
    servers stop: the stop goes on to the end."""
    command, _, children = _ddm_up_process()
    command.send_signal(signal.SIGTERM)
    assert command.stdout is not None
    said = []
    for line in command.stdout:  # the stop has begun; no sleeping
        said.append(line)
        if line.startswith("stopping 5 process(es)"):
            break
    command.send_signal(signal.SIGTERM)
    rest = "".join(said) + command.stdout.read()
    assert command.wait(timeout=60) == 143, rest
    assert "all 5 process(es) stopped" in rest, rest
    assert _running(children) == []


def test_ddm_up_piped_to_a_reader_that_ctrl_c_ended_first_still_stops_every_server() -> None:
    """Ctrl-C on `ddm up | tee log` ends tee too, so `ddm up` shuts down with nobody reading
    its output: saying so must not keep it from stopping its servers (they run in their own
    sessions, out of the terminal's reach, and would be left holding their ports)."""
    command, _, children = _ddm_up_process()
    assert command.stdout is not None
    command.stdout.close()  # the reader is gone
    command.send_signal(signal.SIGINT)
    command.wait(timeout=60)
    survivors = _running(children)
    for pid in survivors:  # not left running for the tests after this one
        os.killpg(int(pid), signal.SIGKILL)
    assert survivors == []


def test_ddm_up_says_why_an_expert_could_not_start(tmp_path: Path) -> None:
    """A corrupt checkpoint: the expert exits 1, and ddm up reports its termination message."""
    import shutil

    from ddm.runtime.local import LocalRunError

    broken = tmp_path / "expert-0-4"
    shutil.copytree(EXAMPLE.parents[1] / "checkpoints" / "digits" / "expert-0-4", broken)
    weights = bytearray((broken / "weights.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (broken / "weights.safetensors").write_bytes(bytes(weights))
    text = EXAMPLE.read_text().replace("image:///opt/ddm/checkpoints/digits/expert-0-4",
                                       f"file://{broken}")
    (tmp_path / "digits.yaml").write_text(text)
    log = io.StringIO()
    with pytest.raises(LocalRunError) as caught:
        run_local(load_manifest(tmp_path / "digits.yaml"), router_port=free_port(), out=log)
    message = str(caught.value)
    assert message.startswith("digits-0-4/0 exited with status 1 before it was ready: "), message
    assert f"checkpoint {broken}: weights.safetensors is corrupt (sha256" in message, message



def _generate(url: str, label: int, steps: int = 2) -> httpx.Response:
    return httpx.post(f"{url}/v1/generate", timeout=60,
                      json={"labels": [label], "steps": steps, "seed": 0})


def test_ddm_up_runs_a_manifest_with_300_steps(tmp_path: Path) -> None:
    """The CRD allows 1000 steps; the router ddm up starts must allow the DDM's own default."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["sampling"]["steps"] = 300
    (tmp_path / "steps.yaml").write_text(yaml.safe_dump(document))
    with _ddm_up(tmp_path / "steps.yaml") as (plan, log, _):
        info = httpx.get(f"{plan.url}/v1/info", timeout=30).json()
        assert info["limits"]["max_steps"] == 300, info
        answer = httpx.post(f"{plan.url}/v1/generate", timeout=300, json={"labels": [7]})
        assert answer.status_code == 200, answer.text + log.getvalue()[-2000:]
        assert len(answer.json()["images"]) == 1


def test_a_killed_expert_is_restarted_and_meanwhile_the_router_names_it() -> None:
    """Kill an expert under ddm up: requests that need it get a 503 naming it, the other
    expert keeps serving, and it comes back without anyone restarting it."""
    with _ddm_up(EXAMPLE, deadline_s=1.0) as (plan, log, _):
        assert _generate(plan.url, 1).status_code == 200
        expert = next(p for p in plan.experts if p.name.startswith("digits-0-4"))
        pid = listening_pid(expert.port)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        answers = []
        while True:  # each request waits at most the router's 1 s deadline
            answers.append(_generate(plan.url, 1))
            if answers[-1].status_code == 200 and len(answers) > 1:
                break
            assert len(answers) < 300, f"{answers[-1].text}\n{log.getvalue()[-3000:]}"
        unavailable = [a for a in answers if a.status_code == 503]
        print(f"\nexpert killed: {len(unavailable)} answers 503 naming it, served again "
              f"{time.monotonic() - killed:.1f} s after the kill")
        assert unavailable, [a.status_code for a in answers]
        assert all("digits-0-4" in a.json()["detail"] for a in unavailable), unavailable[0].text
        assert {a.status_code for a in answers} <= {200, 503}
        assert _generate(plan.url, 7).status_code == 200  # the other expert never stopped
        restarted = listening_pid(expert.port)
        assert restarted is not None and restarted != pid
        text = log.getvalue()
        assert f"{expert.name} exited with status -9" in text, text[-3000:]
        assert f"restarted {expert.name}" in text, text[-3000:]


def test_with_fail_fast_a_dead_expert_stops_everything() -> None:
    with _ddm_up(EXAMPLE, fail_fast=True) as (plan, log, outcome):
        expert = plan.experts[0]
        pid = listening_pid(expert.port)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not outcome:  # run_local returns once it has stopped the others
            assert time.monotonic() < deadline, log.getvalue()[-3000:]
            threading.Event().wait(0.1)
    assert outcome == [1]
    assert f"{expert.name} exited with status -9" in log.getvalue()
    for spec in (*plan.experts, plan.router):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", spec.port)) != 0, f"{spec.name} still listens"


def test_with_auth_ddm_up_experts_answer_only_the_token_the_router_presents(
        tmp_path: Path) -> None:
    """A manifest asking for a token (``router.auth``): ddm up writes a random one to a
    private file, the router requires it, and its experts (reached directly on loopback)
    answer only a caller presenting another random token, in a private file of its own, that
    the router presents (the public token included gets 401), as the operator's pods do;
    generations still work. Every process serves /metrics on the port ddm up printed, and
    not on its API port."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["router"]["auth"] = {}
    (tmp_path / "auth.yaml").write_text(yaml.safe_dump(document))
    with _ddm_up(tmp_path / "auth.yaml") as (plan, log, _):
        tokens = []
        for path in (plan.token_file, plan.expert_token_file):
            assert path is not None and path.stat().st_mode & 0o077 == 0
            tokens.append(path.read_text().strip())
            assert len(tokens[-1]) >= 43 and tokens[-1] not in log.getvalue()
            assert str(path) in log.getvalue()  # ddm up says where it is
        token, expert_token = tokens
        assert token != expert_token
        bearer = {"Authorization": f"Bearer {token}"}
        expert_bearer = {"Authorization": f"Bearer {expert_token}"}
        velocity = {"content-type": CONTENT_TYPE}
        for expert, label in zip(plan.experts, (0, 5)):  # digits-0-4, digits-5-9
            base = f"http://127.0.0.1:{expert.port}"
            call = velocity_call(
                1, np.zeros((1, 1, 16, 16), np.float32), np.full(1, 0.5, np.float32),
                np.full(1, label, np.int64))
            for headers, status in (({}, 401), ({"Authorization": "Bearer guessed"}, 401),
                                    (bearer, 401), (expert_bearer, 200)):
                answer = send(lambda body: httpx.post(
                    f"{base}/v1/velocity", content=body, headers={**velocity, **headers},
                    timeout=30), call)
                assert answer.status_code == status, (expert.name, headers, answer.text)
            assert httpx.get(f"{base}/v1/info", timeout=30).status_code == 401
            assert httpx.get(f"{base}/readyz", timeout=30).status_code == 200  # probes open
        for process in (plan.router, *plan.experts):  # /metrics apart from the API, open
            scrape = f"http://127.0.0.1:{process.metrics_port}/metrics"
            assert scrape in log.getvalue()
            assert httpx.get(scrape, timeout=30).status_code == 200
            assert httpx.get(f"http://127.0.0.1:{process.port}/metrics",
                             timeout=30).status_code == 404
        assert _generate(plan.url, 3).status_code == 401
        answer = httpx.post(f"{plan.url}/v1/generate", timeout=60, headers=bearer,
                            json={"labels": [3, 8], "steps": 4, "seed": 0})
        assert answer.status_code == 200, answer.text + log.getvalue()[-2000:]
        assert answer.json()["experts"] == [["digits-0-4"], ["digits-5-9"]]
