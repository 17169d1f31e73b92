"""The strict reader of exported torch programs (``ddm.models.torch_program``) on a tiny real
export: what it accepts, and each refusal naming what it refused. Hostile full-size experts,
served and checked, are in tests/integration/test_untrusted_programs.py."""

from __future__ import annotations

import io
import json
import operator
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import sympy
import torch

from ddm.models.torch_io import export_program
from ddm.models.torch_program import (ALLOWED_OPS, ZERO_DROPOUT, ProgramRefused,
                                      check_expression, load_program)

SHAPE = (1, 4, 4)
GRAPH = "models/model.json"


class Tiny(torch.nn.Module):
    """``(x, t, y) -> x * scale(t) + bias[y]``: a weight, an embedding and a symbolic batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = torch.nn.Linear(1, 1)
        self.bias = torch.nn.Embedding(3, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * self.scale(t[:, None])[:, :, None, None] + self.bias(y)[:, :, None, None]


@pytest.fixture(scope="module")
def program() -> bytes:
    return export_program(Tiny().eval(), SHAPE)


def edited(program: bytes, edit: Callable[[dict[str, bytes]], None],
           compression: int = zipfile.ZIP_STORED) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(program))
    entries = {name.split("/", 1)[1]: source.read(name) for name in source.namelist()}
    edit(entries)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as target:
        for name, data in entries.items():
            target.writestr(f"archive/{name}", data)
    return out.getvalue()


def graph_edit(change: Callable[[dict], None]) -> Callable[[dict[str, bytes]], None]:
    def edit(entries: dict[str, bytes]) -> None:
        graph = json.loads(entries[GRAPH])
        change(graph)
        entries[GRAPH] = json.dumps(graph).encode()
    return edit


def load(tmp_path: Path, program: bytes) -> torch.nn.Module:
    path = tmp_path / "program.pt2"
    path.write_bytes(program)
    return load_program(path)


def test_a_plain_export_loads_and_computes_what_the_module_does(program, tmp_path):
    x, t, y = torch.randn(5, *SHAPE), torch.rand(5), torch.tensor([0, 1, 2, 1, 0])
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path, program)(x, t, y), Tiny().eval()(x, t, y),
                                   rtol=0, atol=0)


def test_every_allowed_operator_exists_mutates_nothing_and_draws_no_random_numbers():
    """Attention draws random numbers only for dropout, which the reader requires to be 0."""
    for name in ALLOWED_OPS:
        namespace, rest = name.split(".", 1) if name.startswith("_operator.") else ("", name)
        if namespace == "_operator":
            assert callable(getattr(operator, rest)), name
            continue
        _, _, library, op, overload = name.split(".")
        resolved = getattr(getattr(getattr(torch.ops, library), op), overload)
        assert isinstance(resolved, torch._ops.OpOverload), name
        assert not resolved._schema.is_mutable, name
        seeded = torch.Tag.nondeterministic_seeded in resolved.tags
        assert seeded == (name in ZERO_DROPOUT), name
        if seeded:  # the argument the reader requires to be 0 is the op's dropout
            assert ZERO_DROPOUT[name] in [a.name for a in resolved._schema.arguments], name


@pytest.mark.parametrize("expression", [
    sympy.srepr(sympy.Symbol("s13", positive=True, integer=True)),
    sympy.srepr(4 * sympy.Symbol("s13", positive=True, integer=True) + 2),
    sympy.srepr(sympy.Max(sympy.Symbol("s0", integer=True), 1)),
    sympy.srepr(sympy.Eq(sympy.Symbol("s0", integer=True), 3)),
])
def test_sympy_terms_as_torch_writes_them_are_accepted(expression):
    check_expression(expression, "here")


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')",
    "Symbol('s0').__class__",
    "Integer((lambda: 1)())",
    "Symbol('s0; import os')",
    "Symbol('s0', evaluate=__import__('os'))",
    "Add(" * 400 + "Integer(1)" + ")" * 400,
    "Integer(10**100)",
])
def test_anything_else_in_a_symbolic_shape_is_refused(expression):
    with pytest.raises(ProgramRefused, match="is not a literal sympy term"):
        check_expression(expression, "here")


def _pickled_weight(entries: dict[str, bytes]) -> None:
    config = json.loads(entries["data/weights/model_weights_config.json"])
    for meta in config["config"].values():
        meta["use_pickle"] = True
    entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()


def _custom_object_entry(entries: dict[str, bytes]) -> None:
    entries["data/constants/custom_obj_0"] = b"\x80\x02N."


def _legacy_weights(entries: dict[str, bytes]) -> None:
    entries["data/weights/model.pt"] = b""


def _unknown_field(graph: dict) -> None:
    graph["graph_module"]["graph"]["nodes"][0]["payload"] = "x"


def _wrong_type(graph: dict) -> None:
    graph["graph_module"]["graph"]["nodes"][0]["target"] = ["torch.ops.aten.add.Tensor"]


def _custom_object_argument(graph: dict) -> None:
    node = graph["graph_module"]["graph"]["nodes"][0]
    node["inputs"][0]["arg"] = {"as_custom_obj": {"name": "obj", "class_fqn": "os.system"}}


def _injected_name(graph: dict) -> None:
    spec = graph["graph_module"]["signature"]["input_specs"][0]["parameter"]
    spec["parameter_name"] = 'scale.weight"), print("ran'


def _mutated_buffer(graph: dict) -> None:
    outputs = graph["graph_module"]["signature"]["output_specs"]
    outputs.append({"buffer_mutation": {"arg": {"name": "x"}, "buffer_name": "b"}})


def _broadcast_weight(entries: dict[str, bytes]) -> None:
    """A one-element weight viewed as 10^12 elements (stride 0): memory for whatever uses it."""
    config = json.loads(entries["data/weights/model_weights_config.json"])
    meta = next(m for m in config["config"].values() if m["path_name"] == "weight_0")
    meta["tensor_meta"]["sizes"] = [{"as_int": 10 ** 6}, {"as_int": 10 ** 6}]
    meta["tensor_meta"]["strides"] = [{"as_int": 0}, {"as_int": 0}]
    entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()


@pytest.mark.parametrize("edit, refusal", [
    (_pickled_weight, r"entry 'data/weights/weight_\d' \(weight '[a-z.]+'\) is a pickle "
                      r"\(use_pickle\)"),
    (_custom_object_entry, "entry 'data/constants/custom_obj_0' is not part of a torch.export "
                           "program of raw tensors"),
    (_legacy_weights, "entry 'data/weights/model.pt' is not part of"),
    (graph_edit(_unknown_field), r"graph.graph_module.graph.nodes\[0\]: unknown field 'payload'"),
    (graph_edit(_wrong_type), r"nodes\[0\].target is list .* not str"),
    (graph_edit(_custom_object_argument), "an argument of kind 'as_custom_obj'"),
    (graph_edit(_injected_name), "is not a name"),
    (graph_edit(_mutated_buffer), "gives user_output, buffer_mutation; an expert's network"),
    (lambda entries: entries.update({"data/weights/weight_0": b""}),
     r"entry 'data/weights/weight_0' \(weight '[a-z.]+'\) reaches element 0, past the 0 of "
     r"its entry"),
    (_broadcast_weight, r"\(weight '[a-z.]+'\) has 1000000000000 elements, more than the 1 "
                        r"of its entry"),
    (lambda entries: entries.update({"archive_version": b"1"}),
     "entry 'archive_version' is b'1', not '0'"),
])
def test_an_edited_archive_is_refused_naming_what_it_refuses(program, tmp_path, edit, refusal):
    with pytest.raises(ProgramRefused, match=refusal):
        load(tmp_path, edited(program, edit))


def test_a_compressed_entry_is_refused(program, tmp_path):
    with pytest.raises(ProgramRefused, match="entry 'data/weights/weight_0' is compressed"):
        load(tmp_path, edited(program, lambda entries: None, zipfile.ZIP_DEFLATED))


def test_attention_with_dropout_is_refused(tmp_path):
    class Dropping(torch.nn.Module):
        def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.5)

    with pytest.raises(ProgramRefused, match=r"calls 'torch.ops.aten.scaled_dot_product_"
                                             r"attention.default' with dropout_p 0.5"):
        load(tmp_path, export_program(Dropping(), SHAPE))
