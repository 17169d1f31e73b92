"""``ddm train-all``: a DDMTraining's plan run as local processes (torchrun, the JAX job's
variables), its experts checked by ``ddm expert check``, its DDMDeployment loaded; a rerun
after a stop resumes each unfinished job and skips finished ones."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
import yaml

from ddm.checkpoints.format import read_meta
from ddm.cli import main
from ddm.deploy.spec import load_manifest
from ddm.deploy.training_spec import parse_training_manifest
from ddm.runtime.training import TrainingRunError, run_training

pytestmark = [pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "training.yaml"


@pytest.fixture(autouse=True)
def loopback_gloo(monkeypatch):
    """gloo's collectives on the loopback interface (the processes inherit it)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def _test_sized(tmp_path: Path, **expert) -> Path:
    """examples/training.yaml at the smoke UNet's size (150 steps of 32 pass ``ddm expert
    check``'s behaviour check), written to a file."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["output"]["uri"] = f"file://{tmp_path}/out"
    for entry in document["spec"]["experts"]:
        entry.update(model="smoke", steps=150, batchSize=32, seed=3, **expert)
        entry.pop("resources")
    document["spec"]["router"] = {"steps": 20, "batchSize": 32, "processesPerNode": 2}
    path = tmp_path / "training.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_train_all_runs_the_plan_then_its_experts_pass_the_check(tmp_path, capsys):
    path = _test_sized(tmp_path)
    assert main(["train-all", str(path)]) == 0
    said = capsys.readouterr().out
    assert "expert-digits-0-4: started (2 processes, 150 steps)" in said
    # the router network trains beside the experts: started with them, not after
    assert "router: started (2 processes, 20 steps)" in said
    assert said.index("router: started") < min(said.index(f"expert-digits-{part}: finished")
                                               for part in ("0-4", "5-9"))
    deployment = load_manifest(tmp_path / "out" / "deployment.yaml")
    assert deployment.name == "digits-trained"
    for expert in deployment.spec.experts:
        directory = Path(expert.checkpoint.path)
        assert read_meta(directory).training["world_size"] == 2
        assert main(["expert", "check", str(directory)]) == 0, capsys.readouterr().out
    assert deployment.spec.router.checkpoint.uri == f"file://{tmp_path}/out/router"
    assert read_meta(tmp_path / "out" / "router").kind == "router"


class _StopAtFirstSave(io.StringIO):
    """The run's output, which sets ``stop`` once a job reports a saved step."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__()
        self.stop = stop

    def write(self, text: str) -> int:
        if " saved" in text:
            self.stop.set()
        return super().write(text)


def test_a_stopped_run_resumes_where_it_was_saved_and_skips_what_finished(tmp_path):
    path = _test_sized(tmp_path, framework="torch", processesPerNode=1)
    document = yaml.safe_load(path.read_text())
    for entry in document["spec"]["experts"]:
        entry.update(steps=600, saveEvery=5)
    manifest = parse_training_manifest(document, allow_host_paths=True)
    stop = threading.Event()
    first = _StopAtFirstSave(stop)
    with pytest.raises(TrainingRunError, match="stopped; rerun to resume"):
        run_training(manifest, stop=stop, out=first)
    assert not (tmp_path / "out" / "experts" / "digits-0-4" / "config.json").exists()

    second = io.StringIO()
    run_training(manifest, out=second)
    assert "resuming from step" in second.getvalue(), first.getvalue() + second.getvalue()
    assert read_meta(tmp_path / "out" / "experts" / "digits-0-4").training["steps"] == 600

    third = io.StringIO()
    run_training(manifest, out=third)
    assert third.getvalue().count("finished before") == 3
    assert "started" not in third.getvalue()


def _mnist_objects(tmp_path: Path) -> dict[str, bytes]:
    """Tiny MNIST as LeCun distributes it (four .gz files), keyed under ``mnist/``."""
    import gzip

    from ddm.data.mnist import DISTRIBUTED_FILES
    from tests.support.bars_mnist import write_bars_mnist

    raw = tmp_path / "mnist-raw"
    for part in ("train", "t10k"):
        write_bars_mnist(raw, part)
    return {f"mnist/{name}": gzip.compress((raw / name.removesuffix(".gz")).read_bytes(),
                                           mtime=0) for name in DISTRIBUTED_FILES}


def test_train_all_fetches_mnist_from_a_store_and_uploads_what_the_deployment_reads(
        tmp_path, capsys, no_cloud_credentials, monkeypatch):
    """MNIST in S3, the checkpoints to S3 (moto on loopback, IAM on): the data job fetches
    once, each job uploads, the DDMDeployment pins the archives, which fetch back verified;
    a rerun skips every job."""
    pytest.importorskip("moto", reason="moto[server] is in the dev extra")
    from tests.support.s3_store import moto_bucket

    path = _test_sized(tmp_path, framework="torch", processesPerNode=1)
    document = yaml.safe_load(path.read_text())
    for entry in document["spec"]["experts"]:
        entry.update(steps=4, batchSize=8)
    work = tmp_path / "work"
    document["spec"].update(
        data={"dataset": "mnist", "uri": "s3://ddm/mnist"},
        output={"uri": "s3://ddm/runs/1", "volume": f"file://{work}"},
        router={"steps": 2, "batchSize": 8})
    path.write_text(yaml.safe_dump(document))
    with moto_bucket("ddm", _mnist_objects(tmp_path)) as bucket:
        for name, value in (("AWS_ENDPOINT_URL", bucket.url),
                            ("AWS_ACCESS_KEY_ID", bucket.writer[0]),
                            ("AWS_SECRET_ACCESS_KEY", bucket.writer[1]),
                            ("DDM_FETCH_ALLOW_NETWORKS", "127.0.0.1/32")):
            monkeypatch.setenv(name, value)
        assert main(["train-all", str(path)]) == 0
        said = capsys.readouterr().out
        assert "data: started" in said and "expert-digits-0-4: started" in said
        assert "uploaded" in said and (work / "data" / "train-images-idx3-ubyte.gz").is_file()
        deployment = load_manifest(work / "deployment.yaml")
        pinned = {e.name: (e.checkpoint.uri, e.fetch.sha256) for e in deployment.spec.experts}
        router = deployment.spec.router
        pinned["router"] = (router.checkpoint.uri, router.fetch.sha256)
        assert pinned["router"][0] == "s3://ddm/runs/1/router.tar.gz"
        keys = bucket.credentials_file(tmp_path / "reader", bucket.reader)
        for name, (uri, sha256) in pinned.items():
            dest = tmp_path / "fetched" / name
            assert sha256 and main([
                "fetch-checkpoint", uri, str(dest), "--sha256", sha256, "--allow-network",
                "127.0.0.1/32", "--store-credentials-file", str(keys)]) == 0
            assert read_meta(dest).kind == ("router" if name == "router" else "expert")
        assert main(["train-all", str(path)]) == 0
        assert capsys.readouterr().out.count("finished before") == 4


TEXT2IMG_EXAMPLE = EXAMPLE.with_name("training-text2img.yaml")


def test_train_all_trains_the_text2img_ddm_from_coloured_mnist(tmp_path, capsys):
    """examples/training-text2img.yaml at the smoke size, two steps per trained stage and two
    clusters, on the real MNIST files: every stage runs as its job, the experts, the router
    network and its text prior side by side; the imported DDM loads and draws an image."""
    from ddm.models.ddm import load_ddm
    from ddm.sampling.pipeline import generate_text
    from tests.mnist_data import mnist_dir

    document = yaml.safe_load(TEXT2IMG_EXAMPLE.read_text())
    spec = document["spec"]
    spec["data"]["uri"] = f"file://{mnist_dir()}"
    spec["output"]["uri"] = f"file://{tmp_path}/out"
    spec["text2img"] = {"clusters": 2, "size": "smoke",
                        "steps": {"clip": 2, "vae": 2, "expert": 2, "router": 2}}
    spec["deployment"]["spec"]["experts"] = [{"name": "expert-1", "framework": "jax"}]
    path = tmp_path / "training.yaml"
    path.write_text(yaml.safe_dump(document))

    assert main(["train-all", str(path)]) == 0
    said = capsys.readouterr().out
    assert "router: started (1 process, 2 steps, after latents)" in said
    assert said.index("router: started") < min(said.index(f"expert-{k}: finished")
                                               for k in (0, 1))
    assert "ddm-progress step 2/2" in said  # the trained stages log their progress
    deployment = load_manifest(tmp_path / "out" / "deployment.yaml")
    assert deployment.name == "text2img-trained"
    assert [(e.name, e.framework, e.checkpoint.uri) for e in deployment.spec.experts] == [
        (f"expert-{k}", framework, f"file://{tmp_path}/out/ddm/expert_{k}")
        for k, framework in enumerate(("torch", "jax"))]
    assert deployment.spec.router.checkpoint.uri == f"file://{tmp_path}/out/ddm/router"

    ddm = load_ddm(tmp_path / "out" / "ddm")
    images = generate_text(ddm, ["a red 3"], steps=2, seed=0, strategy="top1").images
    assert images.shape == (1, 32, 32, 3)
