"""Long runs resume from their last saved state and end where an uninterrupted run ends.

Bit-identical, not merely close: every batch, time and noise draw is a function of
``(seed, step)``, and the saved state (float32 weights, EMA, optimiser moments, step) is exact,
so the resumed run repeats the very same floating-point operations on the same machine.
"""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from ddm.checkpoints.format import load_checkpoint
from ddm.cli import EXIT_INTERRUPTED, main
from ddm.training.resume import state_directory

# the models run on two cores shared with everything else
pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 30




def _argv(out, *extra, framework="torch", kind="expert"):
    argv = ["train", kind, "--config", "smoke", "--framework", framework, "--steps", STEPS,
            "--batch-size", 8, "--save-every", 7, "--seed", 3, "--out", out, "--quiet", *extra]
    if kind == "expert":
        argv += ["--partition", "labels:0-4,5-9", "--index", 1]
    return [str(a) for a in argv]


def _train(out, *extra, framework="torch", kind="expert"):
    return main(_argv(out, *extra, framework=framework, kind=kind))


def _interrupt_at(step: int, monkeypatch) -> None:
    """Interrupt from inside the trainer's progress callback once it reports ``step``."""
    import ddm.training.cli

    def progress(args, total, what):
        def update(done, loss):
            if done >= step:
                raise KeyboardInterrupt  # what Ctrl-C raises in the middle of training
        return update

    monkeypatch.setattr(ddm.training.cli, "_progress", progress)


@pytest.mark.parametrize("framework,kind", [("torch", "expert"), ("jax", "expert"),
                                            ("torch", "monolith")])
def test_an_interrupted_run_resumed_ends_bit_identical(tmp_path, monkeypatch, framework, kind):
    assert _train(tmp_path / "whole", framework=framework, kind=kind) == 0
    with monkeypatch.context() as patch:
        _interrupt_at(20, patch)  # saved at 7 and 14: steps 15 to 20 are lost and redone
        assert _train(tmp_path / "cut", framework=framework, kind=kind) == EXIT_INTERRUPTED
    assert not (tmp_path / "cut").exists()
    assert (state_directory(tmp_path / "cut") / "identity.json").exists()
    assert _train(tmp_path / "cut", "--resume", framework=framework, kind=kind) == 0
    whole, cut = (load_checkpoint(tmp_path / n).weights for n in ("whole", "cut"))
    assert whole.keys() == cut.keys()
    assert all(np.array_equal(whole[k], cut[k]) for k in whole)


#: ``ddm ARGV...`` killed (SIGKILL: nothing of it runs on) just before its second rename in
#: DIRECTORY, that is, in the middle of its first save of the training state.
_KILLED_IN_THE_FIRST_SAVE = """
import os, signal, sys
from ddm.cli import main

directory, renames = sys.argv[1], []

def kill_before_the_second_rename(event, args):
    if event == "os.rename" and os.path.dirname(args[1]) == directory:
        renames.append(args[1])
        if len(renames) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(kill_before_the_second_rename)
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("again", [[], ["--resume"]], ids=["afresh", "resume"])
def test_a_run_killed_in_its_first_save_can_be_run_again(tmp_path, again):
    """The state was renamed into place before its identity.json: a kill between the two left
    a state no run could read ("No such file or directory: ...identity.json")."""
    out = tmp_path / "e"
    killed = subprocess.run([sys.executable, "-c", _KILLED_IN_THE_FIRST_SAVE,
                             str(state_directory(out)), *_argv(out)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert _train(out, *again) == 0
    assert load_checkpoint(out).meta.training["steps"] == STEPS


def test_a_resumed_run_records_the_training_time_of_every_session(tmp_path, monkeypatch):
    import json

    with monkeypatch.context() as patch:
        _interrupt_at(10, patch)
        assert _train(tmp_path / "e") == EXIT_INTERRUPTED
    identity = state_directory(tmp_path / "e") / "identity.json"
    saved = json.loads(identity.read_text())
    assert saved["step"] == 7 and 0 < saved["seconds"] < 600
    # as if the first session had trained for an hour before its last save
    identity.write_text(json.dumps({**saved, "seconds": 3600.0}))
    assert _train(tmp_path / "e", "--resume") == 0
    seconds = load_checkpoint(tmp_path / "e").meta.training["seconds"]
    assert 3600.0 < seconds < 4200.0


def test_a_saved_state_is_neither_overwritten_nor_continued_by_another_run(tmp_path, capsys,
                                                                           monkeypatch):
    with monkeypatch.context() as patch:
        _interrupt_at(10, patch)
        assert _train(tmp_path / "e") == EXIT_INTERRUPTED
    assert _train(tmp_path / "e") == 2
    assert "holds a training state at step 7: pass --resume" in capsys.readouterr().err
    assert _train(tmp_path / "e", "--resume", "--lr", "0.01") == 2
    assert "was made for another run (differs in: train)" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
