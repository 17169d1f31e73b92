"""``ddm expert check``: does a checkpoint's network behave as its config.json says?

An expert trained elsewhere arrives with a declaration (objective, architecture, classes) that
nothing else verifies: a wrong one serves garbage at full speed. The checks themselves are
in :mod:`ddm.experts.network_checks`; the expert server runs :func:`check_network` on the
backend it is about to serve and refuses to become ready on a failure, and the command adds
the declaration itself and torch/JAX parity (:func:`check_checkpoint`). The command loads
every expert through the one loader (:func:`ddm.models.stages.load_stage`), whose label
families build the network with the function the label server uses
(``ddm.models.loading.expert_network``), so an exported program the server's strict readers
refuse fails the ``load`` check with the same reason. A label expert's behaviour check noises
held-out images of its own classes.

The objective check tests the stage's :attr:`~ddm.models.stages.Stage.prediction`, the
network's own output, against the objective its checkpoint declares, not the velocity ``forward``
converts it to: a wrong declaration makes the converted velocity wrong too, but only the raw
output says which prediction the network really makes ("epsilon explains them"), and the
conversion's schedule factors would stretch the error bounds the check is calibrated with.

A text expert (a stage checkpoint: ``_ddm`` in its config.json) is checked the same way by
:mod:`ddm.experts.text_check`, on conditioning of its own kind; :func:`check_checkpoint`
checks either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ddm.checkpoints.declared import read_declaration
from ddm.checkpoints.format import CheckpointError, CheckpointMeta, read_meta
from ddm.conditioning import Conditioning
from ddm.convention import to_model_space
from ddm.data import Dataset, load_dataset, subset_by_classes
from ddm.experts.network_checks import (BEHAVIOUR_IMAGES, Claim, Examples, Verdict, agreement,
                                        check_outputs, missing_frameworks, run_check)
from ddm.models.loading import ModelFn, expert_image_shape
from ddm.models.stages import Stage, load_stage
from ddm.objectives import ObjectiveError


def check_network(meta: CheckpointMeta, network: ModelFn, image_shape: tuple[int, int, int],
                  data: Dataset | str, max_batch: int = BEHAVIOUR_IMAGES) -> list[Verdict]:
    """Shapes and dtypes, finiteness, determinism and the declared objective's behaviour of
    ``network`` (as trained: its own inputs and prediction), called with at most
    ``max_batch`` rows at a time. ``data``: images ``(N, 1, H, W)`` in ``[0, 1]`` of the
    expert's classes (:func:`behaviour_data`), or why there are none (the behaviour check is
    then skipped)."""
    examples = data if isinstance(data, str) else Examples(to_model_space(data.images),
                                                           data.labels, data.name)
    return check_outputs(network, meta.objective, image_shape,
                         np.int64(meta.classes[0] if meta.classes else 0), examples,
                         Claim(meta.objective.describe(), "objective"), max_batch)


def check_checkpoint(directory: str | Path, backend: str = "native", device: str | None = None,
                     data_source: str | None = None) -> list[Verdict]:
    """Everything :func:`check_network` checks, on ``backend``, plus that the declaration is
    readable and its objective one we convert, that the weights load, and torch/JAX parity
    where both frameworks can run the architecture. A stage checkpoint of role expert (a text
    expert) is checked by :func:`ddm.experts.text_check.check_text_expert`."""
    if read_declaration(Path(directory)) is not None:
        # imported here: a label expert's check needs none of the text stages' libraries
        from ddm.experts.text_check import check_text_expert

        return check_text_expert(directory, backend, device, data_source)
    try:
        meta = read_meta(directory)
    except CheckpointError as error:
        name = "objective" if "objective" in str(error) else "config"
        return [Verdict(name, "FAIL", str(error))]
    verdicts = [Verdict("objective", "PASS", f"declares {meta.objective.describe()}, which "
                                             "we convert to our velocity")]
    try:
        image_shape = expert_image_shape(meta)
        network = _network(load_stage(directory, device=device, backend=backend))
    except (CheckpointError, ObjectiveError, ValueError, ImportError, RuntimeError) as error:
        return verdicts + [Verdict("load", "FAIL", f"{type(error).__name__}: {error}")]
    verdicts.append(Verdict("load", "PASS", f"{meta.kind} {meta.name} on {backend}, images "
                                            f"{'x'.join(map(str, image_shape))}"))
    verdicts += check_network(meta, network, image_shape, behaviour_data(meta, data_source))
    verdicts.append(run_check("parity", lambda: _parity(meta, lambda b: _network(load_stage(
        directory, device=device, backend=b)), image_shape)))
    return verdicts


def _network(stage: Stage) -> ModelFn:
    """A label expert stage's network as trained, as the checks call it: ``(x, t, y)``."""
    raw = stage.prediction
    assert raw is not None, "a label expert's stage has its network (expert_image_shape)"
    return lambda x, t, y: raw(x, t, Conditioning.from_labels(y))


def behaviour_data(meta: CheckpointMeta, source: str | None = None) -> Dataset | str:
    """Held-out images of the expert's classes from ``source`` (default: the source its
    config.json records), at its image size; or why there are none here (no source recorded,
    its files or its loader not installed where this runs: the check then skips behaviour)."""
    source = source or meta.data.get("source")
    if not source:
        return "config.json records no data source (pass --data digits or mnist:DIR)"
    channels, size, _ = expert_image_shape(meta)
    if channels != 1:
        return f"data source {source!r} holds 1-channel images; {meta.name} takes {channels}"
    try:
        return subset_by_classes(load_dataset(source, size, "heldout"), meta.classes)
    except (ImportError, OSError, ValueError) as error:
        return f"cannot load data source {source!r} here ({type(error).__name__}: {error})"


def _parity(meta: CheckpointMeta, network_on: Callable[[str], ModelFn],
            image_shape: tuple[int, int, int]) -> Verdict | str:
    if meta.model.kind != "unet":
        return Verdict("parity", "SKIP", f"a {meta.framework} network ({meta.model.kind}) runs "
                                         f"on {meta.framework} only")
    missing = missing_frameworks()
    if missing:
        return Verdict("parity", "SKIP", f"{', '.join(missing)} not installed here")
    return agreement(network_on("torch"), network_on("jax"), image_shape,
                     np.int64(meta.classes[0] if meta.classes else 0))
