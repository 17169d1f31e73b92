"""``ddm expert check`` of a text expert: a stage checkpoint of role expert (its config.json
declares ``_ddm``), such as ``checkpoints/text2img/expert_0`` (PixArt, served on torch or by
its Flax port) or ``expert_K`` of a ``ddm import paris`` (a Paris DiT).

The expert loads through :func:`ddm.models.stages.load_stage`, the loader the stage server
serves it with, so the check sees what is served: our velocity, after the conversion its
declared convention names. :func:`ddm.experts.check.check_outputs` then runs the label
experts' checks on it with our own objective, its conditioning being of its own kind: text
embeddings, passed as rows of a table (the checks' ``y``), of prompts through its DDM's text
encoder (``text_encoder/`` beside it, loaded the same way; with none there, Gaussian
embeddings of its text width). The text encoder's width and the decoder's latent channels
must agree with the expert's (:func:`~ddm.models.stages.check_stage_shapes`, as a DDM is
assembled).

The behaviour check needs real data: ``--data mnist:DIR`` takes MNIST's test digits coloured
and captioned as the text2img DDM was trained (:mod:`ddm.data.colored_mnist`), encodes them
with its DDM's decoder's VAE, keeps those its DDM's router assigns to the expert's cluster at
``t = 1``, and conditions each on its caption through the text encoder. PixArt's torch and
Flax networks must agree (parity); a Paris DiT runs on torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddm.checkpoints.declared import DECODER, EXPERT, ROUTER, TEXT_ENCODER
from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.convention import FlowMatchNetwork, network_convention
from ddm.data.colored_mnist import IMAGE_SIZE, load_colored_mnist
from ddm.deploy.imported import DECODER_DIR, TEXT_ENCODER_DIR
from ddm.experts.network_checks import (BEHAVIOUR_IMAGES, SEED, Claim, Examples, Verdict,
                                        agreement, check_outputs, missing_frameworks,
                                        run_check)
from ddm.models.loading import ModelFn
from ddm.models.paris_loading import read_component_config
from ddm.models.stages import (ConditionedVelocity, Stage, StageDeclaration, VaeDecoder,
                               check_stage_shapes, load_stage, stage_directory)
from ddm.objectives import NATIVE

#: The prompts of the rows the shapes, finiteness, determinism and parity checks send: a
#: caption, and the empty prompt (guidance's unconditional row).
CHECK_PROMPTS = ("a red seven", "")
#: Tokens of the Gaussian embeddings an expert with no text encoder beside it is given.
GAUSSIAN_TOKENS = 8
#: Test digits encoded to find the expert's cluster among, and the most of them the behaviour
#: check draws from (a cluster is about a quarter of them).
CANDIDATE_DIGITS, MAX_EXAMPLES = 2048, 512
#: The frameworks a stage expert runs on; ``native`` is the first, where its weights were saved.
TORCH, JAX = "torch", "jax"


@dataclass(frozen=True)
class _Loaded:
    """The expert and the stages of its DDM the check uses (None: not beside it)."""

    expert: Stage
    encoder: Stage | None
    decoder: Stage | None


def check_text_expert(directory: str | Path, backend: str = "native", device: str | None = None,
                      data_source: str | None = None) -> list[Verdict]:
    """The verdicts of :func:`ddm.experts.check.check_checkpoint` for the stage checkpoint in
    ``directory``: its declaration, loading (with its DDM's text encoder and decoder), shapes,
    finiteness, determinism, behaviour on ``data_source`` (``mnist:DIR``; none: skipped) and
    torch/JAX parity, the expert run on ``backend`` (``native`` is torch) and ``device``."""
    path = Path(directory)
    try:
        declared = StageDeclaration.from_config(path, read_component_config(path))
    except CheckpointError as error:
        return [Verdict("objective" if "convention" in str(error) else "config", "FAIL",
                        str(error))]
    if declared.role != EXPERT:
        return [Verdict("config", "FAIL", f"{path} is a stage of role {declared.role}, not an "
                                          "expert")]
    verdicts = [Verdict("objective", "PASS", f"declares {_convention(declared)}, which we "
                                             "convert to our velocity")]
    framework = TORCH if backend == "native" else backend
    try:
        loaded = _load(path, framework, device or "cpu")
    except (CheckpointError, ValueError, ImportError, OSError, RuntimeError) as error:
        return verdicts + [Verdict("load", "FAIL", f"{type(error).__name__}: {error}")]
    filled = loaded.expert.declaration
    assert filled.latent_shape is not None and filled.text_width is not None, "loaders fill them"
    table, given = _check_rows(loaded.encoder, filled.text_width)
    verdicts.append(Verdict("load", "PASS", (
        f"expert {path.name} ({filled.family}) on {framework}, latents "
        f"{'x'.join(map(str, filled.latent_shape))}, text width {filled.text_width}, weights "
        f"{loaded.expert.dtype}; conditioned on {given}")))
    data = _text_examples(path, loaded, data_source, device or "cpu")
    examples: Examples | str = data
    if not isinstance(data, str):  # its rows follow the generic checks' in the table
        examples = Examples(data.x1, len(table) + np.arange(len(data.x1), dtype=np.int64),
                            data.name)
        table = np.concatenate([table, data.embeddings])
    verdicts += check_outputs(_on_rows(loaded.expert.forward, table), NATIVE,
                              filled.latent_shape, np.int64(0), examples,
                              Claim(_convention(declared), "_ddm.convention"))
    verdicts.append(run_check("parity", lambda: _parity(
        path, filled, framework, device or "cpu", loaded.expert.forward, table)))
    return verdicts


def check_loaded_expert(expert: Stage, max_batch: int) -> list[Verdict]:
    """The structural checks of this command (shapes and dtypes, finiteness, determinism) of a
    loaded text ``expert``, on Gaussian embeddings of its text width, called with at most
    ``max_batch`` rows at a time: what the model server runs before it serves one. The
    behaviour check needs data and a text encoder, and is skipped."""
    declared = expert.declaration
    assert declared.latent_shape is not None and declared.text_width is not None, \
        "loaders fill them"
    table, _ = _check_rows(None, declared.text_width)
    return check_outputs(_on_rows(expert.forward, table), NATIVE, declared.latent_shape,
                         np.int64(0), "the model server runs the structural checks only "
                         "(ddm expert check --data runs this one)",
                         Claim(_convention(declared), "_ddm.convention"), max_batch)


@dataclass(frozen=True)
class _TextExamples:
    """Data of a text expert: ``x1`` latents (N, C, S, S) and the ``embeddings`` (N, L, D) of
    each one's caption."""

    x1: np.ndarray
    embeddings: np.ndarray
    name: str


def _text_examples(path: Path, loaded: _Loaded, source: str | None,
                  device: str) -> _TextExamples | str:
    """Latents of coloured test digits of the expert's cluster, with their captions'
    embeddings (module doc); or why there are none here (the behaviour check is skipped)."""
    if not source:
        return ("config.json records no data source (pass --data mnist:DIR: MNIST's test "
                "digits, coloured and captioned, through its DDM's decoder and text encoder)")
    directory = source.removeprefix("mnist:")
    if directory == source or not directory:
        return (f"data source {source!r}: a text expert is checked on coloured MNIST "
                "(mnist:DIR)")
    if loaded.encoder is None or loaded.decoder is None:
        return (f"{path.parent} holds no {TEXT_ENCODER_DIR}/ and {DECODER_DIR}/ beside "
                f"{path.name} to encode coloured digits and their captions with")
    vae, shape = loaded.decoder.forward, loaded.decoder.image_shape
    if not isinstance(vae, VaeDecoder):
        return f"its DDM's decoder ({loaded.decoder.declaration.family}) encodes no images"
    if shape != (3, IMAGE_SIZE, IMAGE_SIZE):
        return (f"coloured MNIST's images are 3x{IMAGE_SIZE}x{IMAGE_SIZE}; its DDM's decoder "
                f"makes {'x'.join(map(str, shape or ()))}")
    try:
        data = load_colored_mnist(directory, "t10k")
    except (OSError, ValueError) as error:
        return f"cannot load data source {source!r} here ({type(error).__name__}: {error})"
    rows = np.random.default_rng(SEED).permutation(len(data))[:CANDIDATE_DIGITS]
    latents = np.concatenate([vae.encode(data.float_images(rows[i:i + BEHAVIOUR_IMAGES]))
                              for i in range(0, len(rows), BEHAVIOUR_IMAGES)])
    name = f"coloured-mnist-{IMAGE_SIZE}x{IMAGE_SIZE}/t10k"
    cluster = loaded.expert.declaration.cluster
    router_dir = stage_directory(path.parent, ROUTER)
    if cluster is not None and router_dir is not None:
        try:
            router = load_stage(router_dir, device=device)
        except (CheckpointError, OSError, ValueError) as error:
            return f"cannot load its DDM's router to find its cluster's digits: {error}"
        own = router.forward(latents, np.ones(len(latents), np.float32), None).argmax(1)
        rows, latents = rows[own == cluster], latents[own == cluster]
        name += f"/cluster={cluster}"
        if not len(rows):
            return (f"its DDM's router assigns none of {CANDIDATE_DIGITS} coloured test "
                    f"digits to cluster {cluster}")
    rows, latents = rows[:MAX_EXAMPLES], latents[:MAX_EXAMPLES]
    captions = [data.captions[i] for i in rows]
    encode = loaded.encoder.forward
    embeddings = np.concatenate([encode(captions[i:i + BEHAVIOUR_IMAGES]).embeddings
                                 for i in range(0, len(captions), BEHAVIOUR_IMAGES)])
    return _TextExamples(latents, embeddings, name)


def _load(path: Path, framework: str, device: str) -> _Loaded:
    """The expert on ``framework`` and its DDM's text encoder and decoder, where beside it
    (by its DDM's root index, else by their usual names), their shapes checked against each
    other."""
    expert = load_stage(path, device=device, backend=framework)
    encoder, decoder = (None if where is None else load_stage(where, device=device)
                        for where in (stage_directory(path.parent, role)
                                      for role in (TEXT_ENCODER, DECODER)))
    check_stage_shapes(path.parent, [expert], None, encoder, decoder)
    return _Loaded(expert, encoder, decoder)


def _check_rows(encoder: Stage | None, text_width: int) -> tuple[np.ndarray, str]:
    """The embeddings (B, L, D) of the rows the generic checks send, and what they are."""
    if encoder is None:
        rng = np.random.default_rng(SEED)
        return (rng.standard_normal((1, GAUSSIAN_TOKENS, text_width)).astype(np.float32),
                f"Gaussian embeddings ({TEXT_ENCODER_DIR}/ is not beside it)")
    prompts = " and ".join(repr(p) for p in CHECK_PROMPTS)
    return (encoder.forward(list(CHECK_PROMPTS)).embeddings,
            f"the prompts {prompts} through its DDM's text encoder")


def _on_rows(forward: ConditionedVelocity, table: np.ndarray) -> ModelFn:
    """``forward`` as the checks call a network: ``y`` (B,) int64 the rows of ``table``."""
    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        return forward(x, t, Conditioning(embeddings=table[y]))

    return velocity


def _parity(path: Path, declared: StageDeclaration, framework: str, device: str,
            forward: ConditionedVelocity, table: np.ndarray) -> Verdict | str:
    if declared.family != "pixart":
        return Verdict("parity", "SKIP", f"a {declared.family} network runs on torch only")
    missing = missing_frameworks()
    if missing:
        return Verdict("parity", "SKIP", f"{', '.join(missing)} not installed here")
    other = _on_rows(load_stage(path, device=device, backend=JAX if framework == TORCH
                                else TORCH).forward, table)
    own = _on_rows(forward, table)
    assert declared.latent_shape is not None, "the loader fills it in"
    return agreement(*((own, other) if framework == TORCH else (other, own)),
                     declared.latent_shape, np.int64(0))


def _convention(declared: StageDeclaration) -> str:
    """How a report names the declared convention."""
    assert declared.convention is not None, "StageDeclaration requires it of experts"
    convention = network_convention(declared.convention)
    if isinstance(convention, FlowMatchNetwork):
        return (f"convention {declared.convention!r} (FlowMatchEulerDiscrete's: time sigma x "
                f"{convention.num_train_timesteps}, output noise - data)")
    return (f"convention {declared.convention!r} (ours: time t x "
            f"{convention.timestep_scale:g}, output our velocity x1 - x0)")
