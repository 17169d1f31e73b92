"""``ddm diagram``: a DDMDeployment's topology as a Mermaid flowchart.

Clients reach the router; the router calls every expert and every stage placed on its own (a
text DDM's text encoder, decoder, router network); experts and stages are grouped by the
hardware they run on, each showing its replicas and devices per replica (an expert also its
framework and classes); the stages the router loads itself are named in the router's box. A
pool is one box naming its members, which have no box of their own.
"""

from __future__ import annotations

from pathlib import Path

from ddm.deploy.accelerators import ACCELERATORS
from ddm.deploy.limits import ROUTER_PORT
from ddm.deploy.autoscaling import Autoscaling
from ddm.deploy.spec import DDMSpec, ExpertSpec, PoolSpec, StageSpec, load_manifest


def render_mermaid(spec: DDMSpec, name: str = "ddm") -> str:
    """Mermaid ``flowchart LR`` source for ``spec`` (``name``: the DDMDeployment's name)."""
    sampling, router = spec.sampling, spec.router
    inside = [role.replace("-", " ") for role, stage in spec.stages.items()
              if stage.in_router and spec.conditioning == "text"]
    lines = [
        "flowchart LR",
        f'    clients(["clients"]) -->|"HTTP :{ROUTER_PORT}"| router',
        f'    router["{name} router<br/>strategy {sampling.strategy}, {sampling.steps} '
        f'{sampling.solver} steps<br/>{_replicas(router.replicas)} on CPU'
        f'{"<br/>with its " + ", ".join(inside) if inside else ""}"]',
    ]
    nodes = {f"expert{i}": (e.accelerator.type, _expert_label(e))
             for i, e in enumerate(spec.experts) if e.pool is None}
    nodes.update({f"stage_{role.replace('-', '_')}": (stage.accelerator.type,
                                                      _stage_label(role, stage))
                  for role, stage in spec.stages.items() if stage.separate})
    nodes.update({f"pool_{pool.name.replace('-', '_')}": (pool.accelerator.type,
                                                          _pool_label(spec, pool))
                  for pool in spec.pools})
    for kind, declared in ACCELERATORS.items():
        here = [(node, label) for node, (hardware, label) in nodes.items() if hardware == kind]
        if not here:
            continue
        lines.append(f'    subgraph {kind}["{declared.title}"]')
        lines.extend(f'        {node}["{label}"]' for node, label in here)
        lines.append("    end")
    lines.extend(f"    router --> {node}" for node in nodes)
    return "\n".join(lines) + "\n"


def diagram_file(path: str | Path) -> str:
    """The diagram of the DDMDeployment in a YAML file; raises ``SpecError`` if invalid."""
    manifest = load_manifest(path)
    return render_mermaid(manifest.spec, manifest.name)


def _expert_label(expert: ExpertSpec) -> str:
    classes = f", classes {_classes(expert.classes)}" if expert.classes else ""
    devices = expert.accelerator.describe()
    where = "on CPU" if devices == "cpu" else f"with {devices} each"
    count = _count(expert.replicas, expert.autoscaling)
    return f"{expert.name}<br/>{expert.framework}{classes}<br/>{count} {where}"


def _stage_label(role: str, stage: StageSpec) -> str:
    devices = stage.accelerator.describe()
    where = "on CPU" if devices == "cpu" else f"with {devices} each"
    return f"{role.replace('-', ' ')}<br/>{_replicas(stage.replicas)} {where}"


def _pool_label(spec: DDMSpec, pool: PoolSpec) -> str:
    devices = pool.accelerator.describe()
    where = "on CPU" if devices == "cpu" else f"with {devices} each"
    members = ", ".join(name if isinstance(member, ExpertSpec) else name.replace("-", " ")
                        for name, member in spec.members(pool.name).items())
    count = _count(pool.replicas, pool.autoscaling)
    return f"pool {pool.name}<br/>{members}<br/>{count} {where}"


def _count(replicas: int, scaling: Autoscaling | None) -> str:
    """An expert's or pool's replicas: fixed, or the range its autoscaling keeps to."""
    return (_replicas(replicas) if scaling is None else
            f"{scaling.min_replicas} to {scaling.max_replicas} replicas (autoscaled)")


def _replicas(count: int) -> str:
    return f"{count} replica" + ("" if count == 1 else "s")


def _classes(classes: tuple[int, ...]) -> str:
    """``0-4`` for a run, ``0, 2, 4`` otherwise."""
    ordered = sorted(classes)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))
