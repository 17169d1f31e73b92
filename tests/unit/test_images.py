"""The container images, checked without a Docker engine (none can run here).

A small Dockerfile parser (comments, line continuations, JSON and shell forms, ARG defaults in
FROM, stage names, flags such as ``COPY --from``) and Docker's ``.dockerignore`` matching let
these tests check what a build would only find out later: every COPY source is in the build
context and not ignored; the final stage runs as the operator's numeric non-root user; the
entry point is ``ddm`` and every CMD parses with the real CLI parser; base images are pinned;
and the paths the operator's pods and the examples use (``image://`` checkpoints,
``operator/main.py``, the writable cache directories and their variables) exist in the image.
Every failure names the Dockerfile, the line and the problem.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
import yaml

from ddm.checkpoints.declared import declared_files, read_declaration
from ddm.cli import build_parser
from ddm.operator.config import OperatorConfig
from ddm.operator.manifests import USER_ID, build_children
from ddm.deploy.spec import load_manifest, parse_manifest
from ddm.runtime.local import IMAGE_PREFIX
from tests.support.examples import deployment_examples

ROOT = Path(__file__).resolve().parents[2]
#: Image family (``OperatorConfig.images``) -> its Dockerfile. The tpu family has none yet.
DOCKERFILES = {"cpu": "images/cpu/Dockerfile", "cuda": "Dockerfile.cuda",
               "neuron": "Dockerfile.neuron"}
#: The workload images and the operator's own (the chart's ``images.operator``).
ALL_DOCKERFILES = {**DOCKERFILES, "operator": "images/operator/Dockerfile"}
#: The operator image's entry point (``python /opt/ddm/operator/main.py``).
OPERATOR_MAIN = f"{IMAGE_PREFIX}operator/main.py"


# -- the parser ---------------------------------------------------------------------------------

class DockerfileError(ValueError):
    """The Dockerfile uses syntax this parser does not read (it refuses rather than guesses)."""


@dataclass(frozen=True)
class Instruction:
    """One instruction: ``words`` is the exec (JSON) form's list, else the shell form split on
    whitespace, both after the leading ``--flag[=value]`` options, which are in ``flags``."""

    where: str
    keyword: str
    text: str
    flags: dict[str, str]
    words: list[str]
    json_form: bool


@dataclass
class Stage:
    index: int
    name: str | None
    base: str
    where: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


_FLAGGED = {"FROM", "COPY", "ADD", "RUN"}
_EXEC_FORM = {"CMD", "ENTRYPOINT", "RUN", "COPY", "ADD", "SHELL", "VOLUME"}


def parse_dockerfile(text: str, name: str) -> list[Stage]:
    """The stages of a Dockerfile; ``name`` labels locations (``name:LINE``)."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, logical in _logical_lines(text, name):
        where = f"{name}:{line}"
        keyword, _, rest = logical.strip().partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        flags: dict[str, str] = {}
        while keyword in _FLAGGED and rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key], rest = value, rest.strip()
        if keyword in ("RUN", "COPY", "ADD") and re.search(r"<<-?[\"']?[A-Za-z_]", rest):
            raise DockerfileError(f"{where}: heredocs are not supported by this parser")
        words, json_form = rest.split(), False
        if keyword in _EXEC_FORM and rest.startswith("["):
            with contextlib.suppress(json.JSONDecodeError):
                parsed = json.loads(rest)
                if isinstance(parsed, list) and all(isinstance(w, str) for w in parsed):
                    words, json_form = parsed, True
        instruction = Instruction(where, keyword, rest, flags, words, json_form)
        if keyword == "FROM":
            base = _substitute(words[0], global_args) if words else ""
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(len(stages), alias, base, where))
        elif not stages:
            if keyword != "ARG":
                raise DockerfileError(f"{where}: {keyword} before the first FROM")
            arg, _, default = rest.partition("=")
            global_args[arg] = default
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise DockerfileError(f"{name}: no FROM")
    return stages


def _logical_lines(text: str, name: str) -> list[tuple[int, str]]:
    """(first line number, instruction) pairs: comment lines dropped (inside continuations too),
    a trailing backslash joining the next line."""
    lines: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if re.match(r"#\s*escape\s*=", stripped) and not lines and not pending:
            raise DockerfileError(f"{name}:{number}: only the default escape character (\\) "
                                  "is supported by this parser")
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        lines.append((start, "".join(pending) + raw))
        pending = []
    if pending:
        raise DockerfileError(f"{name}:{start}: the last instruction ends in a line continuation")
    return lines


def _substitute(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))",
                  lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def env_of(stage: Stage) -> dict[str, str]:
    """The stage's ENV settings (``KEY=VALUE`` pairs, or the legacy ``KEY VALUE``)."""
    env: dict[str, str] = {}
    for instruction in stage.all("ENV"):
        tokens = shlex.split(instruction.text)
        if tokens and "=" not in tokens[0]:
            env[tokens[0]] = instruction.text.split(None, 1)[1]
        else:
            env.update(token.split("=", 1) for token in tokens)
    return env


# -- .dockerignore -------------------------------------------------------------------------------

def dockerignore_patterns(text: str) -> list[tuple[re.Pattern[str], bool]]:
    """(pattern, is an exception ``!``) in order, with Docker's (Go filepath.Match plus ``**``)
    syntax; a leading ``/`` and ``./`` are dropped as Docker does."""
    patterns = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = str(PurePosixPath(line.removeprefix("!").strip())).lstrip("/")
        patterns.append((re.compile(_glob_regex(pattern)), negated))
    return patterns


def _glob_regex(pattern: str) -> str:
    out, i = "^", 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
            continue
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
            continue
        if char == "*":
            out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        elif char == "[":
            end = pattern.index("]", i + 1)
            out += "[" + pattern[i + 1:end].replace("!", "^", 1) + "]"
            i = end
        elif char == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(char)
        i += 1
    return out + "$"


def is_ignored(relative: str, patterns: list[tuple[re.Pattern[str], bool]]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = PurePosixPath(relative).parts
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for regex, negated in patterns:
        if any(regex.match(c) for c in candidates):
            ignored = not negated
    return ignored


# -- what the images and the operator need -------------------------------------------------------

def _load(family: str) -> list[Stage]:
    path = ALL_DOCKERFILES[family]
    return parse_dockerfile((ROOT / path).read_text(), path)


IGNORED = dockerignore_patterns((ROOT / ".dockerignore").read_text())
#: The files git tracks: what a directory COPY must carry whole (src/ with its package data).
TRACKED = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip("\0").split("\0")


def image_source(stages: list[Stage], image_path: str) -> Path | None:
    """The build-context path that the final stage copies to ``image_path``, if any.

    Docker's rules: a directory's contents go into the destination; a file goes to the
    destination itself, or into it when it ends in ``/`` or there are several sources.
    """
    wanted, workdir, found = PurePosixPath(image_path), PurePosixPath("/"), None
    for instruction in stages[-1].instructions:
        if instruction.keyword == "WORKDIR":
            workdir = workdir / instruction.words[0]
        if instruction.keyword not in ("COPY", "ADD") or "from" in instruction.flags:
            continue
        *sources, dest = instruction.words
        destination = workdir / dest
        for source in sources:
            local = ROOT / source.strip("/")
            if local.is_dir():
                if wanted == destination or destination in wanted.parents:
                    found = local / wanted.relative_to(destination)
                continue
            into = dest.endswith("/") or len(sources) > 1
            if wanted == (destination / local.name if into else destination):
                found = local
    return found


def _created_and_owned(stage: Stage) -> tuple[set[str], dict[str, bool]]:
    """Directories that the stage's RUN commands ``mkdir``, and those they ``chown`` to
    ``USER_ID`` (-> whether recursively)."""
    created: set[str] = set()
    owned: dict[str, bool] = {}
    for instruction in stage.all("RUN"):
        commands: list[list[str]] = [[]]
        for token in shlex.split(instruction.text):
            if token in ("&&", "||", ";"):
                commands.append([])
            else:
                commands[-1].append(token)
        for command in commands:
            arguments = [a for a in command[1:] if not a.startswith("-")]
            if command[:1] == ["mkdir"]:
                for path in map(PurePosixPath, arguments):
                    created.add(str(path))
                    if "-p" in command:
                        created.update(str(parent) for parent in path.parents)
            if command[:1] == ["chown"] and arguments[:1] == [f"{USER_ID}:{USER_ID}"]:
                owned.update((path, "-R" in command) for path in arguments[1:])
    return created, owned


def _writable(directory: str, created: set[str], owned: dict[str, bool]) -> bool:
    """Whether uid ``USER_ID`` can write ``directory`` in a container without volumes."""
    if directory == "/tmp":  # every base image has a world-writable /tmp
        return True
    path = PurePosixPath(directory)
    return directory in created and (directory in owned or any(
        owned.get(str(parent)) for parent in path.parents))


def _operator_pods() -> dict[str, list[dict]]:
    """Image family -> the server and init containers the operator builds for it (a DDM with
    an expert on each accelerator, fetched from a bucket so the fetcher runs too)."""
    document = {
        "apiVersion": "ddm.dev/v1alpha1", "kind": "DDMDeployment", "metadata": {"name": "x"},
        "spec": {"sampling": {"strategy": "oracle"}, "experts": [
            {"name": f"e{i}", "framework": "torch", "accelerator": {"type": kind},
             "checkpoint": {"uri": f"s3://bucket/e{i}"}, "classes": [i]}
            for i, kind in enumerate(("cpu", "nvidia", "neuron"))], "numClasses": 3}}
    config = OperatorConfig()
    family_of = {image: family for family, image in config.images.by_family.items()}
    pods: dict[str, list[dict]] = {}
    for child in build_children(parse_manifest(document).spec,
                                {"name": "x", "namespace": "ns", "uid": "1"}, config):
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]["spec"]
        for container in pod["containers"] + pod.get("initContainers", []):
            mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
            # the checkpoints' volumes (a server's, the stager's) are data, not scratch: a
            # mount point outside the image's directories, which the runtime creates
            scratch = [mounts[v["name"]] for v in pod["volumes"] if "emptyDir" in v
                       and v["name"] in mounts and v["name"] not in ("checkpoint", "stage")]
            pods.setdefault(family_of[container["image"]], []).append(
                # literal values only: one read from a Secret (a fetched URI) is no path
                {"env": {e["name"]: e["value"] for e in container.get("env", []) if "value" in e},
                 "writable": scratch, "name": f"{child['metadata']['name']}/{container['name']}"})
    return pods


# -- the tests ----------------------------------------------------------------------------------

FAMILIES = pytest.mark.parametrize("family", sorted(DOCKERFILES))
EVERY_IMAGE = pytest.mark.parametrize("family", sorted(ALL_DOCKERFILES))


def test_every_dockerfile_in_the_repository_is_checked():
    found = {str(p.relative_to(ROOT)) for p in [*ROOT.glob("Dockerfile*"),
                                               *ROOT.glob("images/*/Dockerfile*")]}
    assert found == set(ALL_DOCKERFILES.values())
    assert set(DOCKERFILES) <= set(OperatorConfig().images.by_family)


def test_the_parser_reads_continuations_comments_forms_and_stages():
    text = "\n".join([
        "# syntax=docker/dockerfile:1",
        "ARG BASE=python:3.12-slim",
        "FROM ${BASE} AS build",
        "RUN echo a \\",
        "# a comment inside a continuation",
        "  && echo b",
        "COPY --chown=1:1 src/ a.txt /dst/",
        "FROM --platform=linux/amd64 debian:12",
        "COPY --from=build /out /out",
        'ENV A=1 B="two words"',
        'ENV LEGACY some value',
        'CMD ["serve", "expert"]',
        "ENTRYPOINT ddm serve",
    ])
    build, final = parse_dockerfile(text, "t")
    assert (build.name, build.base, build.where) == ("build", "python:3.12-slim", "t:3")
    run = build.instructions[0]
    assert (run.where, run.text) == ("t:4", "echo a   && echo b")
    copy = build.instructions[1]
    assert (copy.flags, copy.words) == ({"chown": "1:1"}, ["src/", "a.txt", "/dst/"])
    assert (final.name, final.base, final.index) == (None, "debian:12", 1)
    assert final.all("COPY")[0].flags == {"from": "build"}
    assert env_of(final) == {"A": "1", "B": "two words", "LEGACY": "some value"}
    cmd, entrypoint = final.all("CMD")[0], final.all("ENTRYPOINT")[0]
    assert (cmd.json_form, cmd.words, cmd.where) == (True, ["serve", "expert"], "t:12")
    assert (entrypoint.json_form, entrypoint.words) == (False, ["ddm", "serve"])
    with pytest.raises(DockerfileError, match="t:2: heredocs"):
        parse_dockerfile("FROM a:1\nRUN <<EOF\necho\nEOF", "t")
    with pytest.raises(DockerfileError, match="t:2: the last instruction ends"):
        parse_dockerfile("FROM a:1\nRUN a \\", "t")


def test_dockerignore_matching_follows_docker():
    patterns = dockerignore_patterns("/out\n**/__pycache__\n*.md\n!README.md\ndocs/*.png\n")
    assert is_ignored("out/x/y", patterns) and not is_ignored("src/out", patterns)
    assert is_ignored("src/ddm/__pycache__/a.pyc", patterns)
    assert is_ignored("NOTES.md", patterns) and not is_ignored("README.md", patterns)
    assert not is_ignored("src/NOTES.md", patterns)  # '*' does not cross '/'
    assert is_ignored("docs/a.png", patterns) and not is_ignored("docs/sub/a.png", patterns)


def test_the_build_context_leaves_out_local_state():
    for path in (".git/HEAD", ".venv/bin/python", "out/x", "tests/unit/test_images.py",
                 ".pytest_cache/v", "src/ddm/__pycache__/cli.cpython-312.pyc",
                 "tools/devcluster/src/ddm_devcluster/pause.c"):  # a tool, not the product
        assert is_ignored(path, IGNORED), f".dockerignore: {path} would be sent to the builder"


@EVERY_IMAGE
def test_every_copy_source_is_in_the_build_context(family):
    stages = _load(family)
    names = {s.name for s in stages if s.name}
    problems = []
    for stage in stages:
        for instruction in stage.all("COPY") + stage.all("ADD") + stage.all("RUN"):
            mount_from = re.search(r"(?:^|,)from=([^,]+)", instruction.flags.get("mount", ""))
            source_stage = instruction.flags.get("from") or (mount_from and mount_from[1])
            if source_stage:
                earlier = {s.name for s in stages[:stage.index]} | {
                    str(i) for i in range(stage.index)}
                if source_stage not in earlier:
                    problems.append(f"{instruction.where}: --from={source_stage} is not an "
                                    f"earlier stage ({', '.join(sorted(names))})")
                continue
            if instruction.keyword == "RUN":
                continue
            for source in instruction.words[:-1]:
                relative = source.strip("/")
                matches = sorted(ROOT.glob(relative)) if relative not in ("", ".") else []
                if relative not in ("", ".") and not matches:
                    problems.append(f"{instruction.where}: COPY source {source} does not "
                                    "exist in the build context")
                for match in matches:
                    prefix = f"{match.relative_to(ROOT)}/" if match.is_dir() else ""
                    inside = [f for f in TRACKED if f.startswith(prefix)] if prefix else []
                    problems += [f"{instruction.where}: COPY source {path} is excluded by "
                                 ".dockerignore" for path in [str(match.relative_to(ROOT)),
                                                              *inside]
                                 if is_ignored(path, IGNORED)]
    assert not problems, "\n".join(problems)


@EVERY_IMAGE
def test_the_final_stage_runs_as_the_operators_numeric_non_root_user(family):
    final = _load(family)[-1]
    users = final.all("USER")
    assert users, f"{final.where}: the final stage sets no USER (it would run as root)"
    user = users[-1]
    match = re.fullmatch(r"(\d+)(?::(\d+))?", user.text)
    assert match, f"{user.where}: USER {user.text} is not numeric: runAsNonRoot cannot verify it"
    assert int(match[1]) == USER_ID != 0, \
        f"{user.where}: USER {match[1]} is not {USER_ID}, the operator's runAsUser"
    assert match[2] is None or int(match[2]) == USER_ID, \
        f"{user.where}: group {match[2]} is not {USER_ID}, the operator's runAsGroup"
    # Named too: kopf (getpass.getuser) and others look the user up in /etc/passwd.
    created = [i for i in final.all("RUN") if re.search(rf"useradd .*--uid {USER_ID}\b", i.text)]
    assert created, f"{final.where}: no `useradd --uid {USER_ID}`: uid {USER_ID} has no name"


@FAMILIES
def test_expose_lists_the_ports_the_operators_pods_serve_on(family):
    """EXPOSE documents the image: the API ports of the roles it runs and the metrics port."""
    from ddm.operator import names

    exposed = {int(port) for line in _load(family)[-1].all("EXPOSE") for port in line.words}
    roles = {names.EXPERT_PORT, names.METRICS_PORT}
    if family != "neuron":  # the Neuron image serves experts only
        roles.add(names.ROUTER_PORT)
    assert exposed == roles, f"{DOCKERFILES[family]}: EXPOSE {sorted(exposed)}, not {sorted(roles)}"


@EVERY_IMAGE
def test_the_entrypoint_is_the_cli_and_every_cmd_is_a_real_command(family):
    stages = _load(family)
    entrypoints = stages[-1].all("ENTRYPOINT")
    assert entrypoints, f"{stages[-1].where}: the final stage sets no ENTRYPOINT"
    entrypoint = entrypoints[-1]
    assert entrypoint.json_form and entrypoint.words == ["ddm"], \
        f"{entrypoint.where}: ENTRYPOINT must be [\"ddm\"], got {entrypoint.text}"
    cmds = [c for stage in stages for c in stage.all("CMD")]
    assert cmds, f"{stages[-1].where}: no CMD: `docker run IMAGE` would only print usage"
    for cmd in cmds:
        assert cmd.json_form, f"{cmd.where}: CMD must be a JSON list (exec form)"
        # The images copy checkpoints/ and examples/ under /opt/ddm; the parser checks that
        # the files it names exist, so here they are the repository's.
        words = [word.replace("/opt/ddm/", f"{ROOT}/", 1) if word.startswith("/opt/ddm/")
                 else word for word in cmd.words]
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors), contextlib.suppress(SystemExit):
            build_parser().parse_args(words)
        assert not errors.getvalue(), \
            f"{cmd.where}: `ddm {' '.join(cmd.words)}` is not a ddm command: {errors.getvalue()}"


@EVERY_IMAGE
def test_base_images_are_pinned(family):
    stages = _load(family)
    for stage in stages:
        base = stage.base
        if base in {s.name for s in stages[:stage.index]} or base == "scratch":
            continue
        assert "$" not in base, f"{stage.where}: FROM {base}: a variable without an ARG default"
        name, _, digest = base.partition("@")
        tag = name.rsplit("/", 1)[-1].partition(":")[2]  # not a registry's :port
        assert digest.startswith("sha256:") or tag not in ("", "latest"), \
            f"{stage.where}: FROM {base} is not pinned to a tag or digest"


def test_the_images_install_the_torch_the_project_pins():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pin = next(r.split("==")[1] for r in extras["torch"] if r.startswith("torch=="))
    for family in ("cpu", "cuda"):
        builder = _load(family)[0]
        args = [i for i in builder.all("ARG") if i.text.startswith("TORCH_VERSION=")]
        assert args and args[0].text == f"TORCH_VERSION={pin}", \
            f"{DOCKERFILES[family]}: ARG TORCH_VERSION must be {pin}, the pin in pyproject.toml"


def test_the_operator_image_holds_the_entry_point_and_exposes_the_liveness_port():
    stages = _load("operator")
    assert image_source(stages, OPERATOR_MAIN) == ROOT / OPERATOR_MAIN.removeprefix(IMAGE_PREFIX)
    liveness = yaml.safe_load((ROOT / "charts/ddm-operator/values.yaml").read_text())[
        "operator"]["livenessPort"]
    exposed = {int(port) for line in stages[-1].all("EXPOSE") for port in line.words}
    assert exposed == {liveness}


@FAMILIES
def test_the_paths_the_operator_and_the_examples_name_exist_in_the_image(family):
    stages = _load(family)
    needed: dict[str, str] = {OPERATOR_MAIN: "the operator image's entry point"}
    for example in deployment_examples():
        spec = load_manifest(example).spec
        checkpoints = ([e.checkpoint for e in spec.experts] + [spec.router.checkpoint]
                       + [stage.checkpoint for stage in spec.stages.values()])
        for checkpoint in checkpoints:
            if checkpoint is not None and checkpoint.scheme == "image":
                needed[checkpoint.path] = f"a checkpoint in examples/{example.name}"
    for cmd in stages[-1].all("CMD"):
        needed.update({w: f"named by CMD at {cmd.where}" for w in cmd.words
                       if w.startswith(IMAGE_PREFIX)})
    problems = []
    for image_path, why in sorted(needed.items()):
        source = image_source(stages, image_path)
        expected = ROOT / image_path.removeprefix(IMAGE_PREFIX)  # what `ddm up` reads locally
        if source is None:
            problems.append(f"{image_path} ({why}) is not copied into the image")
        elif source != expected:
            problems.append(f"{image_path} ({why}) comes from {source}, not {expected}")
        elif not source.exists():
            problems.append(f"{image_path} ({why}): {source.relative_to(ROOT)} does not exist")
        elif source.is_dir() and not _is_checkpoint(source):
            problems.append(f"{image_path} ({why}): {source.relative_to(ROOT)} is not a "
                            "checkpoint (config.json and weights.safetensors, or a stage's "
                            "config.json declaring its files, each present)")
        elif any(is_ignored(str(p.relative_to(ROOT)), IGNORED) for p in [source, *(
                source.rglob("*") if source.is_dir() else [])]):
            problems.append(f"{image_path} ({why}): .dockerignore keeps part of "
                            f"{source.relative_to(ROOT)} out of the build")
    assert not problems, f"{DOCKERFILES[family]}:\n" + "\n".join(problems)


def _is_checkpoint(directory: Path) -> bool:
    """A label checkpoint, or a stage checkpoint whose every declared file is there."""
    declared = read_declaration(directory)
    if declared is None:
        return all((directory / f).is_file() for f in ("config.json", "weights.safetensors"))
    return all((directory / name).is_file() for name in declared_files(directory, declared))


@FAMILIES
def test_writable_directories_and_their_variables_agree_with_the_operators_pods(family):
    final = _load(family)[-1]
    env = env_of(final)
    created, owned = _created_and_owned(final)
    problems = []
    for container in _operator_pods()[family]:
        for name, value in container["env"].items():
            if "/" in value and env.get(name) != value:
                problems.append(f"{container['name']} sets {name}={value}; the image's ENV "
                                f"has {env.get(name)!r}")
        home_and_cache = {v for k, v in container["env"].items() if k in ("HOME",
                                                                           "XDG_CACHE_HOME")}
        for directory in sorted({*container["writable"], *home_and_cache}):
            if not _writable(directory, created, owned):
                problems.append(f"{container['name']} writes {directory}: the image must "
                                f"create it (mkdir) and chown it to {USER_ID}:{USER_ID}")
    assert not problems, f"{DOCKERFILES[family]} ({final.where}):\n" + "\n".join(problems)
