"""``ddm diagram``: a DDMDeployment's topology as a Mermaid flowchart.

Clients reach the router; the router calls every expert; experts are grouped by the hardware
they run on, each showing its framework, classes, replicas and devices per replica.
"""

from __future__ import annotations

from pathlib import Path

from ddm.deploy.spec import DDMSpec, ExpertSpec, load_manifest

HARDWARE = {"neuron": "AWS Neuron", "nvidia": "NVIDIA GPU", "tpu": "Google TPU", "cpu": "CPU"}


def render_mermaid(spec: DDMSpec, name: str = "ddm") -> str:
    """Mermaid ``flowchart LR`` source for ``spec`` (``name``: the DDMDeployment's name)."""
    sampling, router = spec.sampling, spec.router
    lines = [
        "flowchart LR",
        '    clients(["clients"]) -->|"HTTP :8080"| router',
        f'    router["{name} router<br/>strategy {sampling.strategy}, {sampling.steps} '
        f'{sampling.solver} steps<br/>{_replicas(router.replicas)} on CPU"]',
    ]
    ids = {e.name: f"expert{i}" for i, e in enumerate(spec.experts)}
    for kind, title in HARDWARE.items():
        experts = [e for e in spec.experts if e.accelerator.type == kind]
        if not experts:
            continue
        lines.append(f'    subgraph {kind}["{title}"]')
        lines.extend(f"        {ids[e.name]}[\"{_expert_label(e)}\"]" for e in experts)
        lines.append("    end")
    lines.extend(f"    router --> {ids[e.name]}" for e in spec.experts)
    return "\n".join(lines) + "\n"


def diagram_file(path: str | Path) -> str:
    """The diagram of the DDMDeployment in a YAML file; raises ``SpecError`` if invalid."""
    manifest = load_manifest(path)
    return render_mermaid(manifest.spec, manifest.name)


def _expert_label(expert: ExpertSpec) -> str:
    classes = f", classes {_classes(expert.classes)}" if expert.classes else ""
    devices = expert.accelerator.describe()
    where = "on CPU" if devices == "cpu" else f"with {devices} each"
    scaling = expert.autoscaling
    count = (_replicas(expert.replicas) if scaling is None else
             f"{scaling.min_replicas} to {scaling.max_replicas} replicas (autoscaled)")
    return f"{expert.name}<br/>{expert.framework}{classes}<br/>{count} {where}"


def _replicas(count: int) -> str:
    return f"{count} replica" + ("" if count == 1 else "s")


def _classes(classes: tuple[int, ...]) -> str:
    """``0-4`` for a run, ``0, 2, 4`` otherwise."""
    ordered = sorted(classes)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))
