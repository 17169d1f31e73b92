"""The stages of a text-conditioned latent DDM, each a model loaded by role from its own
component directory (after diffusers' ``model_index.json``): the text encoder (transformers'
tokenizer + CLIPTextModel), the experts and router network, the decoder (diffusers'
AutoencoderKL). :func:`load_stage` loads one directory by the role and family its config.json
declares under ``"_ddm"`` (a format-1 label checkpoint by its own fields:
:mod:`ddm.models.label_stages`); :func:`ddm.models.ddm.load_ddm` bundles a root of them as one
DDM for the in-process driver (:mod:`ddm.sampling.pipeline`). Each stage is a NumPy callable in our
convention (conversions at its edge), so it can move to a server.

Weights keep the dtype they were saved in unless a precision is asked for; every stage answers
float32 NumPy arrays. Only safetensors files are read (``use_safetensors=True``): loading runs
no code.

Families: ``paris-dit`` / ``paris-router`` (:mod:`ddm.models.paris_loading`), ``pixart``
(diffusers' PixArtTransformer2DModel), ``latent-router`` (:class:`~ddm.models.latent_router.
LatentRouter`), ``clip-text`` (CLIPTextModel and its tokenizer in the same directory),
``autoencoder-kl``. diffusers' DiTTransformer2DModel takes class labels, not text, so it is no
family here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ddm.checkpoints.declared import DDM_KEY, DECODER, EXPERT, ROLES, ROUTER, TEXT_ENCODER
from ddm.checkpoints.index import read_index
from ddm.checkpoints.format import (FORMAT_KEY, CheckpointError, check_sha256, one_safetensors,
                                    stored_precision)
from ddm.conditioning import LABELS, TEXT, Conditioning
from ddm.deploy import limits
from ddm.deploy.imported import DECODER_DIR, ROUTER_DIR, TEXT_ENCODER_DIR, expert_dir
from ddm.deploy.limits import MAX_IMAGE_CHANNELS, MAX_IMAGE_SIDE, MAX_TEXT_WIDTH
from ddm.convention import NetworkConvention, ScaledTimeNetwork, network_convention
from ddm.models.backends import Runtime, jax_runtime, torch_runtime
from ddm.models.label_stages import (LabelHeader, LabelNetwork, load_label_network,
                                     read_label_header)
from ddm.models.paris_loading import (load_paris_expert, load_paris_router,
                                      read_component_config, weight_file)
from ddm.models.trained_on import TRAINED_ON_KEY, TrainedOn
from ddm.models.text_prior import TEXT_PRIOR_KEY, TextPrior
from ddm.models.torch_io import model_input
from ddm.sampling_params import SamplingError, SamplingParams

#: ``forward(x (B, C, H, W) f32, t (B,) f32 ours, cond) -> v (B, C, H, W) f32``: an expert's
#: unguided velocity in our convention (guidance wraps it: :mod:`ddm.sampling.guidance`).
ConditionedVelocity = Callable[[np.ndarray, np.ndarray, Conditioning], np.ndarray]
#: ``router(x (B, C, H, W), t (B,) ours, cond) -> probabilities (B, K)``.
ConditionedRouter = Callable[[np.ndarray, np.ndarray, Conditioning], np.ndarray]
#: ``router(x (B, C, H, W), t (B,) ours, pooled (B, D) | None) -> probabilities (B, K)``: a
#: router network sees no prompt; its declared text prior (:mod:`ddm.models.text_prior`), if
#: any, weighs in the prompts' pooled text vectors (None: no evidence).
RouterProbabilities = Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray]

#: family -> the role its networks play. The label families (format-1 checkpoints: our
#: UNet, a user's network or exported program, the label router) are read from the
#: checkpoint's own fields, never from a ``_ddm`` block (:mod:`ddm.models.label_stages`).
FAMILIES = {"paris-dit": EXPERT, "paris-router": ROUTER, "pixart": EXPERT,
            "latent-router": ROUTER, "clip-text": TEXT_ENCODER, "autoencoder-kl": DECODER}
#: A family's library class name (config.json's ``_class_name`` or ``architectures``), which
#: names the family where ``_ddm`` does not (the text2img training's components).
_CLASS_FAMILIES = {"PixArtTransformer2DModel": "pixart", "LatentRouter": "latent-router",
                   "CLIPTextModel": "clip-text", "AutoencoderKL": "autoencoder-kl"}
#: How a diffusers model of a stage is read: its own safetensors, nothing fetched, no code of
#: the checkpoint's run (a concrete model class runs none; said so that no later diffusers
#: may), and initialised before its weights load, as diffusers does without ``accelerate``
#: (which our images do not ship): left to its default, it says so at every load.
_DIFFUSERS_LOADING = {"use_safetensors": True, "local_files_only": True,
                     "trust_remote_code": False, "low_cpu_mem_usage": False}
#: Precision names (:data:`ddm.deploy.limits.PRECISIONS`) -> torch dtypes.
PRECISIONS = dict(zip(limits.PRECISIONS, (torch.float32, torch.bfloat16, torch.float16)))


class ClipTextEncoder:
    """``prompts`` -> text :class:`Conditioning`: CLIP's last hidden state (B, L, D) and the
    tokens' attention mask, each prompt padded and truncated to the tokenizer's length (77 for
    CLIP). The model sees no mask (as Stable Diffusion and Paris run CLIP); no pooled vector is
    kept (Paris's experts take none). The tokenizer is ``AutoTokenizer``'s, so a CLIPTokenizer
    and a plain ``PreTrainedTokenizerFast`` both load."""

    def __init__(self, tokenizer: Path, text_encoder: Path, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        from transformers import AutoTokenizer, CLIPTextModel

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True,
                                                       trust_remote_code=False)
        length = self.tokenizer.model_max_length  # transformers' 1e30 where none is recorded
        if not 1 <= length <= limits.MAX_TEXT_TOKENS:
            raise ValueError(f"its tokenizer's model_max_length is {length:.4g}; prompts are "
                             f"padded to it, so it must be 1..{limits.MAX_TEXT_TOKENS}")
        self.model = CLIPTextModel.from_pretrained(
            text_encoder, use_safetensors=True, local_files_only=True, trust_remote_code=False,
            dtype=dtype or stored_dtype(text_encoder)).to(device).eval()
        self.device = device

    @property
    def width(self) -> int:
        """``D``, the embedding width."""
        return int(self.model.config.hidden_size)

    @property
    def length(self) -> int:
        """``L``, the tokens every prompt is padded or cut to."""
        return int(self.tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> Conditioning:
        tokens = self.tokenizer(list(prompts), max_length=self.length, padding="max_length",
                                truncation=True, return_tensors="pt")
        hidden = self.model(tokens.input_ids.to(self.device)).last_hidden_state
        return Conditioning(embeddings=hidden.float().cpu().numpy(),
                            mask=tokens.attention_mask.numpy().astype(np.int64))

    def tokens_cut(self, prompts: Sequence[str]) -> np.ndarray:
        """(B,) int64: how many tokens truncation drops from each prompt (CLIP keeps the
        first ``L``, special tokens included)."""
        # verbose=False: a prompt past the length is what is being counted, and the answer
        # says so; transformers' "longer than the specified maximum" warning would only
        # clutter the server's log.
        ids = self.tokenizer(list(prompts), truncation=False, verbose=False).input_ids
        return np.array([max(0, len(row) - self.length) for row in ids], np.int64)

    def unknown_spans(self, prompts: Sequence[str]) -> np.ndarray:
        """(N, 3) int64: per word the tokenizer maps to its unknown token (a word-level
        vocabulary's missing word; never for CLIP's byte-level BPE) among the ``L`` it reads
        (what is cut is counted by :meth:`tokens_cut`), its prompt's index and its characters
        ``[start, end)`` (:class:`~ddm.conditioning.EncodedPrompts`)."""
        unk = self.tokenizer.unk_token_id
        spans = []
        if unk is not None:
            tokens = self.tokenizer(list(prompts), add_special_tokens=False, truncation=True,
                                    max_length=self.length, return_offsets_mapping=True)
            spans = [(row, start, end) for row, (ids, offsets) in enumerate(zip(
                tokens.input_ids, tokens.offset_mapping))
                for token, (start, end) in zip(ids, offsets) if token == unk]
        return np.array(spans, np.int64).reshape(-1, 3)


class VaeDecoder:
    """Latents (B, C, S, S) -> images (B, 3, H, W) float32 in ``[-1, 1]``: diffusers'
    ``AutoencoderKL.decode(latents / scaling_factor)``, in the weights' own dtype."""

    def __init__(self, directory: Path, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        from diffusers import AutoencoderKL

        self.model = AutoencoderKL.from_pretrained(
            directory, **_DIFFUSERS_LOADING,
            torch_dtype=dtype or stored_dtype(directory)).to(device).eval()
        self.device = device

    @property
    def latent_channels(self) -> int:
        return int(self.model.config.latent_channels)

    @property
    def upsampling(self) -> int:
        """Image side / latent side."""
        return 2 ** (len(self.model.config.block_out_channels) - 1)

    @torch.no_grad()
    def __call__(self, latents: np.ndarray) -> np.ndarray:
        z = model_input(np.asarray(latents, np.float32)).to(self.device, self.model.dtype)
        images = self.model.decode(z / self.model.config.scaling_factor).sample
        return images.float().cpu().numpy()

    @torch.no_grad()
    def encode(self, images: np.ndarray) -> np.ndarray:
        """Images (B, 3, H, W) in ``[-1, 1]`` -> latents (B, C, S, S) float32: the posterior
        mean times ``scaling_factor``, what the experts were trained on (``ddm expert check``
        noises real latents so)."""
        x = model_input(np.asarray(images, np.float32)).to(self.device, self.model.dtype)
        mean = self.model.encode(x).latent_dist.mean
        return (mean * self.model.config.scaling_factor).float().cpu().numpy()


@dataclass(frozen=True)
class StageDeclaration:
    """A component's ``_ddm`` block, checked; sizes the library config determines are filled
    in by :func:`load_stage` (``latent_shape`` (C, S, S), ``text_width`` D)."""

    role: str
    family: str
    convention: str | None = None
    latent_shape: tuple[int, int, int] | None = None
    text_width: int | None = None
    cluster: int | None = None
    weights_sha256: str | None = None
    #: A router's text prior (``_ddm.text_prior``), None where it declares none.
    text_prior: TextPrior | None = field(default=None, compare=False, repr=False)
    #: A text encoder's example prompt (``_ddm.example_prompt``): one its DDM draws well, in
    #: words it knows; the page starts with it.
    example_prompt: str | None = field(default=None, compare=False)
    #: An expert's summary of its cluster (``_ddm.trained_on``), None where it declares none.
    trained_on: TrainedOn | None = field(default=None, compare=False)
    #: A label stage's labels (an expert's; every label for a router) and the size of its
    #: label space (:mod:`ddm.models.label_stages`); ``()`` and None for text stages.
    classes: tuple[int, ...] = ()
    num_classes: int | None = None
    #: A format-1 checkpoint's own name; None: its directory names the stage.
    name: str | None = None
    #: A format-1 checkpoint's framework (torch or jax: our UNet runs on either); None for
    #: the library families, which run on the backend that loads them.
    framework: str | None = None

    @property
    def conditioning(self) -> str:
        """What the stage is conditioned on: labels (a label family's) or text."""
        return TEXT if self.num_classes is None else LABELS

    @classmethod
    def from_config(cls, directory: Path, config: Mapping[str, Any]) -> StageDeclaration:
        """Parse ``config[DDM_KEY]``; the family may instead come from the library class name.
        Other ``_ddm`` keys (provenance: training settings, partition hashes) are kept out."""
        block = config.get(DDM_KEY)
        if not isinstance(block, dict):
            raise CheckpointError(f"{directory}/config.json declares no {DDM_KEY!r} object "
                                  "(role, family, convention): `ddm import` writes it")
        role = block.get("role")
        if role not in ROLES:
            raise CheckpointError(f"{directory}: {DDM_KEY}.role is {role!r}; expected one of "
                                  f"{', '.join(ROLES)}")
        family = block.get("family", _class_family(config))
        if family not in FAMILIES:
            raise CheckpointError(f"{directory}: {DDM_KEY}.family is {family!r}; expected one "
                                  f"of {', '.join(FAMILIES)}")
        if FAMILIES[family] != role:
            raise CheckpointError(f"{directory}: a {family} network plays the role "
                                  f"{FAMILIES[family]}, not {role}")
        convention = block.get("convention")
        if role in (EXPERT, ROUTER):
            if not isinstance(convention, str):
                raise CheckpointError(f"{directory}: an {role} must declare {DDM_KEY}."
                                      "convention ('ours' or 'flow-match-1000')")
            try:
                network_convention(convention)
            except ValueError as exc:
                raise CheckpointError(f"{directory}: {exc}") from None
        example = block.get("example_prompt")
        if example is not None and not (role == TEXT_ENCODER and isinstance(example, str)
                                        and len(example) <= limits.MAX_PROMPT_BYTES):
            raise CheckpointError(f"{directory}: {DDM_KEY}.example_prompt must be a text "
                                  f"encoder's prompt of at most {limits.MAX_PROMPT_BYTES} "
                                  f"characters, got {str(example)[:64]!r} for a {role}")
        shape = block.get("latent_shape")
        if shape is not None and not (
                isinstance(shape, list) and len(shape) == 3 and _ints(shape)
                and 0 < shape[0] <= MAX_IMAGE_CHANNELS and 0 < shape[1] <= MAX_IMAGE_SIDE
                and shape[1] == shape[2]):
            raise CheckpointError(f"{directory}: {DDM_KEY}.latent_shape must be [C, S, S] with "
                                  f"C <= {MAX_IMAGE_CHANNELS}, S <= {MAX_IMAGE_SIDE}; got "
                                  f"{shape!r}")
        width, cluster = block.get("text_width"), block.get("cluster")
        for name, value, top in (("text_width", width, MAX_TEXT_WIDTH), ("cluster", cluster,
                                                                          1 << 16)):
            if value is not None and not (_ints([value]) and 0 <= value <= top):
                raise CheckpointError(f"{directory}: {DDM_KEY}.{name} must be an integer in "
                                      f"0..{top}; got {value!r}")
        digest = block.get("weights_sha256")
        if digest is not None and not (isinstance(digest, str)
                                       and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise CheckpointError(f"{directory}: {DDM_KEY}.weights_sha256 must be 64 "
                                  "lower-case hex digits")
        trained = block.get(TRAINED_ON_KEY)
        if trained is not None and role != EXPERT:
            raise CheckpointError(f"{directory}: only an expert declares {DDM_KEY}."
                                  f"{TRAINED_ON_KEY}, not a {role}")
        prior = block.get(TEXT_PRIOR_KEY)
        if prior is not None and role != ROUTER:
            raise CheckpointError(f"{directory}: only a router declares {DDM_KEY}."
                                  f"{TEXT_PRIOR_KEY}, not a {role}")
        return cls(role=role, family=family, convention=convention,
                   latent_shape=None if shape is None else (shape[0], shape[1], shape[2]),
                   text_width=width, cluster=cluster, weights_sha256=digest,
                   text_prior=None if prior is None else TextPrior.from_declaration(
                       str(directory), prior), example_prompt=example,
                   trained_on=None if trained is None else TrainedOn.from_declaration(
                       str(directory), trained))


@dataclass(frozen=True)
class Stage:
    """One loaded stage: its declaration (sizes filled in), the dtype its weights run in
    (a :data:`PRECISIONS` name) and its NumPy callable, by role:

    * expert: ``(x, t, cond) -> v`` (:data:`ConditionedVelocity`, unguided; a label
      expert's reads ``cond.labels``, a text expert's ``cond.embeddings``);
    * router: ``(x, t, pooled) -> probabilities (B, K)`` (:data:`RouterProbabilities`); the
      label router network's ``(x, t, labels (B,) int64)``;
    * text_encoder: ``(prompts) -> Conditioning``, with ``tokens_cut(prompts) -> (B,)``;
    * decoder: ``(latents) -> images (B, 3, H, W)`` in ``[-1, 1]``; ``image_shape`` (3, H, W).
    """

    declaration: StageDeclaration
    dtype: str
    forward: Callable[..., Any]
    image_shape: tuple[int, int, int] | None = None
    tokens_cut: Callable[[Sequence[str]], np.ndarray] | None = field(default=None, repr=False)
    #: A text encoder's ``unknown_spans(prompts) -> (N, 3)`` (:class:`ClipTextEncoder`).
    unknown_spans: Callable[[Sequence[str]], np.ndarray] | None = field(default=None,
                                                                         repr=False)
    #: The router network's number of clusters (router stages).
    clusters: int | None = None
    #: The torch network ``forward`` calls (an expert's or router network's), which a server
    #: may compile in place (``--compile``); None where there is none to compile (JAX) or
    #: the stage is not compiled (text encoder, decoder: run once per generation).
    network: torch.nn.Module | None = field(default=None, repr=False, compare=False)
    #: A label expert's network as trained, ``(x, t, cond) -> its own prediction`` (the
    #: objective its checkpoint declares: epsilon, x0, ..., before ``forward`` converts it to
    #: our velocity): what ``ddm expert check`` tests that declaration against. None for the
    #: library families, whose declared convention ``forward`` converts exactly.
    prediction: Callable[..., Any] | None = field(default=None, repr=False)
    #: What runs the stage and where (``/v1/info``).
    runtime: Runtime | None = field(default=None, compare=False)
    #: The only batch sizes ``forward`` and ``prediction`` may be called with (a server pads
    #: each batch up to one: an exported program, JAX, a Neuron trace); None: any.
    batch_sizes: tuple[int, ...] | None = None

    @property
    def role(self) -> str:
        return self.declaration.role


def load_stage(directory: str | Path, dtype: str | None = None, device: str | None = "cpu",
               backend: str | None = None, batch_sizes: Sequence[int] | None = None,
               compile_cache: Path | None = None) -> Stage:
    """Load the stage checkpoint at ``directory`` by its declared role and family, its weights
    cast to ``dtype`` (a :data:`PRECISIONS` name; None: as stored), on ``device`` (None: the
    best one here for our label networks, CUDA where present; the CPU for library families),
    on ``backend`` (None: the checkpoint's own framework). A format-1 label checkpoint declares
    its role by its ``kind`` (:mod:`ddm.models.label_stages`); a server gives the
    ``batch_sizes`` it calls it at (a network that runs at fixed sizes is built for them) and
    the Neuron ``compile_cache`` (:mod:`ddm.models.backends`). Raises a ``CheckpointError``
    naming what is missing, undeclared or inconsistent."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    config = read_component_config(path)
    if _is_label_checkpoint(config):
        return _label_stage(load_label_network(path, dtype, device, backend, batch_sizes,
                                               compile_cache))
    backend, device = backend or "torch", device or "cpu"
    declared = StageDeclaration.from_config(path, config)
    if dtype is not None and dtype not in PRECISIONS:
        raise CheckpointError(f"unknown precision {dtype!r}; expected one of "
                              f"{', '.join(PRECISIONS)}")
    if backend not in limits.FRAMEWORKS:
        raise CheckpointError(f"unknown backend {backend!r}; expected one of "
                              f"{', '.join(limits.FRAMEWORKS)}")
    if backend == "jax" and declared.family != "pixart":
        raise CheckpointError(f"{path}: the jax backend serves pixart experts only, not "
                              f"{declared.family}")
    if declared.weights_sha256 is not None:
        check_sha256(path, stage_weights(path, declared).name, declared.weights_sha256)
    stage = load_declared(path, declared, dtype, device, backend)
    return replace(stage, runtime=_library_runtime(backend, device))


def read_stage_declaration(directory: Path) -> StageDeclaration:
    """The declaration of the stage checkpoint in ``directory``, read without its weights:
    its config.json's ``_ddm``, or a format-1 label checkpoint's own fields."""
    config = read_component_config(directory)
    if _is_label_checkpoint(config):
        return _label_declaration(read_label_header(directory))
    return StageDeclaration.from_config(directory, config)


def _is_label_checkpoint(config: Mapping[str, Any]) -> bool:
    return DDM_KEY not in config and FORMAT_KEY in config


def _label_declaration(header: LabelHeader,
                       latent_shape: tuple[int, int, int] | None = None) -> StageDeclaration:
    """A format-1 checkpoint's declaration (convention ours: its loader converts the
    objective)."""
    return StageDeclaration(role=header.role, family=header.family, convention="ours",
                            latent_shape=latent_shape or header.latent_shape,
                            cluster=header.cluster, classes=header.classes,
                            num_classes=header.num_classes, name=header.name,
                            framework=header.framework)


def _label_stage(network: LabelNetwork) -> Stage:
    """A format-1 checkpoint's network as a :class:`Stage`."""
    return Stage(_label_declaration(network.header, network.latent_shape), network.dtype,
                 network.forward, clusters=network.clusters, network=network.network,
                 prediction=network.prediction, runtime=network.runtime,
                 batch_sizes=network.batch_sizes)


def _library_runtime(backend: str, device: str) -> Runtime:
    """What runs a library family's network: torch on ``device``, or JAX on its default."""
    if backend == "jax":
        import jax

        return jax_runtime(jax.devices()[0])
    return torch_runtime(torch.device(device))


def stage_weights(path: Path, declared: StageDeclaration) -> Path:
    """The one safetensors file of the stage checkpoint at ``path``."""
    return weight_file(path) if declared.family.startswith("paris-") else one_safetensors(path)


def load_declared(path: Path, declared: StageDeclaration, dtype: str | None = None,
                  device: str = "cpu", backend: str = "torch") -> Stage:
    """Load ``path`` as ``declared`` says (a release's component that declares nothing
    itself, e.g. Paris's); what it states must match the network."""
    check_library_depth(path, declared.family)
    torch_dtype = None if dtype is None else PRECISIONS[dtype]
    stage = _LOADERS[declared.family](path, declared, torch_dtype, device, backend)
    _check_declared(path, declared, stage.declaration)
    return stage


def check_library_depth(path: Path, family: str) -> None:
    """The depth a library builds a ``family`` network from (:data:`_DEPTH_FIELDS` of its
    config.json) is at most ``MAX_NETWORK_BLOCKS``, before the library builds anything: it
    allocates every block's weights before it reads one (Paris's networks take their depth
    from the weights: ``paris_loading``)."""
    config = read_component_config(path)
    for name in _DEPTH_FIELDS.get(family, ()):
        value = config.get(name)
        depth = len(value) if isinstance(value, list) else value
        if _ints([depth]) and depth > limits.MAX_NETWORK_BLOCKS:
            raise CheckpointError(f"{path}/config.json: {name} gives {depth} blocks; a network "
                                  f"has at most {limits.MAX_NETWORK_BLOCKS}")


#: The config.json fields each library family's depth comes from (a list: its length).
_DEPTH_FIELDS = {"pixart": ("num_layers",), "latent-router": ("depth",),
                 "clip-text": ("num_hidden_layers",),
                 "autoencoder-kl": ("layers_per_block", "block_out_channels")}


#: Where each stage lies in a DDM directory without a root index (a decoder also in vae/).
_STAGE_DIRS = {ROUTER: (ROUTER_DIR,), TEXT_ENCODER: (TEXT_ENCODER_DIR,),
               DECODER: (DECODER_DIR, "vae")}


def stage_directory(root: Path, role: str) -> Path | None:
    """The subfolder of ``root`` (a DDM directory) that holds ``role`` (not the experts:
    :func:`expert_directories`): as its root index (:mod:`ddm.checkpoints.index`) names it,
    else by today's name where that subfolder exists; None where the DDM has none."""
    index = read_index(root)
    if index is not None:
        return index.stage_path(role)
    return next((root / name for name in _STAGE_DIRS[role] if (root / name).is_dir()), None)


#: A DDM's sampler settings where its root config.json says nothing (Paris's port's).
DEFAULT_GUIDANCE, DEFAULT_STEPS, DEFAULT_ROUTING = 7.5, 50, "top2"
#: Where a release's root config.json gives them (the names of Paris's port).
_RELEASE_SETTINGS = {"guidance_scale": ("cfg_scale", DEFAULT_GUIDANCE),
                     "steps": ("num_inference_steps", DEFAULT_STEPS),
                     "strategy": ("routing", DEFAULT_ROUTING)}


def release_sampling(root: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ``guidance_scale``, ``steps`` and ``strategy`` a release's root config.json
    (``settings``) gives, its port's defaults where it gives none, as :class:`SamplingParams`
    takes them; a :class:`CheckpointError` naming the file and the key where one is outside
    its declaration's bounds (a checkpoint is a peer's: its numbers size every generation that
    takes its defaults)."""
    values = {name: settings.get(key, default)
              for name, (key, default) in _RELEASE_SETTINGS.items()}
    if isinstance(values["steps"], float) and values["steps"].is_integer():
        values["steps"] = int(values["steps"])  # JSON's 50.0
    try:
        params = SamplingParams(**values)
    except SamplingError as error:
        raise CheckpointError(f"{root}/config.json: " + "; ".join(
            f"{_RELEASE_SETTINGS[name][0]} {message}" for name, message in error.problems)
        ) from None
    return {name: getattr(params, name) for name in _RELEASE_SETTINGS}
_EXPERT_DIR = re.compile(r"expert_(\d+)")


def expert_directories(root: Path) -> list[str]:
    """``root``'s expert subfolders in the router network's order: as its root index
    (:mod:`ddm.checkpoints.index`) lists them, else ``expert_0 .. expert_N-1``."""
    index = read_index(root)
    if index is not None:
        return list(index.experts)
    indices = sorted(int(m.group(1)) for p in root.iterdir()
                     if p.is_dir() and (m := _EXPERT_DIR.fullmatch(p.name)))
    if indices != list(range(len(indices))) or not indices:
        raise CheckpointError(f"{root} must hold expert_0 .. expert_N-1, found experts "
                              f"{indices}")
    return [expert_dir(k) for k in indices]


def check_stage_shapes(root: Path, experts: Sequence[Stage], router: Stage | None,
                       encoder: Stage | None, decoder: Stage | None) -> tuple[int, int, int]:
    """The state's (C, S, S), the same for every expert, the router and the decoder (its
    channels; its side where declared), and the text width the experts and encoder share."""
    shapes = {expert_dir(k): e.declaration.latent_shape for k, e in enumerate(experts)}
    if router is not None:
        shapes[ROUTER_DIR] = router.declaration.latent_shape
        if router.clusters != len(experts):
            raise CheckpointError(f"{root}: the router network was trained for "
                                  f"{router.clusters} experts, the DDM has {len(experts)}")
        prior = router.declaration.text_prior
        if prior is not None and encoder is not None and (
                prior.text_width != encoder.declaration.text_width):
            raise CheckpointError(f"{root}: the router's {DDM_KEY}.{TEXT_PRIOR_KEY} takes "
                                  f"text of width {prior.text_width}, the text encoder makes "
                                  f"{encoder.declaration.text_width}")
    if len(set(shapes.values())) != 1:
        raise CheckpointError(f"{root}: the stages disagree on the latent shape (C, S, S): "
                              f"{shapes}")
    latent_shape = shapes["expert_0"]
    assert latent_shape is not None, "every expert and router family fills it in"
    if decoder is not None:
        decoded = decoder.declaration.latent_shape
        assert decoded is not None, "the decoder's loader fills it in"
        if decoded[0] != latent_shape[0]:
            raise CheckpointError(f"{root}: the decoder takes {decoded[0]}-channel latents, "
                                  f"the experts make {latent_shape[0]}")
    widths = {e.declaration.text_width for e in experts}
    if encoder is not None and widths != {encoder.declaration.text_width}:
        raise CheckpointError(f"{root}: the text encoder's width is "
                              f"{encoder.declaration.text_width}, the experts take "
                              f"{sorted(widths)}")
    return latent_shape


def stored_dtype(directory: Path) -> torch.dtype:
    """The one floating dtype of a diffusers component's safetensors weights."""
    path = one_safetensors(directory)
    precision = stored_precision(path)
    if precision is None:
        raise CheckpointError(f"{path} holds no floating weights; expected F32, BF16 or F16")
    return PRECISIONS[precision]


def precision_name(dtype: torch.dtype) -> str:
    """A torch floating dtype -> its :data:`PRECISIONS` name."""
    return next(name for name, value in PRECISIONS.items() if value == dtype)


# Conversions at a network's edge: our (x, t, cond) in, our velocity out --------------------

def network_velocity(run: Callable[..., torch.Tensor], like: torch.Tensor,
                     convention: NetworkConvention) -> ConditionedVelocity:
    """An expert network ``run(x, timestep, embeddings, *per_row) -> output`` (tensors in the
    weights' dtype and device, timestep float32; further per-row integer arrays, such as a
    grouped forward's expert of each row, as int64 on the device) as our unguided velocity
    ``(x, t, cond, *per_row)``."""

    @torch.no_grad()
    def velocity(x: np.ndarray, t: np.ndarray, cond: Conditioning,
                 *per_row: np.ndarray) -> np.ndarray:
        if cond.embeddings is None:
            raise ValueError("a text expert is conditioned on text embeddings, not labels")
        output = run(_tensor(x, like), _tensor(convention.timestep(t), like, torch.float32),
                     _tensor(cond.embeddings, like),
                     *(_tensor(array, like, torch.int64) for array in per_row))
        return np.asarray(convention.velocity(output.float().cpu().numpy()), np.float32)

    return velocity


def network_probabilities(run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          like: torch.Tensor, timestep: Callable[[np.ndarray], np.ndarray],
                          prior: TextPrior | None = None) -> RouterProbabilities:
    """A router network ``run(x, timestep) -> logits`` as ``(x, t, pooled) -> softmax (B,
    K)``; with a text ``prior``, of the logits plus its log odds of the pooled rows (Bayes'
    rule, :mod:`ddm.models.text_prior`); without one, or for ``pooled`` None, the network's."""

    @torch.no_grad()
    def probabilities(x: np.ndarray, t: np.ndarray,
                      pooled: np.ndarray | None = None) -> np.ndarray:
        logits = run(_tensor(x, like), _tensor(timestep(t), like, torch.float32))
        logits = logits.double().cpu()
        if prior is not None and pooled is not None:
            if len(pooled) != len(logits):
                raise ValueError(f"{len(pooled)} pooled text rows for {len(logits)} latents")
            logits = logits + torch.from_numpy(prior.log_odds(pooled))
        return torch.softmax(logits, dim=-1).float().numpy()

    return probabilities


def _tensor(array: np.ndarray, like: torch.Tensor,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    return model_input(np.ascontiguousarray(array)).to(like.device, dtype or like.dtype)


# One loader per family ---------------------------------------------------------------------

def _paris_expert(path: Path, declared: StageDeclaration, dtype: torch.dtype | None,
                  device: str, backend: str) -> Stage:
    network = load_paris_expert(path, dtype).to(device)
    _check_outputs(path, network.config.in_channels, network.config.out_channels)
    return _stage(declared, network, paris_expert_velocity(network, _convention(declared)),
                  latent=(network.config.in_channels, network.config.input_size),
                  text_width=network.config.text_embed_dim)


def _paris_router(path: Path, declared: StageDeclaration, dtype: torch.dtype | None,
                  device: str, backend: str) -> Stage:
    network = load_paris_router(path, dtype).to(device)
    stage = _stage(declared, network,
                   paris_router_probabilities(network, _convention(declared),
                                              declared.text_prior),
                   latent=(network.config.in_channels, network.config.input_size))
    return _with_clusters(path, stage, network.config.num_clusters)


def paris_expert_velocity(network: torch.nn.Module, convention: NetworkConvention
                          ) -> ConditionedVelocity:
    """A Paris expert ``(x, timestep, text)`` as our unguided velocity."""
    return network_velocity(network, next(network.parameters()), convention)


def paris_router_probabilities(network: torch.nn.Module, convention: NetworkConvention,
                               prior: TextPrior | None = None) -> RouterProbabilities:
    """A Paris router network ``(x, timestep)`` as our cluster probabilities."""
    return network_probabilities(network, next(network.parameters()), convention.timestep,
                                 prior)


def _pixart(path: Path, declared: StageDeclaration, dtype: torch.dtype | None, device: str,
            backend: str) -> Stage:
    from diffusers import PixArtTransformer2DModel

    if backend == "jax":
        return _flax_pixart(path, declared, dtype)
    model = PixArtTransformer2DModel.from_pretrained(
        path, **_DIFFUSERS_LOADING, torch_dtype=dtype or stored_dtype(path)).to(device).eval()
    config = model.config
    _check_outputs(path, config.in_channels, config.out_channels)

    def run(x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return model(x, encoder_hidden_states=text, timestep=timestep,
                     added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample

    velocity = network_velocity(run, next(model.parameters()), _convention(declared))
    return _stage(declared, model, velocity, latent=(config.in_channels, config.sample_size),
                  text_width=config.caption_channels)


def _flax_pixart(path: Path, declared: StageDeclaration, dtype: torch.dtype | None) -> Stage:
    """The pixart expert on JAX: ``ddm.models.flax_pixart.load_flax_expert(directory)``
    gives ``(forward(latents, text, timestep) -> output NumPy, its diffusers config)``."""
    from ddm.models import flax_pixart

    if dtype is not None:
        raise CheckpointError("the jax pixart expert runs in its stored dtype; --precision "
                              "is for the torch backend")
    forward, config = flax_pixart.load_flax_expert(path)
    convention = _convention(declared)

    def velocity(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        if cond.embeddings is None:
            raise ValueError("a text expert is conditioned on text embeddings, not labels")
        output = forward(np.asarray(x, np.float32), np.asarray(cond.embeddings, np.float32),
                         convention.timestep(t))
        return np.asarray(convention.velocity(np.asarray(output, np.float32)), np.float32)

    filled = _filled(declared, latent=(config["in_channels"], config["sample_size"]),
                     text_width=config["caption_channels"])
    return Stage(filled, precision_name(stored_dtype(path)), velocity)


def _latent_router(path: Path, declared: StageDeclaration, dtype: torch.dtype | None,
                   device: str, backend: str) -> Stage:
    from ddm.models.latent_router import LatentRouter

    if not isinstance(_convention(declared), ScaledTimeNetwork):
        raise CheckpointError(f"{path}: a latent-router sees our time t (it scales it "
                              "itself): its convention must be 'ours'")
    model = LatentRouter.from_pretrained(path, **_DIFFUSERS_LOADING,
                                         torch_dtype=dtype or stored_dtype(path))
    model = model.to(device).eval()
    stage = _stage(declared, model, network_probabilities(
        model, next(model.parameters()), lambda t: np.asarray(t, np.float32),
        declared.text_prior), latent=(model.config.in_channels, model.config.input_size))
    return _with_clusters(path, stage, model.config.num_clusters)


def _clip_text(path: Path, declared: StageDeclaration, dtype: torch.dtype | None, device: str,
               backend: str) -> Stage:
    try:
        encoder = ClipTextEncoder(path, path, device, dtype)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: a clip-text stage holds CLIPTextModel and its "
                              f"tokenizer files: {exc}") from None
    filled = _filled(declared, text_width=encoder.width)
    return Stage(filled, precision_name(encoder.model.dtype), encoder,
                 tokens_cut=encoder.tokens_cut, unknown_spans=encoder.unknown_spans)


def _autoencoder_kl(path: Path, declared: StageDeclaration, dtype: torch.dtype | None,
                    device: str, backend: str) -> Stage:
    decoder = VaeDecoder(path, device, dtype)
    config = decoder.model.config
    side = (declared.latent_shape[1] if declared.latent_shape is not None
            else int(config.sample_size) // decoder.upsampling)
    filled = _filled(declared, latent=(decoder.latent_channels, side))
    return Stage(filled, precision_name(decoder.model.dtype), decoder,
                 image_shape=(int(config.out_channels), side * decoder.upsampling,
                              side * decoder.upsampling))


_LOADERS: dict[str, Callable[[Path, StageDeclaration, torch.dtype | None, str, str], Stage]] = {
    "paris-dit": _paris_expert, "paris-router": _paris_router, "pixart": _pixart,
    "latent-router": _latent_router, "clip-text": _clip_text,
    "autoencoder-kl": _autoencoder_kl}


def _stage(declared: StageDeclaration, network: torch.nn.Module, forward: Callable[..., Any],
           latent: tuple[int, int], text_width: int | None = None) -> Stage:
    dtype = next(network.parameters()).dtype
    return Stage(_filled(declared, latent, text_width), precision_name(dtype), forward,
                 network=network)


def _with_clusters(path: Path, stage: Stage, clusters: int) -> Stage:
    prior = stage.declaration.text_prior
    if prior is not None and prior.clusters != clusters:
        raise CheckpointError(f"{path}: {DDM_KEY}.{TEXT_PRIOR_KEY} weighs {prior.clusters} "
                              f"clusters, the router network has {clusters}")
    return Stage(stage.declaration, stage.dtype, stage.forward, clusters=int(clusters),
                 network=stage.network)


def _filled(declared: StageDeclaration, latent: tuple[int, int] | None = None,
            text_width: int | None = None) -> StageDeclaration:
    """``declared`` with the sizes the library config determines."""
    shape = None if latent is None else (int(latent[0]), int(latent[1]), int(latent[1]))
    return replace(declared, latent_shape=shape or declared.latent_shape,
                   text_width=declared.text_width if text_width is None else int(text_width))


def _check_declared(path: Path, declared: StageDeclaration, loaded: StageDeclaration) -> None:
    """What ``_ddm`` states must be what the weights and library config say."""
    for name in ("latent_shape", "text_width"):
        stated, actual = getattr(declared, name), getattr(loaded, name)
        if stated is not None and stated != actual:
            raise CheckpointError(f"{path}: {DDM_KEY}.{name} says {stated}, the network "
                                  f"has {actual}")


def _check_outputs(path: Path, channels: int, outputs: int) -> None:
    if outputs != channels:
        raise CheckpointError(f"{path}: the expert predicts {outputs} channels for "
                              f"{channels}-channel latents (a learned sigma is not served)")


def _convention(declared: StageDeclaration) -> NetworkConvention:
    assert declared.convention is not None, "StageDeclaration requires it of experts, routers"
    return network_convention(declared.convention)


def _class_family(config: Mapping[str, Any]) -> str | None:
    names = [config.get("_class_name"), *(config.get("architectures") or [])]
    return next((_CLASS_FAMILIES[n] for n in names if n in _CLASS_FAMILIES), None)




def _ints(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)
