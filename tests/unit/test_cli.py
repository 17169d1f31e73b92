"""The ``ddm`` command on bad input: a one-line error naming the problem, exit 2, no output file.

Uses a tiny random-weight DDM (two smoke experts and a router) written by the fixture: the
checks here are about validation, not quality.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddm.checkpoints.format import CheckpointMeta, save_checkpoint
from ddm.cli import main, run
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
    (("--strategy", "oracle", "--labels", "3,12"), r"labels \[12\] are outside"),
    (("--labels", "1,x"), "--labels must be comma-separated integers"),
    (("--backend", "tensorflow"), "unknown backend 'tensorflow'"),
])
def test_sample_rejects_bad_input(tiny_ddm, tmp_path, capsys, extra, message):
    out = tmp_path / "s.npz"
    code, captured = _run(capsys, "sample", "--checkpoints", tiny_ddm, "--out", out, *extra)
    assert code == 2
    assert captured.err.startswith("ddm: error: ")
    assert re.search(message, captured.err), captured.err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra,message", [
    (("--strategy", "randomly"), "--strategy 'randomly' is not valid: use oracle"),
    (("--steps", "0"), r"--steps must be an integer in \[1, 1000\], got '0'"),
    (("--solver", "rk45"), "--solver must be one of euler, heun, got 'rk45'"),
])
def test_sample_flags_outside_their_declarations_are_refused_as_parsed(tiny_ddm, tmp_path,
                                                                       capsys, extra, message):
    """The sampling flags are built from ``ddm.sampling_params``: argparse refuses a value
    outside the declaration, naming the flag, before any model loads."""
    out = tmp_path / "s.npz"
    with pytest.raises(SystemExit) as exit_:
        _run(capsys, "sample", "--checkpoints", tiny_ddm, "--out", out, *extra)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert re.search(f"argument {extra[0]}: {message}", err), err
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
    assert code == 2 and "not a .npz file: expected a .npz with images and labels" in captured.err


def test_eval_of_an_image_says_what_it_expects_not_numpys_pickle_message(tmp_path, capsys):
    image = tmp_path / "x.png"
    Image.new("RGB", (4, 4)).save(image)
    code, captured = _run(capsys, "eval", image)
    assert code == 2 and "x.png is not a .npz file: expected a .npz with images and labels, " \
        "as `ddm sample --out` writes" in captured.err and "pickle" not in captured.err


def test_a_missing_input_is_named_with_the_commands_usage_before_any_import(tmp_path):
    """Seconds of imports are not spent on a typo: the arguments are checked first."""
    for argv, usage in ((["eval", str(tmp_path / "s.npz")], "usage: ddm eval"),
                        (["render", "/nonexistent.yaml"], "usage: ddm render"),
                        (["up", str(tmp_path / "d.yaml")], "usage: ddm up"),
                        (["sample", str(tmp_path / "d.yaml"), "--out", "o.npz"],
                         "usage: ddm sample")):
        code = ("import sys\nfrom ddm.cli import main\ncode = main(sys.argv[1:])\n"
                "heavy = {'numpy', 'torch', 'jax', 'transformers'} & set(sys.modules)\n"
                "assert not heavy, heavy\nsys.exit(code)")
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and usage in done.stderr, done.stderr
        assert f"{argv[1]}: not found" in done.stderr and "Errno" not in done.stderr


def test_an_unknown_flag_gets_the_commands_usage_not_the_top_level_one(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["sample", "--promt=eight", "--out", "o.npz"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "ddm sample: error: unrecognized arguments: --promt" in err
    assert "usage: ddm sample" in err and "COMMAND ..." not in err


def test_a_missing_file_met_while_running_is_named_without_an_errno(tmp_path, capsys):
    def handler(_: object) -> int:
        open(tmp_path / "gone.yaml")
        return 0

    code = run(argparse.Namespace(handler=handler, debug=False))
    err = capsys.readouterr().err
    assert code == 2 and err == f"ddm: error: {tmp_path / 'gone.yaml'}: not found\n", err


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


def test_sigterm_ends_a_command_with_143_and_main_restores_the_handler(monkeypatch, capsys):
    """``ddm``'s own SIGTERM handler (PID 1 of a container has no default action for it): a
    command SIGTERM interrupts runs its ``finally`` blocks and exits 143; after ``main`` the
    previous handler is back (tests call ``main`` in-process)."""
    import os
    import signal
    import time

    import ddm.operator.commands

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
    monkeypatch.setattr(ddm.operator.commands, "_diagram", command)
    assert main(["diagram", "x.yaml"]) == 143
    assert cleaned_up == [True]
    assert capsys.readouterr().err.strip() == "ddm: terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_while_the_commands_import_says_so_and_exits_143(monkeypatch, capsys):
    """SIGTERM before any command runs (the parser's areas import their modules: seconds for
    a pod's throttled container) ends ``ddm`` with 143 and says why, as in a command (it
    exited 143 in silence: the e2e test of a pod deleted while importing found no line)."""
    import os
    import signal
    import time

    import ddm.cli

    def importing(commands):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler's exception ends the sleep at once

    monkeypatch.setattr(ddm.cli, "add_partition_command", importing)
    assert main(["diagram", "x.yaml"]) == 143
    assert capsys.readouterr().err.strip() == "ddm: terminated (SIGTERM)"


# -- outputs and progress ------------------------------------------------------------------------

def test_an_output_in_a_missing_directory_fails_before_sampling_and_creates_nothing(
        tiny_ddm, tmp_path, capsys):
    out = tmp_path / "missing" / "s.npz"
    code, captured = _run(capsys, *_sample(tiny_ddm, out))
    assert code == 2
    assert captured.err.strip() == (f"ddm: error: --out {out}: directory {out.parent} does not "
                                    "exist (create it first)")
    assert list(tmp_path.iterdir()) == []
    code, captured = _run(capsys, *_sample(tiny_ddm, tmp_path / "s.npz", "--png",
                                           tmp_path / "nowhere" / "g.png"))
    assert code == 2 and f"directory {tmp_path / 'nowhere'} does not exist" in captured.err
    assert list(tmp_path.iterdir()) == []  # not even the samples file: checked before sampling


def test_a_report_checks_its_output_before_an_hour_of_sampling(tmp_path, capsys):
    out = tmp_path / "missing" / "quality.md"
    code, captured = _run(capsys, "report", "--out", out)
    assert code == 2
    assert captured.err.strip() == (f"ddm: error: --out {out}: directory {out.parent} does not "
                                    "exist (create it first)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_outputs_get_the_mode_the_umask_gives_any_new_file(tiny_ddm, tmp_path, capsys, umask,
                                                           mode):
    import os
    import stat

    previous = os.umask(umask)
    try:
        code, _ = _run(capsys, *_sample(tiny_ddm, tmp_path / "s.npz", "--png",
                                        tmp_path / "g.png"))
    finally:
        os.umask(previous)
    assert code == 0
    for name in ("s.npz", "g.png"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.png", "s.npz"]  # no temporaries


def _sample_in_a_process(tiny_ddm, out, stderr_on_a_terminal: bool) -> str:
    """``ddm sample`` as a process, its stderr a pipe or a pseudo-terminal; what it wrote."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    argv = [sys.executable, "-m", "ddm", *map(str, _sample(tiny_ddm, out, "--labels", "1,2"))]
    if not stderr_on_a_terminal:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 wide
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=secondary)
    os.close(secondary)
    written = b""
    while True:  # until the process closes the terminal (EIO on Linux)
        try:
            chunk = os.read(primary, 4096)
        except OSError:
            break
        if not chunk:
            break
        written += chunk
    os.close(primary)
    assert process.wait(timeout=300) == 0, written
    return written.decode(errors="replace")


def test_sampling_shows_a_progress_bar_only_on_a_terminal(tiny_ddm, tmp_path):
    on_terminal = _sample_in_a_process(tiny_ddm, tmp_path / "a.npz", stderr_on_a_terminal=True)
    # The bar is drawn, then cleared (leave=False); how many updates it drew in between
    # depends on the machine's speed (tqdm redraws at most every 0.1 s), so only its first
    # frame and its unit are certain.
    assert "sampling 2 images" in on_terminal and "0/3" in on_terminal, on_terminal
    assert "step/s" in on_terminal, on_terminal
    piped = _sample_in_a_process(tiny_ddm, tmp_path / "b.npz", stderr_on_a_terminal=False)
    assert piped == ""  # a log or a pipe gets no bar, no carriage returns


# -- eval: which classifier, and what its figures are worth ---------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _real_digits(path, n):
    """``n`` real 16x16 digits (the held-out split) written as a samples file."""
    from ddm.convention import to_model_space, to_uint8
    from ddm.data import load_dataset
    from ddm.samples import save_samples_npz

    real = load_dataset("digits", 16, "heldout")
    save_samples_npz(path, to_uint8(to_model_space(real.images[:n]))[:, 0], real.labels[:n])
    return path


def test_eval_judges_16x16_samples_with_the_digits_classifier_and_warns_of_few_images(
        tmp_path, capsys):
    code, captured = _run(capsys, "eval", _real_digits(tmp_path / "s.npz", 24))
    assert code == 0, captured.err
    assert f"judged by {ROOT / 'checkpoints' / 'digits' / 'classifier'}" in captured.out
    assert ("ddm eval: warning: 24 images per run: FD is unreliable below 640 (10 per feature "
            "of the classifier's 64)") in captured.err
    assert "ddm eval: warning: one run: no spread" in captured.err
    fd = next(line for line in captured.out.splitlines() if line.startswith("fd "))
    assert fd.split("real-vs-real")[0].count("+/-") == 0, fd  # one run has no spread
    assert "+/-" in fd.split("real-vs-real")[1]  # the floor's three subsets have one


def test_eval_names_the_classifier_for_the_samples_size(tmp_path, capsys):
    samples = _real_digits(tmp_path / "s.npz", 24)
    mnist = ROOT / "checkpoints" / "mnist" / "classifier"
    code, captured = _run(capsys, "eval", samples, "--classifier", mnist)
    assert code == 2
    assert captured.err.strip() == (
        f"ddm: error: samples are 16x16 but {mnist} judges 32x32 images: pass --classifier "
        f"{ROOT / 'checkpoints' / 'digits' / 'classifier'}, which judges 16x16")


def test_eval_of_a_size_no_shipped_classifier_judges_says_how_to_get_one(tiny_ddm, tmp_path,
                                                                          capsys):
    out = tmp_path / "s.npz"
    assert _run(capsys, *_sample(tiny_ddm, out, "--labels", "3"))[0] == 0  # 8x8 images
    code, captured = _run(capsys, "eval", out)
    assert code == 2
    assert captured.err.strip() == (
        "ddm: error: no shipped classifier judges 8x8 images: train one (ddm train classifier "
        "--image-size 8 --data SOURCE --out DIR) and pass --classifier DIR")
