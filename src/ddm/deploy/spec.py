"""The DDMDeployment spec as frozen dataclasses, and the checks a CRD schema cannot make.

``parse_spec`` also makes the schema's checks (types, ranges, patterns, unknown keys): specs
come from files no API server has seen too (``ddm diagram``, ``ddm up``). The CRD is generated
from ``ddm.deploy.crd``, declared with the limits here; tests/unit/test_generated_crds.py
checks that this parser refuses whatever the CRD refuses and defaults as it does. Every
problem is reported at once, each with its field path, e.g.
``spec.experts[1].accelerator.count: 3 is not a size tpu offers per pod``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Mapping, TypeVar

import yaml

from ddm.checkpoints.declared import DECODER, PLAN_NAMES, ROUTER, STAGE_ROLES, TEXT_ENCODER
from ddm.checkpoints.uri import (
    BUCKET_SCHEMES,
    REMOTE_SCHEMES,
    CheckpointSource,
    parse_checkpoint,
    redact_uri,
    secret_checkpoint,
)
from ddm.deploy.accelerators import (
    ACCELERATORS,
    HOST,
    Accelerator,
    node_label_conflicts,
    unit_names,
    with_defaults,
)
from ddm.deploy.autoscaling import (OPERATOR_SCALER, Autoscaling, fleet_problems,
                                    parse_autoscaling)
from ddm.deploy.fields import FieldReader
from ddm.deploy.limits import (
    COMPILE_MODES,
    CONDITIONINGS,
    DEFAULT_CONTEXT_CACHE_BYTES,
    DEFAULT_FRAMEWORK,
    DEFAULT_MISSING_EXPERT_POLICY,
    FRAMEWORKS,
    GROUPED_FORWARD_MODES,
    GUIDED_FORWARD_ROWS,
    MAX_ACCELERATOR_COUNT,
    MAX_BATCH,
    MAX_CLASS,
    MAX_CONTEXT_CACHE_BYTES,
    MAX_DELAY_MS,
    MAX_EXPERTS,
    MAX_NUM_CLASSES,
    MAX_MISSING_EXPERT_WAIT_S,
    MAX_REPLICAS,
    MISSING_EXPERT_POLICIES,
    MISSING_EXPERT_WAIT_S,
    PRECISIONS,
    STAGE_PLACEMENTS,
    compile_refusal,
)
from ddm.deploy.pod_options import PodOptions, parse_pod_options
from ddm.deploy.pools import STAGE_FIELDS, Component, PoolSpec, pool_problems
from ddm.deploy.router_config import MEMBER_NAME_PATTERN, MissingExpert
from ddm.deploy.strict_yaml import load_yaml
from ddm.sampling_params import PARAMS, SamplingParams, sampling_problems

#: The resource this module describes.
GROUP = "ddm.dev"
VERSION = "v1alpha1"
KIND = "DDMDeployment"
API_VERSION = f"{GROUP}/{VERSION}"
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 24
#: An expert's (and a pool's) name: a pool member's name, a path segment of its routes.
EXPERT_NAME_PATTERN = MEMBER_NAME_PATTERN
MAX_EXPERT_NAME_LENGTH = 30
PRODUCT_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
TOPOLOGY_PATTERN = r"^[1-9][0-9]?(x[1-9][0-9]?){1,2}$"
#: A Secret's name (a DNS-1123 subdomain) and a key in it (no leading '.', so never '..').
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_SECRET_NAME_LENGTH = 253
SECRET_KEY_PATTERN = r"^[-_A-Za-z0-9][-._A-Za-z0-9]*$"
DEFAULT_TOKEN_KEY = "token"
#: The most pools a spec lists: each holds one component at least.
MAX_POOLS = MAX_EXPERTS + len(STAGE_ROLES)
#: A pinned SHA-256 (``checkpoint.sha256``): 64 hex digits, optionally ``sha256:`` first.
SHA256_PATTERN = r"^(sha256:)?[0-9a-fA-F]{64}$"


class SpecError(ValueError):
    """An invalid spec; ``problems`` holds one message per offending field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


#: A request's defaults (``spec.sampling``): declared in ``ddm.sampling_params``.
Sampling = SamplingParams


@dataclass(frozen=True)
class SecretKey:
    """One key of a Secret in the DDMDeployment's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class FetchOptions:
    """How a fetched (http(s), s3, gs) checkpoint is checked and authorised: ``sha256`` pins
    the bytes (lower-case hex: of the archive, or of ``config.json`` for a directory, which
    records the weights' hash); ``credentials`` holds ``Name: value`` HTTP header lines;
    ``store_credentials`` an ``s3://``/``gs://`` store's own credentials file."""

    sha256: str | None = None
    credentials: SecretKey | None = None
    store_credentials: SecretKey | None = None

    def secrets(self) -> list[tuple[str, SecretKey]]:
        """(spec field, Secret key) of each Secret these options name."""
        named = (("credentialsSecret", self.credentials),
                 ("storeCredentialsSecret", self.store_credentials))
        return [(field, secret) for field, secret in named if secret is not None]


@dataclass(frozen=True)
class RouterAuth:
    """Bearer-token authentication: the token is ``key`` of Secret ``secret_name``; None:
    the operator creates (and owns) a Secret with a random token."""

    secret_name: str | None = None
    key: str = DEFAULT_TOKEN_KEY


@dataclass(frozen=True)
class StageSpec:
    """A stage besides the experts: the text encoder, the decoder or the router network (whose
    ``checkpoint`` is ``spec.router.checkpoint``). ``placement``: ``router`` loads it inside
    the router's process (its pods' CPU: no accelerator, replicas or pod options of its own);
    ``separate`` serves it from pods (processes) of its own, ``replicas`` of them, each on
    ``accelerator``; ``pool`` (set by ``pool: NAME``, never written as a placement): served by
    the pool named ``pool`` (``spec.pools``). ``precision``: the dtype its weights are cast to
    (None: as stored)."""

    checkpoint: CheckpointSource
    placement: str = "router"
    accelerator: Accelerator = Accelerator()
    replicas: int = 1
    precision: str | None = None
    pod: PodOptions = PodOptions()
    fetch: FetchOptions = FetchOptions()
    pool: str | None = None

    @property
    def separate(self) -> bool:
        return self.placement == "separate"

    @property
    def in_router(self) -> bool:
        """Loaded by the router itself (placement ``router``)."""
        return self.placement == "router"


@dataclass(frozen=True)
class RouterSpec:
    """``checkpoint`` is None only with the oracle strategy (it routes by label); ``auth``
    None: the spec does not ask for authentication (the operator may still require it).
    ``missing_expert``: what a step routed to an expert without a ready replica gets
    (``missingExpert: {policy, waitSeconds}``; router.yaml's ``missing_expert``);
    ``context_cache_bytes``: the text contexts it keeps (``contextCacheBytes``; router.yaml's
    ``limits.context_cache_bytes``)."""

    replicas: int = 1
    checkpoint: CheckpointSource | None = None
    pod: PodOptions = PodOptions()
    auth: RouterAuth | None = None
    fetch: FetchOptions = FetchOptions()
    missing_expert: MissingExpert = MissingExpert()
    network: StageSpec | None = None
    context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES


@dataclass(frozen=True)
class ExpertSpec:
    """One expert. ``max_batch``/``max_delay_ms``/``compile`` None: the server's own defaults
    (``compile``: ``torch.compile``'s mode, ``ddm serve --compile``); ``pool``: the pool that
    serves it (None: servers of its own)."""

    name: str
    framework: str
    accelerator: Accelerator
    checkpoint: CheckpointSource
    classes: tuple[int, ...] = ()
    replicas: int = 1
    max_batch: int | None = None
    max_delay_ms: int | None = None
    pod: PodOptions = PodOptions()
    fetch: FetchOptions = FetchOptions()
    autoscaling: Autoscaling | None = None
    precision: str | None = None
    pool: str | None = None
    compile: str | None = None


@dataclass(frozen=True)
class DDMSpec:
    """A validated DDMDeployment spec; ``experts`` in the router network's output order.
    ``conditioning``: ``labels`` (``num_classes`` of them) or ``text`` (prompts, encoded by
    ``text_encoder``); ``decoder``: latents -> images (None: the experts work in pixels)."""

    experts: tuple[ExpertSpec, ...]
    num_classes: int = 10
    sampling: Sampling = Sampling()
    router: RouterSpec = RouterSpec()
    conditioning: str = "labels"
    text_encoder: StageSpec | None = None
    decoder: StageSpec | None = None
    pools: tuple[PoolSpec, ...] = ()

    def members(self, pool: str) -> dict[str, ExpertSpec | StageSpec]:
        """The components pool ``pool`` serves, by their names in the plan (an expert's name,
        or a stage's role: ``text-encoder``, ``decoder``, ``router-network``): experts first,
        in order."""
        experts = {e.name: e for e in self.experts if e.pool == pool}
        return {**experts, **{role: stage for role, stage in self.stages.items()
                              if stage.pool == pool}}

    @property
    def stages(self) -> dict[str, StageSpec]:
        """Role -> stage, for every stage besides the experts this DDM has (the router
        network's only when it has one)."""
        network = self.router.network or (StageSpec(self.router.checkpoint)
                                          if self.router.checkpoint else None)
        found = {PLAN_NAMES[TEXT_ENCODER]: self.text_encoder, PLAN_NAMES[DECODER]: self.decoder,
                 PLAN_NAMES[ROUTER]: network}
        return {role: stage for role, stage in found.items() if stage is not None}


SpecT = TypeVar("SpecT")


@dataclass(frozen=True)
class Manifest(Generic[SpecT]):
    """A ddm.dev document read from a file: its name, namespace (None: unset) and spec."""

    name: str
    namespace: str | None
    spec: SpecT


#: A DDMDeployment read from a file.
DDMManifest = Manifest[DDMSpec]


def parse_spec(raw: Any, *, allow_host_paths: bool = False) -> DDMSpec:
    """A checked ``DDMSpec`` from a DDMDeployment's ``spec``; raises ``SpecError``.

    ``allow_host_paths`` accepts file:// checkpoints (host paths; see ``checkpoints``).
    """
    problems: list[str] = []
    reader = FieldReader(raw, "spec", problems)
    conditioning = reader.string("conditioning", "labels", choices=CONDITIONINGS) or "labels"
    if conditioning == "text" and reader.has("numClasses"):
        reader.problem("numClasses", "only for conditioning: labels (a text DDM takes prompts)")
    num_classes = reader.integer("numClasses", 10, 1, MAX_NUM_CLASSES)
    sampling = _sampling(reader.child("sampling"))
    router = _router(reader.child("router"), allow_host_paths)
    text_encoder, decoder = (
        _stage(reader.child(key), allow_host_paths) if reader.has(key) else None
        for key in ("textEncoder", "decoder"))
    raw_experts = reader.items("experts")
    if not 1 <= len(raw_experts) <= MAX_EXPERTS:
        reader.problem("experts", f"must list 1..{MAX_EXPERTS} experts, got {len(raw_experts)}")
    experts = tuple(
        e for i, item in enumerate(raw_experts)
        if (e := _expert(FieldReader(item, f"spec.experts[{i}]", problems), allow_host_paths))
    )
    raw_pools = reader.items("pools")
    if len(raw_pools) > MAX_POOLS:
        reader.problem("pools", f"must list at most {MAX_POOLS} pools (one per component), got "
                                f"{len(raw_pools)}")
    pools = tuple(p for i, item in enumerate(raw_pools)
                  if (p := _pool(FieldReader(item, f"spec.pools[{i}]", problems))))
    reader.done()
    spec = DDMSpec(experts=experts, num_classes=num_classes or 10, sampling=sampling,
                   router=router, conditioning=conditioning, text_encoder=text_encoder,
                   decoder=decoder, pools=pools)
    if not problems:
        problems.extend(_semantic_problems(spec))
    if problems:
        raise SpecError(problems)
    return spec


def _sampling(reader: FieldReader) -> Sampling:
    """``spec.sampling``, each field checked against its declaration (a bad one recorded and
    replaced by its default)."""
    given = {param.name: reader.value(param.key) for param in PARAMS if reader.has(param.key)}
    bad = dict(sampling_problems(given))
    for param in PARAMS:
        if param.name in bad:
            reader.problem(param.key, bad[param.name])
    reader.done()
    return Sampling(**{name: value for name, value in given.items() if name not in bad})


def _checkpoint(reader: FieldReader, allow_host_paths: bool
                ) -> tuple[CheckpointSource | None, FetchOptions]:
    """The checkpoint's source and fetch options. A URI appears in messages only redacted
    (``redact_uri``): a pre-signed URL's signature must not reach the status or events."""
    uri = reader.value("uri")
    uri_from = reader.child("uriFrom") if reader.has("uriFrom") else None
    sha256 = reader.string("sha256", None, pattern=SHA256_PATTERN,
                           hint="64 hexadecimal digits, optionally 'sha256:' first")
    credentials, store_credentials = (
        read_secret_key(reader.child(field)) if reader.has(field) else None
        for field in ("credentialsSecret", "storeCredentialsSecret"))
    fetch = FetchOptions(sha256=sha256.lower().removeprefix("sha256:") if sha256 else None,
                         credentials=credentials, store_credentials=store_credentials)
    if reader.has("credentialsSecret") and reader.has("storeCredentialsSecret"):
        reader.problem("storeCredentialsSecret", "give credentialsSecret (HTTP headers) or "
                                                 "storeCredentialsSecret, not both")
    if uri_from is not None:
        if uri is not None:
            reader.problem("uriFrom", "give uri or uriFrom, not both")
        held = (read_secret_key(uri_from.child("secretKeyRef")) if uri_from.has("secretKeyRef")
                else None)
        if not uri_from.has("secretKeyRef"):
            uri_from.problem("secretKeyRef", "is required")
        uri_from.done()
        reader.done()
        return (secret_checkpoint(held.name, held.key) if held and uri is None else None), fetch
    reader.done()
    if uri is None:
        reader.problem("uri", "is required (or uriFrom.secretKeyRef)")
        return None, fetch
    shown = redact_uri(uri) if isinstance(uri, str) else uri
    try:
        checkpoint = parse_checkpoint(uri)
    except ValueError as error:
        reader.problem("uri", str(error).replace(repr(uri), repr(shown)))
        return None, fetch
    if checkpoint.scheme == "file" and not allow_host_paths:
        reader.problem("uri", f"{shown!r} mounts a directory of the node (a hostPath); this "
                              "operator allows no host path (DDM_ALLOW_HOST_PATHS is empty): "
                              "use pvc://, image://, http(s)://, s3:// or gs://")
    if checkpoint.scheme not in REMOTE_SCHEMES:
        for key in ("sha256", "credentialsSecret"):
            if reader.has(key):
                reader.problem(key, f"only for a fetched checkpoint ({', '.join(REMOTE_SCHEMES)}"
                                    f" or uriFrom); {shown!r} is not fetched")
    if checkpoint.scheme not in BUCKET_SCHEMES and reader.has("storeCredentialsSecret"):
        reader.problem("storeCredentialsSecret",
                       f"only for a bucket ({', '.join(f'{s}://' for s in BUCKET_SCHEMES)} or "
                       f"uriFrom); {shown!r} is not one: give HTTP headers (credentialsSecret) "
                       "or a pre-signed URL")
    if "@" in checkpoint.location:
        reader.problem("uri", f"{shown!r}: credentials in the URI are refused; put them in a "
                              "Secret and name it in credentialsSecret")
    elif checkpoint.scheme == "http" and fetch.sha256 is None:
        reader.problem("uri", f"{shown!r}: plain http is refused unless the download is pinned "
                              "(set sha256: of the archive, or of DIR/config.json for a "
                              "directory)")
    return checkpoint, fetch


def read_secret_key(reader: FieldReader) -> SecretKey | None:
    """A reference to one key of a Secret (``name`` and ``key``, both required), or None with
    the problems recorded on ``reader``."""
    name = reader.string("name", None, pattern=SECRET_NAME_PATTERN,
                         max_length=MAX_SECRET_NAME_LENGTH,
                         hint="a Secret name: lower-case letters, digits, '-' and '.'")
    key = reader.string("key", None, pattern=SECRET_KEY_PATTERN,
                        max_length=MAX_SECRET_NAME_LENGTH,
                        hint="a key of the Secret: letters, digits, '-', '_' and '.'")
    for field in ("name", "key"):
        if not reader.has(field):
            reader.problem(field, "is required")
    reader.done()
    return SecretKey(name, key) if name and key else None


def _auth(reader: FieldReader) -> RouterAuth:
    auth = RouterAuth(
        secret_name=reader.string("secretName", None, pattern=SECRET_NAME_PATTERN,
                                  max_length=MAX_SECRET_NAME_LENGTH,
                                  hint="a Secret name: lower-case letters, digits, '-' and '.'"),
        key=reader.string("key", DEFAULT_TOKEN_KEY, pattern=SECRET_KEY_PATTERN,
                          max_length=MAX_SECRET_NAME_LENGTH,
                          hint="a key of the Secret: letters, digits, '-', '_' and '.'")
        or DEFAULT_TOKEN_KEY,
    )
    reader.done()
    return auth


def _router(reader: FieldReader, allow_host_paths: bool) -> RouterSpec:
    checkpoint, fetch = (_checkpoint(reader.child("checkpoint"), allow_host_paths)
                         if reader.has("checkpoint") else (None, FetchOptions()))
    auth = _auth(reader.child("auth")) if reader.has("auth") else None
    network = None
    if reader.has("network"):
        if checkpoint is None and not reader.has("checkpoint"):
            reader.problem("network", "places the router network: it needs "
                                      "spec.router.checkpoint")
        network = _stage(reader.child("network"), allow_host_paths, (checkpoint, fetch))
    router = RouterSpec(replicas=reader.integer("replicas", 1, 0, MAX_REPLICAS) or 0,
                        checkpoint=checkpoint, pod=parse_pod_options(reader), auth=auth,
                        fetch=fetch, missing_expert=_missing_expert(reader.child("missingExpert")),
                        network=network,
                        context_cache_bytes=reader.integer(
                            "contextCacheBytes", DEFAULT_CONTEXT_CACHE_BYTES, 1,
                            MAX_CONTEXT_CACHE_BYTES) or DEFAULT_CONTEXT_CACHE_BYTES)
    reader.done()
    return router


def _stage(reader: FieldReader, allow_host_paths: bool,
           router: tuple[CheckpointSource | None, FetchOptions] | None = None
           ) -> StageSpec | None:
    """A text encoder or decoder (its own ``checkpoint``), or the router network (given
    ``router``: the router's checkpoint and fetch options; the field is not read)."""
    checkpoint, fetch = router or (None, FetchOptions())
    if router is None:
        if reader.has("checkpoint"):
            checkpoint, fetch = _checkpoint(reader.child("checkpoint"), allow_host_paths)
        else:
            reader.problem("checkpoint", "is required")
    placement = reader.string("placement", "router", choices=STAGE_PLACEMENTS) or "router"
    pool = _pool_name(reader)
    if pool is not None:
        placement = "pool"
    elif placement == "router":
        for key in ("accelerator", "replicas", "resources", "image", "nodeSelector",
                    "tolerations", "affinity"):
            if reader.has(key):
                reader.problem(key, "only for placement: separate (placement: router loads "
                                    "the stage inside the router's pods, on their CPU)")
    accelerator, accelerator_ok = read_accelerator(reader, "torch")
    stage = StageSpec(
        checkpoint=checkpoint,  # type: ignore[arg-type]  # dropped below when None
        placement=placement, accelerator=accelerator,
        replicas=reader.integer("replicas", 1, 1, MAX_REPLICAS) or 1,
        precision=reader.string("precision", None, choices=PRECISIONS),
        pod=parse_pod_options(reader), fetch=fetch, pool=pool)
    if accelerator_ok:
        report_node_label_conflicts(reader, accelerator, stage.pod)
    reader.done()
    return stage if checkpoint else None


def read_accelerator(reader: FieldReader, framework: str) -> tuple[Accelerator, bool]:
    """The ``accelerator`` field with its defaults, and whether it passed its checks."""
    accelerator = with_defaults(_accelerator(reader.child("accelerator")))
    accelerator_problems = accelerator.problems(framework)
    for field, message in accelerator_problems:
        reader.problem(f"accelerator.{field}", message)
    return accelerator, not accelerator_problems


def report_node_label_conflicts(reader: FieldReader, accelerator: Accelerator,
                                pod: PodOptions) -> None:
    """A problem on ``reader`` for each label of the pod's ``nodeSelector`` that clashes with
    what ``accelerator`` selects."""
    for key, message in node_label_conflicts(accelerator, pod.node_selector or {}):
        reader.problem(f"nodeSelector[{key!r}]", message)


def _missing_expert(reader: FieldReader) -> MissingExpert:
    policy = reader.string("policy", DEFAULT_MISSING_EXPERT_POLICY,
                           choices=MISSING_EXPERT_POLICIES) or DEFAULT_MISSING_EXPERT_POLICY
    wait_s = reader.integer("waitSeconds", int(MISSING_EXPERT_WAIT_S), 1,
                            int(MAX_MISSING_EXPERT_WAIT_S))
    reader.done()
    return MissingExpert(policy, float(wait_s or MISSING_EXPERT_WAIT_S))


def _scale_to_zero_problems(spec: DDMSpec) -> list[str]:
    """An expert or pool the operator's scaler may leave at zero needs a policy that waits for
    it or reroutes: a waiting or rerouted generation is what starts it, and under ``fail`` a
    generation that needs it fails without either, so it never starts. (An external scaler
    starts it on signals of its own.)"""
    if spec.router.missing_expert.policy != DEFAULT_MISSING_EXPERT_POLICY:
        return []
    scaled = [(f"spec.experts[{i}]", e.autoscaling) for i, e in enumerate(spec.experts)
              if e.pool is None]
    scaled += [(f"spec.pools[{i}]", p.autoscaling) for i, p in enumerate(spec.pools)]
    at_zero = [path for path, rules in scaled if rules is not None and
               rules.min_replicas == 0 and rules.scaler == OPERATOR_SCALER]
    others = " or ".join(p for p in MISSING_EXPERT_POLICIES
                         if p != DEFAULT_MISSING_EXPERT_POLICY)
    return [f"{path}.autoscaling.minReplicas: 0 needs spec.router.missingExpert.policy "
            f"{others}: under {DEFAULT_MISSING_EXPERT_POLICY} (the default) a generation "
            "that needs it while it is at zero fails, and nothing starts it"
            for path in at_zero]


def _accelerator(reader: FieldReader) -> Accelerator:
    accelerator = Accelerator(
        type=reader.string("type", HOST, choices=tuple(ACCELERATORS)) or HOST,
        count=reader.integer("count", 0, 1, MAX_ACCELERATOR_COUNT) or 0,
        unit=reader.string("unit", None, choices=unit_names()),
        product=reader.string("product", None, pattern=PRODUCT_PATTERN, max_length=63,
                              hint="a node label value"),
        topology=reader.string("topology", None, pattern=TOPOLOGY_PATTERN,
                               hint="e.g. 2x2 or 2x2x1"),
    )
    reader.done()
    return accelerator


def read_unit_name(reader: FieldReader) -> str | None:
    """The required ``name`` of an expert or a pool: a DNS-1123 label, as the names of the
    Kubernetes objects made for it end in it."""
    name = reader.string("name", None, pattern=EXPERT_NAME_PATTERN,
                         max_length=MAX_EXPERT_NAME_LENGTH, hint=DNS_LABEL_HINT)
    if not reader.has("name"):
        reader.problem("name", "is required")
    return name


def _expert(reader: FieldReader, allow_host_paths: bool) -> ExpertSpec | None:
    name = read_unit_name(reader)
    framework = (reader.string("framework", DEFAULT_FRAMEWORK, choices=FRAMEWORKS)
                 or DEFAULT_FRAMEWORK)
    pool = _pool_name(reader)
    accelerator, accelerator_ok = read_accelerator(reader, framework)
    checkpoint, fetch = None, FetchOptions()
    if reader.has("checkpoint"):
        checkpoint, fetch = _checkpoint(reader.child("checkpoint"), allow_host_paths)
    else:
        reader.problem("checkpoint", "is required")
    classes = reader.items("classes")
    if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_CLASS
               for c in classes):
        reader.problem("classes", f"must be integers in 0..{MAX_CLASS}, got {classes}")
    elif len(set(classes)) != len(classes):
        reader.problem("classes", f"lists a label twice: {classes}")
    expert = ExpertSpec(
        name=name or "",
        framework=framework,
        accelerator=accelerator,
        checkpoint=checkpoint,  # type: ignore[arg-type]  # dropped below when None
        classes=tuple(classes),
        replicas=reader.integer("replicas", 1, 0, MAX_REPLICAS) or 0,
        max_batch=_max_batch(reader),
        max_delay_ms=_max_delay_ms(reader),
        pod=parse_pod_options(reader),
        fetch=fetch,
        autoscaling=_autoscaling(reader),
        precision=reader.string("precision", None, choices=PRECISIONS),
        pool=pool,
        compile=_compile(reader),
    )
    if accelerator_ok:
        report_node_label_conflicts(reader, accelerator, expert.pod)
    reader.done()
    return expert if name and checkpoint else None


#: What an expert's or pool's name must be (``EXPERT_NAME_PATTERN``), in words.
DNS_LABEL_HINT = "a DNS-1123 label: lower-case letters, digits and '-'"
#: What a pool decides for its members: a component that names a pool gives none of these.
POOL_PLACED_FIELDS = ("placement", "accelerator", "replicas", "resources", "image",
                      "nodeSelector", "tolerations", "affinity", "maxBatch", "maxDelayMs",
                      "autoscaling", "compile")


def _pool_name(reader: FieldReader) -> str | None:
    """A component's ``pool``, refusing every field its pool decides instead."""
    pool = reader.string("pool", None, pattern=EXPERT_NAME_PATTERN,
                         max_length=MAX_EXPERT_NAME_LENGTH, hint=f"a pool's name, {DNS_LABEL_HINT}")
    if pool is not None:
        for key in POOL_PLACED_FIELDS:
            if reader.has(key):
                where = ("leave it out: the pool's server serves it" if key == "placement" else
                         f"give {key} there, not here")
                reader.problem(key, f"the component is in pool {pool!r}, which places it "
                                    f"(spec.pools): {where}")
    return pool


def _max_batch(reader: FieldReader) -> int | None:
    return reader.integer("maxBatch", None, 1, MAX_BATCH)


def _max_delay_ms(reader: FieldReader) -> int | None:
    return reader.integer("maxDelayMs", None, 0, MAX_DELAY_MS)


def _compile(reader: FieldReader) -> str | None:
    return reader.string("compile", None, choices=COMPILE_MODES)


def _autoscaling(reader: FieldReader) -> Autoscaling | None:
    return parse_autoscaling(reader.child("autoscaling")) if reader.has("autoscaling") else None


def _pool(reader: FieldReader) -> PoolSpec | None:
    name = read_unit_name(reader)
    # Which frameworks the accelerator must run is the members' question (pool_problems).
    accelerator, accelerator_ok = read_accelerator(reader, "torch")
    pool = PoolSpec(name=name or "", accelerator=accelerator,
                    replicas=reader.integer("replicas", 1, 1, MAX_REPLICAS) or 1,
                    max_batch=_max_batch(reader), max_delay_ms=_max_delay_ms(reader),
                    pod=parse_pod_options(reader), autoscaling=_autoscaling(reader),
                    compile=_compile(reader),
                    grouped_forward=reader.string("groupedForward", None,
                                                  choices=GROUPED_FORWARD_MODES))
    if accelerator_ok:
        report_node_label_conflicts(reader, accelerator, pool.pod)
    reader.done()
    return pool if name else None


def _semantic_problems(spec: DDMSpec) -> list[str]:
    """Rules across fields: class ranges, the oracle's partition, the router checkpoint."""
    found: list[str] = []
    pools = {p.name: p for p in spec.pools}
    # A pooled expert scales with its pool (an unknown pool is pool_problems' to name).
    found.extend(fleet_problems([e.autoscaling if e.pool is None else
                                 pools[e.pool].autoscaling if e.pool in pools else None
                                 for e in spec.experts]))
    found.extend(_scale_to_zero_problems(spec))
    names = [e.name for e in spec.experts]
    for name in sorted({n for n in names if names.count(n) > 1}):
        found.append(f"spec.experts: the name {name!r} is used more than once")
    last = spec.num_classes - 1
    for i, expert in enumerate(spec.experts):
        outside = [c for c in expert.classes if c > last]
        if outside:
            found.append(f"spec.experts[{i}].classes: {outside} are outside 0..{last} "
                         f"(spec.numClasses is {spec.num_classes})")
    found.extend(_conditioning_problems(spec))
    found.extend(_compile_problems(spec))
    found.extend(pool_problems(spec.pools, [
        *(Component(f"spec.experts[{i}]", e.name, e.pool, e.framework, e.precision)
          for i, e in enumerate(spec.experts)),
        *(Component(STAGE_FIELDS[role], role, stage.pool, "torch", stage.precision,
                    stage=True)
          for role, stage in spec.stages.items())]))
    strategy = spec.sampling.strategy
    if strategy == "oracle":
        found.extend(_oracle_problems(spec))
    elif spec.router.checkpoint is None:
        found.append(f"spec.router.checkpoint: strategy {strategy} needs the router network's "
                     "checkpoint (only oracle routes without one)")
    match = re.fullmatch(r"top(?:k:)?(\d+)", strategy)
    if match and int(match.group(1)) > len(spec.experts):
        found.append(f"spec.sampling.strategy: {strategy} combines {match.group(1)} experts but "
                     f"only {len(spec.experts)} are defined")
    return found


def _compile_problems(spec: DDMSpec) -> list[str]:
    """A ``compile`` mode where the server's backend is not torch (JAX, Neuron): an
    expert's own, or a pool's for its members' framework."""
    placed = [(f"spec.experts[{i}]", e.compile, e.accelerator, e.framework)
              for i, e in enumerate(spec.experts) if e.pool is None]
    for j, pool in enumerate(spec.pools):
        framework = next((m.framework for m in spec.members(pool.name).values()
                          if isinstance(m, ExpertSpec)), "torch")
        placed.append((f"spec.pools[{j}]", pool.compile, pool.accelerator, framework))
    found = []
    for path, mode, accelerator, framework in placed:
        backend = accelerator.declared.backends.get(framework)
        refusal = (None if mode is None or backend is None  # no backend: named elsewhere
                   else compile_refusal(mode, backend[0]))
        if refusal is not None:
            found.append(f"{path}.compile: {refusal}")
    return found


def _conditioning_problems(spec: DDMSpec) -> list[str]:
    """A text DDM encodes prompts and routes without labels; a label DDM has no prompts to
    encode and no guidance (its experts take no unconditional input)."""
    if spec.conditioning == "labels":
        found = []
        if spec.text_encoder is not None:
            found.append("spec.textEncoder: only for conditioning: text (a label DDM has no "
                         "prompts to encode)")
        if spec.sampling.guidance_scale != 1.0 or spec.sampling.guidance_cutoff != 1.0:
            found.append("spec.sampling.guidanceScale: classifier-free guidance needs "
                         "conditioning: text; a label DDM samples unguided (1)")
        return found
    found = [f"spec.experts[{i}].classes: only for conditioning: labels (a text DDM's experts "
             "own clusters of images, not labels)"
             for i, expert in enumerate(spec.experts) if expert.classes]
    # Any request may ask for guidance, and a guided row runs as GUIDED_FORWARD_ROWS rows.
    batching = [*((f"spec.experts[{i}]", e.max_batch) for i, e in enumerate(spec.experts)
                  if e.pool is None),
                *((f"spec.pools[{j}]", p.max_batch) for j, p in enumerate(spec.pools)
                  if any(e.pool == p.name for e in spec.experts))]
    found.extend(f"{path}.maxBatch: {rows} cannot hold a guided row, which runs as "
                 f"{GUIDED_FORWARD_ROWS} forward rows (the row and its unconditional twin); a "
                 f"text DDM's experts need {GUIDED_FORWARD_ROWS} or more"
                 for path, rows in batching if rows is not None and rows < GUIDED_FORWARD_ROWS)
    if spec.text_encoder is None:
        found.append("spec.textEncoder: conditioning: text needs the text encoder that turns "
                     "prompts into the experts' embeddings")
    if spec.sampling.strategy == "oracle":
        found.append("spec.sampling.strategy: oracle routes by label; a text DDM needs the "
                     "router network (e.g. top1, top2)")
    return found


def _oracle_problems(spec: DDMSpec) -> list[str]:
    """The oracle sends each label to the one expert that owns it: a partition of the labels."""
    found: list[str] = []
    owner: dict[int, str] = {}
    for i, expert in enumerate(spec.experts):
        if not expert.classes:
            found.append(f"spec.experts[{i}].classes: the oracle strategy routes by label, so "
                         "every expert must list its classes")
        for label in expert.classes:
            if label in owner:
                found.append(f"spec.experts[{i}].classes: label {label} is also claimed by "
                             f"expert {owner[label]}; the oracle needs classes without overlap")
            owner.setdefault(label, expert.name)
    uncovered = sorted(set(range(spec.num_classes)) - set(owner))
    if uncovered:
        found.append(f"spec.experts: labels {uncovered} belong to no expert; the oracle strategy "
                     f"needs every label 0..{spec.num_classes - 1} covered")
    return found


def read_identity(document: Any, kind: str, problems: list[str]
                  ) -> tuple[str | None, str | None]:
    """A ``ddm.dev`` resource document's name and namespace (None: unset), checked against
    ``kind``; each problem recorded in ``problems``. Its ``spec`` is the caller's to read."""
    reader = FieldReader(document, "document", problems)
    if reader.value("apiVersion") != API_VERSION or reader.value("kind") != kind:
        problems.append(f"apiVersion/kind: must be {API_VERSION} {kind}")
    metadata = reader.child("metadata")
    name = metadata.string("name", None, pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH,
                           hint="a DNS-1035 label: a lower-case letter, then letters, digits "
                                "and '-'")
    if not metadata.has("name"):
        metadata.problem("name", "is required")
    namespace = metadata.string("namespace", None)
    reader.value("spec")
    reader.value("status")  # a document saved from the cluster carries one; it is ignored
    reader.done()  # metadata may hold anything (labels, annotations): not checked
    return name, namespace


def parse_manifest(document: Any, *, allow_host_paths: bool = False) -> DDMManifest:
    """A whole ``kind: DDMDeployment`` document (as read from YAML); raises ``SpecError``."""
    problems: list[str] = []
    name, namespace = read_identity(document, KIND, problems)
    try:
        spec = parse_spec(document.get("spec") if isinstance(document, Mapping) else None,
                          allow_host_paths=allow_host_paths)
    except SpecError as error:
        problems.extend(error.problems)
    if problems:
        raise SpecError([p.removeprefix("document.") for p in problems])
    return DDMManifest(name=name or "", namespace=namespace, spec=spec)


def load_manifest(path: str | Path, *, allow_host_paths: bool = True) -> DDMManifest:
    """Read one DDMDeployment from a YAML file (a local file: host paths are fine)."""
    return parse_manifest(read_manifest_document(path), allow_host_paths=allow_host_paths)


def read_manifest_document(path: str | Path) -> Any:
    """The YAML document in the file ``path``, unchecked; ``SpecError`` naming the file when it
    is not YAML text, or gives a key twice (``ddm.deploy.strict_yaml``)."""
    try:
        return load_yaml(Path(path).read_bytes(), str(path))
    except yaml.YAMLError as error:
        raise SpecError([f"{path}: not valid YAML: {error}"]) from None
