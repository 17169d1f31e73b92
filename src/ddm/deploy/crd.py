"""The DDMDeployment custom resource's fields, declared once: ``crds/`` is generated from them.

Types, bounds, enums, patterns, API-server defaults and descriptions live here, built from the
constants the parser (``ddm.deploy.spec``) checks against and from the sampling parameters'
declarations (``ddm.sampling_params``); ``scripts/generate_crds.py`` writes the CRD and the
chart's copy (``make generate``), and ``make lint`` fails while a committed file differs.

Name lengths: children are named <name>-router and <name>-expert-<expert>, and a Service name
is a DNS-1035 label of at most 63 characters, so a DDMDeployment name has at most 24
characters (starting with a letter) and an expert name at most 30 (24 + 8 + 30 < 63).

Defaults: the API server fills in only what no rule forbids a spec to give. A component in a
pool or in the router's process gives no placement of its own, so replicas and accelerators
have no CRD default (the parser's apply); guidance is for text DDMs, so a label DDM's spec
never gains a guidance field.
"""

from __future__ import annotations

from ddm.checkpoints.uri import MAX_URI_LENGTH, URI_PATTERN
from ddm.deploy import autoscaling as scaling
from ddm.deploy import limits
from ddm.deploy.accelerators import ACCELERATORS, HOST, unit_names
from ddm.deploy.pod_options import (
    IMAGE_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_IMAGE_LENGTH,
    MAX_LABEL_VALUE_LENGTH,
    MAX_NODE_SELECTOR_LABELS,
    MAX_TOLERATION_KEY_LENGTH,
    MAX_TOLERATIONS,
    QUANTITY_PATTERN,
    TAINT_EFFECTS,
    TOLERATION_OPERATORS,
)
from ddm.deploy.schema import (
    Array,
    Column,
    CustomResource,
    Field,
    Integer,
    Number,
    Object,
    Quantity,
    String,
)
from ddm.deploy.spec import (
    API_VERSION,
    DEFAULT_TOKEN_KEY,
    EXPERT_NAME_PATTERN,
    GROUP,
    KIND,
    MAX_EXPERT_NAME_LENGTH,
    MAX_NAME_LENGTH,
    MAX_POOLS,
    MAX_SECRET_NAME_LENGTH,
    NAME_PATTERN,
    PRODUCT_PATTERN,
    SECRET_KEY_PATTERN,
    SECRET_NAME_PATTERN,
    SHA256_PATTERN,
    TOPOLOGY_PATTERN,
    VERSION,
)
from ddm.sampling_params import GUIDANCE_CUTOFF, GUIDANCE_SCALE, PARAMS, Param

PLURAL = "ddmdeployments"
#: The labels of every CRD of this operator.
LABELS = {"app.kubernetes.io/name": "ddm-operator", "app.kubernetes.io/part-of": "ddm"}
#: What ``status.phase`` says (``ddm.operator.status`` decides it).
PHASES = ("Pending", "Progressing", "Ready", "Failed", "Invalid")
#: Sampling parameters the API server writes no default for (text DDMs only).
UNDEFAULTED_PARAMS = (GUIDANCE_SCALE, GUIDANCE_CUTOFF)


def param_field(param: Param) -> Field:
    """A sampling parameter's field (``spec.sampling``), from its one declaration."""
    default = None if param in UNDEFAULTED_PARAMS else param.default
    description = param.description[:1].upper() + param.description[1:] + (
        "." if default is not None else f". Default {param.default:g}.")
    if param.kind is int:
        return Integer(description=description, default=default, minimum=param.minimum,
                       maximum=param.maximum)
    if param.kind is float:
        return Number(description=description, default=default, minimum=param.minimum,
                      maximum=param.maximum, exclusive_minimum=param.exclusive_minimum)
    return String(description=description, default=default, choices=param.choices,
                  pattern=param.pattern)


# -- A checkpoint: where a model's files come from ----------------------------------------------
SECRET_NAME = String(max_length=MAX_SECRET_NAME_LENGTH, pattern=SECRET_NAME_PATTERN)
SECRET_KEY = String(max_length=MAX_SECRET_NAME_LENGTH, pattern=SECRET_KEY_PATTERN)
CHECKPOINT = Object(one_of=(("uri",), ("uriFrom",)), properties={
    "uri": String(
        description="pvc://CLAIM[/SUB/PATH] (a claim of this DDM's own, named <name>-*, unless "
                    "the operator allows others, DDM_ALLOWED_CLAIMS), image:///ABS/PATH (inside "
                    "the image), http(s)://..., s3://BUCKET/KEY, gs://BUCKET/KEY (fetched by the "
                    "DDM's checkpoint stager), or file:///ABS/PATH (a host path, refused unless "
                    "it lies under a directory the operator allows, DDM_ALLOW_HOST_PATHS). "
                    "Exactly one of uri and uriFrom.",
        max_length=MAX_URI_LENGTH, pattern=URI_PATTERN),
    "uriFrom": Object(
        description="A fetched checkpoint's URI (http(s)://, s3://, gs://) held in a key of a "
                    "Secret in this namespace, e.g. a pre-signed URL: the stager's fetch step "
                    "reads it from the Secret; it never appears in the spec, and the operator "
                    "never reads it. Pods roll when the reference changes, not when the "
                    "Secret's content does. A spec names only the DDM's own Secrets, <name>-*, "
                    "unless the operator allows others (DDM_ALLOWED_SECRETS).",
        required=("secretKeyRef",), properties={
            "secretKeyRef": Object(required=("name", "key"),
                                   properties={"name": SECRET_NAME, "key": SECRET_KEY})}),
    "sha256": String(
        description="Fetched checkpoints only: pins the bytes received. For an archive URI the "
                    "output of `sha256sum model.tar.gz`; for a directory URI that of `sha256sum "
                    "DIR/config.json` (config.json records the weights' SHA-256, which the "
                    "loader checks, so one pin covers both). Required for plain http://. "
                    "Unpinned, the checkpoint's own checksum proves only that its files agree, "
                    "not where they came from.",
        pattern=SHA256_PATTERN),
    "credentialsSecret": Object(
        description="Fetched checkpoints only: the key of a Secret (in this namespace) holding "
                    "HTTP headers for the store, one 'Name: value' per line (e.g. "
                    "'Authorization: Bearer ...'). Mounted read-only into the stager's fetch "
                    "step alone and sent to the store's origin only; never put credentials in "
                    "the URI. A spec names only the DDM's own Secrets, <name>-*, unless the "
                    "operator allows others (DDM_ALLOWED_SECRETS).",
        required=("name", "key"), properties={"name": SECRET_NAME, "key": SECRET_KEY}),
    "storeCredentialsSecret": Object(
        description="s3:// and gs:// checkpoints (or uriFrom) only, instead of "
                    "credentialsSecret: the key of a Secret (in this namespace) holding the "
                    "store's own credentials file: an AWS shared credentials file ([default] "
                    "with aws_access_key_id, aws_secret_access_key and optionally "
                    "aws_session_token) for s3://, a Google service-account key (JSON) for "
                    "gs://. Every read is signed with it. Mounted read-only into the stager's "
                    "fetch step alone. For clusters whose pods have no cloud identity (IRSA, "
                    "Workload Identity). A spec names only the DDM's own Secrets, <name>-*, "
                    "unless the operator allows others (DDM_ALLOWED_SECRETS).",
        required=("name", "key"), properties={"name": SECRET_NAME, "key": SECRET_KEY}),
})

# -- Where a component runs: its accelerator and the pod fields passed through -----------------


def accelerator_field(each: str) -> Object:
    """An ``accelerator`` (``ddm.deploy.accelerators``), its count being devices per ``each``
    (a serving replica, a training node)."""
    return Object(properties={
        "type": String(choices=tuple(ACCELERATORS), default=HOST),
        "count": Integer(
            description=f"Devices per {each} (neuron: 1-16 devices or 1-32 cores, nvidia: 1-8, "
                        "tpu: 1, 4 or 8 chips); not for cpu. Defaults to 1.",
            minimum=1, maximum=limits.MAX_ACCELERATOR_COUNT),
        "unit": String(
            description="neuron only: request whole devices (default) or NeuronCores.",
            choices=unit_names()),
        "product": String(
            description="nvidia: the nvidia.com/gpu.product node label to require; tpu: the "
                        "cloud.google.com/gke-tpu-accelerator (default tpu-v5-lite-podslice).",
            max_length=MAX_LABEL_VALUE_LENGTH, pattern=PRODUCT_PATTERN),
        "topology": String(
            description="tpu only: the slice topology (default from count: 1x1, 2x2, 2x4).",
            pattern=TOPOLOGY_PATTERN),
    })


ACCELERATOR = accelerator_field("replica")
QUANTITIES = Object(values=Quantity(pattern=QUANTITY_PATTERN))
RESOURCES = Object(
    description="Requests and limits as for a container (quantities such as 500m, 2, 512Mi); "
                "accelerator devices come from accelerator, not from here.",
    properties={"limits": QUANTITIES, "requests": QUANTITIES})
LABEL_VALUE = String(max_length=MAX_LABEL_VALUE_LENGTH, pattern=LABEL_VALUE_PATTERN)
#: The pod fields every placed component passes through (``ddm.deploy.pod_options``).
FRAMEWORK = String(choices=limits.FRAMEWORKS, default=limits.DEFAULT_FRAMEWORK)
POD_FIELDS: dict[str, Field] = {
    "image": String(
        description="Overrides the operator's default image (a plain image reference): one of "
                    "the operator's own repositories, unless it allows others "
                    "(DDM_ALLOWED_IMAGES).",
        min_length=1, max_length=MAX_IMAGE_LENGTH, pattern=IMAGE_PATTERN),
    "resources": RESOURCES,
    "nodeSelector": Object(
        description="Node labels the pods require (label values). Control-plane labels and "
                    "kubernetes.io/hostname are refused unless the operator allows them "
                    "(DDM_ALLOW_CONTROL_PLANE, DDM_ALLOW_NODE_NAMES); it may limit the keys "
                    "(DDM_ALLOWED_NODE_SELECTOR_KEYS).",
        max_properties=MAX_NODE_SELECTOR_LABELS, values=LABEL_VALUE),
    "tolerations": Array(
        Object(properties={
            "key": String(max_length=MAX_TOLERATION_KEY_LENGTH),
            "operator": String(choices=TOLERATION_OPERATORS),
            "value": LABEL_VALUE,
            "effect": String(choices=TAINT_EFFECTS),
            "tolerationSeconds": Integer(format="int64"),
        }),
        description="Taints the pods tolerate, as for a pod (accelerator taints are added). A "
                    "toleration without a key (every taint) or of the control-plane taint is "
                    "refused unless the operator allows it (DDM_ALLOW_TOLERATE_ALL_TAINTS, "
                    "DDM_ALLOW_CONTROL_PLANE); it may limit the keys "
                    "(DDM_ALLOWED_TOLERATION_KEYS).",
        max_items=MAX_TOLERATIONS),
    "affinity": Object(
        description="A pod affinity, passed through (the API server checks it); its "
                    "nodeAffinity is held to the nodeSelector's rules (matchFields pins a named "
                    "node: DDM_ALLOW_NODE_NAMES).",
        preserve_unknown=True),
}
MEMBER_NAME = String(min_length=1, max_length=MAX_EXPERT_NAME_LENGTH, pattern=EXPERT_NAME_PATTERN)
POOL = MEMBER_NAME.described(
    "The pool (spec.pools[].name) that serves this component: it then has no placement, "
    "accelerator, replicas, resources, image, nodeSelector, tolerations or affinity of its "
    "own.")
MAX_BATCH_FIELD = Integer(
    description="Largest batch the server runs at once (per pool member); a text DDM's "
                f"experts need {limits.GUIDED_FORWARD_ROWS} or more (a guided row runs as "
                f"{limits.GUIDED_FORWARD_ROWS} forward rows).",
    minimum=1, maximum=limits.MAX_BATCH)
MAX_DELAY_FIELD = Integer(description="How long the server waits to fill a batch.",
                          minimum=0, maximum=limits.MAX_DELAY_MS)
COMPILE_FIELD = String(
    description="torch backend only: run the torch networks (experts, router network) under "
                "torch.compile in this mode (reduce-overhead adds CUDA graphs on a GPU; "
                "max-autotune searches kernels, long compiles); each batch is padded to the "
                "next of a few sizes up to maxBatch (powers of two and, from 8, their halfway "
                "points: 12, 24, 48...) and every size is compiled and warmed before the "
                "server is ready, so allow for it in the start-up time. Unset: none (eager).",
    choices=limits.COMPILE_MODES)

# -- An expert's autoscaling (``ddm.deploy.autoscaling``) ---------------------------------------


def _scaling_rules(description: str, default: scaling.ScalingRules) -> Object:
    """One direction of ``behavior``, as a HorizontalPodAutoscaler's."""
    return Object(description=description, properties={
        "stabilizationWindowSeconds": Integer(
            description="Recommendations of the last so many seconds are considered (default "
                        f"{default.stabilization_window_s}).",
            minimum=0, maximum=scaling.MAX_STABILIZATION_WINDOW_S),
        "selectPolicy": String(
            description="Max (the policy allowing the most change, the default), Min, or "
                        "Disabled (never scale this way).",
            choices=scaling.SELECT_POLICIES),
        "policies": Array(
            Object(required=("type", "value", "periodSeconds"), properties={
                "type": String(choices=scaling.POLICY_TYPES),
                "value": Integer(minimum=1, maximum=scaling.MAX_POLICY_VALUE),
                "periodSeconds": Integer(minimum=1, maximum=scaling.MAX_POLICY_PERIOD_S),
            }),
            min_items=1, max_items=10),
    })


AUTOSCALING = Object(
    description="The operator sets the expert's (or pool's) replicas from the routers' "
                "demand (replicas is then ignored): enough replicas for target.rowsPerSecond "
                "routed rows per second each, between minReplicas and maxReplicas, changed as "
                "behavior allows (the HorizontalPodAutoscaler's rules). With minReplicas 0 the "
                "expert runs no pod while idle and is started when a step needs it; set "
                "router.missingExpert to wait or reroute. One expert of the DDM at least must "
                "keep a replica (the router needs a ready expert to serve at all). "
                "docs/autoscaling.md.",
    required=("minReplicas", "maxReplicas"), properties={
        "minReplicas": Integer(minimum=0, maximum=limits.MAX_REPLICAS),
        "maxReplicas": Integer(minimum=1, maximum=limits.MAX_REPLICAS),
        "target": Object(
            description="What one replica is sized for: rowsPerSecond, the rows per second the "
                        "router sends it (one forward pass each, batched), before any "
                        f"rerouting (default {scaling.DEFAULT_TARGET_ROWS_PER_S}).",
            properties={"rowsPerSecond": Integer(minimum=1,
                                                 maximum=scaling.MAX_TARGET_ROWS_PER_S)}),
        "scaler": String(
            description="operator (its own scaler sets the replicas) or external (an HPA or "
                        "KEDA does, on the router's metrics; the operator leaves the replicas "
                        "alone and the other fields are for it to mirror).",
            choices=scaling.SCALERS, default=scaling.SCALERS[0]),
        "scaleDownDelaySeconds": Integer(
            description="How long the expert keeps its last replica without any demand before "
                        "going to minReplicas 0 (KEDA's cooldownPeriod).",
            minimum=0, maximum=scaling.MAX_SCALE_DOWN_DELAY_S,
            default=scaling.DEFAULT_SCALE_DOWN_DELAY_S),
        "behavior": Object(
            description="As a HorizontalPodAutoscaler's behavior (autoscaling/v2); an omitted "
                        "field keeps HPA's default.",
            properties={
                "scaleUp": _scaling_rules("Adding replicas (default: at once, up to 100% or 4 "
                                          "pods per 15 s, whichever is more).",
                                          scaling.DEFAULT_SCALE_UP),
                "scaleDown": _scaling_rules("Removing replicas (default: after a 300 s window, "
                                            "up to 100% per 15 s).", scaling.DEFAULT_SCALE_DOWN),
            }),
    })

# -- The stages besides the experts: text encoder, decoder, router network ----------------------
#: A stage's placement fields; the router network's (``spec.router.network``) are these alone,
#: its checkpoint being ``spec.router.checkpoint``.
STAGE_PLACEMENT: dict[str, Field] = {
    "placement": String(
        description="router: loaded inside the router's pods, on their CPU (no accelerator, "
                    "replicas or pod fields of its own); separate: served by a Deployment of "
                    "its own (ddm serve stage). Default router; none with pool.",
        choices=limits.STAGE_PLACEMENTS),
    "accelerator": ACCELERATOR,
    "replicas": Integer(description="placement separate only (default 1).",
                        minimum=1, maximum=limits.MAX_REPLICAS),
    "precision": String(
        description="The dtype the server casts the weights to (float32, bfloat16, float16); "
                    "unset: the dtype they are stored in.",
        choices=limits.PRECISIONS),
    **POD_FIELDS,
    "pool": POOL,
}
STAGE_FIELDS: dict[str, Field] = {"checkpoint": CHECKPOINT, **STAGE_PLACEMENT}

# -- The router -----------------------------------------------------------------------------------
ROUTER = Object(default={}, properties={
    "replicas": Integer(minimum=0, maximum=limits.MAX_REPLICAS, default=1),
    "checkpoint": CHECKPOINT.described(
        "The router network; only the oracle strategy routes without one."),
    **POD_FIELDS,
    "resources": RESOURCES.described(
        "Requests and limits of the router container (quantities such as 500m, 2, 512Mi). "
        "Unset: requests cpu 250m and memory 384Mi, limits cpu 2 and memory 1Gi; set, they "
        "replace those defaults whole."),
    "missingExpert": Object(
        description="What a step routed to an expert with no ready replica (scaled to zero, "
                    "crashed) gets: fail (503 naming the expert), wait (the router holds the "
                    "generation until a replica is ready, at most waitSeconds; the answer's "
                    "waited_s says how long) or reroute (the step uses the best available "
                    "experts serving the label, weights renormalised over them; the answer's "
                    "rerouted lists each image's rerouted steps). Use wait or reroute with an "
                    "expert at autoscaling.minReplicas 0.",
        properties={
            "policy": String(choices=limits.MISSING_EXPERT_POLICIES,
                             default=limits.DEFAULT_MISSING_EXPERT_POLICY),
            "waitSeconds": Integer(description="The longest a generation waits (policy wait).",
                                   minimum=1, maximum=int(limits.MAX_MISSING_EXPERT_WAIT_S),
                                   default=int(limits.MISSING_EXPERT_WAIT_S)),
        }),
    "contextCacheBytes": Integer(
        description="A text DDM's generation contexts (the prompts' embeddings and negative "
                    "rows sent to the experts) the router keeps, least recently used dropped "
                    "first past this many bytes (a dropped one costs only making it again; one "
                    "Paris context of 8 guided prompts is 3.8 MB): router.yaml's "
                    "limits.context_cache_bytes. Count it in the router's memory.",
        format="int64", minimum=1, maximum=limits.MAX_CONTEXT_CACHE_BYTES,
        default=limits.DEFAULT_CONTEXT_CACHE_BYTES),
    "auth": Object(
        description="Require a bearer token on the router's API. The token is key (default "
                    f"{DEFAULT_TOKEN_KEY}) of Secret secretName (the DDM's own, <name>-*, "
                    "unless the operator allows others, DDM_ALLOWED_SECRETS); without "
                    "secretName the operator creates an immutable Secret "
                    "<name>-router-token-<digest of the uid> with a random token, owned by this "
                    "resource (status.routerTokenSecret names it). The experts require another "
                    "token, in a Secret the operator creates, that only the router holds. The "
                    "operator's DDM_ROUTER_AUTH setting requires a token for every router.",
        properties={"secretName": SECRET_NAME,
                    "key": String(max_length=MAX_SECRET_NAME_LENGTH, pattern=SECRET_KEY_PATTERN,
                                  default=DEFAULT_TOKEN_KEY)}),
    "network": Object(
        description="Where the router network (spec.router.checkpoint) runs: in the router's "
                    "process (placement router, the default) or as a stage of its own "
                    "(placement separate: its own pods, replicas and accelerator), e.g. a "
                    "129M-parameter network on a GPU or Trainium.",
        properties=STAGE_PLACEMENT),
})

# -- The experts and the pools ------------------------------------------------------------------
EXPERT = Object(required=("name", "checkpoint"), properties={
    "name": MEMBER_NAME,
    "framework": FRAMEWORK,
    "accelerator": ACCELERATOR,
    "checkpoint": CHECKPOINT,
    "precision": STAGE_PLACEMENT["precision"],
    "classes": Array(
        Integer(minimum=0, maximum=limits.MAX_CLASS),
        description="conditioning labels only; the class labels this expert was trained on.",
        max_items=limits.MAX_NUM_CLASSES, unique=True),
    "replicas": Integer(description="Default 1.", minimum=0, maximum=limits.MAX_REPLICAS),
    "maxBatch": MAX_BATCH_FIELD,
    "maxDelayMs": MAX_DELAY_FIELD,
    "compile": COMPILE_FIELD,
    **POD_FIELDS,
    "pool": POOL,
    "autoscaling": AUTOSCALING,
})
POOL_ITEM = Object(required=("name",), properties={
    "name": MEMBER_NAME,
    "accelerator": ACCELERATOR,
    "replicas": Integer(description="Default 1.", minimum=1, maximum=limits.MAX_REPLICAS),
    "maxBatch": MAX_BATCH_FIELD,
    "maxDelayMs": MAX_DELAY_FIELD,
    "compile": COMPILE_FIELD,
    "groupedForward": String(
        description="Whether the pool's Paris experts of one architecture run a step's rows "
                    "of all of them as one forward (each projection one grouped matrix "
                    "product over their stacked weights): auto groups on an accelerator up "
                    "to the rows it measured faster at start, and not on a CPU; on always; "
                    "off never. Unset: auto.",
        choices=limits.GROUPED_FORWARD_MODES),
    **POD_FIELDS,
    "autoscaling": AUTOSCALING,
})

SPEC = Object(required=("experts",), properties={
    "conditioning": String(
        description="What the DDM is conditioned on: class labels (numClasses, the experts' "
                    "classes) or text prompts (encoded by textEncoder).",
        choices=limits.CONDITIONINGS, default=limits.CONDITIONINGS[0]),
    "numClasses": Integer(
        description="conditioning labels only: the number of class labels the models condition "
                    "on (labels 0..numClasses-1). Default 10.",
        minimum=1, maximum=limits.MAX_NUM_CLASSES),
    "sampling": Object(description="Defaults for requests that do not choose their own.",
                       default={}, properties={p.key: param_field(p) for p in PARAMS}),
    "router": ROUTER,
    "textEncoder": Object(
        description="conditioning text only (and required there): the tokenizer and text model "
                    "that turn prompts into the experts' embeddings, run once per request.",
        required=("checkpoint",), properties=STAGE_FIELDS),
    "decoder": Object(
        description="Latents to images (a VAE decoder), run once per image after the last "
                    "step; absent when the experts denoise pixels.",
        required=("checkpoint",), properties=STAGE_FIELDS),
    "experts": Array(EXPERT, description="The experts, in the order of the router network's "
                                         "outputs.",
                     min_items=1, max_items=limits.MAX_EXPERTS, map_keys=("name",)),
    "pools": Array(
        POOL_ITEM,
        description="Model servers that each hold several of the DDM's components on one "
                    "accelerator: one Deployment per pool, one process per replica (ddm serve "
                    "pool), which the experts, textEncoder, decoder and router.network that "
                    "name it in their pool field join (a label DDM's experts too). A "
                    "pool's members share one backend and one precision. An "
                    "autoscaled pool follows the sum of its member experts' demand "
                    "(docs/autoscaling.md).",
        max_items=MAX_POOLS, map_keys=("name",)),
})

# -- The status the operator writes (``ddm.operator.status``) ----------------------------------
REASON = String(description="Why a replica is not ready (CrashLoopBackOff, ImagePullBackOff, "
                            "Unschedulable, ...).")
MESSAGE = String(description="What the failing pod's container said (its termination message), "
                             "or the scheduler.")
REPLICAS_STATUS: dict[str, Field] = {"replicas": Integer(), "readyReplicas": Integer(),
                                     "reason": REASON, "message": MESSAGE}
STATUS = Object(properties={
    "observedGeneration": Integer(format="int64"),
    "phase": String(choices=PHASES),
    "expertsReady": String(description='experts with every replica ready / experts, e.g. "2/3".'),
    "routerURL": String(),
    "routerTokenSecret": String(
        description="The Secret holding the router's bearer token (its name, never the token)."),
    "tokenSecrets": Array(
        String(),
        description="The token Secrets the operator created for this resource (their names); "
                    "one of those names that it did not create is never used."),
    "router": Object(properties=REPLICAS_STATUS),
    "experts": Array(Object(required=("name",), properties={
        "name": String(), "accelerator": String(), **REPLICAS_STATUS}), map_keys=("name",)),
    "stages": Array(
        Object(required=("name",), properties={
            "name": String(), "placement": String(), "accelerator": String(),
            **REPLICAS_STATUS}),
        description="The stages placed on their own (text encoder, decoder, router network).",
        map_keys=("name",)),
    "pools": Array(
        Object(required=("name",), properties={
            "name": String(), "accelerator": String(), "members": Array(String()),
            **REPLICAS_STATUS}),
        description="The pools (spec.pools) and their members.", map_keys=("name",)),
    "expertReplicas": String(
        description='Ready/desired replicas of each expert, e.g. "a 1/1, b 0/0" (an autoscaled '
                    "expert's desired count is the operator's last decision)."),
    "demand": Object(
        description="The routers' demand on each autoscaled expert and pool, as the operator "
                    "last read it from their metrics (docs/autoscaling.md).",
        properties={
            "observedAt": String(format="date-time"),
            "routers": String(
                description="Router pods whose metrics were read / router pods ready."),
            "experts": Array(Object(required=("name",), properties={
                "name": String(),
                "rowsPerSecond": Number(
                    description="Routed rows per second, summed over the routers."),
                "waiting": Integer(
                    description="Generations waiting now for a replica (policy wait)."),
                "desiredReplicas": Integer(),
                "idleSeconds": Integer(
                    description="Seconds since the expert last had any demand."),
            }), map_keys=("name",)),
            "pools": Array(Object(required=("name",), properties={
                "name": String(),
                "experts": Array(String(),
                                 description="The member experts whose demand is summed."),
                "rowsPerSecond": Number(
                    description="Routed rows per second to its experts, summed."),
                "waiting": Integer(
                    description="Generations waiting now for one of its experts."),
                "desiredReplicas": Integer(),
                "idleSeconds": Integer(
                    description="Seconds since any of its experts last had demand."),
            }), description="Autoscaled pools; a pool's demand is the sum of its experts'.",
                map_keys=("name",)),
        }),
    "conditions": Array(Object(required=("type", "status"), properties={
        "type": String(),
        "status": String(choices=("True", "False", "Unknown")),
        "reason": String(),
        "message": String(),
        "lastTransitionTime": String(format="date-time"),
        "observedGeneration": Integer(format="int64"),
    }), map_keys=("type",)),
})

DDM_DEPLOYMENT = CustomResource(
    group=GROUP, version=VERSION, kind=KIND, plural=PLURAL, short_names=("ddm",),
    labels=LABELS,
    root=Object(required=("spec",), properties={
        "apiVersion": String(),
        "kind": String(),
        "metadata": Object(properties={
            "name": String(max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)}),
        "spec": SPEC,
        "status": STATUS,
    }),
    columns=(
        Column("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        Column("Experts", ".status.expertsReady",
               description="experts with every replica ready / experts"),
        Column("Replicas", ".status.expertReplicas",
               description="ready/desired replicas of each expert"),
        Column("Strategy", ".spec.sampling.strategy"),
        Column("Phase", ".status.phase"),
        Column("Age", ".metadata.creationTimestamp", type="date"),
    ),
    comment=f"The {KIND} custom resource ({API_VERSION}): one Decentralized Diffusion\n"
            "Model served as a router and its experts. Generated by scripts/generate_crds.py\n"
            "(make generate) from the declarations in src/ddm/deploy/crd.py: edit those, not "
            "this file.",
)
