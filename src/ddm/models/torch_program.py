"""A strict reader of ``torch.export`` programs (``program.pt2``): a graph and raw tensors only.

``torch.export.load`` runs code from the archive it reads: it unpickles every weight or
constant its config marks ``use_pickle`` (``torch.load(weights_only=False)``), the sample
inputs (falling back to ``weights_only=False``), script and opaque objects; ``sympy.sympify``
evaluates every symbolic-shape expression as Python; and ``ExportedProgram.module()`` executes
the archive's ``guards_code``. A checkpoint's author writes all of these (and config.json with
its sha256), so a program never reaches that loader. This module reads the archive itself
(torch 2.13's layout, ``torch/export/pt2_archive/_package.py``), before torch sees any of it:

- the zip holds only the entries ``torch.export.save`` writes for one program of raw tensors
  (:func:`_entry_kind`), stored uncompressed; any other entry (``extra/``, AOTInductor,
  executorch, legacy ``.pt`` weights, custom or opaque objects) is refused, naming it;
- the graph, weight and constant JSON are parsed against torch's own schema
  (``torch._export.serde.schema``), refusing unknown keys and values of the wrong type;
- every weight and constant is raw bytes (``use_pickle`` refused), of a plain dtype, within its
  entry; every node calls an operator of :data:`ALLOWED_OPS` (side-effect free, deterministic);
  no argument is a custom object, a subgraph or an operator; every name is an identifier, and
  every symbolic expression a literal sympy term of :data:`SYMPY_CALLS`;
- the signature is an expert's: three positional tensors ``(x, t, y)`` in, one tensor out, no
  buffer mutations or effect tokens.

The program is then built by torch's deserializer from those parsed parts: tensors made here
from the raw bytes, no sample inputs (so ``module()`` generates no guards), node metadata and
``guards_code`` left out. The sample-input entry is accepted, as ``torch.export.save`` always
writes it, and never read.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import io
import json
import keyword
import math
import re
import sys
import types
import typing
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch._export.serde import schema
from torch._export.serde.serialize import ExportedProgramDeserializer
from torch._export.serde.union import _Union
from torch.export.pt2_archive import constants as layout

from ddm.checkpoints.format import CheckpointError

#: The operators an exported expert may call: the aten operators our UNet and the tiny DiT
#: of the docs export to, and the common layers of other diffusion networks (convolutions,
#: norms, attention, resampling, elementwise maths, shape changes), none of which mutates its
#: arguments or draws random numbers (tests/unit/test_torch_program.py checks their schemas);
#: ``_operator`` functions compute symbolic sizes.
ALLOWED_OPS = frozenset({f"torch.ops.aten.{op}" for op in (
    "_assert_scalar.default", "_assert_tensor_metadata.default",
    "_native_batch_norm_legit_no_training.default", "_softmax.default", "_to_copy.default",
    "abs.default", "adaptive_avg_pool2d.default", "add.Scalar", "add.Tensor", "addmm.default",
    "amax.default", "arange.default", "arange.start", "arange.start_step",
    "avg_pool2d.default", "baddbmm.default", "bmm.default", "cat.default", "chunk.default",
    "clamp.default", "clamp_min.default", "clone.default", "constant_pad_nd.default",
    "contiguous.default", "conv1d.default", "conv2d.default", "conv_transpose2d.input",
    "convolution.default", "cos.default", "cumsum.default", "div.Scalar", "div.Tensor",
    "div.Tensor_mode", "einsum.default", "elu.default", "embedding.default", "erf.default",
    "exp.default", "expand.default", "flatten.using_ints", "full.default", "full_like.default",
    "gelu.default", "group_norm.default", "index_select.default", "layer_norm.default",
    "leaky_relu.default", "lift_fresh_copy.default", "linear.default", "log.default",
    "log_softmax.int", "matmul.default", "max_pool2d.default", "maximum.default",
    "mean.default", "mean.dim", "minimum.default", "mish.default", "mm.default", "mul.Scalar",
    "mul.Tensor", "native_group_norm.default", "native_layer_norm.default", "neg.default",
    "ones.default", "ones_like.default", "pad.default", "permute.default",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "relu.default", "repeat.default",
    "reshape.default", "rsqrt.default", "rsub.Scalar", "scalar_tensor.default",
    "scaled_dot_product_attention.default", "select.int", "sigmoid.default", "silu.default",
    "sin.default", "slice.Tensor", "softmax.int", "split.Tensor", "split_with_sizes.default",
    "sqrt.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "stack.default",
    "sub.Scalar", "sub.Tensor", "sum.default", "sum.dim_IntList", "sym_size.int", "t.default",
    "tanh.default", "to.dtype", "to.dtype_layout", "transpose.int", "type_as.default",
    "unbind.int", "unflatten.int", "unsqueeze.default", "upsample_bilinear2d.vec",
    "upsample_nearest2d.default", "upsample_nearest2d.vec", "var.correction", "view.default",
    "where.self", "zeros.default", "zeros_like.default")} | {
    f"_operator.{op}" for op in ("add", "floordiv", "getitem", "mod", "mul", "neg", "sub")})
#: Allowed operators that draw random numbers unless their dropout argument (named here) is 0,
#: as it is in every network exported in eval mode.
ZERO_DROPOUT = {"torch.ops.aten.scaled_dot_product_attention.default": "dropout_p"}
#: The argument kinds a node may take (torch's ``Argument`` union): values, tensors and
#: symbolic sizes; never a custom object, an operator or a subgraph.
ALLOWED_ARGUMENTS = frozenset({
    "as_none", "as_tensor", "as_tensors", "as_int", "as_ints", "as_float", "as_floats",
    "as_string", "as_strings", "as_sym_int", "as_sym_ints", "as_scalar_type",
    "as_memory_format", "as_layout", "as_device", "as_bool", "as_bools", "as_sym_bool",
    "as_sym_bools", "as_optional_tensors", "as_sym_float", "as_sym_floats",
    "as_optional_tensor", "as_complex", "as_int_lists", "as_float_lists"})
#: The sympy constructors a symbolic-shape expression (written by ``sympy.srepr``) may call;
#: torch evaluates the expression as Python (``sympy.sympify``).
SYMPY_CALLS = frozenset({
    "Symbol", "Integer", "Add", "Mul", "Max", "Min", "FloorDiv", "CeilDiv", "CleanDiv", "Mod",
    "PythonMod", "Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan",
    "GreaterThan", "And", "Or", "Not"})
#: The longest symbolic-shape expression read (ours are below 100 characters).
MAX_EXPRESSION_CHARS = 2000
#: Weight and constant dtypes, by torch's serialized scalar type.
DTYPES = {schema.ScalarType.FLOAT: torch.float32, schema.ScalarType.HALF: torch.float16,
          schema.ScalarType.BFLOAT16: torch.bfloat16, schema.ScalarType.DOUBLE: torch.float64,
          schema.ScalarType.LONG: torch.int64, schema.ScalarType.INT: torch.int32,
          schema.ScalarType.SHORT: torch.int16, schema.ScalarType.CHAR: torch.int8,
          schema.ScalarType.BYTE: torch.uint8, schema.ScalarType.BOOL: torch.bool}
#: An expert's calling convention as a pytree spec: ``((x, t, y), {})`` in, one tensor out.
_IN_SPEC = [1, {"type": "builtins.tuple", "context": "null", "children_spec": [
    {"type": "builtins.tuple", "context": "null", "children_spec": [
        {"type": None, "context": None, "children_spec": []}] * 3},
    {"type": "builtins.dict", "context": "[]", "children_spec": []}]}]
_OUT_SPEC = [1, {"type": None, "context": None, "children_spec": []}]
_MODEL = "model"
_NUMBERED = {"weight": re.compile(re.escape(layout.WEIGHT_FILENAME_PREFIX) + r"[0-9]+"),
             "constant": re.compile(re.escape(layout.TENSOR_CONSTANT_FILENAME_PREFIX) +
                                    r"[0-9]+")}
_DIRECTORY = {"weight": layout.WEIGHTS_DIR, "constant": layout.CONSTANTS_DIR}
_FIXED_ENTRIES = {
    layout.ARCHIVE_FORMAT_PATH: "format", layout.ARCHIVE_VERSION_PATH: "version",
    "byteorder": "byteorder", ".data/version": "zip version",
    ".data/serialization_id": "serialization id",
    layout.MODELS_FILENAME_FORMAT.format(_MODEL): "graph",
    layout.WEIGHTS_CONFIG_FILENAME_FORMAT.format(_MODEL): "weight config",
    layout.CONSTANTS_CONFIG_FILENAME_FORMAT.format(_MODEL): "constant config",
    layout.SAMPLE_INPUTS_FILENAME_FORMAT.format(_MODEL): "sample inputs (never read)"}
_SYMBOL = re.compile(r"[a-z]+[0-9]+")
_DOTTED = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


class ProgramRefused(CheckpointError):
    """An exported torch program holds something other than a graph and raw tensors."""


def load_program(path: Path) -> torch.nn.Module:
    """The ``torch.export`` program at ``path`` as a module ``(x, t, y) -> out`` on the CPU,
    read by this module's strict reader (module doc); anything else is a
    :class:`ProgramRefused` naming the refused entry, operator or value."""
    entries = read_entries(path.read_bytes(), path.name)
    try:
        program = _parse(schema.ExportedProgram, _json(entries, "graph", path.name),
                         f"{path.name}: graph")
        check_graph(program, path.name)
    except RecursionError:
        raise ProgramRefused(f"{path.name}: its graph is nested too deeply") from None
    state_dict = _tensors(entries, "weight", path.name)
    constants = _tensors(entries, "constant", path.name)
    _check_lifted(program, state_dict, constants, path.name)
    for node in program.graph_module.graph.nodes:
        node.metadata = {}  # debugging text (stack traces, module types): not needed to run
    program.graph_module.metadata = {}
    program.guards_code = []  # Python source that module() would exec
    try:
        exported = ExportedProgramDeserializer().deserialize(program, state_dict, constants,
                                                             None)
        return exported.module()
    except Exception as error:  # noqa: BLE001 - an inconsistent graph is a bad checkpoint
        raise ProgramRefused(f"{path.name}: torch cannot build its graph "
                             f"({type(error).__name__}: {error})") from None


def read_entries(data: bytes, where: str) -> dict[str, bytes]:
    """The archive's entries by name below its root folder, each checked by
    :func:`_entry_kind`; the root folder is the one folder every entry is in."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as error:
        raise ProgramRefused(f"{where} is not a torch.export archive ({error})") from None
    roots = {info.filename.split("/", 1)[0] for info in infos}
    if len(roots) != 1 or not infos:
        raise ProgramRefused(f"{where} is not a torch.export archive: its entries are not in "
                             f"one folder ({', '.join(sorted(roots)[:5]) or 'none'})")
    root = roots.pop() + "/"
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ProgramRefused(f"{where}: entry {info.filename[len(root):]!r} is compressed; "
                                 "torch.export.save stores every entry as it is")
    if sum(info.file_size for info in infos) > len(data):  # entries overlap: a zip bomb
        raise ProgramRefused(f"{where}: its entries hold more bytes than the archive")
    entries: dict[str, bytes] = {}
    for info in infos:
        name = info.filename[len(root):]
        kind = _entry_kind(name)
        if kind is None:
            raise ProgramRefused(
                f"{where}: entry {name!r} is not part of a torch.export program of raw "
                "tensors (a graph, its weights and constants); refused: exported programs "
                "may hold no pickles, custom objects, extra files or compiled code")
        if name in entries:
            raise ProgramRefused(f"{where}: entry {name!r} appears twice")
        try:
            entries[name] = archive.read(info)
        except (zipfile.BadZipFile, ValueError, OSError) as error:
            raise ProgramRefused(f"{where}: entry {name!r} is unreadable ({error})") from None
    for name, value in ((layout.ARCHIVE_FORMAT_PATH, layout.ARCHIVE_FORMAT_VALUE),
                        (layout.ARCHIVE_VERSION_PATH, layout.ARCHIVE_VERSION_VALUE),
                        ("byteorder", sys.byteorder)):
        if entries.get(name) != value.encode():
            raise ProgramRefused(f"{where}: entry {name!r} is {entries.get(name)!r}, not "
                                 f"{value!r} (torch {torch.__version__} writes that)")
    return entries


def _entry_kind(name: str) -> str | None:
    """What an archive entry is (None: not one ``torch.export.save`` writes for a program of
    raw tensors)."""
    if name in _FIXED_ENTRIES:
        return _FIXED_ENTRIES[name]
    for kind, pattern in _NUMBERED.items():
        directory = _DIRECTORY[kind]
        if name.startswith(directory) and pattern.fullmatch(name[len(directory):]):
            return kind
    return None


def _json(entries: dict[str, bytes], kind: str, where: str) -> Any:
    name = next(n for n, k in _FIXED_ENTRIES.items() if k == kind)
    if name not in entries:
        raise ProgramRefused(f"{where}: entry {name!r} ({kind}) is missing")
    try:
        return json.loads(entries[name])
    except (ValueError, RecursionError) as error:
        raise ProgramRefused(f"{where}: entry {name!r} is not JSON ({error})") from None


def _parse(hint: Any, data: Any, where: str) -> Any:
    """``data`` (parsed JSON) as torch's schema type ``hint``: unknown keys, missing fields and
    values of another type are refused (torch's own reader ignores the first and checks no
    types)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        inner, = (arg for arg in typing.get_args(hint) if arg is not type(None))
        return _parse(inner, data, where)
    if origin is list:
        if not isinstance(data, list):
            raise ProgramRefused(f"{where} is not a list")
        item, = typing.get_args(hint)
        return [_parse(item, value, f"{where}[{i}]") for i, value in enumerate(data)]
    if origin is dict:
        if not isinstance(data, dict):
            raise ProgramRefused(f"{where} is not an object")
        _, item = typing.get_args(hint)
        return {key: _parse(item, value, f"{where}.{key}") for key, value in data.items()}
    if isinstance(hint, type) and issubclass(hint, _Union):
        if not isinstance(data, dict) or len(data) != 1:
            raise ProgramRefused(f"{where} is not one of {', '.join(_fields(hint))}")
        (kind, value), = data.items()
        if kind not in _fields(hint):
            raise ProgramRefused(f"{where}: {kind!r} is not one of {', '.join(_fields(hint))}")
        return hint.create(**{kind: _parse(_fields(hint)[kind], value, f"{where}.{kind}")})
    if dataclasses.is_dataclass(hint):
        if not isinstance(data, dict):
            raise ProgramRefused(f"{where} is not an object")
        unknown = sorted(set(data) - set(_fields(hint)))
        if unknown:
            raise ProgramRefused(f"{where}: unknown field {unknown[0]!r}")
        try:
            return hint(**{key: _parse(_fields(hint)[key], value, f"{where}.{key}")
                           for key, value in data.items()})
        except TypeError as error:
            raise ProgramRefused(f"{where}: {error}") from None
    return _scalar(hint, data, where)


def _scalar(hint: type, data: Any, where: str) -> Any:
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        if type(data) is int and data in hint._value2member_map_:
            return hint(data)
    elif hint is float:
        if type(data) in (int, float):
            return float(data)
        if data in ("Infinity", "-Infinity", "NaN"):
            return float(data.lower().replace("infinity", "inf"))
    elif hint in (int, str, bool) and type(data) is hint:
        return data
    raise ProgramRefused(f"{where} is {type(data).__name__} {str(data)[:40]!r}, not "
                         f"{getattr(hint, '__name__', hint)}")


@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(schema))


def check_graph(program: schema.ExportedProgram, where: str) -> None:
    """Refuse, naming it, any operator outside :data:`ALLOWED_OPS`, any argument kind
    outside :data:`ALLOWED_ARGUMENTS`, any name that is not an identifier, any symbolic
    expression that is not a literal sympy term, and any signature but an expert's."""
    if program.schema_version.major != schema.SCHEMA_VERSION[0]:
        raise ProgramRefused(f"{where}: schema version {program.schema_version.major} is not "
                             f"torch {torch.__version__}'s {schema.SCHEMA_VERSION[0]}")
    module = program.graph_module
    if module.treespec_namedtuple_fields or module.graph.custom_obj_values:
        raise ProgramRefused(f"{where}: the graph holds named tuples or custom objects")
    for name in program.range_constraints:
        if not _SYMBOL.fullmatch(name):
            raise ProgramRefused(f"{where}: range constraint on {name!r}, not a size symbol")
    _check_signature(module, where)
    for value in _walk(program):
        if isinstance(value, schema.Node):
            if value.target not in ALLOWED_OPS:
                raise ProgramRefused(f"{where}: the graph calls {value.target!r}, which is not "
                                     "an operator exported experts may call (side-effect-free"
                                     " aten operators: ddm.models.torch_program.ALLOWED_OPS)")
            _identifier(value.name, where)
            _check_dropout(value, where)
        elif isinstance(value, schema.Argument) and value.type not in ALLOWED_ARGUMENTS:
            raise ProgramRefused(f"{where}: the graph passes an argument of kind "
                                 f"{value.type!r}; exported experts pass tensors and values")
        elif isinstance(value, schema.TensorArgument | schema.TokenArgument):
            _identifier(value.name, where)
        elif isinstance(value, schema.SymIntArgument | schema.SymFloatArgument |
                        schema.SymBoolArgument) and value.type == "as_name":
            _identifier(value.value, where)
        elif isinstance(value, schema.SymExpr):
            check_expression(value.expr_str, where)
    graph = module.graph
    for name in (*graph.tensor_values, *graph.sym_int_values, *graph.sym_bool_values,
                 *graph.sym_float_values):
        _identifier(name, where)


def _check_dropout(node: schema.Node, where: str) -> None:
    name = ZERO_DROPOUT.get(node.target)
    for argument in node.inputs if name else ():
        if argument.name == name and argument.arg.value != 0:
            raise ProgramRefused(f"{where}: node {node.name!r} calls {node.target!r} with "
                                 f"{name} {argument.arg.value!r}; an expert must be "
                                 "deterministic (export it in eval mode)")


def _check_signature(module: schema.GraphModule, where: str) -> None:
    """Three positional tensors in, one tensor out, no buffer mutations or effect tokens, and
    every lifted name and module path a dotted name (torch writes them into Python code)."""
    kinds = [spec.type for spec in module.signature.input_specs]
    refused = sorted(set(kinds) - {"user_input", "parameter", "buffer", "tensor_constant"})
    outputs = [spec.type for spec in module.signature.output_specs]
    if refused or outputs != ["user_output"] or kinds.count("user_input") != 3:
        raise ProgramRefused(
            f"{where}: its signature takes {', '.join(kinds).replace('user_input', 'input')} "
            f"and gives {', '.join(outputs)}; an expert's network takes three tensors (x, t, "
            "y) and gives one, mutating nothing")
    for spec in module.signature.input_specs:
        for name in ("parameter_name", "buffer_name", "tensor_constant_name"):
            if hasattr(spec.value, name) and not _DOTTED.fullmatch(getattr(spec.value, name)):
                raise ProgramRefused(f"{where}: {getattr(spec.value, name)!r} is not a name")
    root, *submodules = module.module_call_graph or [None]
    signature = root.signature if root else None
    if (root is None or root.fqn != "" or signature is None
            or _spec(signature.in_spec) != _IN_SPEC or _spec(signature.out_spec) != _OUT_SPEC
            or len(signature.forward_arg_names or ()) != 3):
        raise ProgramRefused(f"{where}: its call is not forward(x, t, y) -> tensor")
    for name in signature.forward_arg_names or ():
        _identifier(name, where)
    for entry in submodules:
        if entry.signature is not None or not _DOTTED.fullmatch(entry.fqn):
            raise ProgramRefused(f"{where}: module {entry.fqn!r} has a preserved signature or "
                                 "is not a dotted name")


def _spec(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _walk(value: Any) -> typing.Iterator[Any]:
    """Every schema object, list and value below ``value``."""
    yield value
    if isinstance(value, _Union):
        yield from _walk(value.value)
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield from _walk(getattr(value, field.name))
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _walk(item)


def _identifier(name: Any, where: str) -> None:
    if not (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)):
        raise ProgramRefused(f"{where}: {str(name)[:60]!r} is not a Python identifier")


def check_expression(text: str, where: str) -> None:
    """Refuse ``text`` unless it is a literal sympy term (``sympy.srepr``'s form) built of
    :data:`SYMPY_CALLS`, symbols like ``s13`` and integers: ``sympy.sympify`` evaluates it as
    Python, so anything else could run code."""
    try:
        tree = ast.parse(text, mode="eval") if len(text) <= MAX_EXPRESSION_CHARS else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        tree = None
    if tree is None or not _literal_term(tree.body):
        raise ProgramRefused(f"{where}: symbolic expression {text[:80]!r} is not a literal "
                             f"sympy term of {', '.join(sorted(SYMPY_CALLS))}")


def _literal_term(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("true", "false")
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in SYMPY_CALLS):
        return False
    args = node.args
    if node.func.id == "Symbol":
        return (len(args) == 1 and isinstance(args[0], ast.Constant)
                and isinstance(args[0].value, str) and bool(_SYMBOL.fullmatch(args[0].value))
                and all(kw.arg in ("positive", "integer", "nonnegative", "real")
                        and isinstance(kw.value, ast.Constant) and type(kw.value.value) is bool
                        for kw in node.keywords))
    if node.func.id == "Integer":
        return (len(args) == 1 and not node.keywords and isinstance(args[0], ast.Constant)
                and type(args[0].value) is int and abs(args[0].value) < 2 ** 63)
    return not node.keywords and all(_literal_term(arg) for arg in args)


def _tensors(entries: dict[str, bytes], kind: str, where: str) -> dict[str, torch.Tensor]:
    """The program's weights or constants (``kind``), each a view of its entry's raw bytes
    (several may share one entry, as tied weights do)."""
    config = _parse(schema.PayloadConfig, _json(entries, f"{kind} config", where),
                    f"{where}: {kind} config").config
    storages: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, payload in config.items():
        entry = _DIRECTORY[kind] + payload.path_name
        what = f"{where}: entry {entry!r} ({kind} {name!r})"
        if payload.use_pickle:
            raise ProgramRefused(f"{what} is a pickle (use_pickle); unpickling runs code, so "
                                 "exported programs may hold raw tensors only")
        meta = payload.tensor_meta
        if not _NUMBERED[kind].fullmatch(payload.path_name) or entry not in entries:
            raise ProgramRefused(f"{what} is not an entry of the archive")
        if meta is None or meta.layout != schema.Layout.Strided or meta.dtype not in DTYPES:
            names = ", ".join(str(dtype).removeprefix("torch.") for dtype in DTYPES.values())
            raise ProgramRefused(f"{what} is not a dense tensor of {names}")
        dtype = DTYPES[meta.dtype]
        if entry not in storages:
            raw = entries[entry]
            if len(raw) % dtype.itemsize:
                raise ProgramRefused(f"{what}: {len(raw)} bytes is not a whole number of "
                                     f"{dtype} values")
            storages[entry] = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                               else torch.empty(0, dtype=torch.uint8))
        tensors[name] = _view(storages[entry], meta, dtype, what)
        if payload.is_param:
            tensors[name] = torch.nn.Parameter(tensors[name], requires_grad=False)
    used = {_DIRECTORY[kind] + payload.path_name for payload in config.values()}
    unused = sorted(n for n in entries if _entry_kind(n) == kind and n not in used)
    if unused:
        raise ProgramRefused(f"{where}: entry {unused[0]!r} is not a {kind} of the program")
    return tensors


def _view(storage: torch.Tensor, meta: schema.TensorMeta, dtype: torch.dtype,
          what: str) -> torch.Tensor:
    """The tensor ``meta`` describes in ``storage`` (bytes), refused unless it lies within."""
    numbers = [*meta.sizes, *meta.strides, meta.storage_offset]
    if any(n.type != "as_int" or n.value < 0 for n in numbers):
        raise ProgramRefused(f"{what} has a symbolic or negative size, stride or offset")
    sizes = [n.value for n in meta.sizes]
    strides = [n.value for n in meta.strides]
    if len(sizes) != len(strides):
        raise ProgramRefused(f"{what} has {len(sizes)} sizes but {len(strides)} strides")
    elements = storage.numel() // dtype.itemsize
    last = meta.storage_offset.value + sum((s - 1) * st for s, st in zip(sizes, strides))
    if 0 not in sizes and last >= elements:
        raise ProgramRefused(f"{what} reaches element {last}, past the {elements} of its "
                             "entry")
    if 0 not in sizes and math.prod(sizes) > elements:  # a broadcast view, unbounded in size
        raise ProgramRefused(f"{what} has {math.prod(sizes)} elements, more than the "
                             f"{elements} of its entry")
    flat = storage.view(dtype) if elements else torch.empty(0, dtype=dtype)
    return torch.as_strided(flat, sizes, strides, meta.storage_offset.value)


def _check_lifted(program: schema.ExportedProgram, state_dict: dict[str, torch.Tensor],
                  constants: dict[str, torch.Tensor], where: str) -> None:
    """Every parameter and persistent buffer among the weights, every constant and
    non-persistent buffer among the constants, and nothing else there."""
    wanted: dict[str, set[str]] = {"weight": set(), "constant": set()}
    for spec in program.graph_module.signature.input_specs:
        value = spec.value
        if spec.type == "parameter":
            wanted["weight"].add(value.parameter_name)
        elif spec.type == "buffer":
            wanted["weight" if value.persistent else "constant"].add(value.buffer_name)
        elif spec.type == "tensor_constant":
            wanted["constant"].add(value.tensor_constant_name)
    for kind, held in (("weight", state_dict), ("constant", constants)):
        if set(held) != wanted[kind]:
            odd = sorted(set(held) ^ wanted[kind])[0]
            raise ProgramRefused(f"{where}: {kind} {odd!r} is "
                                 f"{'not used by' if odd in held else 'missing from'} the graph")

