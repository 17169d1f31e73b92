"""An exported torch program is read by ddm's strict reader, never by ``torch.export.load``:
a real expert exported by ``ddm expert export``, then edited as a hostile tenant would (a
pickle that writes a file, Python in a symbolic shape or in the guards, an operator outside the
allow-list, an extra entry). Plain torch runs the payloads (in a subprocess, which writes the
marker); ``ddm expert check`` and ``ddm serve expert`` refuse them, naming what they refuse,
and nothing is ever written. The untampered program still loads and serves the same velocity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import resource
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest
import torch

from ddm.checkpoints.format import (CheckpointError, CheckpointMeta, ModelSpec, load_checkpoint,
                                    save_checkpoint)
from ddm.cli import main
from ddm.models.loading import expert_network
from ddm.models.torch_io import export_program
from ddm.runtime.local import free_port
from tests.integration.servers import ready_server
from tests.support.label_wire import post_call, velocity_call

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_EXPERT = ROOT / "checkpoints" / "digits" / "expert-0-4"
SHAPE = (1, 16, 16)
GRAPH = "models/model.json"
WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
SERVER_DEADLINE_S = 120


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped digits 0-4 expert exported to a torch program by ``ddm expert export``."""
    out = tmp_path_factory.mktemp("exported") / "expert-0-4"
    assert main(["expert", "export", str(SHIPPED_EXPERT), "--out", str(out),
                 "--format", "torch"]) == 0
    return out


class WritesMarker:
    """Unpickling this writes ``path``: what a hostile weight does in ``torch.load``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return exec, (f"open({str(self.path)!r}, 'w').write('ran')",)


def edit_archive(program: bytes, edit: Callable[[dict[str, bytes]], None]) -> bytes:
    """``program`` with its entries (by name below the root folder) changed by ``edit``."""
    source = zipfile.ZipFile(io.BytesIO(program))
    root = source.namelist()[0].split("/", 1)[0]
    entries = {name.split("/", 1)[1]: source.read(name) for name in source.namelist()}
    edit(entries)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for name, data in entries.items():
            target.writestr(f"{root}/{name}", data)
    return out.getvalue()


def edit_json(name: str, change: Callable[[dict], None]) -> Callable[[dict[str, bytes]], None]:
    def edit(entries: dict[str, bytes]) -> None:
        document = json.loads(entries[name])
        change(document)
        entries[name] = json.dumps(document).encode()
    return edit


def tampered(exported: Path, out: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    """A copy of the exported expert whose program ``edit`` changed, its config.json
    recording the new program's sha256 (the tenant writes both)."""
    ckpt = load_checkpoint(exported)
    program = edit_archive((exported / "program.pt2").read_bytes(), edit)
    return save_checkpoint(out, ckpt.meta, {}, program=program)


def pickled_weight(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """The first weight's entry replaced by a pickle that writes ``marker``, and flagged
    ``use_pickle`` as ``torch.export.save`` flags a tensor subclass."""
    payload = io.BytesIO()
    torch.save(WritesMarker(marker), payload)

    def edit(entries: dict[str, bytes]) -> None:
        config = json.loads(entries[WEIGHTS_CONFIG])
        for meta in config["config"].values():
            if meta["path_name"] == "weight_0":
                meta["use_pickle"] = True
        entries[WEIGHTS_CONFIG] = json.dumps(config).encode()
        entries["data/weights/weight_0"] = payload.getvalue()
    return edit


def plain_torch_load(program: Path, call: bool = False) -> None:
    """``torch.export.load`` (and a call of its module) in a fresh interpreter, as ddm loaded
    programs before; its failures do not matter here, only what it ran."""
    code = (f"import torch\nprogram = torch.export.load({str(program)!r})\n" + (
        "program.module()(torch.zeros(3, 1, 16, 16), torch.zeros(3), torch.zeros(3).long())"
        if call else ""))
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_pickled_weight_runs_its_code_in_torch_export_load(exported, tmp_path):
    """The hole: plain torch unpickles the weight, and the pickle writes its file."""
    marker = tmp_path / "ran"
    hostile = tampered(exported, tmp_path / "hostile", pickled_weight(marker))
    plain_torch_load(hostile / "program.pt2")
    assert marker.read_text() == "ran"


def test_ddm_expert_check_refuses_a_pickled_weight_naming_its_entry(exported, tmp_path,
                                                                    capsys):
    marker = tmp_path / "ran"
    hostile = tampered(exported, tmp_path / "hostile", pickled_weight(marker))
    assert main(["expert", "check", str(hostile)]) == 1
    lines = capsys.readouterr().out.splitlines()
    load = next(line for line in lines if line.startswith(("PASS load", "FAIL load")))
    assert load.startswith(f"FAIL load: ProgramRefused: checkpoint {hostile}: program.pt2: "
                           "entry 'data/weights/weight_0' (weight 'time_mlp.0.weight') is a "
                           "pickle (use_pickle)"), load
    assert not marker.exists()


def test_ddm_serve_expert_never_becomes_ready_on_a_pickled_weight(exported, tmp_path):
    """It exits 1 with the reason in its termination log; /readyz never answers 200."""
    marker = tmp_path / "ran"
    hostile = tampered(exported, tmp_path / "hostile", pickled_weight(marker))
    log = tmp_path / "termination-log"
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "ddm.cli", "serve", "expert", "--checkpoint", str(hostile),
         "--port", str(port), "--backend", "torch", "--log-level", "error"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "DDM_TERMINATION_LOG": str(log)})
    readiness = []
    deadline = time.monotonic() + SERVER_DEADLINE_S
    try:
        while (status := server.poll()) is None:  # ask for readiness for as long as it lives
            assert time.monotonic() < deadline, "the server neither exited nor became ready"
            try:
                readiness.append(httpx.get(f"http://127.0.0.1:{port}/readyz",
                                           timeout=1).status_code)
            except httpx.TransportError:
                readiness.append(None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=0.05)  # its exit ends the wait at once
    finally:
        server.kill()
        server.wait()
    assert status == 1
    assert 200 not in readiness
    assert "entry 'data/weights/weight_0' (weight 'time_mlp.0.weight') is a pickle" in (
        log.read_text())
    assert not marker.exists()


def test_python_in_a_symbolic_shape_is_refused_where_torch_would_run_it(exported, tmp_path):
    """torch's loader evaluates every shape expression with ``sympy.sympify``."""
    marker = tmp_path / "ran"
    code = f"__import__('builtins').open({str(marker)!r}, 'w').write('ran')"

    def change(graph: dict) -> None:
        size = graph["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]
        size["as_expr"]["expr_str"] = f"Add({code}, Symbol('s13', positive=True, integer=True))"

    hostile = tampered(exported, tmp_path / "hostile", edit_json(GRAPH, change))
    plain_torch_load(hostile / "program.pt2")
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(CheckpointError, match=r"program.pt2: symbolic expression "
                                              r"\"Add\(__import__\('builtins'\)"):
        expert_network(load_checkpoint(hostile))
    assert not marker.exists()


def test_python_in_the_guards_is_never_run(exported, tmp_path):
    """The module of ``torch.export.load`` runs the archive's ``guards_code`` on every call;
    ddm never uses it."""
    marker = tmp_path / "ran"
    guard = f"open({str(marker)!r}, 'w').write('ran') == 3"
    hostile = tampered(exported, tmp_path / "hostile",
                       edit_json(GRAPH, lambda graph: graph["guards_code"].append(guard)))
    plain_torch_load(hostile / "program.pt2", call=True)
    assert marker.read_text() == "ran"
    marker.unlink()
    expert_network(load_checkpoint(hostile))(*inputs())
    assert not marker.exists()


def test_an_operator_outside_the_allow_list_is_refused_naming_it(tmp_path):
    class Noisy(torch.nn.Module):
        def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + torch.randn_like(x)

    path = save_checkpoint(tmp_path / "noisy", meta(), {}, program=export_program(Noisy(), SHAPE))
    with pytest.raises(CheckpointError, match=r"program.pt2: the graph calls "
                                              r"'torch.ops.aten.randn_like.default', which is "
                                              r"not an operator exported experts may call"):
        expert_network(load_checkpoint(path))


def test_an_extra_entry_is_refused_naming_it(exported, tmp_path):
    program = torch.export.load(exported / "program.pt2")  # ours: trusted bytes
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={"notes.txt": "hello"})
    path = save_checkpoint(tmp_path / "extra", load_checkpoint(exported).meta, {},
                           program=buffer.getvalue())
    with pytest.raises(CheckpointError, match=r"program.pt2: entry 'extra/notes.txt' is not "
                                              r"part of a torch.export program of raw tensors"):
        expert_network(load_checkpoint(path))


def test_an_arange_edited_to_100_gb_fails_ddm_expert_check_naming_it_without_allocating(
        exported, tmp_path, capsys):
    """The sinusoidal time embedding's ``arange(32)`` made ``arange(25e9)``: refused on fake
    tensors at load; the process's peak memory barely moves."""
    def change(graph: dict) -> None:
        node = next(n for n in graph["graph_module"]["graph"]["nodes"] if n["name"] == "arange")
        node["inputs"][0]["arg"] = {"as_int": 25_000_000_000}

    hostile = tampered(exported, tmp_path / "hostile", edit_json(GRAPH, change))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    assert main(["expert", "check", str(hostile)]) == 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 500 * 1024
    lines = capsys.readouterr().out.splitlines()
    load = next(line for line in lines if line.startswith(("PASS load", "FAIL load")))
    assert load.startswith(f"FAIL load: ProgramRefused: checkpoint {hostile}: program.pt2: node "
                           "'arange' (aten.arange.default) computes a torch.float32 tensor of "
                           "(25000000000,), 100000000000 bytes, at batch 1;"), load


def test_the_untampered_export_serves_the_velocity_of_the_network_it_came_from(exported):
    x, t, y = inputs()
    expected = expert_network(load_checkpoint(SHIPPED_EXPERT), "torch")(x, t, y)
    np.testing.assert_allclose(expert_network(load_checkpoint(exported))(x, t, y), expected,
                               atol=1e-5)
    from ddm.serving.wire.protocol import decode_response

    with ready_server(exported, max_batch=4) as base:
        reply = post_call(base, velocity_call(4, x, t, y))
        assert reply.status_code == 200, reply.content
        np.testing.assert_allclose(decode_response(reply.content, 4), expected, atol=1e-5)


def meta() -> CheckpointMeta:
    return CheckpointMeta(kind="expert", name="noisy", architecture={}, framework="torch",
                          classes=(0, 1), model=ModelSpec("exported", image_shape=SHAPE))


def inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((3, *SHAPE), dtype=np.float32),
            np.array([0.1, 0.5, 0.9], np.float32), np.array([0, 2, 4]))


def test_a_declared_image_shape_over_the_limits_is_refused_before_the_program_runs(
        exported, tmp_path):
    """The program's memory bound scales with ``model.image_shape``, which the tenant writes:
    a checkpoint that declares a 4096-pixel side must not raise its own bound."""
    ckpt = load_checkpoint(exported)
    huge = dataclasses.replace(ckpt.meta, model=dataclasses.replace(
        ckpt.meta.model, image_shape=(1, 4096, 4096)))
    path = save_checkpoint(tmp_path / "huge", huge, {},
                           program=(exported / "program.pt2").read_bytes())
    with pytest.raises(CheckpointError, match=r"image_shape \[1, 4096, 4096\] is over the limits"):
        expert_network(load_checkpoint(path))
