"""The ``ddm`` command on bad input: a one-line error naming the problem, exit 2, no output file.

Uses a tiny random-weight DDM (two smoke experts and a router) written by the fixture: the
checks here are about validation, not quality.
"""

import re

import numpy as np
import pytest
import torch

from ddm.checkpoints.format import CheckpointMeta, save_checkpoint
from ddm.cli import main
from ddm.models.config import UNET_CONFIGS, RouterNetworkConfig
from ddm.models.router_net import RouterNet
from ddm.models.torch_io import canonical_weights
from ddm.models.torch_unet import UNet

SMOKE = UNET_CONFIGS["smoke"]
SCHEME = {"method": "labels", "groups": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]}


@pytest.fixture(scope="module")
def tiny_ddm(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddm")
    torch.manual_seed(0)
    for index, classes in enumerate(SCHEME["groups"]):
        meta = CheckpointMeta(kind="expert", name=f"e{index}", architecture=SMOKE.to_dict(),
                              framework="torch", classes=classes,
                              partition={"scheme": SCHEME, "index": index})
        save_checkpoint(root / f"e{index}", meta, canonical_weights(UNet(SMOKE)))
    router = RouterNetworkConfig(image_size=SMOKE.image_size, num_experts=2)
    save_checkpoint(root / "router",
                    CheckpointMeta(kind="router", name="router", architecture=router.to_dict(),
                                   framework="torch", classes=range(10),
                                   partition={"scheme": SCHEME}),
                    canonical_weights(RouterNet(router)))
    return root


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr()


def _sample(tiny_ddm, out, *extra):
    return ("sample", "--checkpoints", tiny_ddm, "--steps", 3, "--out", out, *extra)


def test_sample_writes_images_labels_and_expert_calls(tiny_ddm, tmp_path, capsys):
    out = tmp_path / "s.npz"
    code, _ = _run(capsys, *_sample(tiny_ddm, out, "--labels", "0,7", "--n-per-label", 2,
                                    "--strategy", "top2", "--png", tmp_path / "g.png"))
    assert code == 0
    data = np.load(out)
    assert data["images"].shape == (4, 8, 8) and data["images"].dtype == np.uint8
    np.testing.assert_array_equal(data["labels"], [0, 0, 7, 7])
    # Top-2 among the experts trained on the label: only one knows 0 (or 7); 3 steps.
    np.testing.assert_array_equal(data["expert_calls"], [3, 3, 3, 3])
    assert (tmp_path / "g.png").read_bytes().startswith(b"\x89PNG")


def test_sample_is_deterministic_and_batch_independent(tiny_ddm, tmp_path, capsys):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    _run(capsys, *_sample(tiny_ddm, a, "--labels", "1,2,3", "--batch-size", 3))
    _run(capsys, *_sample(tiny_ddm, b, "--labels", "1,2,3", "--batch-size", 1))
    np.testing.assert_array_equal(np.load(a)["images"], np.load(b)["images"])


@pytest.mark.parametrize("extra,message", [
    (("--strategy", "randomly"), "unknown routing strategy 'randomly'"),
    (("--strategy", "oracle", "--labels", "3,12"), r"labels \[12\] are outside"),
    (("--steps", "0"), "steps must be an integer in"),
    (("--labels", "1,x"), "--labels must be comma-separated integers"),
    (("--solver", "rk45"), "unknown solver 'rk45'"),
    (("--backend", "tensorflow"), "unknown backend 'tensorflow'"),
])
def test_sample_rejects_bad_input(tiny_ddm, tmp_path, capsys, extra, message):
    out = tmp_path / "s.npz"
    code, captured = _run(capsys, "sample", "--checkpoints", tiny_ddm, "--out", out, *extra)
    assert code == 2
    assert captured.err.startswith("ddm: error: ")
    assert re.search(message, captured.err), captured.err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_oracle_rejects_labels_no_expert_covers(tmp_path, tiny_ddm, capsys):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "e0").symlink_to(tiny_ddm / "e0")
    out = tmp_path / "s.npz"
    code, captured = _run(capsys, *_sample(partial, out, "--strategy", "oracle", "--labels", "2,8"))
    assert code == 2 and "labels [8] are not covered by any expert" in captured.err
    assert not out.exists()


def test_missing_and_corrupt_checkpoints(tmp_path, tiny_ddm, capsys):
    out = tmp_path / "s.npz"
    code, captured = _run(capsys, *_sample(tmp_path / "nope", out))
    assert code == 2 and "does not exist" in captured.err
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("e0", "e1", "router"):
        (broken / name).mkdir()
        for f in (tiny_ddm / name).iterdir():
            (broken / name / f.name).write_bytes(f.read_bytes())
    weights = broken / "e1" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, captured = _run(capsys, *_sample(broken, out))
    assert code == 2 and "e1: weights.safetensors is corrupt" in captured.err
    assert not out.exists()


def test_eval_rejects_a_bad_samples_file(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    code, captured = _run(capsys, "eval", bad, "--json")
    assert code == 2 and "not a readable .npz" in captured.err


def test_eval_reads_what_sample_writes(tiny_ddm, tmp_path, capsys):
    from ddm.samples import load_samples_npz

    out = tmp_path / "s.npz"
    assert _run(capsys, *_sample(tiny_ddm, out, "--labels", "3"))[0] == 0
    samples = load_samples_npz(out)
    assert samples.images.shape == (1, 8, 8) and samples.labels.tolist() == [3]
    assert samples.expert_calls.tolist() == [3]


def _failing(error: BaseException):
    def handler(args):
        raise error
    return handler


@pytest.mark.parametrize("error,status,prefix", [
    (ValueError("bad value"), 2, "ddm: error: bad value"),
    (FileNotFoundError("no such file"), 2, "ddm: error: no such file"),
    (RuntimeError("the expert exited"), 1, "ddm: error: the expert exited"),
    (ConnectionRefusedError("refused"), 1, "ddm: error: refused"),
    (KeyError("images"), 1, "ddm: internal error: KeyError: 'images' (run ddm --debug"),
])
def test_errors_are_usage_errors_failures_or_internal_errors(error, status, prefix, capsys):
    from ddm.cli import build_parser, run

    args = build_parser().parse_args(["diagram", "x.yaml"])
    args.handler = _failing(error)  # what a command whose code raises this would do
    assert run(args) == status
    err = capsys.readouterr().err
    assert err.startswith(prefix) and "Traceback" not in err, err


def test_debug_prints_the_traceback_of_an_internal_error(capsys):
    from ddm.cli import build_parser, run

    args = build_parser().parse_args(["--debug", "diagram", "x.yaml"])
    args.handler = _failing(KeyError("images"))
    assert run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):"), err
    assert err.rstrip().endswith("ddm: internal error: KeyError: 'images'"), err


def test_a_manifest_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    code, captured = _run(capsys, "up", tmp_path / "missing.yaml")
    assert code == 2 and "does not exist" in captured.err


def test_sigterm_ends_a_command_with_143_and_main_restores_the_handler(monkeypatch, capsys):
    """``ddm``'s own SIGTERM handler (PID 1 of a container has no default action for it): a
    command SIGTERM interrupts runs its ``finally`` blocks and exits 143; after ``main`` the
    previous handler is back (tests call ``main`` in-process)."""
    import os
    import signal
    import time

    import ddm.cli

    cleaned_up = []

    def command(args):
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
            raise AssertionError("no SIGTERM handler: the signal would end pytest itself")
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler's exception ends the sleep at once
        finally:
            cleaned_up.append(True)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(ddm.cli, "_diagram", command)
    assert main(["diagram", "x.yaml"]) == 143
    assert cleaned_up == [True]
    assert capsys.readouterr().err.strip() == "ddm: terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is before
