"""``ddm expert check`` on the shipped experts, on a misdeclared one and on a broken one; the
expert server refuses to serve an expert that fails it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddm.checkpoints.format import load_checkpoint, read_meta, save_checkpoint
from ddm.cli import main
from ddm.data import Dataset
from ddm.experts.check import behaviour_data
from ddm.runtime.local import free_port

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "checkpoints"
EPSILON_EXPERT = SHIPPED / "digits-heterogeneous" / "expert-0-4-epsilon"
READY_DEADLINE_S = 120


def check(checkpoint: Path, capsys: pytest.CaptureFixture[str], *flags: str
          ) -> tuple[int, dict[str, str]]:
    """Run the command; its exit status and each check's line by check name."""
    status = main(["expert", "check", str(checkpoint), *flags])
    lines = capsys.readouterr().out.strip().splitlines()
    verdicts = {}
    for line in lines:
        match = re.fullmatch(r"(PASS|FAIL|SKIP) ([a-z]+): (.+)", line)
        assert match, f"not a verdict line: {line!r}"
        verdicts[match[2]] = line
    return status, verdicts


def declared_as_velocity(tmp_path: Path) -> Path:
    """The epsilon expert with a config.json that claims our velocity (weights untouched, so
    their sha256 still holds)."""
    copy = tmp_path / "epsilon-declared-velocity"
    shutil.copytree(EPSILON_EXPERT, copy)
    config = json.loads((copy / "config.json").read_text())
    config["objective"] = {"prediction": "velocity", "schedule": "linear",
                           "time": "continuous", "timesteps": None, "time_scale": 1.0}
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def shipped_experts() -> list[str]:
    """Every expert checkpoint under checkpoints/ (label experts and monoliths, stage
    checkpoints of role expert), each once (a symlinked directory is its target)."""
    found: dict[Path, str] = {}
    for config in sorted(SHIPPED.rglob("config.json")):
        declared = json.loads(config.read_text())
        block = declared.get("_ddm")
        if (block.get("role") == "expert" if isinstance(block, dict)
                else declared.get("kind") in ("expert", "monolith")):
            found.setdefault(config.parent.resolve(), config.parent.relative_to(SHIPPED)
                             .as_posix())
    return sorted(found.values())


#: The shipped experts whose data this repository embeds: every check runs, and passes.
ALL_PASS = ["digits/expert-0-4", "digits/expert-5-9", "digits-heterogeneous/expert-0-4-epsilon"]
CHECKS = ["objective", "load", "shapes", "finite", "determinism", "behaviour", "parity"]


@pytest.mark.parametrize("expert", ALL_PASS)
def test_the_shipped_experts_pass_every_check(expert, capsys):
    status, verdicts = check(SHIPPED / expert, capsys)
    assert status == 0, verdicts
    assert set(verdicts) == {"objective", "load", "shapes", "finite", "determinism",
                             "behaviour", "parity"}
    assert all(line.startswith("PASS") for line in verdicts.values()), verdicts


def test_the_shipped_experts_are_label_and_text_experts_of_both_frameworks():
    experts = shipped_experts()
    assert {"digits/expert-0-4", "digits/expert-5-9", "mnist/expert-1", "text2img/expert_0",
            "text2img/expert_1", "text2img/monolith"} <= set(experts), experts
    assert len(experts) == 14, experts


@pytest.mark.parametrize("expert", sorted(set(shipped_experts()) - set(ALL_PASS)))
def test_every_other_shipped_expert_passes_ddm_expert_check(expert, capsys):
    """Label and text experts alike; behaviour is skipped where their data is not here
    (MNIST's files; coloured MNIST for the text experts: test_text_expert_check.py)."""
    status, verdicts = check(SHIPPED / expert, capsys)
    assert status == 0, verdicts
    assert list(verdicts) == CHECKS
    assert not any(line.startswith("FAIL") for line in verdicts.values()), verdicts
    assert [name for name, line in verdicts.items() if line.startswith("SKIP")] in (
        [], ["behaviour"]), verdicts


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_an_exported_program_of_a_shipped_expert_passes_every_check_but_parity(
        framework, tmp_path, capsys):
    """``ddm expert export`` (torch.export, jax.export), then the check of what it wrote."""
    out = tmp_path / f"expert-0-4-{framework}"
    assert main(["expert", "export", str(SHIPPED / "digits" / "expert-0-4"), "--out",
                 str(out), "--format", framework]) == 0
    capsys.readouterr()
    status, verdicts = check(out, capsys)
    assert status == 0, verdicts
    assert list(verdicts) == CHECKS
    assert verdicts["load"] == "PASS load: expert expert-0-4 on native, images 1x16x16"
    assert verdicts["behaviour"].startswith("PASS behaviour: velocity explains the outputs")
    assert verdicts["parity"] == (f"SKIP parity: a {framework} network (exported) runs on "
                                  f"{framework} only")


def test_an_epsilon_expert_declared_as_velocity_fails_the_behaviour_check(tmp_path, capsys):
    status, verdicts = check(declared_as_velocity(tmp_path), capsys, "--backend", "torch")
    assert status == 1
    line = verdicts["behaviour"]
    assert line.startswith("FAIL behaviour: config.json declares velocity on linear"), line
    assert "epsilon explains them" in line, line
    relative = float(re.search(r"relative squared error of ([0-9.]+)", line)[1])
    assert relative > 1.0  # worse than predicting zero
    assert verdicts["shapes"].startswith("PASS") and verdicts["objective"].startswith("PASS")


def test_an_expert_with_nan_weights_fails_the_finite_check(tmp_path, capsys):
    shipped = load_checkpoint(SHIPPED / "digits" / "expert-0-4")
    weights = dict(shipped.weights)
    name = sorted(weights)[0]
    weights[name] = np.full_like(weights[name], np.nan)
    broken = save_checkpoint(tmp_path / "nan", shipped.meta, weights)
    status, verdicts = check(broken, capsys, "--backend", "torch")
    assert status == 1
    assert verdicts["finite"].startswith("FAIL finite: the velocity has NaN or inf values")
    assert verdicts["behaviour"].startswith("SKIP")


def test_an_undeclarable_objective_fails_the_objective_check(tmp_path, capsys):
    copy = tmp_path / "unknown-objective"
    shutil.copytree(EPSILON_EXPERT, copy)
    config = json.loads((copy / "config.json").read_text())
    config["objective"]["prediction"] = "score"
    (copy / "config.json").write_text(json.dumps(config))
    status, verdicts = check(copy, capsys)
    assert status == 1
    assert verdicts["objective"].startswith("FAIL objective:")
    assert "prediction 'score' is not one we convert" in verdicts["objective"]


def test_the_expert_server_exits_1_on_a_misdeclared_expert_and_says_why(tmp_path):
    """The operator shows the termination message in the DDM's status."""
    checkpoint = declared_as_velocity(tmp_path)
    log = tmp_path / "termination-log"
    port = free_port()
    expert = subprocess.Popen(
        [sys.executable, "-m", "ddm.cli", "serve", "expert", "--checkpoint", str(checkpoint),
         "--port", str(port), "--log-level", "error"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "DDM_TERMINATION_LOG": str(log)})
    try:
        assert expert.wait(timeout=READY_DEADLINE_S) == 1
    finally:
        expert.kill()
        expert.wait()
    message = log.read_text()
    assert "failed ddm expert check: FAIL behaviour: config.json declares velocity" in message
    assert message.count("\n") == 1


def test_without_a_data_source_the_behaviour_check_is_skipped_and_says_why(
        smoke_expert_checkpoint, capsys):
    """The conftest's random smoke expert records no data: nothing to test its objective on."""
    status, verdicts = check(smoke_expert_checkpoint, capsys, "--backend", "torch")
    assert status == 0, verdicts
    assert verdicts["behaviour"] == ("SKIP behaviour: config.json records no data source "
                                     "(pass --data digits or mnist:DIR)")
    assert verdicts["determinism"].startswith("PASS")


def test_the_behaviour_check_has_its_digits_where_scikit_learn_is_not_installed(monkeypatch):
    """As in the serving images: the digits are the package's own, so a server in a cluster
    runs the behaviour check instead of skipping it."""
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now raises ImportError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    data = behaviour_data(read_meta(SHIPPED / "digits" / "expert-0-4"))
    assert isinstance(data, Dataset), data
    assert data.name == "digits-16x16/heldout/classes=0,1,2,3,4" and len(data) == 225
