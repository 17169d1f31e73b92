"""The rules a spec's pools and their members keep (``spec.pools``, ``pool: NAME``): what one
``ddm serve pool`` process can hold together. ``ddm.deploy.spec`` reads the fields and reports
these with its other rules; the plan (``ddm.deploy.plan``) relies on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ddm.checkpoints.roles import EXPERT, stage_roles
from ddm.deploy.accelerators import Accelerator
from ddm.deploy.autoscaling import Autoscaling
from ddm.deploy.limits import FRAMEWORKS
from ddm.deploy.pod_options import PodOptions

#: Where each stage that may join a pool is in the spec, by its role's plan name.
STAGE_FIELDS = {role.plan_name: role.spec_field for role in stage_roles()}


@dataclass(frozen=True)
class PoolSpec:
    """A pool (``spec.pools[]``): ``replicas`` model server processes (pods), each holding every
    member's weights on one ``accelerator``; its members are the components that name it
    (``pool: NAME``) and carry no placement of their own. ``max_batch``/``max_delay_ms``
    apply to each member's batcher, ``compile`` (``torch.compile``'s mode) to each member's
    torch network (None: the server's own defaults); ``autoscaling``: its replicas follow
    the sum of its member experts' demand (None: ``replicas`` fixed); ``grouped_forward``:
    whether its like Paris experts share one forward (``ddm serve pool --grouped-forward``;
    None: the server's default, ``auto``)."""

    name: str
    accelerator: Accelerator
    replicas: int = 1
    max_batch: int | None = None
    max_delay_ms: int | None = None
    pod: PodOptions = PodOptions()
    autoscaling: Autoscaling | None = None
    compile: str | None = None
    grouped_forward: str | None = None


@dataclass(frozen=True)
class Component:
    """What the rules need of an expert or a stage: ``path`` in the spec, ``name`` in the
    plan, the ``pool`` it names (None: none), its ``framework`` (a stage's: torch) and
    ``precision``; ``stage``: a text encoder, decoder or router network."""

    path: str
    name: str
    pool: str | None
    framework: str
    precision: str | None
    stage: bool = False


def pool_problems(pools: Sequence[PoolSpec], components: Sequence[Component]) -> list[str]:
    """Pools and their members: every named pool exists and has members, which a pool server
    can hold together (label or stage checkpoints, one backend, one precision)."""
    found: list[str] = []
    names = [p.name for p in pools]
    for name in sorted({n for n in names if names.count(n) > 1}):
        found.append(f"spec.pools: the name {name!r} is used more than once")
    by_name = {p.name: p for p in pools}
    served: dict[str, list[tuple[Component, str]]] = {}  # pool -> its members and backends
    for component in components:
        if component.pool is None:
            continue
        pool = by_name.get(component.pool)
        problem, backend = ((f"pool: no pool named {component.pool!r} in spec.pools (there are: "
                             f"{', '.join(map(repr, by_name)) or 'none'})", None)
                            if pool is None else _member_problem(component, pool))
        if problem is not None:
            found.append(f"{component.path}.{problem}")
        elif backend is not None:
            served.setdefault(component.pool, []).append((component, backend))
    for i, pool in enumerate(pools):
        found.extend(f"spec.pools[{i}]: pool {pool.name!r} {problem}"
                     for problem in _agreement_problems(served.get(pool.name, [])))
        named = [c.name for c in components if c.pool == pool.name]
        if not named:
            found.append(f"spec.pools[{i}]: pool {pool.name!r} has no members (name it in an "
                         "expert's, spec.textEncoder's, spec.decoder's or spec.router.network's "
                         "pool)")
        elif pool.autoscaling is not None:
            found.extend(f"spec.pools[{i}].autoscaling: {problem}" for problem in
                         _scaling_problems(pool, [c for c in components if c.pool == pool.name]))
        for name in sorted({n for n in named if named.count(n) > 1}):
            found.append(f"spec.pools[{i}]: pool {pool.name!r} has two members named {name!r} "
                         "(an expert named like a stage's role); rename the expert")
    return found


def _scaling_problems(pool: PoolSpec, members: Sequence[Component]) -> list[str]:
    """Why ``pool`` cannot scale as its ``autoscaling`` says: the routers count demand per
    expert (a pool's is the sum of its experts'), and a stage serves every generation, which
    no missing-expert policy waits for or reroutes."""
    assert pool.autoscaling is not None
    if all(m.stage for m in members):
        return [f"pool {pool.name!r} holds no expert, so no demand to scale by (the routers "
                "count rows per expert); set replicas"]
    stages = [m.path for m in members if m.stage]
    if pool.autoscaling.min_replicas == 0 and stages:
        return [f"minReplicas 0 would leave {', '.join(stages)} (in pool {pool.name!r}) without "
                "a server, and every generation needs it; keep minReplicas at 1 or more, or "
                "give the stage a pool (or placement) of its own"]
    return []


@dataclass(frozen=True)
class MemberDeclaration:
    """What a pool member's checkpoint declares (``_ddm``) that its fellow members must agree
    on, where it declares it: the ``latent_shape`` (C, H, W) it takes or makes, the width of
    the text contexts it takes or makes (``text_width``), and an expert's ``convention``."""

    role: str
    latent_shape: tuple[int, ...] | None = None
    text_width: int | None = None
    convention: str | None = None


def member_disagreements(members: Mapping[str, MemberDeclaration]) -> list[str]:
    """Pairs of a pool's members (name -> declaration) that cannot serve one DDM together:
    each names both members and their values. Latent shapes and text widths must agree across
    every member that declares one, the conventions across its experts (the sampler treats
    every expert's output alike)."""
    found = []
    for field in ("latent_shape", "text_width", "convention"):
        first: tuple[str, Any] | None = None
        for name, declared in members.items():
            seen = getattr(declared, field)
            if seen is None or (field == "convention" and declared.role != EXPERT):
                continue
            if first is None:
                first = (name, seen)
            elif seen != first[1]:
                found.append(f"members {first[0]} and {name} disagree on "
                             f"{field}: {_shown(first[1])} for {first[0]}, {_shown(seen)} for "
                             f"{name}")
    return found


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _member_problem(component: Component, pool: PoolSpec) -> tuple[str | None, str | None]:
    """(what keeps ``component`` out of ``pool``: ``field: message``, or None; the backend
    the pool would serve it with)."""
    backends = pool.accelerator.declared.backends
    if component.framework not in backends:
        return (f"framework: pool {pool.name!r} runs on {pool.accelerator.type}, which cannot "
                f"run framework {component.framework}", None)
    backend = backends[component.framework][0]
    if backend not in FRAMEWORKS:
        return (f"pool: pool {pool.name!r} would serve it with the {backend} backend; a pool "
                f"serves its members with {' or '.join(FRAMEWORKS)} only", None)
    return None, backend


def _agreement_problems(members: Sequence[tuple[Component, str]]) -> list[str]:
    """What keeps a pool's ``members`` (each with the backend that would serve it) from one
    process: one backend and one precision per pool server. Each side is named with the
    fields that put it there, the fewest first (most often the one to change)."""
    backends = _sides({backend: [f"{c.path}{'' if c.stage else '.framework'}"
                                 for c, b in members if b == backend]
                       for backend in dict.fromkeys(b for _, b in members)})
    if backends:
        stages = any(c.stage for c, _ in members)
        return [f"runs its members on one backend, but {backends} (give every member the same "
                "framework" + ("; a text encoder, decoder or router network runs on torch "
                               "only)" if stages else ")")]
    precisions = _sides({precision or "as stored": [
        f"{c.path}.precision" if c.precision else c.path for c, _ in members
        if c.precision == precision] for precision in dict.fromkeys(c.precision
                                                                    for c, _ in members)})
    if precisions:
        return [f"casts every member to one precision, but {precisions} (give every member "
                "the same precision)"]
    return []


def _sides(groups: dict[str, list[str]]) -> str | None:
    """``value for path, path; other for path`` for two or more groups, the smallest first;
    None for one."""
    if len(groups) < 2:
        return None
    ordered = sorted(groups.items(), key=lambda group: len(group[1]))
    return "; ".join(f"{value} for {', '.join(paths)}" for value, paths in ordered)
