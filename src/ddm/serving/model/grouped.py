"""A pool's same-architecture experts as one forward (issue 37, deliver 3).

A top-2 step calls two of a pool's experts with the same rows' shapes; run one after the
other, each is a forward of a few rows, which on an accelerator is bound by its kernels'
launches and latencies rather than by its arithmetic. Paris experts that agree on their
architecture, dtype, device and convention form an :class:`ExpertGroup`: their weights move
into one :class:`~ddm.models.paris.ParisExpertGroup` (no second copy: each expert's
parameters become views of it), their velocity calls share one batcher, and a batch runs
either as one grouped forward of every member's rows or member by member through each
expert's own forward, whichever measured faster for that batch's largest share of one member
(:attr:`ExpertGroup.up_to_rows`).

``--grouped-forward`` (:data:`~ddm.deploy.limits.GROUPED_FORWARD_MODES`) chooses: ``auto``
groups experts on an accelerator where it measures faster: both ways at start (two members'
rows, 1, 2, 4... rows each, after warm-up, the median of :data:`CALIBRATION_CALLS`), the
batches grouped up to the largest share at which the grouped forward was faster at every
share so far (:func:`grouped_up_to`; none: the members keep their own batchers, as without a
group); on a CPU, where a forward of a few rows is not bound by launches and the grouped one
measured no faster (within noise: docs/benchmarks.md, ``forwards``), it forms no group.
``on`` groups every batch, on any device; ``off`` forms no group. The figures are in the
pool's ``/v1/info`` (``pool.groups``).

The group forms before its members warm up or compile (:func:`preload`), since a compiled
forward's CUDA graphs hold the parameters' addresses; the group's own forward is compiled and
warmed like a member's (:mod:`ddm.serving.model.compiled`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from ddm.conditioning import Conditioning
from ddm.deploy.limits import compile_buckets
from ddm.models.stages import network_velocity
from ddm.convention import network_convention
from ddm.sampling.guidance import guided
from ddm.serving.batching import Batcher, BatchReport
from ddm.serving.model.compiled import (CUDA_GRAPHS, WARM_TEXT_TOKENS, bucketed,
                                        on_compiled_thread)
from ddm.serving.model.options import Hooks, ServingOptions
from ddm.serving.model.stage import StageMember, VelocityKey, batch_conditioning

__all__ = ["CALIBRATION_CALLS", "CALIBRATION_ROWS", "ExpertGroup", "forward_chunks",
           "grouped_up_to", "preload"]

#: The family whose experts can share a forward (:class:`~ddm.models.paris.ParisExpertGroup`).
GROUPED_FAMILY = "paris-dit"
#: Rows per member ``auto`` measures at (those within the pool's ``max_batch`` for two).
CALIBRATION_ROWS = (1, 2, 4, 8, 16)
#: Timed calls per way and size; the median counts.
CALIBRATION_CALLS = 5


class ExpertGroup:
    """Experts of one architecture sharing a grouped forward and a batcher (module doc)."""

    def __init__(self, members: Mapping[str, StageMember], network: Any,
                 options: ServingOptions, hooks: Hooks) -> None:
        self.members = dict(members)
        self.names = list(self.members)
        self.network = network
        self.options = options
        first = next(iter(self.members.values()))
        assert first.preloaded is not None, "a group forms from its members' loaded stages"
        #: What the members share: latent shape, text width, convention.
        self.declaration = first.preloaded.declaration
        #: Forward rows of one model call (``--max-batch``): of the grouped forward, and of
        #: each member's forward in a batch run member by member.
        self.max_batch = first.limits.max_batch
        # Each member's rows of a batch up to a full forward, as their own batchers allowed.
        self.batcher = Batcher(self.execute, len(self.members) * self.max_batch,
                               options.max_delay_ms, self._observe,
                               serving_loops=hooks.serving_loops, cpu=hooks.cpu)
        #: Batches whose largest share of one member is at most this many forward rows run
        #: as one grouped forward; larger ones member by member (0: none grouped).
        self.up_to_rows = 0
        #: What ``auto`` measured: one entry per rows-per-member size.
        self.calibration: list[dict[str, float | int]] = []
        #: Why the grouped forward could not start (its members then run alone).
        self.failure: str | None = None
        self._forward: Callable[..., np.ndarray] | None = None

    @property
    def active(self) -> bool:
        """Whether the members' velocity calls go through this group."""
        return self.up_to_rows > 0

    def describe(self) -> dict[str, Any]:
        """``/v1/info``'s entry for this group."""
        return {"members": self.names, "family": GROUPED_FAMILY,
                "mode": self.options.grouped_forward, "grouped_up_to_rows": self.up_to_rows,
                "calibration": self.calibration, "failure": self.failure}

    async def submit(self, member: StageMember, key: VelocityKey,
                     inputs: tuple[np.ndarray, ...], cost: int) -> np.ndarray:
        """One velocity call of ``member``, batched with every member's calls."""
        k = self._index_of(member)
        return await self.batcher.submit(key, (*inputs, np.full(len(inputs[0]), k, np.int64)),
                                         cost, tag=k)

    def execute(self, key: Hashable, inputs: tuple[Any, ...]) -> np.ndarray:
        """One batch: one grouped forward where every member's share is at most
        :attr:`up_to_rows` forward rows and all of them fit one forward, else member by
        member, each member's rows in forwards of at most ``max_batch`` rows."""
        assert isinstance(key, VelocityKey) and self._forward is not None
        x, t, held, rows, guidance, members = inputs
        cond = batch_conditioning(key.tokens, [held, rows, guidance])
        cost = 1 + (np.asarray(guidance) != 1.0)  # forward rows of each row
        shares = [int(cost[members == k].sum()) for k in range(len(self.names))]
        if max(shares) <= self.up_to_rows and sum(shares) <= self.max_batch:
            return guided(self._forward, None)(x, t, cond, members)
        out = np.empty(x.shape, np.float32)
        for k, member in enumerate(self.members.values()):
            assert member.stage is not None
            velocity = guided(member.stage.forward, None)
            for part in forward_chunks(np.flatnonzero(members == k), cost, self.max_batch):
                out[part] = velocity(x[part], t[part], cond.take(part))
        return out

    def start(self) -> None:
        """Compile (as the members are) and warm the grouped forward, then choose
        :attr:`up_to_rows` by the mode (``auto``: measured); in a start-up worker, after
        every member is warm."""
        like = next(self.network.buffers())
        forward = network_velocity(self.network, like,
                                   network_convention(self.declaration.convention))
        mode = self.options.compile
        if mode != "none":
            from ddm.models.torch_io import compile_network

            buckets = compile_buckets(self.max_batch)
            compile_network(self.network, mode, len(buckets))
            forward = bucketed(on_compiled_thread(mode, forward), buckets)
            for _ in range(2 if mode == CUDA_GRAPHS else 1):  # a graph records at the 2nd call
                for size in buckets:
                    forward(*self._rows(size, size))
        self._forward = forward
        if self.options.grouped_forward == "on":
            self.up_to_rows = self.max_batch
        else:
            self.up_to_rows = self._calibrate()

    def _calibrate(self) -> int:
        """Two members' rows each way at each :data:`CALIBRATION_ROWS` size that fits: the
        largest share up to which the grouped forward was faster at every size."""
        assert self._forward is not None
        members = list(self.members.values())[:2]
        for rows in (r for r in CALIBRATION_ROWS if 2 * r <= self.max_batch):
            x, t, cond, index = self._rows(2 * rows, rows)

            def member_by_member() -> None:
                for k, member in enumerate(members):
                    assert member.stage is not None
                    part = slice(k * rows, (k + 1) * rows)
                    member.stage.forward(x[part], t[part], cond.take(np.arange(
                        k * rows, (k + 1) * rows)))

            def grouped() -> None:
                assert self._forward is not None
                self._forward(x, t, cond, index)

            apart_ms, together_ms = _median_ms(member_by_member), _median_ms(grouped)
            self.calibration.append({"rows_per_member": rows, "member_by_member_ms": apart_ms,
                                     "grouped_ms": together_ms})
            if together_ms >= apart_ms:
                break
        return grouped_up_to(self.calibration)

    def _rows(self, size: int, per_member: int
              ) -> tuple[np.ndarray, np.ndarray, Conditioning, np.ndarray]:
        """``size`` rows of Paris's shapes, ``per_member`` of each member in turn, seeded."""
        declared = self.declaration
        assert declared.latent_shape is not None and declared.text_width is not None
        generator = np.random.default_rng(0)
        x = generator.standard_normal((size, *declared.latent_shape), np.float32)
        t = generator.uniform(0.05, 0.95, size).astype(np.float32)
        text = generator.standard_normal((size, WARM_TEXT_TOKENS, declared.text_width),
                                         np.float32)
        index = (np.arange(size) // per_member) % len(self.names)
        return x, t, Conditioning(embeddings=text), index.astype(np.int64)

    def _observe(self, report: BatchReport) -> None:
        """A batch in the metrics of each member with calls in it: its rows and its calls'
        queue delays, the batch's model time."""
        for k, member in enumerate(self.members.values()):
            mine = [row for row, tag in enumerate(report.tags) if tag == k]
            if mine:
                member.metrics.observe_batch(BatchReport(
                    images=sum(report.costs[row] for row in mine),
                    queue_delays=tuple(report.queue_delays[row] for row in mine),
                    model_seconds=report.model_seconds))

    def _index_of(self, member: StageMember) -> int:
        return next(k for k, held in enumerate(self.members.values()) if held is member)

    async def close(self) -> None:
        await self.batcher.close()


async def preload(members: Mapping[str, StageMember], options: ServingOptions,
                  hooks: Hooks) -> list[ExpertGroup]:
    """The groups of a pool's experts (module doc), formed before any member warms: each
    candidate expert is loaded and checked first (its warm-up then takes that stage), and
    those that agree share a :class:`~ddm.models.paris.ParisExpertGroup`. A candidate that
    fails to load forms no group (its own load reports why)."""
    candidates = {name: member for name, member in members.items()
                  if member.takes_velocity and member.declared.family == GROUPED_FAMILY}
    if (options.grouped_forward == "off" or options.backend != "torch" or len(candidates) < 2
            or _auto_on_a_cpu(options)):
        return []
    for member in candidates.values():
        try:
            member.preloaded = await hooks.start_up(member.load_checked)
        except Exception:  # noqa: BLE001 - its own load, next, reports the failure
            return []
    return await hooks.start_up(lambda: _form(candidates, options, hooks))


def _auto_on_a_cpu(options: ServingOptions) -> bool:
    """``auto`` on a server whose torch device is the CPU (``--device`` cpu, or none given and
    no CUDA): no group, known before anything loads, so that such a pool loads as it would
    without groups."""
    from ddm.models.torch_io import select_torch_device

    return (options.grouped_forward == "auto" and options.device in (None, "cpu")
            and select_torch_device(options.device).type == "cpu")


def _form(candidates: Mapping[str, StageMember], options: ServingOptions,
          hooks: Hooks) -> list[ExpertGroup]:
    from ddm.models.paris import ParisExpertGroup, grouped_forward_unsupported

    alike: dict[tuple[Any, ...], dict[str, StageMember]] = {}
    for name, member in candidates.items():
        stage = member.preloaded
        assert stage is not None and stage.network is not None
        parameter = next(stage.network.parameters())
        if options.grouped_forward == "auto" and parameter.device.type == "cpu":
            continue
        if grouped_forward_unsupported(stage.network.config, parameter.dtype,
                                       parameter.device, options.compile != "none") is None:
            key = (stage.network.config, parameter.dtype, parameter.device,
                   stage.declaration.convention)
            alike.setdefault(key, {})[name] = member
    groups = []
    for (_, _, device, _), same in alike.items():
        if len(same) > 1:
            networks: Sequence[Any] = [m.preloaded.network for m in same.values()
                                       if m.preloaded is not None]
            groups.append(ExpertGroup(same, ParisExpertGroup(networks), options, hooks))
            if device.type == "cuda":
                import torch

                # The experts' own weights, stacked away, back to the device (the caching
                # allocator would hold them, as much again as the group's weights).
                torch.cuda.empty_cache()
    return groups


def forward_chunks(rows: np.ndarray, cost: np.ndarray, limit: int) -> list[np.ndarray]:
    """``rows`` in order, cut into runs of at most ``limit`` forward rows (row r costs
    ``cost[r]``: 2 where guided); none empty."""
    chunks: list[np.ndarray] = []
    start, taken = 0, 0
    for position, row in enumerate(rows):
        if taken + cost[row] > limit:
            chunks.append(rows[start:position])
            start, taken = position, 0
        taken += int(cost[row])
    if rows.size:
        chunks.append(rows[start:])
    return chunks


def grouped_up_to(calibration: Sequence[Mapping[str, float | int]]) -> int:
    """The largest ``rows_per_member`` up to which the grouped forward measured faster than
    member by member at every size measured (sizes in increasing order), or 0."""
    up_to = 0
    for measured in calibration:
        if not measured["grouped_ms"] < measured["member_by_member_ms"]:
            break
        up_to = int(measured["rows_per_member"])
    return up_to


def _median_ms(call: Callable[[], None]) -> float:
    call()  # warm: the first call of a size pays its allocations
    times = []
    for _ in range(CALIBRATION_CALLS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)
