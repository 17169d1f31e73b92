"""``ddm train text2img STAGE``: each stage reads the components before it from the DDM root and
writes its own, resumably, so that scripts/train_text2img.sh can chain and restart them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ddm.data.colored_mnist import EXAMPLE_PROMPT, ColoredDigits, load_colored_mnist
from ddm.deploy.imported import expert_dir
from ddm.deploy.training_spec import TEXT2IMG_CLUSTERS, TEXT2IMG_STEPS
from ddm.models.text2img import expert_convention, expert_kwargs, router_convention, sizes
from ddm.training.config import TrainConfig
from ddm.training.distributed import SINGLE, World
from ddm.training.resume import Resumable, state_directory
from ddm.training.text2img import layout

#: ``progress(step, loss)``, as ``ddm.training.torch_loop.ProgressFn`` (not imported: torch).
ProgressFn = Callable[[int, float], None]

#: Default optimisation per training stage (``--steps`` etc. override them); the steps are
#: the ones a DDMTraining's ``spec.text2img.steps`` defaults to.
DEFAULTS = {
    "clip": TrainConfig(steps=TEXT2IMG_STEPS["clip"], batch_size=128, learning_rate=1e-3),
    "vae": TrainConfig(steps=TEXT2IMG_STEPS["vae"], batch_size=32, learning_rate=1e-3),
    "expert": TrainConfig(steps=TEXT2IMG_STEPS["expert"], batch_size=128, learning_rate=5e-4),
    "monolith": TrainConfig(steps=TEXT2IMG_CLUSTERS * TEXT2IMG_STEPS["expert"],
                            batch_size=128, learning_rate=5e-4),
    "router": TrainConfig(steps=TEXT2IMG_STEPS["router"], batch_size=256, learning_rate=1e-3),
}
#: The stages that train data-parallel when started by torchrun; the others run alone.
DATA_PARALLEL_STAGES = ("expert", "router", "monolith")
#: Clusters of the partition (experts) unless ``--clusters`` says, and the times the router's
#: accuracy is reported at.
CLUSTERS = TEXT2IMG_CLUSTERS
ROUTER_REPORT_TIMES = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class StageRun:
    """What every stage is given: the DDM root, the MNIST IDX directory, the network size,
    the colouring seed of the data, how to train and save, and this process's world
    (``ddm.training.distributed``: rank 0 alone saves); ``clusters``: the partition stage's
    k (the later stages read it from the partition)."""

    root: Path
    mnist: Path
    size: str
    train: TrainConfig
    data_seed: int = 0
    index: int | None = None
    clusters: int = CLUSTERS
    save_every: int = 250
    resume: bool = False
    progress: ProgressFn | None = None
    world: World = SINGLE

    def data(self) -> ColoredDigits:
        return load_colored_mnist(self.mnist, "train", self.data_seed)

    def resumable(self, component: str, **identity: Any) -> Resumable:
        return Resumable(state_directory(self.root / component), every=self.save_every,
                         resume=self.resume, writer=self.world.writer, identity={
                             "stage": component, "size": self.size, "data_seed": self.data_seed,
                             "train": self.train.to_dict(), **identity})


def default_train(stage: str, overrides: dict[str, Any]) -> TrainConfig:
    """The stage's defaults with the given fields (those not None) replaced."""
    base = DEFAULTS.get(stage, TrainConfig())
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def run_stage(stage: str, run: StageRun) -> Path | None:
    """Run one stage; returns the component directory it wrote and refreshes model_index.json
    (on data-parallel ranks other than 0, which write nothing: None)."""
    stages: dict[str, Callable[[StageRun], Path | None]] = {
        "tokenizer": tokenizer_stage, "clip": clip_stage, "vae": vae_stage,
        "partition": partition_stage, "latents": latents_stage, "expert": expert_stage,
        "router": router_stage, "text-prior": text_prior_stage, "monolith": monolith_stage,
        "monolith-snapshot": monolith_snapshot_stage}
    if stage not in stages:
        raise ValueError(f"unknown text2img stage {stage!r}; known: {', '.join(stages)}")
    sizes(run.size)  # reject an unknown size before any work
    if run.world.size > 1 and stage not in DATA_PARALLEL_STAGES:
        raise ValueError(f"the {stage} stage runs as one process; only "
                         f"{', '.join(DATA_PARALLEL_STAGES)} train on several")
    run.world.shard(run.train.batch_size)  # a batch the processes cannot share: refused now
    out = stages[stage](run)
    if not run.world.writer:
        return None
    layout.write_model_index(run.root)
    return out


def tokenizer_stage(run: StageRun) -> Path:
    from ddm.training.text2img.tokenizer import build_tokenizer

    return layout.save_component(build_tokenizer(run.data().captions), run.root,
                                 layout.TOKENIZER)


def load_tokenizer(root: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_component(root, layout.TOKENIZER),
                                         trust_remote_code=False)


def load_clip(root: Path) -> Any:
    from transformers import CLIPModel

    return CLIPModel.from_pretrained(_component(root, layout.CLIP),
                                     trust_remote_code=False).eval().requires_grad_(False)


def load_vae(root: Path) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(_component(root, layout.VAE),
                                         trust_remote_code=False).eval().requires_grad_(False)


def clip_stage(run: StageRun) -> Path:
    from ddm.training.text2img.clip import text_encoder_of, train_clip

    tokenizer = load_tokenizer(run.root)
    clip = train_clip(run.data(), tokenizer, sizes(run.size), run.train,
                      run.resumable(layout.CLIP), run.progress)
    layout.save_component(text_encoder_of(clip), run.root, layout.TEXT_ENCODER,
                          {"example_prompt": EXAMPLE_PROMPT})
    return layout.save_component(clip, run.root, layout.CLIP)


def vae_stage(run: StageRun) -> Path:
    from ddm.training.text2img.vae import train_vae

    vae = train_vae(run.data(), sizes(run.size), run.train, run.resumable(layout.VAE),
                    run.progress)
    return layout.save_component(vae, run.root, layout.VAE)


def partition_stage(run: StageRun) -> Path:
    from ddm.data.partition_file import save_partition_file
    from ddm.training.text2img.clip import image_embeddings
    from ddm.training.text2img.partition import file_sha256, fit_embedding_partition

    clip = load_clip(run.root)
    data = run.data()
    content = fit_embedding_partition(
        image_embeddings(clip, data.images), data, run.clusters, run.train.seed,
        file_sha256(run.root / layout.CLIP / "model.safetensors"))
    return save_partition_file(run.root / layout.PARTITION, content)


def latents_stage(run: StageRun) -> Path:
    """Encode every training image (VAE posterior mean x scaling factor) and every distinct
    caption (text encoder), with each image's cluster, into ``latents.safetensors``."""
    import numpy as np
    import torch
    from transformers import CLIPTextModel

    from ddm.training.text2img.clip import image_embeddings
    from ddm.training.text2img.flow import LatentSet
    from ddm.training.text2img.partition import assign, read_embedding_partition
    from ddm.training.text2img.prior import distinct_captions
    from ddm.training.text2img.tokenizer import tokenize
    from ddm.training.text2img.vae import encode_means

    data = run.data()
    record = read_embedding_partition(run.root / layout.PARTITION)
    clusters = assign(np.asarray(record["centroids"]),
                      image_embeddings(load_clip(run.root), data.images))
    vae = load_vae(run.root)
    latents = encode_means(vae, data.images) * vae.config.scaling_factor
    captions, caption_index = distinct_captions(data.captions)
    encoder = CLIPTextModel.from_pretrained(_component(run.root, layout.TEXT_ENCODER),
                                            trust_remote_code=False).eval()
    ids = torch.from_numpy(tokenize(load_tokenizer(run.root), list(captions)))
    with torch.no_grad():
        embeddings = torch.cat([encoder(input_ids=ids[i:i + 256]).last_hidden_state
                                for i in range(0, len(ids), 256)]).numpy()
    out = run.root / layout.LATENTS
    LatentSet(latents.astype(np.float32), clusters, caption_index,
              embeddings.astype(np.float32)).save(out, {
                  "partition_sha256": record["sha256"],
                  "scaling_factor": str(vae.config.scaling_factor),
                  "empty_caption_index": str(int(np.flatnonzero(captions == "")[0]))})
    return out


def expert_stage(run: StageRun) -> Path | None:
    import numpy as np

    from ddm.training.text2img.flow import train_flow

    data, sha = _latent_set(run.root)
    clusters = _clusters(run.root)
    if run.index is None or not 0 <= run.index < clusters:
        raise ValueError(f"an expert needs --index between 0 and {clusters - 1} (the "
                         f"partition's {clusters} clusters)")
    name = expert_dir(run.index)
    resumable = run.resumable(name, partition_sha256=sha, index=run.index)
    model = train_flow(data, np.flatnonzero(data.clusters == run.index), sizes(run.size),
                       run.train, resumable, run.progress, run.world)
    if not run.world.writer:
        return None
    return layout.save_component(model, run.root, name, _declared(
        run, resumable, expert_convention(), role="expert", cluster=run.index,
        partition_sha256=sha))


def monolith_stage(run: StageRun) -> Path | None:
    import numpy as np

    from ddm.training.text2img.flow import train_flow

    data, _ = _latent_set(run.root)
    resumable = run.resumable(layout.MONOLITH)
    model = train_flow(data, np.arange(len(data.latents)), sizes(run.size), run.train,
                       resumable, run.progress, run.world)
    if not run.world.writer:
        return None
    return layout.save_component(model, run.root, layout.MONOLITH, _declared(
        run, resumable, expert_convention(), role="monolith"))


def monolith_snapshot_stage(run: StageRun) -> Path:
    """``monolith-snapshot/``: the EMA weights of the monolith's latest saved training state,
    for comparisons while its (long) training still runs; its config declares the steps it
    had (``trained_steps``) beside the planned ones (``train.steps``). Reads only."""
    import json

    import torch
    from diffusers import PixArtTransformer2DModel

    from ddm.training.resume import IDENTITY_FILE
    from ddm.training.torch_loop import TORCH_STATE

    saved = state_directory(run.root / layout.MONOLITH)
    if not (saved / TORCH_STATE).is_file():
        raise FileNotFoundError(f"{saved / TORCH_STATE} is missing: the monolith has saved no "
                                "state yet")
    state = torch.load(saved / TORCH_STATE, map_location="cpu", weights_only=True)
    identity = json.loads((saved / IDENTITY_FILE).read_text())
    text = json.loads((_component(run.root, layout.TEXT_ENCODER) / "config.json").read_text())
    model = PixArtTransformer2DModel(**expert_kwargs(sizes(identity["size"]),
                                                     text["hidden_size"]))
    model.load_state_dict(state["ema"], strict=True)
    return layout.save_component(model.eval(), run.root, layout.MONOLITH_SNAPSHOT, {
        **expert_convention(), "role": "monolith", "size": identity["size"],
        "train": identity["train"], "trained_steps": int(state["step"])})


def router_stage(run: StageRun) -> Path | None:
    from ddm.training.text2img.flow import router_accuracy, train_latent_router

    data, sha = _latent_set(run.root)
    resumable = run.resumable(layout.ROUTER, partition_sha256=sha)
    router = train_latent_router(data, _clusters(run.root), sizes(run.size), run.train,
                                 resumable,
                                 run.progress, run.world)
    if not run.world.writer:
        return None
    accuracy = router_accuracy(router, data, ROUTER_REPORT_TIMES, 2000, run.train.seed)
    return layout.save_component(router, run.root, layout.ROUTER, _declared(
        run, resumable, router_convention(), role="router", partition_sha256=sha,
        accuracy_by_time=accuracy))


def text_prior_stage(run: StageRun) -> Path:
    """``text_prior.json``: the router's text prior p(cluster | caption), fitted on the training
    captions and their images' clusters (:mod:`ddm.training.text2img.prior`), with its
    provenance; ``ddm import text2img`` declares it in the router's config.json."""
    import json

    import numpy as np

    from ddm.fileio import atomic_path
    from ddm.models.stages import ClipTextEncoder
    from ddm.models.text_prior import TEXT_PRIOR_FILE, pooled_text
    from ddm.training.text2img.partition import file_sha256
    from ddm.training.text2img.prior import L2, distinct_captions, fit_text_prior

    data, sha = _latent_set(run.root)
    captions, index = distinct_captions(run.data().captions)
    if not np.array_equal(index, data.caption_index):
        raise ValueError(f"{run.root / layout.LATENTS} numbers other captions than the data's: "
                         "rerun the latents stage")
    encoder = ClipTextEncoder(_component(run.root, layout.TOKENIZER),
                              _component(run.root, layout.TEXT_ENCODER))
    pooled = np.concatenate([pooled_text(encoder(list(captions[i:i + 256])))
                             for i in range(0, len(captions), 256)])
    projection = load_clip(run.root).text_projection.weight.numpy()
    prior, nll = fit_text_prior(projection, pooled, index, data.clusters,
                                _clusters(run.root))
    out = run.root / TEXT_PRIOR_FILE
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps({
            "partition_sha256": sha,
            "clip_sha256": file_sha256(_component(run.root, layout.CLIP) / "model.safetensors"),
            "fit": {"method": "softmax regression of the image's cluster on the caption's "
                              "unit CLIP text embedding, L-BFGS", "l2": L2,
                    "captions": int(np.any(pooled != 0, axis=1).sum()),
                    "nll_nats": round(nll, 4)},
            "text_prior": prior.declaration()}))
    return out


def _latent_set(root: Path) -> tuple[Any, str]:
    from safetensors import safe_open

    from ddm.training.text2img.flow import LatentSet

    path = root / layout.LATENTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the latents stage first")
    with safe_open(str(path), "np") as f:
        sha = f.metadata()["partition_sha256"]
    return LatentSet.load(path), sha


def _clusters(root: Path) -> int:
    """The number of clusters of the partition in ``root`` (the partition stage's k)."""
    from ddm.training.text2img.partition import read_embedding_partition

    return len(read_embedding_partition(root / layout.PARTITION)["centroids"])


def _declared(run: StageRun, resumable: Resumable, convention: dict[str, Any],
              **fields: Any) -> dict[str, Any]:
    """What a trained component's config.json declares under ``DDM_CONFIG_KEY``: its
    conventions, role and provenance (wall-clock training seconds, resumed sessions included;
    the processes that shared each global batch)."""
    return {**convention, **fields, "size": run.size, "train": run.train.to_dict(),
            "training_seconds": round(resumable.elapsed(), 1), "world_size": run.world.size}


def _component(root: Path, name: str) -> Path:
    path = root / name
    if not layout.finished(path):
        raise FileNotFoundError(f"{path} is missing: run its stage of `ddm train text2img` "
                                "first")
    return path
