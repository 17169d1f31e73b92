"""Fixtures shared by every test: tiny real checkpoints and a real local control plane.

There are no trained checkpoints in the repository's tests, so these are random-init ``smoke``
UNets written with the real checkpoint format; the format is framework-neutral, so the JAX one
differs only in the framework it records.

The dev cluster fixtures run a real local control plane (``ddm_devcluster``) for the session,
with fake nodes only (tests/e2e/conftest.py makes the one with a real node).

``dev_cluster`` finds or builds the binaries (the first build takes 7 to 12 minutes and is
cached in ``$DDM_KUBE_CACHE``; ``DDM_DEV_CLUSTER_BUILD=0`` forbids building), starts a fresh
cluster in a temporary directory and always stops it. Without binaries it skips, except
under CI (``CI`` set), where it fails. Tests that use it are marked ``cluster``
(``pytest -m "not cluster"`` leaves them out; ``make test-fast`` leaves out ``cluster``, ``e2e``,
``image`` and ``slow``). A failed test that used a dev cluster reports
the tails of its real node's logs.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddm.checkpoints.format import CheckpointMeta, save_checkpoint
from ddm_devcluster import BuildError, ClusterInfo, down, ensure_binaries, up
from ddm_devcluster.components import Layout
from ddm_devcluster.processes import log_tail
from ddm.models.config import UNET_CONFIGS

# torch.compile's kernels (tests/integration/test_compiled_members.py) are built once per
# machine, not once per run: inductor's cache under ~/.cache, as CI keeps it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path.home() / ".cache" / "ddm" / "torchinductor"))

#: The classes the smoke experts serve (of the smoke config's 10).
SMOKE_CLASSES = (0, 1, 2, 3, 4)


def _smoke_expert(directory: Path, framework: str) -> Path:
    import torch

    from ddm.models.torch_io import canonical_weights
    from ddm.models.torch_unet import UNet

    config = UNET_CONFIGS["smoke"]
    torch.manual_seed(0)
    groups = [list(SMOKE_CLASSES), [5, 6, 7, 8, 9]]
    meta = CheckpointMeta(kind="expert", name=f"smoke-{framework}",
                          architecture=config.to_dict(), framework=framework,
                          classes=SMOKE_CLASSES,
                          partition={"scheme": {"method": "labels", "groups": groups},
                                     "index": 0})
    return save_checkpoint(directory, meta, canonical_weights(UNet(config)))


#: What botocore's credential chain reads from the environment (ddm.checkpoints.credentials).
_AWS_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_STS",
    "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")


@pytest.fixture(autouse=True)
def termination_log(tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the CLI leaves its termination message (never the host's /dev: every failing
    command writes one, servers and training commands alike)."""
    path = tmp_path_factory.mktemp("termination") / "message"
    monkeypatch.setenv("DDM_TERMINATION_LOG", str(path))
    return path


#: What ``ddm.threads.apply_cpu_thread_policy`` sets for the whole process.
_THREAD_POLICY_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "XLA_FLAGS")


@pytest.fixture(autouse=True)
def cpu_thread_policy_undone() -> Iterator[None]:
    """A test that runs the CLI in-process (``main([...])``) sets the CPU thread policy for the
    whole worker (variables and torch's pool, chosen from the machine's load at that moment);
    undone after it, so that no later test depends on which ran before it, or on the load
    then."""
    saved = {name: os.environ.get(name) for name in _THREAD_POLICY_VARIABLES}
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def no_cloud_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path_factory) -> None:
    """Clouds' credential chains that find nothing and ask no metadata server: no keys in the
    environment, config files that do not exist, the instance metadata service off."""
    for name in _AWS_CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    nowhere = tmp_path_factory.mktemp("no-cloud-config")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(nowhere / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(nowhere / "gcloud"))


@pytest.fixture(scope="session")
def smoke_expert_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init ``smoke`` expert recorded as trained with PyTorch (classes 0-4)."""
    return _smoke_expert(tmp_path_factory.mktemp("ckpt") / "smoke-torch", "torch")


@pytest.fixture(scope="session")
def smoke_jax_expert_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same ``smoke`` expert recorded as trained with JAX (classes 0-4)."""
    return _smoke_expert(tmp_path_factory.mktemp("ckpt") / "smoke-jax", "jax")


# ------------------------------------------------------------------ the dev cluster

E2E = Path(__file__).parent / "e2e"


#: The fixtures that start a dev cluster (the second one with a real node).
CLUSTER_FIXTURES = ("dev_cluster", "real_node_cluster")
TESTS = Path(__file__).parent
#: Modules every test of which is ``slow``, and why: ``make test-fast`` leaves them to ``make
#: test`` (which runs everything), so that the quick lane stays within a few minutes.
SLOW_MODULES = {
    "integration/test_local_runtime.py": "ddm up: five processes per test, minutes each",
    "integration/test_hostile_ddm_up.py": "ddm up under 600 slow connections",
    "integration/test_byo_ddm.py": "trains a DiT, then serves it with ddm up",
    "integration/test_expert_server.py": "expert processes, SIGTERM and drain timings",
    "integration/test_expert_check.py": "ddm expert check runs every check on real experts",
    "integration/test_scale_to_zero.py": "ddm up starting and stopping experts on demand",
    "integration/test_untrusted_programs.py": "torch.export programs loaded in subprocesses",
    "integration/test_shipped_mnist.py": "the full-size MNIST experts in both frameworks",
    "integration/test_text2img_served.py": "ddm up of the shipped text2img, 20 generations",
    "unit/test_flax_pixart.py": "compiles Flax PixArt transformers against diffusers'",
    "unit/test_text2img_stages.py": "trains the text-to-image stages",
    "unit/test_paris_in_process.py": "the Paris pipeline in-process, many guided steps",
    "unit/test_ema_warmup.py": "trains with both frameworks (JAX compiles for a minute)",
    "unit/test_flax_unet.py": "compiles and trains Flax UNets",
    "unit/test_paris_reference.py": "the Paris reference pipeline end to end",
    "unit/test_evaluation.py": "trains a classifier, writes and resumes reports",
    "unit/test_training.py": "trains experts and routers",
    "unit/test_resume.py": "interrupted and resumed training runs, both frameworks",
    "unit/test_objective_training.py": "trains epsilon experts with both frameworks",
    "unit/test_checkov.py": "runs checkov over the chart",
    "unit/test_chart.py": "renders the chart with helm, once per case",
    "unit/test_packaging.py": "builds the wheels",
}


#: The xdist group (``--dist loadgroup``) of every test that uses a dev cluster, the real node
#: or buildah's image cache: one worker runs them all, in order, so that two clusters never run
#: side by side (the e2e package's is stopped before the integration tests' starts) and two
#: image builds never share the cache at once.
CLUSTER_GROUP = "dev-cluster"
_MACHINE_WIDE = ("cluster", "e2e", "image")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``cluster``: the test uses a dev cluster; ``e2e``: it is one of tests/e2e (the real node
    and the images); ``slow``: its module is one of :data:`SLOW_MODULES`. ``make test-fast``
    leaves the three out. Each test's xdist group is :data:`CLUSTER_GROUP` where it uses
    something of the whole machine, else its file (whose module fixtures are then made once)."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in CLUSTER_FIXTURES):
            item.add_marker(pytest.mark.cluster)
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.e2e)
        if item.path.is_relative_to(TESTS) and (
                item.path.relative_to(TESTS).as_posix() in SLOW_MODULES):
            item.add_marker(pytest.mark.slow)
        machine_wide = any(item.get_closest_marker(name) for name in _MACHINE_WIDE)
        item.add_marker(pytest.mark.xdist_group(CLUSTER_GROUP if machine_wide
                                                else item.nodeid.partition("::")[0]))


#: The logs a failed test on a dev cluster reports (those of the real node, when it has one).
NODE_LOGS = ("kubelet", "containerd", "kube-proxy", "cluster-dns")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[pytest.TestReport]:
    """A failed test that used a dev cluster reports its real node's logs: the cluster's
    temporary directory may be gone by the time someone looks."""
    report = yield
    if report.failed and report.when == "call":
        clusters = [v for v in getattr(item, "funcargs", {}).values()
                    if isinstance(v, ClusterInfo)]
        for info in dict.fromkeys(clusters):
            for component in NODE_LOGS:
                log = Layout(info.state_dir).log_file(component)
                if log.is_file():
                    report.sections.append((f"{component} log ({log})", log_tail(log, 40)))
    return report


@pytest.fixture(scope="session")
def dev_cluster(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[ClusterInfo]:
    """A running dev cluster (admin credentials); stopped when the session ends."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # show build and start-up progress live
        try:
            binaries = ensure_binaries(allow_build=os.environ.get("DDM_DEV_CLUSTER_BUILD") != "0")
        except BuildError as error:
            message = f"no Kubernetes control-plane binaries: {error}"
            if os.environ.get("CI"):
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        state_dir = tmp_path_factory.mktemp("dev-cluster")
        # The control plane and fake nodes only: the operator's integration tests watch pods
        # stay Pending; tests/e2e has its own cluster with the real node.
        info = up(state_dir, binaries=binaries, real_node=False)  # stops what it started on error
    try:
        yield info
    finally:
        down(state_dir)


@pytest.fixture(scope="session")
def kube_client(dev_cluster: ClusterInfo) -> Iterator[Any]:
    """A ``kubernetes.client.ApiClient`` logged in as the dev cluster's admin."""
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def kube_namespace(kube_client: Any) -> str:
    """A fresh namespace for one test (left behind: the session's cluster is thrown away).

    Pods on the fake nodes are never run nor finalised (no kubelet), so deleting a namespace
    that has some would never finish; the cluster is deleted as a whole instead.
    """
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(kube_client).create_namespace({"metadata": {"name": name}})
    return name


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """PyTorch on one thread for a module's tests (opt in with ``pytestmark``): the models and
    in-process servers share two cores with everything else."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
