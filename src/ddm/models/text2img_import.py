"""``ddm import text2img SRC --out DST``: the text2img training's directory (docs/text2img.md)
-> stage checkpoints (``DST/expert_K``, ``router``, ``text_encoder`` with its tokenizer files,
``decoder``) and ``DST/ddm.yaml``, the layout :func:`ddm.models.stages.load_text_ddm`, ``ddm
up`` and the operator read.

Each component keeps its library's config.json and its one safetensors file byte for byte
(weights stay float32 as trained); the import adds our declarations under ``"_ddm"`` (role,
family, convention, state shape, text width, cluster, ``weights_sha256``) beside the
training's provenance. The report's aids travel too, outside the deployment: ``monolith/``
(the equal-compute baseline, or a snapshot of its unfinished training, declared as an expert
so the same loader runs it) and ``clip/``
(both towers of the small CLIP, the report's text-image judge). The experts alternate
PyTorch and JAX in ddm.yaml. Every component is loaded and checked before anything is
written, and the write is atomic (a hidden directory beside DST, renamed into place).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ddm.checkpoints.format import CheckpointError, one_safetensors
from ddm.models.stages import DDM_KEY, expert_directories, load_text_ddm
from ddm.models.text2img import (DEFAULT_GUIDANCE, DEFAULT_STEPS, DEFAULT_STRATEGY,
                                 LATENT_CHANNELS, LATENT_SIZE)

#: The training's directories every import needs.
NEEDED = ("router", "text_encoder", "vae", "tokenizer")
#: Where the baseline comes from: the finished monolith, else a snapshot of its training
#: (``ddm train text2img monolith-snapshot``); imported as ``monolith/``.
MONOLITHS = ("monolith", "monolith-snapshot")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MANIFEST_FILE = "ddm.yaml"
#: Expert k's framework in ddm.yaml: PyTorch and JAX in turn.
FRAMEWORKS = ("torch", "jax")


def declarations(src: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Imported directory name -> (its training directory, the ``_ddm`` block the import
    writes for it, before its ``weights_sha256``); training provenance is kept."""
    latent = [LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE]
    text_width = int(_config(src / "text_encoder")["hidden_size"])
    experts = {name: src / name for name in expert_directories(src)}
    monolith = next((src / m for m in MONOLITHS if (src / m / "config.json").is_file()), None)
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    for name, source in {**experts, **({"monolith": monolith} if monolith else {})}.items():
        out[name] = (source, {**_config(source).get(DDM_KEY, {}), "role": "expert",
                              "family": "pixart", "convention": "ours", "latent_shape": latent,
                              "text_width": text_width})
    out["router"] = (src / "router", {**_config(src / "router").get(DDM_KEY, {}),
                                      "role": "router", "family": "latent-router",
                                      "convention": "ours", "latent_shape": latent})
    out["text_encoder"] = (src / "text_encoder", {"role": "text_encoder",
                                                  "family": "clip-text",
                                                  "text_width": text_width})
    out["decoder"] = (src / "vae", {"role": "decoder", "family": "autoencoder-kl",
                                    "latent_shape": latent})
    return out


def manifest(experts: int, name: str, checkpoint_base: str) -> dict[str, Any]:
    """The DDMDeployment serving the import from ``checkpoint_base`` (a URI ending in ``/``):
    the text encoder and decoder as stages of their own, the router network inside the
    router, experts alternating :data:`FRAMEWORKS`, the shipped sampler defaults."""
    def stage(directory: str) -> dict[str, Any]:
        return {"checkpoint": {"uri": checkpoint_base + directory}, "placement": "separate",
                "accelerator": {"type": "cpu"}, "replicas": 1}

    return {
        "apiVersion": "ddm.dev/v1alpha1", "kind": "DDMDeployment", "metadata": {"name": name},
        "spec": {
            "conditioning": "text",
            "sampling": {"steps": DEFAULT_STEPS, "solver": "euler",
                         "strategy": DEFAULT_STRATEGY, "guidanceScale": DEFAULT_GUIDANCE},
            "textEncoder": stage("text_encoder"),
            "decoder": stage("decoder"),
            "router": {"replicas": 1, "checkpoint": {"uri": checkpoint_base + "router"},
                       "network": {"placement": "router"}},
            "experts": [{"name": f"expert-{k}", "framework": FRAMEWORKS[k % len(FRAMEWORKS)],
                         "accelerator": {"type": "cpu"},
                         "checkpoint": {"uri": f"{checkpoint_base}expert_{k}"}, "replicas": 1}
                        for k in range(experts)]}}


def import_text2img(src: str | Path, out: str | Path, name: str = "text2img",
                    checkpoint_base: str | None = None) -> Path:
    """Write the import of the training directory ``src`` to the new directory ``out``;
    ``checkpoint_base``: where ddm.yaml says the stages are (default ``file://`` ``out``).
    Raises ``CheckpointError`` naming a missing or inconsistent component, and
    ``FileExistsError`` for an existing ``out`` (nothing is replaced)."""
    source, target = Path(src), Path(out).absolute()
    if target.exists():
        raise FileExistsError(f"{target} exists; an import writes a new directory")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write {target}: {target.parent} does not exist")
    for needed in NEEDED:
        if not (source / needed).is_dir():
            raise CheckpointError(f"{source} has no {needed}/: train it first "
                                  "(scripts/train_text2img.sh)")
    declared = declarations(source)
    experts = [n for n in declared if n.startswith("expert_")]
    base = checkpoint_base or target.as_uri() + "/"
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for imported, (trained, block) in declared.items():
            extra = [source / "tokenizer" / f for f in TOKENIZER_FILES] \
                if imported == "text_encoder" else []
            _write_component(trained, staging / imported, block, extra)
        if (source / "clip").is_dir():
            shutil.copytree(source / "clip", staging / "clip")
        (staging / MANIFEST_FILE).write_text(
            f"# `ddm import text2img {source.name}`: the coloured-MNIST text-to-image DDM "
            "(docs/text2img.md)\n" + yaml.safe_dump(manifest(len(experts), name, base),
                                                     sort_keys=False), encoding="utf-8")
        load_text_ddm(staging, backends=FRAMEWORKS)  # every stage loads, shapes agree
        staging.chmod(0o755)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _write_component(src: Path, dst: Path, block: dict[str, Any], extra: list[Path]) -> None:
    weights = one_safetensors(src)
    dst.mkdir()
    shutil.copyfile(weights, dst / weights.name)
    for path in extra:
        shutil.copyfile(path, dst / path.name)
    config = {k: v for k, v in _config(src).items() if k != DDM_KEY}
    config[DDM_KEY] = {**block, "weights_sha256": _sha256(dst / weights.name)}
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _config(directory: Path) -> dict[str, Any]:
    from ddm.models.paris_loading import read_component_config

    config = read_component_config(directory)
    if not config:
        raise CheckpointError(f"{directory} has no config.json")
    return config


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
