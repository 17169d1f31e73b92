"""Every limit and name list of a deployment, declared once; everything else imports them.

The spec parser, ``router.yaml``, the servers, the sampler and the operator all read these.
The CRD (``crds/ddmdeployments.ddm.dev.yaml``) is generated from them (``ddm.deploy.crd``,
``make generate``).
Plain constants only: no NumPy, no ML framework (the operator and the CLI import this).
"""

from __future__ import annotations

from ddm.objective_names import DEFAULT_FRAMEWORK as DEFAULT_FRAMEWORK
from ddm.objective_names import FRAMEWORKS as FRAMEWORKS
# The sampling parameters' bounds and defaults are declared in ddm.sampling_params.
from ddm.sampling_params import DEFAULT_SOLVER as DEFAULT_SOLVER
from ddm.sampling_params import DEFAULT_STEPS as DEFAULT_STEPS
from ddm.sampling_params import DEFAULT_STRATEGY as DEFAULT_STRATEGY
from ddm.sampling_params import EVALUATION_STRATEGIES as EVALUATION_STRATEGIES
from ddm.sampling_params import MAX_GUIDANCE_SCALE as MAX_GUIDANCE_SCALE
from ddm.sampling_params import MAX_STEPS as MAX_STEPS
from ddm.sampling_params import SOLVERS as SOLVERS
from ddm.sampling_params import STRATEGY_HINT as STRATEGY_HINT
from ddm.sampling_params import STRATEGY_PATTERN as STRATEGY_PATTERN

#: The ports the servers listen on in a pod, and the servers' own defaults (``ddm up`` picks
#: free loopback ports instead): the API of an expert or stage and of the router, and
#: ``/metrics`` (either server's, alone on it).
EXPERT_PORT = 8000
ROUTER_PORT = 8080
METRICS_PORT = 9090
#: The TCP ports a server may be told to listen on (0 would be the kernel's choice, unknown to
#: whoever then connects).
PORTS = range(1, 65536)

#: What a DDM is conditioned on: class labels (one integer per image) or text prompts (encoded
#: by its text encoder stage).
CONDITIONINGS = ("labels", "text")
#: Where a stage other than the experts runs (text encoder, decoder, router network): in the
#: router's own process, or in pods (processes) of its own on its accelerator.
STAGE_PLACEMENTS = ("router", "separate")
#: The dtypes a server may cast a model's weights to (``--precision``; default: as stored).
PRECISIONS = ("float32", "bfloat16", "float16")
#: The largest magnitude a state's value may have where a client gives it: a request's
#: ``latents`` at the router (422 naming the field) and ``x`` on the wire at every model
#: server (``docs/protocol.md``, 422). Real states stay within a few tens (unit Gaussian noise,
#: data in [-1, 1], a VAE's scaled latents), so this is far above any, and far enough below
#: float32's 3.4e38 that a network's sums and squares of it stay finite: a state of 3e38
#: made every expert answer infinities (issue 35).
MAX_STATE_MAGNITUDE = 1e4
#: What the router does with a step routed to an expert that has no ready replica
#: (``ddm.serving.router.fleet.missing``): 503 (``fail``), hold the generation until one is ready,
#: within ``MISSING_EXPERT_WAIT_S`` (``wait``), or use the best available experts (``reroute``).
MISSING_EXPERT_POLICIES = ("fail", "wait", "reroute")
DEFAULT_MISSING_EXPERT_POLICY = "fail"
MISSING_EXPERT_WAIT_S = 120.0
MAX_MISSING_EXPERT_WAIT_S = 3600.0
#: An expert with ``autoscaling`` waits this long without demand before scaling down.
DEFAULT_SCALE_DOWN_DELAY_S = 300
MAX_SCALE_DOWN_DELAY_S = 86400
#: The router's per-request defaults (``router.yaml`` ``limits:``); a DDM's own default step
#: count raises ``ROUTER_MAX_STEPS`` for its router (``ddm.deploy.plan``).
ROUTER_MAX_BATCH = 64
ROUTER_MAX_STEPS = 200
ROUTER_MAX_CONCURRENT = 16
#: Of those, what one client may run at once (``ddm.serving.router.api.clients`` says who a
#: client is): a quarter, so that one client cannot take the router from the others.
ROUTER_MAX_CONCURRENT_PER_CLIENT = 4
#: What one client may ask of the experts over time (``ddm.serving.router.api.clients.
#: ClientBudget``, a token bucket of rows x steps, ``ddm.sampling.loop.row_steps``): it holds
#: at most this many (four of the largest guided generations the router's default limits
#: allow, 64 images x 200 steps x 2 rows, as many as run at once) and refills this many per
#: second (a guided 40-step image takes 80: some 25 such images a second, per client).
ROUTER_CLIENT_ROW_STEPS = 4 * ROUTER_MAX_BATCH * ROUTER_MAX_STEPS * 2
ROUTER_CLIENT_ROW_STEPS_PER_S = 2048.0
#: The router's JSON body limit where the DDM's largest valid request is smaller (room for a
#: label DDM's spacing and fields); a larger request raises it (``ddm.serving.router.api.requests.
#: max_body_bytes``).
ROUTER_MIN_BODY_BYTES = 65536

#: A DDMDeployment's sizes.
MAX_EXPERTS = 16
MAX_REPLICAS = 64
MAX_NUM_CLASSES = 1000
MAX_CLASS = MAX_NUM_CLASSES - 1
#: A model server's defaults (``ddm serve expert``, ``ddm serve stage``; a DDMDeployment's
#: ``maxBatch`` and ``maxDelayMs`` override the first two): images per model call; no waiting
#: for more requests (those arriving while the model is busy already form the next batch, and a
#: router stepping alone would pay the whole delay at every step, with no clear throughput
#: gain: docs/benchmarks.md, ``calls``); requests admitted at once, queued or
#: running (four full batches of one-row requests from routers stepping concurrently, and at
#: most that many bodies buffered).
SERVER_MAX_BATCH = 64
SERVER_MAX_DELAY_MS = 0.0
SERVER_MAX_PENDING = 256
#: An expert server's images per model call (the spec's ``maxBatch``) and its batching wait.
MAX_BATCH = 4096
MAX_DELAY_MS = 10_000
#: The longest batching wait a model server takes (``--max-delay-ms``): a deployment's is at
#: most MAX_DELAY_MS; tests batch across requests with longer ones, and a wait past the
#: thread timers' limit would fail in the batching thread.
MAX_SERVER_DELAY_MS = 3_600_000
#: Forward rows per guided row of a text expert (the row and its unconditional twin): any
#: request may ask for guidance, so a text expert's ``max_batch`` must hold this many.
GUIDED_FORWARD_ROWS = 2
MAX_ACCELERATOR_COUNT = 32
#: The largest tensor an exported torch program may compute at a batch (``ddm.models.
#: torch_program.check_memory``, on fake tensors before it runs): this multiple of the batch's
#: input ``x``, or the floor for small batches (weights are not counted: the archive holds them).
#: Measured at 1x16x16, batch 1 and 64: our digits UNet's largest is 72x its input (72 channels
#: after a skip concatenation), the tiny DiT's of the docs 16x (its MLP's hidden tokens); 1024x
#: leaves room for wider networks and attention over more pixels, 64 MiB for small images.
MAX_PROGRAM_TENSOR_INPUT_MULTIPLE = 1024
MIN_PROGRAM_TENSOR_BYTES = 64 * 1024 * 1024

#: The most blocks (transformer layers, residual blocks) a network that a checkpoint describes
#: may have (Paris's DiT-XL has 28): a depth read from weights or a config is checked against
#: it before anything is built, for even an empty module costs memory per block (a
#: zero-element tensor named block 20000 once had 20000 built: 1.1 GB).
MAX_NETWORK_BLOCKS = 256

#: What the router believes of an expert's own report (``/v1/info``, ``ddm.serving.router.
#: replicas.ExpertInfo``): an image is at most this many channels and this side in pixels (the
#: router allocates ``(B, C, H, W)`` states from it), a string field at most this long.
MAX_IMAGE_CHANNELS = 16
MAX_IMAGE_SIDE = 1024
MAX_EXPERT_TEXT = 256
#: How deeply an expert's ``partition`` may nest objects and lists (a k-means partition nests 4:
#: the router hashes it with ``json.dumps``, which a deeper one overflows, a 500 on every call).
MAX_EXPERT_INFO_DEPTH = 8
#: Bodies the router reads from an expert outside the binary protocol: ``/v1/info`` (its
#: checkpoint's partition included; the shipped MNIST experts' is 20 KB) and ``/readyz``.
MAX_EXPERT_INFO_BYTES = 1024 * 1024
MAX_EXPERT_PROBE_BYTES = 16 * 1024

#: The expert server's ``--backend`` choices (the frameworks an expert is trained in,
#: ``FRAMEWORKS``, are the checkpoint format's too: declared in ``ddm.objective_names``; which
#: backend and device run a framework on each accelerator type is its declaration's, in
#: ``ddm.deploy.accelerators``). (In-process loading adds ``native``, the checkpoint's own
#: framework: ``ddm.models.loading.LOAD_BACKENDS``.)
EXPERT_BACKENDS = ("torch", "jax", "neuron")
#: How long a model server's pod may take to pull its image and fetch its weights before the
#: server starts (then its plan's ready budget runs): how long the operator's scaler counts a
#: cold start as demand, and what a Deployment's progress deadline allows beyond that budget.
PULL_S = 600
#: ``torch.compile``'s modes a model server may run its torch networks in (``--compile``, the
#: spec's ``compile``); ``none`` runs them eagerly. ``reduce-overhead`` adds CUDA graphs (on a
#: GPU), ``max-autotune`` searches kernels as well (long compiles). Compiled, a server pads
#: each batch to a bucket (:func:`batch_buckets`) and warms every bucket
#: before it is ready.
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
#: Whether a pool runs its same-architecture experts' rows as one grouped forward
#: (``--grouped-forward``; :mod:`ddm.serving.model.grouped`): ``auto`` where it measured
#: faster at start, for the batch sizes it measured faster at; ``on`` always; ``off`` never.
GROUPED_FORWARD_MODES = ("auto", "on", "off")
#: The only backend ``torch.compile`` applies to; the others compile their own way, always.
COMPILING_BACKEND = "torch"
_OWN_COMPILERS = {"jax": "XLA compiles every batch bucket at start",
                  "neuron": "torch-neuronx traces every batch bucket at start"}


def compile_refusal(mode: str, backend: str) -> str | None:
    """Why a server on ``backend`` cannot run its networks in compile ``mode``, or None."""
    if mode not in COMPILE_MODES:
        return f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}"
    if mode != "none" and backend != COMPILING_BACKEND:
        return (f"compile {mode} is torch.compile's, for the torch backend; on the {backend} "
                f"backend {_OWN_COMPILERS.get(backend, 'nothing compiles')}: give compile none")
    return None

#: A text DDM's conditioning on the wire (``docs/protocol.md``, version 2): a context (one
#: generation's embeddings) holds at most this many rows (prompts) of at most this many tokens
#: of this width (CLIP ViT-L/14: 77 x 768; T5-XXL: 512 x 4096); an encode request at most this
#: many prompts of this many UTF-8 bytes each (CLIP cuts at 77 tokens, a few hundred bytes).
MAX_CONTEXT_ROWS = 256
MAX_TEXT_TOKENS = 512
MAX_TEXT_WIDTH = 8192
MAX_PROMPTS = 256
MAX_PROMPT_BYTES = 4096
#: An expert server's cache of contexts (LRU, by bytes held): the default, and the most
#: ``--context-cache-bytes`` may ask. One Paris context of 8 prompts (77 x 768, with its
#: negative rows, float32) is 3.8 MB, so the default keeps about 65 generations.
DEFAULT_CONTEXT_CACHE_BYTES = 256 * 1024 * 1024
MAX_CONTEXT_CACHE_BYTES = 64 * 1024 * 1024 * 1024
#: The largest context body an expert reads: 64 prompts of Paris's CLIP (77 x 768) with their
#: negative rows in float32 are 30 MB (a router's max_batch of guided prompts; at 77 x 768 this
#: cap, not ``MAX_CONTEXT_ROWS``, binds past 141 guided rows: a larger context gets 413 naming
#: it; the router makes none, sending a call of more rows in several contexts).
MAX_CONTEXT_BODY_BYTES = 64 * 1024 * 1024


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to compile for: powers of two below ``max_batch``, then ``max_batch``.

    Compiled backends (JAX, Neuron) need one program per batch size; padding to these few
    sizes wastes at most half a batch and bounds compilation to ``log2(max_batch) + 1``.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def compile_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a ``torch.compile``d network runs at: :func:`batch_buckets`' and, from 8
    rows on, the halfway point between two powers of two (12, 24, 48, 96...).

    Unlike a JAX or Neuron program, its compiled code serves every size (dynamo makes the
    batch dynamic at its second size), so a size costs a CUDA graph recorded at start, not a
    compile, while padding costs a forward's rows at every call: from 8 rows on a batch is
    padded by less than a third, not by up to a half (on an H200 a pool's expert batches of
    33-60 rows ran padded to 64: docs/paris.md).
    """
    powers = batch_buckets(max_batch)
    halfway = (power * 3 // 2 for power in powers if power >= 8)
    return tuple(sorted({*powers, *(size for size in halfway if size < max_batch)}))
