"""Frechet distance known answers, the held-out digit classifier, and samples files."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import torch

from ddm.checkpoints.format import CheckpointError, CheckpointMeta, load_checkpoint, save_checkpoint
from ddm.convention import to_model_space, to_uint8
from ddm.data import Dataset, load_dataset
from ddm.evaluation.classifier import (Classifier, ClassifierConfig, ClassifierNet,
                                       load_classifier, save_classifier, train_classifier)
from ddm.evaluation.evaluate import evaluate_samples
from ddm.evaluation.frechet import frechet_distance, frechet_distance_from_stats
from ddm.progress import JobProgress, progress_bar
from ddm.samples import SamplesFileError, load_samples_npz

#: The small 16x16 DDM: the report's tests name it (the default is the MNIST DDM).
DIGITS = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"

# --- Frechet distance --------------------------------------------------------------------

def test_frechet_identical_sets_is_zero() -> None:
    feats = np.random.default_rng(0).standard_normal((200, 8))
    assert frechet_distance(feats, feats) == pytest.approx(0.0, abs=1e-9)


def test_frechet_shifted_means_is_squared_shift() -> None:
    feats = np.random.default_rng(1).standard_normal((300, 5))
    shift = np.array([1.0, -2.0, 0.5, 0.0, 3.0])
    assert frechet_distance(feats, feats + shift) == pytest.approx(shift @ shift, rel=1e-9)


def test_frechet_diagonal_covariances_closed_form() -> None:
    var_a, var_b = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.0])
    mu_a, mu_b = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0])
    expected = ((mu_a - mu_b) ** 2).sum() + ((np.sqrt(var_a) - np.sqrt(var_b)) ** 2).sum()
    got = frechet_distance_from_stats(mu_a, np.diag(var_a), mu_b, np.diag(var_b))
    assert got == pytest.approx(expected, rel=1e-12)


def test_frechet_is_finite_for_rank_deficient_covariances() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((5, 20)), rng.standard_normal((6, 20))  # N < D: singular
    fd = frechet_distance(a, b)
    assert np.isfinite(fd) and fd >= 0.0
    assert fd == pytest.approx(frechet_distance(b, a), rel=1e-6)


@pytest.mark.parametrize("a, b, problem", [
    (np.zeros((4, 3)), np.zeros((4, 2)), "feature dimensions differ"),
    (np.zeros((1, 3)), np.zeros((4, 3)), "N >= 2"),
    (np.full((4, 3), np.nan), np.zeros((4, 3)), "NaN"),
])
def test_frechet_rejects_bad_inputs(a: np.ndarray, b: np.ndarray, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        frechet_distance(a, b)


# --- classifier --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """On a small shared CPU, torch's two-thread kernels thrash; one thread is 4x faster here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits_train() -> Dataset:
    return load_dataset("digits", 16, "train")


@pytest.fixture(scope="module")
def classifier_weights(single_thread: None) -> dict[str, np.ndarray]:
    heldout = load_dataset("digits", 16, "heldout")
    return train_classifier(heldout.images, heldout.labels, ClassifierConfig(image_size=16),
                            steps=200, seed=0)


def _uint8(ds: Dataset) -> np.ndarray:
    return to_uint8(to_model_space(ds.images))[:, 0]


def test_classifier_trained_on_heldout_classifies_train_split(
        classifier_weights: dict[str, np.ndarray], digits_train: Dataset) -> None:
    classifier = Classifier.from_weights(ClassifierConfig(image_size=16), classifier_weights)
    accuracy = (classifier.predict(_uint8(digits_train)) == digits_train.labels).mean()
    assert accuracy >= 0.9
    features = classifier.features(_uint8(digits_train)[:7])
    assert features.shape == (7, 64) and features.dtype == np.float64


def test_training_is_deterministic_given_seed(single_thread: None, digits_train: Dataset) -> None:
    def train(seed: int) -> dict[str, np.ndarray]:
        return train_classifier(digits_train.images[:64], digits_train.labels[:64],
                                ClassifierConfig(image_size=16), 2, seed)

    a, b, c = train(5), train(5), train(6)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)


def test_net_handles_32px_images() -> None:
    logits, features = ClassifierNet(ClassifierConfig(image_size=32))(torch.zeros(2, 1, 32, 32))
    assert logits.shape == (2, 10) and features.shape == (2, 64)


def test_save_load_round_trip_and_checks(tmp_path: Path, classifier_weights: dict[str, np.ndarray],
                                         digits_train: Dataset) -> None:
    config = ClassifierConfig(image_size=16)
    path = save_classifier(tmp_path / "clf", config, classifier_weights,
                           data={"source": "digits", "split": "heldout"})
    loaded = load_classifier(path)
    images = _uint8(digits_train)[:50]
    original = Classifier.from_weights(config, classifier_weights)
    np.testing.assert_array_equal(loaded.predict(images), original.predict(images))
    assert load_checkpoint(path).meta.kind == "classifier"

    wrong_arch = CheckpointMeta(kind="classifier", name="c", framework="torch", classes=range(10),
                                architecture={**config.to_dict(), "feature_dim": 32})
    save_checkpoint(tmp_path / "wrong", wrong_arch, classifier_weights)
    with pytest.raises(CheckpointError, match=r"body.9.weight has shape \(64, 1024\)"):
        load_classifier(tmp_path / "wrong")
    unknown_key = CheckpointMeta(kind="classifier", name="c", framework="torch", classes=range(10),
                                 architecture={**config.to_dict(), "depth": 3})
    save_checkpoint(tmp_path / "unknown", unknown_key, classifier_weights)
    with pytest.raises(CheckpointError, match="unknown keys: depth"):
        load_classifier(tmp_path / "unknown")
    router = CheckpointMeta(kind="router", name="r", framework="torch", classes=range(10),
                            architecture={})
    save_checkpoint(tmp_path / "router", router, classifier_weights)
    with pytest.raises(CheckpointError, match="is a router, not a classifier"):
        load_classifier(tmp_path / "router")


def test_classifier_rejects_wrong_inputs(classifier_weights: dict[str, np.ndarray]) -> None:
    classifier = Classifier.from_weights(ClassifierConfig(image_size=16), classifier_weights)
    with pytest.raises(TypeError, match="uint8"):
        classifier.predict(np.zeros((2, 16, 16), np.float32))
    with pytest.raises(ValueError, match=r"expects images \(N, 16, 16\)"):
        classifier.predict(np.zeros((2, 32, 32), np.uint8))


def test_evaluate_samples_reports_metrics(classifier_weights: dict[str, np.ndarray],
                                          digits_train: Dataset) -> None:
    classifier = Classifier.from_weights(ClassifierConfig(image_size=16), classifier_weights)
    images, labels = _uint8(digits_train), digits_train.labels
    report = evaluate_samples(images[:300], labels[:300], classifier, images[300:])
    assert report["n"] == 300 and report["n_reference"] == len(images) - 300
    assert report["accuracy"] >= 0.9 and report["fd"] > 0.0
    assert set(report["per_class_accuracy"]) == {str(c) for c in np.unique(labels[:300])}
    assert json.loads(json.dumps(report)) == report
    noise = np.random.default_rng(0).integers(0, 256, (300, 16, 16), dtype=np.uint8)
    assert evaluate_samples(noise, labels[:300], classifier, images[300:])["fd"] > report["fd"]
    with pytest.raises(ValueError, match="one label per image"):
        evaluate_samples(images[:10], labels[:9], classifier, images)


# --- samples files -----------------------------------------------------------------------

def _arrays(n: int = 4, **override: np.ndarray) -> dict[str, np.ndarray]:
    arrays = {"images": np.zeros((n, 16, 16), np.uint8), "labels": np.arange(n, dtype=np.int32)}
    return {**arrays, **override}


def test_load_samples_npz_reads_valid_files(tmp_path: Path) -> None:
    np.savez(tmp_path / "plain.npz", **_arrays())
    samples = load_samples_npz(tmp_path / "plain.npz")
    assert samples.images.shape == (4, 16, 16) and samples.labels.dtype == np.int64
    assert samples.expert_calls is None
    np.savez_compressed(tmp_path / "calls.npz", **_arrays(expert_calls=np.full(4, 20)))
    np.testing.assert_array_equal(load_samples_npz(tmp_path / "calls.npz").expert_calls, 20)


@pytest.mark.parametrize("arrays, problem", [
    (_arrays(images=np.zeros((4, 16, 16), np.float32)),
     "images must be uint8 .N, H, W., got float32"),
    (_arrays(images=np.zeros((4, 1, 16, 16), np.uint8)), "images must be uint8 .N, H, W."),
    (_arrays(labels=np.arange(3)), r"labels must be integers of shape \(4,\)"),
    (_arrays(labels=np.zeros(4)), "labels must be integers .* got float64"),
    (_arrays(labels=np.array([0, -1, 2, 3])), "labels must be non-negative"),
    (_arrays(expert_calls=np.ones((4, 2), np.int64)), "expert_calls must be integers"),
    ({"images": np.zeros((4, 16, 16), np.uint8)}, r"missing keys \['labels'\]"),
    (_arrays(extra=np.zeros(4)), r"unknown keys \['extra'\]"),
])
def test_load_samples_npz_rejects_bad_contents(tmp_path: Path, arrays: dict[str, np.ndarray],
                                               problem: str) -> None:
    np.savez(tmp_path / "s.npz", **arrays)
    with pytest.raises(SamplesFileError, match=problem):
        load_samples_npz(tmp_path / "s.npz")


def test_load_samples_npz_rejects_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(SamplesFileError, match="does not exist"):
        load_samples_npz(tmp_path / "absent.npz")
    (tmp_path / "junk.npz").write_bytes(b"definitely not numpy")
    with pytest.raises(SamplesFileError, match="junk.npz is not a .npz file"):
        load_samples_npz(tmp_path / "junk.npz")
    np.savez(tmp_path / "whole.npz", **_arrays())
    (tmp_path / "cut.npz").write_bytes((tmp_path / "whole.npz").read_bytes()[:200])
    with pytest.raises(SamplesFileError, match="cut.npz"):
        load_samples_npz(tmp_path / "cut.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(SamplesFileError, match="single .npy array: expected a .npz"):
        load_samples_npz(tmp_path / "single.npy")
    with zipfile.ZipFile(tmp_path / "objects.npz", "w") as archive:
        with archive.open("images.npy", "w") as member:
            np.save(member, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        with archive.open("labels.npy", "w") as member:
            np.save(member, np.arange(1))
    with pytest.raises(SamplesFileError, match="corrupt array"):
        load_samples_npz(tmp_path / "objects.npz")


# --- the report --------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def cache_home(tmp_path_factory, monkeypatch) -> Path:
    """``ddm report`` caches by default under the user's cache directory: a fresh one."""
    home = tmp_path_factory.mktemp("cache-home")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _job(log: Callable[[str], None], clock: Callable[[], float] | None = None) -> JobProgress:
    """A report's progress as a log sees it (no terminal: a line per run to ``log``)."""
    bar = progress_bar(None, "report", "sample", quiet=True)
    return JobProgress(bar, "sample", log=log, **({"clock": clock} if clock else {}))


def test_the_whole_reports_progress_counts_samples_and_the_time_left() -> None:
    """Reused runs leave the plan (they take no time), so the time left is reckoned from
    runs actually sampled."""
    now = [0.0]
    heard: list[str] = []
    job = _job(heard.append, clock=lambda: now[0])
    job.plan(3 * 100)
    job.done(100, "a: reused", reused=True)
    assert heard[-1] == "a: reused (0/200 samples, time left unknown)"
    now[0] = 40.0
    job.done(100, "b: sampled")
    assert heard[-1] == "b: sampled (100/200 samples, about 40 s left)"
    job.plan(900)  # a later part of the job, known now
    now[0] = 120.0
    job.done(100, "c: sampled")  # 0.6 s a sample so far, 900 to go
    assert heard[-1] == "c: sampled (200/1100 samples, about 9 min left)"

def test_report_rows_have_spreads_over_seeds_and_the_floor_first(tmp_path: Path) -> None:
    from ddm.cli import main

    out = tmp_path / "quality.md"
    assert main(["report", "--checkpoints", str(DIGITS), "--n-per-label", "3", "--steps", "2",
                 "--out", str(out)]) == 0
    main_table = out.read_text().split("| model |")[1].split("\n\n")[0]
    table = [line for line in main_table.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[1] for row in table] == [
        "-", "single model", "oracle", "top1", "top2", "ensemble", "random"]
    assert table[0].startswith("| real test digits (disjoint subsets)")
    assert all(row.count("+/-") == 6 for row in table)
    assert "the same images: this judge has seen its reference" in out.read_text()
    # a label partition: the router sees the label, so its choice is the final image's part
    agreement = out.read_text().split("Router top-1 agreement")[1].splitlines()
    assert "| step | 1 | 2 |" in agreement
    assert "| agreement | 1.000 | 1.000 |" in agreement
    verdicts = [line for line in out.read_text().splitlines() if " FD = " in line]
    assert verdicts[0].startswith("DDM top-1 FD / monolith (4000 steps) FD = ")
    assert verdicts[1].startswith("Random expert per step FD / DDM top-1 FD = ")
    assert all(" lower in " in line and " of 3 runs" in line or " all 3 runs" in line
               for line in verdicts)


def test_oracle_is_reported_only_where_each_label_has_one_expert() -> None:
    from ddm.evaluation.report import STRATEGIES, agreement_steps, strategies_for
    from ddm.models.ddm import DDM

    def ddm(*classes: tuple[int, ...]) -> DDM:
        return DDM(expert_names=tuple(f"e{i}" for i in range(len(classes))),
                   experts=(), expert_classes=classes, latent_shape=(1, 8, 8), num_classes=4)

    assert strategies_for(ddm((0, 1), (2, 3))) == STRATEGIES
    assert "oracle" not in strategies_for(ddm((0, 1, 2, 3), (0, 1, 2, 3)))  # k-means
    assert "oracle" not in strategies_for(ddm((0, 1), (1, 2, 3)))
    assert agreement_steps(40) == (1, 10, 20, 30, 40)
    assert agreement_steps(2) == (1, 2)


def test_report_compares_the_heterogeneous_ddm_at_top1(tmp_path: Path, capsys) -> None:
    """``--compare``: the epsilon + velocity DDM beside the all-velocity one, same judge."""
    from ddm.cli import main

    root = Path(__file__).resolve().parents[2] / "checkpoints"
    out = tmp_path / "quality.md"
    assert main(["report", "--checkpoints", str(DIGITS), "--n-per-label", "2", "--steps", "2",
                 "--out", str(out),
                 "--compare", str(root / "digits-heterogeneous")]) == 0
    text = out.read_text()
    section = text[text.index("## Homogeneous vs heterogeneous experts"):]
    assert "velocity 0-4 (4000 steps) + velocity 5-9 (4000 steps)" in section
    assert "epsilon 0-4 (" in section and ") + velocity 5-9 (4000 steps)" in section
    table = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[1] for row in table] == ["top1", "top1"]
    assert "digits-heterogeneous` top-1 accuracy - DDM top-1 accuracy = " in section
    # the main table keeps only the DDM's own rows
    main_table = text[:text.index("## Homogeneous")]
    assert "digits-heterogeneous" not in main_table.split("| model |")[1]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", "--checkpoints", str(DIGITS), "--n-per-label", "2", "--steps", "2",
                 "--out", str(out),
                 "--compare", str(empty)]) == 2  # named before any sampling; out untouched
    assert f"no checkpoints (directories with config.json) in {empty}" in capsys.readouterr().err
    assert out.read_text() == text


def test_a_stopped_report_resumes_from_its_cache(tmp_path: Path) -> None:
    """``--cache``: every sampled run is kept; a rerun samples only what is missing and
    writes the same table (CPU seconds aside: a fresh run measures them again)."""
    from ddm.evaluation.report import write_report

    class Stopped(Exception):
        pass

    cache, heard = tmp_path / "runs", []

    def stop_after_four(line: str) -> None:
        heard.append(line)
        if len(heard) == 4:
            raise Stopped(line)

    settings = dict(checkpoints=DIGITS, n_per_label=2, steps=2, cache=cache)
    with pytest.raises(Stopped):
        write_report(out=tmp_path / "stopped.md", progress=_job(stop_after_four), **settings)
    assert not (tmp_path / "stopped.md").exists()
    assert len(list(cache.glob("*.npz"))) == 4
    assert all(" CPU-s (" in line for line in heard)
    assert heard[-1].split(" CPU-s ")[1].startswith("(80/360 samples, about ")  # 18 runs of 20

    heard.clear()
    resumed = write_report(out=tmp_path / "resumed.md", progress=_job(heard.append), **settings)
    reused = [line for line in heard if ": reused " in line]
    assert len(reused) == 4 and len(heard) == 3 * 6  # 6 sampled rows, 3 seeds each
    assert heard[-1].endswith("(280/280 samples, about 0 s left)")  # the 4 reused left the plan
    assert "4 of the 18 runs were reused from an earlier" in resumed.read_text()

    heard.clear()
    damaged = reused[0].split(": reused ")[1].split(" (")[0]
    (cache / damaged).write_bytes(b"PK\x03\x04 cut short")
    again = write_report(out=tmp_path / "again.md", progress=_job(heard.append), **settings)
    assert sum(": reused " in line for line in heard) == 17  # the damaged run is sampled anew

    def table(path: Path) -> list[str]:
        rows = [r for r in path.read_text().splitlines() if r.startswith("| ") and "+/-" in r]
        return [r.rsplit(" | ", 2)[0] for r in rows]  # less the CPU seconds

    fresh = write_report(out=tmp_path / "fresh.md", **{**settings, "cache": None})
    assert table(resumed) == table(again) == table(fresh)
    assert "runs were reused" not in fresh.read_text()

    heard.clear()
    write_report(out=tmp_path / "other.md", progress=_job(heard.append),
                 **{**settings, "steps": 3})
    assert not any(": reused " in line for line in heard)  # other settings: other runs


def test_report_caches_by_default_says_where_and_not_with_no_cache(tmp_path: Path, capsys,
                                                                  cache_home: Path) -> None:
    from ddm.cli import main

    args = ["report", "--checkpoints", str(DIGITS), "--n-per-label", "1", "--steps", "1",
            "--out", str(tmp_path / "q.md")]
    assert main(args) == 0
    kept = cache_home / "ddm" / "report"
    err = capsys.readouterr().err
    assert f"ddm report: keeping sampled runs in {kept} (--no-cache: none)" in err
    assert len(list(kept.glob("*.npz"))) == 18
    assert err.count(" CPU-s (") == 18 and "(180/180 samples, about 0 s left)" in err

    assert main(args) == 0  # the second report samples nothing
    err = capsys.readouterr().err
    assert err.count(": reused ") == 18 and "(0/0 samples, time left unknown)" in err

    assert main([*args, "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert "keeping no sampled runs (--no-cache)" in err and ": reused " not in err
    elsewhere = tmp_path / "elsewhere"
    assert main([*args, "--cache", str(elsewhere)]) == 0
    assert len(list(elsewhere.glob("*.npz"))) == 18
    with pytest.raises(SystemExit):  # one or the other
        main([*args, "--cache", str(elsewhere), "--no-cache"])


def test_models_are_compared_run_by_run() -> None:
    """Each run's real subset moves every model's FD alike: the verdict pairs the runs."""
    from ddm.evaluation.report import Row, compare_fd

    def row(*fd: float) -> Row:
        return Row("m", "top1", {"fd": {"mean": float(np.mean(fd)), "values": list(fd)}},
                   40.0, 1.0, 1.0)

    # the means differ by less than either spread, yet the DDM is lower in every run
    ddm, monolith = row(10.0, 20.0, 30.0), row(11.0, 21.5, 31.0)
    assert compare_fd(ddm, monolith, "the DDM", "the monolith") == (
        "the DDM is better, lower in all 3 runs (per run -1.17 +/- 0.29)")
    assert compare_fd(monolith, ddm, "the monolith", "the DDM").startswith(
        "the DDM is better, lower in all 3 runs (per run +1.17")
    assert compare_fd(row(10.0, 22.0, 30.0), monolith, "the DDM", "the monolith") == (
        "no consistent difference, the DDM lower in 2 of 3 runs (per run -0.50 +/- 0.87)")
