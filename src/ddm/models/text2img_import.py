"""``ddm import text2img SRC --out DST``: the text2img training's directory (docs/text2img.md)
-> stage checkpoints (``DST/expert_K``, ``router``, ``text_encoder`` with its tokenizer files,
``decoder``) and ``DST/ddm.yaml``, the layout :func:`ddm.models.ddm.load_ddm`, ``ddm
up`` and the operator read.

Each component keeps its library's config.json and its one safetensors file byte for byte
(weights stay float32 as trained); the import adds our declarations under ``"_ddm"`` (role,
family, convention, state shape, text width, cluster, what the cluster holds (``trained_on``,
from the partition's fit), ``weights_sha256``) beside the
training's provenance. The report's aids travel too, outside the deployment: ``monolith/``
(the equal-compute baseline, or a snapshot of its unfinished training, declared as an expert
so the same loader runs it) and ``clip/`` (both towers of the small CLIP, the report's
text-image judge). The experts alternate PyTorch and JAX in ddm.yaml. The shared writer
(``ddm.checkpoints.importers``) writes atomically; every stage is then loaded from the result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Sequence

from ddm.checkpoints.declared import DECODER, EXPERT, ROUTER, TEXT_ENCODER
from ddm.checkpoints.format import CheckpointError, one_safetensors
from ddm.checkpoints.importers import Component, write_import
from ddm.checkpoints.release import check_release
from ddm.deploy.imported import (TEXT_ENCODER_DIR, ImportedDDM, imported_manifest,
                                 manifest_text)
from ddm.deploy.limits import FRAMEWORKS
from ddm.models.ddm import load_ddm
from ddm.models.stages import DDM_KEY, expert_directories
from ddm.models.text_prior import TEXT_PRIOR_FILE, TEXT_PRIOR_KEY
from ddm.models.trained_on import PARTITION_FILE, TRAINED_ON_KEY, TrainedOn
from ddm.models.text2img import (DEFAULT_GUIDANCE, DEFAULT_STEPS, DEFAULT_STRATEGY,
                                 LATENT_CHANNELS, LATENT_SIZE)

#: The training's directories every import needs.
NEEDED = ("router", "text_encoder", "vae", "tokenizer")
#: Where the baseline comes from: the finished monolith, else a snapshot of its training
#: (``ddm train text2img monolith-snapshot``); imported as ``monolith/``.
MONOLITHS = ("monolith", "monolith-snapshot")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def declarations(src: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Imported directory name -> (its training directory, the ``_ddm`` block the import
    writes for it, before its ``weights_sha256``); training provenance is kept."""
    latent = [LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE]
    text_width = int(_config(src / "text_encoder")["hidden_size"])
    experts = {name: src / name for name in expert_directories(src)}
    monolith = next((src / m for m in MONOLITHS if (src / m / "config.json").is_file()), None)
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    fit = _partition_fit(src)
    for name, source in {**experts, **({"monolith": monolith} if monolith else {})}.items():
        trained = _config(source).get(DDM_KEY, {})
        cluster = trained.get("cluster")
        out[name] = (source, {**trained, "role": EXPERT, "family": "pixart",
                              "convention": "ours", "latent_shape": latent,
                              "text_width": text_width,
                              **({TRAINED_ON_KEY: TrainedOn.from_fit(fit, cluster).declaration()}
                                 if fit is not None and isinstance(cluster, int) else {})})
    router = _config(src / "router").get(DDM_KEY, {})
    out["router"] = (src / "router", {**router, **_text_prior(src, router),
                                      "role": ROUTER, "family": "latent-router",
                                      "convention": "ours", "latent_shape": latent})
    out["text_encoder"] = (src / "text_encoder", {
        **_config(src / "text_encoder").get(DDM_KEY, {}),  # its example prompt
        "role": TEXT_ENCODER, "family": "clip-text", "text_width": text_width})
    out["decoder"] = (src / "vae", {"role": DECODER, "family": "autoencoder-kl",
                                    "latent_shape": latent})
    return out


def import_text2img(src: str | Path, out: str | Path, *, name: str = "text2img",
                    accelerators: Sequence[str] = ("cpu",), precision: str | None = None,
                    checkpoint_base: str | None = None) -> Path:
    """Write the import of the training directory ``src`` to the new directory ``out``
    (``ddm.checkpoints.importers``: atomically), then load every stage from it (experts on
    both frameworks), removing it again if one fails; ``checkpoint_base``: where ddm.yaml
    says the stages are (default ``file://`` + ``out``). Raises ``CheckpointError`` naming a
    missing or inconsistent component, ``FileExistsError`` for an existing ``out``."""
    source, target = Path(src), Path(out).absolute()
    if target.exists():
        raise FileExistsError(f"{target} exists; an import writes a new directory")
    for needed in NEEDED:
        if not (source / needed).is_dir():
            raise CheckpointError(f"{source} has no {needed}/: train it first "
                                  "(scripts/train_text2img.sh)")
    declared = declarations(source)
    copied = {trained for trained, _ in declared.values()} | {source / "tokenizer"}
    for directory in sorted(copied | ({source / "clip"} if (source / "clip").is_dir() else set())):
        check_release(directory)  # what is copied: regular files, no code asked for
    components = tuple(
        Component(name=imported, config=_library_config(trained), ddm=block,
                  weights=one_safetensors(trained),
                  files=tuple(source / "tokenizer" / f for f in TOKENIZER_FILES)
                  if imported == TEXT_ENCODER_DIR else ())
        for imported, (trained, block) in declared.items())
    if (source / "clip").is_dir():
        components += (Component(name="clip", config=_library_config(source / "clip"),
                                 ddm={"aid": "the report's text-image judge: the small CLIP, "
                                             "both towers (not a stage)"},
                                 weights=one_safetensors(source / "clip")),)
    experts = sum(n.startswith("expert_") for n in declared)
    imported = ImportedDDM(experts=experts, conditioning="text", steps=DEFAULT_STEPS,
                           strategy=DEFAULT_STRATEGY, guidance_scale=DEFAULT_GUIDANCE,
                           frameworks=FRAMEWORKS)  # expert k's: PyTorch and JAX in turn
    document = imported_manifest(imported, name, checkpoint_base or f"file://{target}/",
                                 accelerators, precision, separate_stages=True)
    header = ("The coloured-MNIST text-to-image DDM (docs/text2img.md), imported by `ddm "
              "import text2img`:\nexperts alternate PyTorch and JAX; the text encoder and "
              "decoder are stages of their own.")
    write_import(target, components, manifest_text(document, header),
                 expert_directories(source))
    try:
        load_ddm(target, backends=FRAMEWORKS)  # every stage loads, shapes agree
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def _text_prior(src: Path, router: dict[str, Any]) -> dict[str, Any]:
    """The router's ``text_prior`` and its fit's provenance from ``src/text_prior.json`` (``ddm
    train text2img text-prior``), which must be of the router's partition; none without it."""
    path = src / TEXT_PRIOR_FILE
    if not path.is_file():
        return {}
    from ddm.checkpoints.declared import load_config_json

    try:
        record = load_config_json(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(record, dict) or TEXT_PRIOR_KEY not in record:
        raise CheckpointError(f"{path} holds no {TEXT_PRIOR_KEY!r}: rerun `ddm train text2img "
                              "text-prior`")
    if record.get("partition_sha256") != router.get("partition_sha256"):
        raise CheckpointError(f"{path} was fitted on partition "
                              f"{record.get('partition_sha256')}, the router on "
                              f"{router.get('partition_sha256')}: rerun the text-prior stage")
    return {TEXT_PRIOR_KEY: record[TEXT_PRIOR_KEY],
            "text_prior_fit": {k: record.get(k) for k in ("fit", "clip_sha256")}}


def _partition_fit(src: Path) -> dict[str, Any] | None:
    """The ``fit`` record of the training's partition file (cluster sizes, digits per
    cluster), None where the training wrote none."""
    path = src / PARTITION_FILE
    if not path.is_file():
        return None
    fit = json.loads(path.read_text()).get("fit")
    if not isinstance(fit, dict):
        raise CheckpointError(f"{path} records no fit (cluster sizes): refit the partition")
    return fit


def _library_config(directory: Path) -> dict[str, Any]:
    """The library's config.json of a training component, our training block left out (the
    import writes its own ``_ddm``)."""
    return {k: v for k, v in _config(directory).items() if k != DDM_KEY}


def _config(directory: Path) -> dict[str, Any]:
    from ddm.models.paris_loading import read_component_config

    config = read_component_config(directory)
    if not config:
        raise CheckpointError(f"{directory} has no config.json")
    return config
