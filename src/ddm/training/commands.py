"""``ddm train ...``: load data, pick the partition, train, write a checkpoint with provenance."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ddm.checkpoints.discovery import discover
from ddm.checkpoints.index import write_index
from ddm.checkpoints.roles import ROUTER
from ddm.checkpoints.format import (CheckpointError, CheckpointMeta, check_checkpoint_output,
                                   load_checkpoint, save_checkpoint)
from ddm.convention import to_model_space
from ddm.data import (Dataset, Partition, check_partition_hash, classes_of, load_dataset,
                      load_partition, partition_from_dict, partition_from_spec, partition_sha256)
from ddm.data.datasets import recorded_source
from ddm.models.config import RouterNetworkConfig, unet_config
from ddm.objectives import NATIVE, Objective
from ddm.training.config import TrainConfig
from ddm.training.distributed import World
from ddm.training.resume import SAVE_EVERY, Resumable, state_directory
from ddm.training.torch_loop import ProgressFn


def train_unet(kind: str, framework: str, data: str, model_config: str, train: TrainConfig,
               out: Path, name: str | None = None, device: str | None = None,
               partition: str | None = None, index: int | None = None,
               progress: ProgressFn | None = None, objective: Objective = NATIVE,
               save_every: int = SAVE_EVERY, resume: bool = False) -> Path | None:
    """Train an expert (one part of ``partition``) or the monolith (all data) and save it.

    ``objective`` (see :func:`unet_objective`) is what the UNet learns to predict; the
    checkpoint declares it so that loaders convert its outputs to our velocity. The training
    state is saved every ``save_every`` steps beside ``out`` (``ddm.training.resume``);
    ``resume`` continues it.

    Started by torchrun, or with the JAX job's variables, it is one of several data-parallel
    processes (``ddm.training.distributed``); only rank 0 writes and reports progress, and
    returns the checkpoint's path (the others return None).
    """
    if kind not in ("expert", "monolith"):
        raise ValueError(f"unknown UNet kind {kind!r}")
    check_checkpoint_output(out)
    config = unet_config(model_config)
    dataset = load_dataset(data, config.image_size, "train")
    if kind == "expert":
        if partition is None or index is None:
            raise ValueError("an expert needs --partition and --index")
        scheme = partition_from_spec(partition, dataset, seed=train.seed)
        if not 0 <= index < scheme.num_partitions:
            raise ValueError(f"--index {index} is outside the {scheme.num_partitions} parts "
                             f"of partition {partition!r}")
        ids = scheme.assign(dataset.images, dataset.labels)
        rows = np.flatnonzero(ids == index)
        if rows.size == 0:
            raise ValueError(f"part {index} of partition {partition!r} holds no training images")
        subset = dataset.select(rows, f"{dataset.name}/part{index}")
        classes = classes_of(ids, dataset.labels, index)
        partition_meta: dict[str, Any] | None = {"scheme": scheme.to_dict(), "index": index}
    else:
        subset, partition_meta = dataset, None
        classes = tuple(int(c) for c in np.unique(dataset.labels))

    images, labels = to_model_space(subset.images), subset.labels
    with _processes(framework, device, train) as (world, target, resolved):
        resumable = Resumable(state_directory(out), every=save_every, resume=resume,
                              writer=world.writer, identity={
            "kind": kind, "framework": framework, "config": model_config, "data": data,
            "partition": partition_meta and [partition_meta["scheme"]["sha256"], index],
            "objective": objective.to_dict(), "train": train.to_dict()})
        progress = progress if world.writer else None
        if framework == "torch":
            from ddm.training.torch_expert import train_torch_unet

            weights = train_torch_unet(config, train, images, labels, target, progress,
                                       objective=objective, resumable=resumable, world=world)
        else:
            from ddm.training.jax_expert import train_flax_unet

            weights = train_flax_unet(config, train, images, labels, progress, mesh=target,
                                      objective=objective, resumable=resumable)
    if not world.writer:
        return None
    meta = CheckpointMeta(
        kind=kind, name=name or out.name, architecture=config.to_dict(), framework=framework,
        classes=classes, partition=partition_meta, data=_data_record(data, subset),
        training=_training_record(train, model_config, resolved, resumable.elapsed(), world),
        objective=objective)
    return save_checkpoint(out, meta, weights)


@contextlib.contextmanager
def _processes(framework: str, device: str | None, train: TrainConfig
               ) -> Iterator[tuple[World, Any, str]]:
    """This process's data-parallel world, what its trainer runs on (a ``torch.device``, or a
    JAX mesh) and its device's name for the record; refuses a global batch the processes
    cannot share equally before anything trains."""
    from ddm.training import distributed

    if framework == "torch":
        with distributed.torch_world(device) as (world, resolved):
            world.shard(train.batch_size)
            yield world, resolved, str(resolved)
    elif framework == "jax":
        world, mesh = distributed.jax_world(device)
        world.shard(train.batch_size)
        yield world, mesh, str(mesh.local_devices[0])
    else:
        raise ValueError(f"unknown framework {framework!r}; use torch or jax")


def unet_objective(prediction: str = "velocity", schedule: str = "linear",
                   time: str = "continuous", timesteps: int = 1000) -> Objective:
    """The objective our UNet trains on: its time input is a fraction of the unit interval
    (``ddm.convention.TIME_EMBEDDING_SCALE`` spreads it), so a discrete expert receives
    ``k / T`` (the embedding then sees DDPM's step ``k``) and a continuous one ``tau``."""
    if time not in ("continuous", "discrete"):
        raise ValueError(f"our UNet trains with continuous or discrete time, not {time!r}")
    if time == "discrete":
        return Objective(prediction, schedule, time, timesteps=timesteps,
                         time_scale=1.0 / timesteps)
    return Objective(prediction, schedule, time)


def train_router_command(experts: Path | None, data: str, train: TrainConfig, out: Path,
                         use_labels: bool = True, device: str | None = None,
                         progress: ProgressFn | None = None, partition: str | None = None,
                         save_every: int = SAVE_EVERY, resume: bool = False,
                         model_config: Sequence[str] | None = None) -> Path | None:
    """Train the router network of a DDM and save it; saved into ``experts`` (``--out
    EXPERTS/router``), it completes that DDM: its root index (``ddm.checkpoints.index``) is
    written, naming the experts in partition order.

    Either from the expert checkpoints in ``experts``, which must share one partition (the
    sha256 of its content; ``partition``, ``file:PATH``, must then be that one too) and give
    the image shape; or, ``experts`` None, from ``partition`` (``file:PATH`` or
    ``labels:...``) and ``model_config``, the experts' UNet config (image side, channels and
    classes), so that it trains beside the experts instead of after them. Both write the same
    checkpoint.

    Data-parallel under torchrun as :func:`train_unet` is: rank 0 alone writes and returns
    the path."""
    from ddm.training.router import train_router

    check_checkpoint_output(out)
    if experts is not None:
        if model_config is not None:
            raise ValueError("--config is for a router trained without --experts (their "
                             "checkpoints give the image shape)")
        scheme, arch, order = _experts_partition(experts, partition)
    else:
        arch = _beside_experts(partition, model_config)
    dataset = load_dataset(data, arch["image_size"], "train")
    if experts is None:
        scheme = partition_from_spec(str(partition), dataset, seed=train.seed)
    config = RouterNetworkConfig(image_size=arch["image_size"], in_channels=arch["in_channels"],
                          num_experts=scheme.num_partitions, num_classes=arch["num_classes"],
                          use_labels=use_labels)
    ids = scheme.assign(dataset.images, dataset.labels)
    with _processes("torch", device, train) as (world, target, resolved):
        resumable = Resumable(state_directory(out), every=save_every, resume=resume,
                              writer=world.writer, identity={
            "kind": "router", "experts": experts and str(experts), "data": data,
            "partition": scheme.sha256, "network": config.to_dict(), "train": train.to_dict()})
        weights = train_router(config, train, to_model_space(dataset.images), dataset.labels,
                               ids, target, progress if world.writer else None, resumable,
                               world)
    if not world.writer:
        return None
    meta = CheckpointMeta(
        kind="router", name=out.name, architecture=config.to_dict(), framework="torch",
        classes=tuple(int(c) for c in np.unique(dataset.labels)),
        partition={"scheme": scheme.to_dict()}, data=_data_record(data, dataset),
        training=_training_record(train, "router", resolved, resumable.elapsed(), world))
    saved = save_checkpoint(out, meta, weights)
    if experts is not None and out.absolute().parent == experts.absolute():
        write_index(experts, order, {ROUTER: out.name})  # the router completes that DDM
    return saved


def _experts_partition(experts: Path, partition: str | None
                       ) -> tuple[Partition, dict[str, Any], list[str]]:
    """The partition the experts in ``experts`` share (``partition``, ``file:PATH``: it must
    be that one), their architecture, and their directories' names in partition order."""
    paths = discover(experts).get("expert", [])
    metas = [load_checkpoint(p).meta for p in paths]
    if not metas:
        raise CheckpointError(f"{experts} holds no expert checkpoints")
    scheme = shared_partition(metas, f"the experts in {experts}")
    if partition is not None:
        method, _, path = partition.partition(":")
        if method != "file" or not path:
            raise ValueError(f"a router's --partition with --experts is 'file:PATH', got "
                             f"{partition!r}")
        check_partition_hash(load_partition(path).sha256, scheme.sha256,
                             f"the experts in {experts}")
    order = sorted(zip(metas, paths), key=lambda pair: int(pair[0].partition["index"]))
    return scheme, metas[0].architecture, [path.name for _, path in order]


#: What a router network shares with every expert it routes between.
ROUTED_SHAPE = ("image_size", "in_channels", "num_classes")


def _beside_experts(partition: str | None, model_configs: Sequence[str] | None
                    ) -> dict[str, Any]:
    """The architecture of the experts' UNet configs ``model_configs`` (each distinct one of
    the experts'), for a router trained beside them on ``partition`` (``file:PATH`` or
    ``labels:...``: what they train on). Configs whose image shape or classes disagree are
    refused naming both: no one router serves such experts."""
    if partition is None or not model_configs:
        raise ValueError("a router needs --experts DIR, or --partition and --config (the "
                         "experts' UNet config) to train beside them")
    method, _, arg = partition.partition(":")
    if method not in ("file", "labels") or not arg:
        raise ValueError(f"a router's --partition is 'file:PATH' or 'labels:GROUPS', got "
                         f"{partition!r} (fit k-means once with `ddm partition fit`)")
    shapes = {name: ", ".join(f"{key} {unet_config(name).to_dict()[key]}"
                              for key in ROUTED_SHAPE) for name in model_configs}
    first, *others = model_configs
    for other in others:
        if shapes[other] != shapes[first]:
            raise ValueError(f"--config {first} ({shapes[first]}) and --config {other} "
                             f"({shapes[other]}) disagree: one router routes between experts "
                             "of one image shape and one set of classes")
    return unet_config(first).to_dict()


def shared_partition(metas: Sequence[CheckpointMeta], who: str) -> Partition:
    """The one partition every expert of ``metas`` records, each part once; raises
    ``CheckpointError`` naming ``who`` (and each expert's sha256) otherwise."""
    if any(not m.partition for m in metas):
        raise CheckpointError(f"{who} do not share one partition (some record none); a router "
                              "is trained for experts of one partition")
    hashes = {m.name: partition_sha256(m.partition["scheme"]) for m in metas}
    if len(set(hashes.values())) != 1:
        named = ", ".join(f"{name}: sha256 {sha}" for name, sha in sorted(hashes.items()))
        raise CheckpointError(f"{who} do not share one partition ({named}); a router can only "
                              "be trained for experts of the same partition")
    scheme = partition_from_dict(metas[0].partition["scheme"])
    indices = sorted(int(m.partition["index"]) for m in metas)
    if indices != list(range(scheme.num_partitions)):
        raise CheckpointError(f"{who} are experts for parts {indices} of a "
                              f"{scheme.num_partitions}-part partition; every part needs one")
    return scheme


def check_router_partition(router: Path, experts: Sequence[Path]) -> None:
    """Refuse a router network trained for another partition than the experts ``experts``
    share (a router trained beside them read the partition itself): the message names both
    hashes."""
    metas = [load_checkpoint(p).meta for p in experts]
    scheme = shared_partition(metas, "the experts " + ", ".join(str(p) for p in experts))
    recorded = load_checkpoint(router).meta.partition or {}
    if "scheme" not in recorded:
        raise CheckpointError(f"router {router} records no partition")
    check_partition_hash(scheme.sha256, partition_sha256(recorded["scheme"]),
                         f"router {router}")


def _data_record(source: str, dataset: Dataset) -> dict[str, Any]:
    return {"source": recorded_source(source), "split": "train", "name": dataset.name,
            "images": len(dataset),
            "image_size": dataset.image_size}


def _training_record(train: TrainConfig, config_name: str, device: str, seconds: float,
                     world: World) -> dict[str, Any]:
    """``seconds``: the whole run's training time, every session of a resumed one;
    ``world_size``: the processes of the last session, ``batch_size`` being their global
    batch (``device`` is rank 0's)."""
    return {**train.to_dict(), "config": config_name, "device": device,
            "seconds": round(seconds, 1), "host": platform.machine(),
            "world_size": world.size}
