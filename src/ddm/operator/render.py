"""``ddm render``: every object the operator would create for a DDMDeployment (or the jobs
and the DDMDeployment of a DDMTraining), as YAML.

As ``helm template`` does for a chart: users and reviewers read the pods, the Secrets and
the NetworkPolicies before applying. The objects come from the operator's own functions
(``children.checked_spec``, ``children.desired_children``), under the operator's settings read
from the same variables (``OperatorConfig.from_env``), where router authentication and
NetworkPolicies default to the chart's values (on) rather than to a bare process's (off).

What the API server decides is not known before the DDMDeployment exists: its uid (in the
ownerReferences, and digested into the names of the operator's Secrets) is shown as
``PLACEHOLDER_UID``, and a token the operator would draw at random as ``PLACEHOLDER_TOKEN``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from ddm.deploy.spec import parse_manifest, read_manifest_document
from ddm.deploy.training_plan import plan_training
from ddm.deploy.training_spec import KIND as TRAINING_KIND
from ddm.deploy.training_spec import parse_training_manifest
from ddm.operator import names
from ddm.operator.children import checked_spec, desired_children
from ddm.operator.config import NETWORK_POLICY_ENV, ROUTER_AUTH_ENV, OperatorConfig
from ddm.operator.training_manifests import build_deployment, build_training_objects

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
PLACEHOLDER_TOKEN = "random-when-the-operator-creates-it"
#: The chart's defaults (values.yaml ``routerAuth.enabled``, ``networkPolicy.enabled``) for the
#: settings whose bare default differs; tests/unit/test_render.py keeps them equal.
CHART_DEFAULTS = {ROUTER_AUTH_ENV: "true", NETWORK_POLICY_ENV: "true"}
DEFAULT_NAMESPACE = "default"


def render_objects(document: Any, config: OperatorConfig, *, namespace: str | None = None,
                   uid: str = PLACEHOLDER_UID) -> list[dict[str, Any]]:
    """The objects for one DDMDeployment ``document`` (as read from YAML), in the order the
    operator creates them; ``namespace``: where it would live (default: its own, else
    ``default``). ``SpecError`` when the operator would refuse it."""
    manifest = parse_manifest(document, allow_host_paths=True)  # the settings decide below
    spec = checked_spec(document["spec"], manifest.name, config)
    owner = {"apiVersion": names.API_VERSION, "kind": names.KIND,
             "metadata": {"name": manifest.name, "uid": uid,
                          "namespace": namespace or manifest.namespace or DEFAULT_NAMESPACE}}
    return desired_children(spec, owner, config, lambda: PLACEHOLDER_TOKEN)


def render_training(document: Any, config: OperatorConfig, *, namespace: str | None = None
                    ) -> list[dict[str, Any]]:
    """The jobs of one DDMTraining ``document`` in plan order (Jobs, or TrainJobs under
    kubeflow-trainer), each after its NetworkPolicy (with the ``network_policy`` setting),
    then the DDMDeployment created once they have all finished. ``SpecError`` when the spec
    is invalid."""
    manifest = parse_training_manifest(document, allow_host_paths=True)
    meta = {"name": manifest.name,
            "namespace": namespace or manifest.namespace or DEFAULT_NAMESPACE}
    objects = build_training_objects(manifest.spec, plan_training(manifest.spec), meta, config)
    return [*(made for job in objects.values() for made in job),
            build_deployment(manifest.spec, meta)]


def render_file(path: Path, env: Mapping[str, str], namespace: str | None = None) -> str:
    """``ddm render PATH``: a multi-document YAML stream, one document per object."""
    document = read_manifest_document(path)
    config = OperatorConfig.from_env({**CHART_DEFAULTS, **env})
    if isinstance(document, Mapping) and document.get("kind") == TRAINING_KIND:
        header = (f"# The jobs the operator runs for {path}, in order (each after those its "
                  "job waits for,\n# and after its NetworkPolicy), then the DDMDeployment it "
                  "creates when they have all\n# finished.\n")
        return header + yaml.safe_dump_all(render_training(document, config,
                                                           namespace=namespace),
                                           sort_keys=False)
    objects = render_objects(document, config, namespace=namespace)
    header = (f"# The objects the operator creates for {path}.\n# Made when it is created: "
              f"the DDMDeployment's uid (here {PLACEHOLDER_UID}),\n# and so the names "
              f"ending in its digest, and the tokens (here {PLACEHOLDER_TOKEN}).\n")
    return header + yaml.safe_dump_all(objects, sort_keys=False)
