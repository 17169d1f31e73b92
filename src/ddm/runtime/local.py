"""``ddm up``: run a DDMDeployment's experts, stages and router as local processes, no cluster
needed.

The same YAML a user would ``kubectl apply`` is planned by the one deployment plan
(``ddm.deploy.plan``, which the operator uses too), placed here by :func:`plan_local`, then
supervised (:func:`run_local`): every expert replica becomes a ``ddm serve expert`` process on
a free loopback port (held from when it is drawn until the process takes it over:
:class:`HeldPorts`), the router a ``ddm serve router`` process whose config lists those
endpoints. A stage placed ``separate`` (a text encoder, decoder or router network) becomes
``ddm serve stage`` processes the router reaches the same way; one placed ``router`` is loaded
by the router from its local directory. A pool (``spec.pools``) becomes one ``ddm serve pool``
process per replica holding all its members. Before anything starts, the state shape the local
stage checkpoints declare (``_ddm.latent_shape``) must agree across experts, router network
and decoder. Ctrl-C or SIGTERM stops everything started.

A process that dies once everything was up is restarted, on the same port, as the kubelet
restarts a container: after a back-off that doubles with each restart up to 5 minutes, and
resets once the process has run 10 minutes (:class:`Backoff`). The kubelet's first delay is
10 s; here it is 1 s, since a local run has no crash-looping fleet to protect and a developer
waits for it. Meanwhile the router answers requests that need the dead expert with a 503
naming it (once its call deadline, ``--deadline-s``, has passed), and serves the others.
``fail_fast`` (``ddm up --fail-fast``) instead stops everything when one process dies.
An expert or pool with ``autoscaling.minReplicas: 0`` runs on demand
(:mod:`ddm.runtime.scaling`): its process starts when the router's ``/v1/demand`` shows a
generation needing it (any of a pool's experts) and stops after its scale-down delay without
demand; what a request meanwhile gets is the router's ``missingExpert`` policy (wait for it,
or reroute to the best available experts): a pool at zero is all its experts missing.
A server that cannot start leaves a one-line reason in its own termination-message file
(``DDM_TERMINATION_LOG``, as Kubernetes would show it), and ``ddm up`` reports that line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TextIO

from ddm.checkpoints.declared import declared_latent_shape
from ddm.checkpoints.local import IMAGE_PREFIX as IMAGE_PREFIX
from ddm.checkpoints.local import REPOSITORY_ROOT as REPOSITORY_ROOT
from ddm.checkpoints.local import resolve_checkpoint as resolve_checkpoint
from ddm.checkpoints.shipped import DEFAULT_DDM
from ddm.checkpoints.uri import CheckpointSource
from ddm.deploy.accelerators import DEFAULT_STARTUP_BUDGET_S
from ddm.deploy.autoscaler import Scaled
from ddm.deploy.limits import MAX_EXPERT_PROBE_BYTES, PORTS, ROUTER_PORT
from ddm.deploy.plan import RouterPlan, plan_deployment
from ddm.deploy.router_config import Auth, Discovery, RouterConfigFile, StaticDiscovery
from ddm.deploy.spec import DDMManifest
from ddm.runtime.scaling import DemandPoller, OnDemand, Scaler
from ddm.serving.http.fetch import FetchError, fetch_json
from ddm.serving.http.handoff import ENV as HANDOFF_ENV
from ddm.serving.http.handoff import handoff_env
from ddm.termination import ENV as TERMINATION_LOG_ENV
from ddm.termination import sigterm_handled
from ddm.threads import usable_cpus

#: What ``ddm up`` (``make demo``) runs when given no manifest: the default DDM.
DEFAULT_MANIFEST = REPOSITORY_ROOT / "examples" / f"{DEFAULT_DDM}.yaml"
#: Each readiness poll's deadline.
READY_POLL_S = 2.0
STOP_TIMEOUT_S = 10.0
#: How often the supervisor looks for processes that died or are due to restart.
SUPERVISE_INTERVAL_S = 0.2
#: The longest piece of a process's output relayed as one line: one that never ends is
#: relayed in pieces, not held whole.
RELAY_LINE_CHARS = 64 * 1024


class LocalRunError(RuntimeError):
    """The deployment cannot run locally, or one of its processes failed."""


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: ``name`` labels its log lines, ``port`` is where it listens,
    ``metrics_port`` where it serves ``/metrics`` (alone, as in a pod); ``ready_s``: how long
    it may take to become ready (a server's plan says: ``ddm.deploy.plan.ready_budget_s``,
    the budget the operator gives its pods)."""

    name: str
    argv: tuple[str, ...]
    port: int
    env: tuple[tuple[str, str], ...] = ()
    metrics_port: int | None = None
    ready_s: float = DEFAULT_STARTUP_BUDGET_S


@dataclass(frozen=True)
class LocalPlan:
    """The processes to run; ``token_file``: the bearer token the router requires (None: auth
    is off); ``expert_token_file``: the one the router presents to its experts, which require
    it (another token, so that an expert never holds the public one); ``on_demand``: experts
    and pools with ``minReplicas: 0``, whose processes run only while there is demand for them;
    ``stages``: the servers of the stages placed ``separate``; ``pools``: the pools' servers."""

    experts: tuple[ProcessSpec, ...]
    router: ProcessSpec
    router_config: RouterConfigFile
    url: str
    token_file: Path | None = None
    expert_token_file: Path | None = None
    on_demand: tuple[OnDemand, ...] = ()
    stages: tuple[ProcessSpec, ...] = ()
    pools: tuple[ProcessSpec, ...] = ()

    @property
    def servers(self) -> tuple[ProcessSpec, ...]:
        """Every model server process: experts, separate stages and pools."""
        return (*self.experts, *self.stages, *self.pools)


def plan_local(manifest: DDMManifest, ports: Callable[[], int], router_port: int,
               host: str = "127.0.0.1", *,
               locate: Callable[[CheckpointSource], Path] = resolve_checkpoint,
               threads: int = 1, config_path: Path = Path("router.yaml"),
               cache_dir: Path = Path(tempfile.gettempdir()) / "ddm-cache",
               token_file: Path | None = None, expert_token_file: Path | None = None,
               require_auth: bool = False) -> LocalPlan:
    """The manifest's plan placed here: ``ports()`` hands out free ports (each server's and its
    metrics', no two alike, none the router's: a port is bound only when its server starts, so
    a free one can be drawn twice), ``locate`` finds each checkpoint's directory,
    ``cache_dir`` holds compile caches (Neuron).
    When the spec asks for authentication (``router.auth``) or ``require_auth``, the router
    reads its public bearer token from ``token_file``, and presents the one in
    ``expert_token_file`` to the experts, which answer nobody else: as the operator mounts
    the public token's Secret into the router alone and the experts' into both.

    An expert with 0 replicas still gets one process: locally there is nothing to save, and
    the router needs an address for each of its experts. One (or a pool) with
    ``autoscaling.minReplicas`` 0 gets its process(es) on demand (:mod:`ddm.runtime.scaling`);
    with autoscaling, locally ``max(1, minReplicas)`` processes."""
    plan = plan_deployment(manifest.spec)
    handed_out = {router_port}

    def new_port() -> int:
        for _ in range(_PORT_TRIES):
            port = ports()
            if port not in handed_out:
                handed_out.add(port)
                return port
        raise LocalRunError(f"no port for {manifest.name}'s servers but the {len(handed_out)} "
                            f"handed out already, after {_PORT_TRIES} draws")

    token = expert_token = None
    if plan.router.auth or require_auth:
        if token_file is None or expert_token_file is None:
            raise LocalRunError(f"{manifest.name} asks for a bearer token (spec.router.auth): "
                                "give a token file and the experts' (ddm up writes its own)")
        token, expert_token = str(token_file), str(expert_token_file)
    # No progress bars: a process loading its weights draws one per component into the log
    # every process shares (transformers' and huggingface_hub's, both off by this variable).
    quiet = (("PYTHONUNBUFFERED", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"))
    env = _threads_env(threads) + quiet
    experts: list[ProcessSpec] = []
    discovery: dict[str, Discovery] = {}
    scaled = {(unit.pool, unit.name): unit for unit in plan.autoscaled}
    on_demand: list[OnDemand] = []
    for expert in plan.unpooled_experts:
        checkpoint = str(locate(expert.checkpoint))
        processes = _on_demand(scaled.get((False, expert.name)), expert.name, expert.replicas,
                               on_demand)
        replicas, discovery[expert.name] = _replicas(
            expert.name, processes, host, new_port, env + expert.env(str(cache_dir)),
            expert.ready_s, lambda port, metrics: expert.command(
                checkpoint, host, port, metrics, expert_token))
        experts.extend(replicas)
    stages: list[ProcessSpec] = []
    stage_places: dict[str, str | Discovery] = {}
    local_dirs = {f"expert {e.name}": locate(e.checkpoint) for e in plan.experts}
    for stage in plan.stages:
        checkpoint = locate(stage.checkpoint)
        local_dirs[stage.role] = checkpoint
        if stage.in_router:
            stage_places[stage.role] = str(checkpoint)
            continue
        if not stage.separate:  # pooled
            continue
        replicas, stage_places[stage.role] = _replicas(
            stage.role, stage.replicas, host, new_port, env + stage.env(str(cache_dir)),
            stage.ready_s, lambda port, metrics: stage.command(
                str(checkpoint), host, port, metrics, expert_token))
        stages.extend(replicas)
    pools: list[ProcessSpec] = []
    pool_discovery: dict[str, Discovery] = {}
    for pool in plan.pools:
        member_dirs = {name: str(locate(checkpoint)) for name, checkpoint in pool.members}
        processes = _on_demand(scaled.get((True, pool.name)), f"pool-{pool.name}",
                               pool.replicas, on_demand)
        pool_env = (_threads_env(pool_threads(threads, len(pool.members))) + quiet
                    + pool.env(str(cache_dir)))
        replicas, pool_discovery[pool.name] = _replicas(
            f"pool-{pool.name}", processes, host, new_port, pool_env, pool.ready_s,
            lambda port, metrics: pool.command(
                member_dirs, host, port, metrics, expert_token))
        pools.extend(replicas)
    check_state_shapes(local_dirs)
    metrics_port = new_port()
    router = ProcessSpec("router", _quiet(RouterPlan.command(str(config_path), host,
                                                              router_port, metrics_port)),
                         router_port, env, metrics_port, plan.router.ready_s)
    auth = (Auth(token_file=token, expert_token_file=expert_token)
            if token is not None and expert_token is not None else None)
    return LocalPlan(tuple(experts), router,
                     plan.router_config(discovery, None, auth, stage_places=stage_places,
                                        pool_discovery=pool_discovery),
                     f"http://{host}:{router_port}",
                     Path(token) if token is not None else None,
                     Path(expert_token) if expert_token is not None else None,
                     tuple(on_demand), tuple(stages), tuple(pools))


def pool_threads(threads: int, members: int, cpus: int | None = None) -> int:
    """A pool process's CPU threads: ``threads`` per member, as each would have alone, up to
    the ``cpus`` this machine gives (:func:`~ddm.threads.usable_cpus`); its forwards share
    them (:class:`~ddm.threads.CpuShare`)."""
    return max(1, min(threads * members, usable_cpus() if cpus is None else cpus))


def _threads_env(threads: int) -> tuple[tuple[str, str], ...]:
    return (("OMP_NUM_THREADS", str(threads)), ("MKL_NUM_THREADS", str(threads)))


def _on_demand(unit: Scaled | None, name: str, replicas: int, on_demand: list[OnDemand]) -> int:
    """How many processes server ``name`` (an expert, or ``pool-NAME``) runs here, named
    ``name/0``, ``name/1``...: its ``replicas``, or, autoscaled (``unit``), its
    ``minReplicas``; at least one. With ``minReplicas`` 0 they run on demand (added to
    ``on_demand``)."""
    processes = max(1, replicas if unit is None else unit.rules.min_replicas)
    if unit is not None and unit.rules.min_replicas == 0:
        on_demand.append(OnDemand(unit, tuple(f"{name}/{replica}"
                                              for replica in range(processes))))
    return processes


def check_state_shapes(directories: dict[str, Path]) -> None:
    """Refuse, naming each, stage checkpoints that declare different state shapes
    (``_ddm.latent_shape`` of an expert, router network or decoder; checkpoints without the
    declaration, such as label experts, are not compared)."""
    declared = {name: shape for name, directory in directories.items()
                if (shape := declared_latent_shape(directory)) is not None}
    if len(set(declared.values())) > 1:
        shown = ", ".join(f"{name} {list(shape)}" for name, shape in declared.items())
        raise LocalRunError(f"the stages disagree on the state shape (latent channels, size): "
                            f"{shown}")



@dataclass(frozen=True)
class Backoff:
    """The pause before restarting a process that died: ``first_s`` doubling with each
    restart up to ``max_s``; a process that ran ``reset_after_s`` starts over at ``first_s``
    (the kubelet's rule, with 10 s, 300 s and 600 s)."""

    first_s: float = 1.0
    max_s: float = 300.0
    reset_after_s: float = 600.0

    def delay(self, restarts: int) -> float:
        """Seconds to wait before restart number ``restarts + 1``."""
        return min(self.max_s, self.first_s * 2.0 ** min(restarts, 32))


#: Where :func:`free_port` looks: below Linux's default ephemeral range (32768-60999), from which
#: the kernel picks the local port of every outgoing connection and of every bind to port 0.
#: A port taken from that range and released until its server starts could meanwhile become a
#: connection's (the experts' probes make many): the router then failed with "Address already
#: in use". Here only a process that names its port can take it.
PORT_RANGE = range(20000, 32768)
_PORT_TRIES = 100


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` free a moment ago, outside the kernel's ephemeral range."""
    with _free_socket(host) as sock:
        return sock.getsockname()[1]


def _free_socket(host: str) -> socket.socket:
    """A socket bound to a free port of ``host`` outside the kernel's ephemeral range, without
    ``SO_REUSEADDR``: while it is open nothing else can bind that port, not even a server that
    sets it (as uvicorn does)."""
    for _ in range(_PORT_TRIES):
        port = PORT_RANGE.start + secrets.randbelow(len(PORT_RANGE))
        sock = socket.socket()
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                continue
            raise _unusable_host(host, exc) from None
        return sock
    raise LocalRunError(f"no free port of {host} in {PORT_RANGE.start}..{PORT_RANGE.stop - 1} "
                        f"after {_PORT_TRIES} tries")


class HeldPorts:
    """The ports of one run's servers, each kept bound (not listening) here from when it is
    drawn until its server's process starts and takes the socket over
    (:mod:`ddm.serving.http.handoff`): the router starts minutes after its port was chosen,
    once every expert has loaded, and a port merely free when drawn could be taken meanwhile.
    A process restarted later binds its port again by number, as a container would. Only for
    servers that take a handed socket over (every ``ddm serve``): any other could not bind
    the port it inherited."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._held: dict[int, socket.socket] = {}

    def draw(self) -> int:
        """A free port of the host, held from now on."""
        sock = _free_socket(self.host)
        port = sock.getsockname()[1]
        self._held[port] = sock
        return port

    def hold_router_port(self, port: int) -> None:
        """Hold ``port`` for the router, or fail, before any server starts, unless the router
        could listen on it: the router starts last, and a port the kernel picks (0) would
        never be seen ready there. A port taken or not ours is the port's fault; anything
        else, the host's (as in :func:`free_port`)."""
        if port not in PORTS:
            raise ValueError(f"--port must be in {PORTS.start}..{PORTS.stop - 1}, got {port}")
        # Alone on the port if possible; else as the router would bind it (uvicorn sets
        # SO_REUSEADDR), which a previous run's connections in TIME_WAIT do not refuse.
        for reuse in (False, True):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
            try:
                sock.bind((self.host, port))
            except OSError as exc:
                sock.close()
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise _unusable_host(self.host, exc) from None
                if reuse or exc.errno != errno.EADDRINUSE:
                    raise LocalRunError(f"the router cannot listen on {self.host}:{port} "
                                        f"({exc.strerror or exc}): stop what holds the port, "
                                        "or choose another --port") from None
                continue
            self._held[port] = sock
            return

    def hand_over(self, *ports: int | None) -> list[socket.socket]:
        """The held sockets of ``ports``, no longer held here (the caller closes them)."""
        return [self._held.pop(port) for port in ports if port in self._held]

    def close(self) -> None:
        """Let go of every port still held."""
        for sock in self._held.values():
            sock.close()
        self._held.clear()


class Supervisor:
    """Starts processes, relays their output with a name prefix, and stops them all.

    With ``termination_dir``, each process gets its own termination-message file there, and
    :meth:`exit_reason` reads why one that exited could not start. With ``held``, a process
    is handed the sockets held for its ports when it starts."""

    def __init__(self, out: TextIO, termination_dir: Path | None = None,
                 held: HeldPorts | None = None) -> None:
        self.out = out
        self.termination_dir = termination_dir
        self.held = held
        self.processes: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, ProcessSpec] = {}
        self.started_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def start(self, spec: ProcessSpec) -> None:
        """Start ``spec`` (again, when it ran before: its old termination message goes), handed
        the sockets held for its ports (the first time). Never while it runs: the first would
        be left running, unsupervised, after ``ddm up`` ended."""
        if self.running(spec.name):
            raise LocalRunError(f"{spec.name} is running already; it is not started twice")
        env = os.environ | dict(spec.env)
        env.pop(HANDOFF_ENV, None)  # none of ours to pass on
        if self.termination_dir is not None:
            self._termination_file(spec.name).unlink(missing_ok=True)
            env[TERMINATION_LOG_ENV] = str(self._termination_file(spec.name))
        handed = (self.held.hand_over(spec.port, spec.metrics_port)
                  if self.held is not None else [])
        if handed:
            env.update([handoff_env(handed)])
        try:
            process = subprocess.Popen(spec.argv, env=env, pass_fds=[s.fileno() for s in handed],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       encoding="utf-8", errors="replace",
                                       start_new_session=True)
        finally:
            for sock in handed:  # the process holds them now (or nobody: it did not start)
                sock.close()
        self.processes[spec.name], self.specs[spec.name] = process, spec
        self.started_at[spec.name] = time.monotonic()
        threading.Thread(target=self._relay, args=(spec.name, process), daemon=True).start()

    def _relay(self, name: str, process: subprocess.Popen) -> None:
        """Relay the process's output until it closes, each line behind the process's name,
        whatever it writes (bytes that are not UTF-8 replaced, a line without end cut into
        pieces) and whether or not anyone still reads ``out``: an output not drained blocks
        the process at its next write."""
        for piece in iter(lambda: process.stdout.readline(RELAY_LINE_CHARS), ""):
            line = piece.removesuffix("\n")
            with self._lock:
                _tell(self.out, f"[{name}] {line}")

    def start_ready(self, specs: Sequence[ProcessSpec], host: str) -> None:
        """Start every process (they load in parallel), then wait until each is ready, each
        for at most its ``ready_s``; says when each starts and when it becomes ready (loading
        a model takes a while), in the order they become ready."""
        for spec in specs:
            self.start(spec)
            self._say(f"started {spec.name} (pid {self.processes[spec.name].pid}, "
                      f"port {spec.port}); loading...")
        waiting = list(specs)
        while waiting:
            for spec in [spec for spec in waiting if self.is_ready(spec, host)]:
                waiting.remove(spec)
                seconds = time.monotonic() - self.started_at[spec.name]
                self._say(f"{spec.name} is ready ({seconds:.1f} s)")
            late = [spec for spec in waiting
                    if time.monotonic() - self.started_at[spec.name] >= spec.ready_s]
            if late:
                raise LocalRunError("; ".join(f"{spec.name} not ready within "
                                              f"{spec.ready_s:.0f} s" for spec in late))
            if waiting:
                time.sleep(0.2)  # external processes: polling their probes is the only signal

    def _say(self, line: str) -> None:
        with self._lock:
            print(line, file=self.out, flush=True)

    def is_ready(self, spec: ProcessSpec, host: str) -> bool:
        """Whether ``/readyz`` answers 200 now; fails if the process has exited."""
        code = self.processes[spec.name].poll()
        if code is not None:
            raise LocalRunError(f"{spec.name} exited with status {code} before it was ready: "
                                f"{self.exit_reason(spec.name)}")
        return answers_ready(host, spec.port)

    def exit_reason(self, name: str) -> str:
        """The line process ``name`` left in its termination-message file, or a pointer to its
        log when it left none."""
        path = self._termination_file(name) if self.termination_dir is not None else None
        try:
            reason = path.read_text(encoding="utf-8").strip() if path is not None else ""
        except OSError:
            reason = ""
        return reason or "its log lines above say why"

    def _termination_file(self, name: str) -> Path:
        assert self.termination_dir is not None
        return self.termination_dir / f"{name.replace('/', '-')}.termination-log"

    def stop_one(self, name: str) -> None:
        """Stop process ``name`` (SIGTERM, SIGKILL after the timeout) and forget it, so that
        it is not restarted: an expert scaled to zero."""
        process = self.processes.pop(name)
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()

    def running(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    def first_exit(self) -> tuple[str, int] | None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                return name, process.returncode
        return None

    def stop(self) -> int:
        """SIGTERM every process group, then SIGKILL whatever is left after the timeout;
        returns how many had to be killed. Every process has ended when it returns."""
        for process in self.processes.values():
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        killed = 0
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
                killed += 1
        return killed


def run_local(manifest: DDMManifest, router_port: int = ROUTER_PORT, host: str = "127.0.0.1",
              image_root: Path = REPOSITORY_ROOT, pvc_root: Path | None = None,
              threads: int = 1, out: TextIO = sys.stdout,
              on_ready: Callable[[LocalPlan], None] | None = None,
              stop: threading.Event | None = None, *, fail_fast: bool = False,
              backoff: Backoff = Backoff(), deadline_s: float | None = None,
              auth_token_file: Path | None = None, api_docs: bool = False) -> int:
    """Run until Ctrl-C or ``stop`` being set, restarting what dies (with ``fail_fast``:
    until a process dies); returns an exit status. ``deadline_s``: the router's time budget
    for one expert call (``ddm serve router --deadline-s``; default from router.yaml).
    Authentication is on when the spec asks for it (``router.auth``), with a random token
    written to a private file in the run's directory, or with ``auth_token_file`` (the
    caller's token); the experts require another random token, in another private file,
    which only the router presents. ``api_docs``: the router serves Swagger UI
    at ``/docs``."""
    check_exposure(manifest, host, auth_token_file is not None)
    held = HeldPorts(host)
    with contextlib.closing(held), tempfile.TemporaryDirectory(prefix="ddm-up-") as workdir:
        held.hold_router_port(router_port)
        config_path = Path(workdir) / "router.yaml"
        plan = plan_local(manifest, held.draw, router_port, host,
                          locate=functools.partial(resolve_checkpoint, image_root=image_root,
                                                   pvc_root=pvc_root),
                          threads=threads, config_path=config_path,
                          cache_dir=Path(workdir) / "cache",
                          token_file=auth_token_file or Path(workdir) / "router-token",
                          expert_token_file=Path(workdir) / "expert-token",
                          require_auth=auth_token_file is not None)
        config_path.write_text(plan.router_config.to_yaml())
        if plan.token_file is not None and auth_token_file is None:
            write_token(plan.token_file)
        if plan.expert_token_file is not None:
            write_token(plan.expert_token_file)
        plan = with_router_options(plan, deadline_s, api_docs)
        supervisor = Supervisor(out, termination_dir=Path(workdir), held=held)
        try:
            scaler = _scaler(plan, supervisor, host, out)
            supervisor.start_ready([*(p for p in plan.servers if p.name not in scaler.names)],
                                   host)
            supervisor.start_ready([plan.router], host)
            counts = ", ".join(f"{len(processes)} {kind} process(es)" for kind, processes in
                               (("expert", plan.experts), ("stage", plan.stages),
                                ("pool", plan.pools)) if processes)
            print(f"DDM {manifest.name} is up: {counts} and the router at {plan.url} (web page "
                  f"{plan.url}/, API POST {plan.url}/v1/generate"
                  f"{f', API docs {plan.url}/docs' if api_docs else ''}). Ctrl-C stops "
                  "everything.", file=out, flush=True)
            print(metrics_line(plan, host), file=out, flush=True)
            if plan.token_file is not None:  # the path only: a token never goes to a log
                print(f"The API needs Authorization: Bearer <the token in {plan.token_file}>; "
                      f"the experts need the one in {plan.expert_token_file}.", file=out,
                      flush=True)
            if on_ready is not None:
                on_ready(plan)
            return _supervise(supervisor, stop or threading.Event(), out,
                              None if fail_fast else backoff, scaler.tick)
        except KeyboardInterrupt:
            return 0
        finally:  # Ctrl-C, SIGTERM (the caller's exception), an error or a death: stop all
            # A second SIGTERM (a service manager's, the one `timeout` forwards after the
            # user's) would abort the stop and leave servers running; it ends on its own.
            with sigterm_handled(signal.SIG_IGN):
                count = len(supervisor.processes)
                _tell(out, f"stopping {count} process(es)...")
                killed = supervisor.stop()
                _tell(out, f"all {count} process(es) stopped" + (
                    f" ({killed} killed after {STOP_TIMEOUT_S:g} s)" if killed else ""))


def _tell(out: TextIO, line: str) -> None:
    """Print ``line`` to ``out`` if anyone still reads it (Ctrl-C ends `ddm up | tee` too)."""
    try:
        print(line, file=out, flush=True)
    except OSError:
        pass


def check_exposure(manifest: DDMManifest, host: str, token_given: bool) -> None:
    """Fail, before anything starts, when the servers would listen beyond this machine
    (``host`` not loopback) and nobody would need a token: the spec asks for none
    (``router.auth``) and none was given (``token_given``)."""
    if manifest.spec.router.auth is not None or token_given or _loopback(host):
        return
    raise LocalRunError(f"--host {host} exposes {manifest.name}'s API beyond this machine, and "
                        "its spec asks for no token: turn authentication on (add auth: {} "
                        "under spec.router in the manifest, and ddm up writes a random token "
                        "and says where; or give --auth-token-file FILE), or keep the default "
                        "--host 127.0.0.1")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


def _unusable_host(host: str, exc: OSError) -> LocalRunError:
    return LocalRunError(f"--host {host}: no server can listen there ({exc.strerror or exc}); "
                         "give an IPv4 address of this machine (127.0.0.1: this machine only, "
                         "0.0.0.0: every interface)")


def with_router_options(plan: LocalPlan, deadline_s: float | None = None,
                        api_docs: bool = False) -> LocalPlan:
    """``plan`` with ``ddm up``'s router options on the router's command line."""
    extra = (*(("--deadline-s", str(deadline_s)) if deadline_s is not None else ()),
             *(("--api-docs",) if api_docs else ()))
    return dataclasses.replace(plan, router=dataclasses.replace(
        plan.router, argv=(*plan.router.argv, *extra)))


def write_token(path: Path) -> None:
    """A fresh random bearer token (256 bits, URL-safe base64), readable by this user only."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_urlsafe(32) + "\n")


def metrics_line(plan: LocalPlan, host: str) -> str:
    """Where each process serves ``/metrics`` (its own port, apart from the API, as in a pod)."""
    where = ", ".join(f"{p.name} http://{host}:{p.metrics_port}/metrics"
                      for p in (plan.router, *plan.servers)
                      if p.metrics_port is not None)
    return f"Metrics: {where}."


def answers_ready(host: str, port: int) -> bool:
    """Whether the process on ``port`` answers ``/readyz`` with 200 now."""
    try:
        fetch_json(f"http://{host}:{port}/readyz", deadline=READY_POLL_S,
                   cap=MAX_EXPERT_PROBE_BYTES)
    except FetchError:
        return False
    return True


def _scaler(plan: LocalPlan, supervisor: Supervisor, host: str, out: TextIO) -> Scaler:
    """Starts and stops the plan's on-demand experts and pools as the router's demand
    says."""
    specs = {p.name: p for p in plan.servers}
    return Scaler(plan.on_demand, DemandPoller(plan.url, plan.token_file),
                  start=lambda name: supervisor.start(specs[name]), stop=supervisor.stop_one,
                  running=supervisor.running,
                  ready=lambda name: supervisor.running(name) and answers_ready(
                      host, specs[name].port), out=out)


def _supervise(supervisor: Supervisor, stop: threading.Event, out: TextIO,
               backoff: Backoff | None, scale: Callable[[], None]) -> int:
    """Until ``stop``: restart each process that died after its back-off, and ``scale()``;
    with ``backoff`` None, return 1 at the first death instead (the caller stops the
    others)."""
    restarts: dict[str, int] = {}
    due: dict[str, float] = {}  # name -> when to start it again
    while not stop.wait(SUPERVISE_INTERVAL_S):
        scale()
        now = time.monotonic()
        for name, process in supervisor.processes.items():
            if name in due or process.poll() is None:
                continue
            what = (f"{name} exited with status {process.returncode} "
                    f"({supervisor.exit_reason(name)})")
            if backoff is None:
                print(f"{what}; stopping the others", file=out, flush=True)
                return 1
            if now - supervisor.started_at[name] >= backoff.reset_after_s:
                restarts[name] = 0
            delay = backoff.delay(restarts.get(name, 0))
            restarts[name] = restarts.get(name, 0) + 1
            due[name] = now + delay
            print(f"{what}; restarting it in {delay:g} s (restart {restarts[name]})", file=out,
                  flush=True)
        for name, when in list(due.items()):
            if name not in supervisor.processes:  # scaled to zero meanwhile
                del due[name]
            elif supervisor.running(name):  # a generation needed it: the scaler started it
                del due[name]
                print(f"{name} was started again on demand; no restart needed", file=out,
                      flush=True)
            elif when <= now:
                del due[name]
                supervisor.start(supervisor.specs[name])
                print(f"restarted {name}", file=out, flush=True)
    return 0


def _ddm() -> Sequence[str]:
    return (sys.executable, "-m", "ddm")


def _quiet(command: Sequence[str]) -> tuple[str, ...]:
    """``ddm COMMAND`` logging warnings and errors only: every process shares one output."""
    return (*_ddm(), *command, "--log-level", "warning")


def _replicas(name: str, count: int, host: str, new_port: Callable[[], int],
              env: tuple[tuple[str, str], ...], ready_s: float,
              command: Callable[[int, int], Sequence[str]]
              ) -> tuple[list[ProcessSpec], StaticDiscovery]:
    """``count`` processes of one server, ``NAME/0`` on, each on ports of its own (``command``
    of its port and metrics port), and where the router finds them."""
    specs = []
    for replica in range(count):
        port, metrics_port = new_port(), new_port()
        specs.append(ProcessSpec(f"{name}/{replica}", _quiet(command(port, metrics_port)), port,
                                 env, metrics_port, ready_s))
    return specs, StaticDiscovery(tuple(f"{host}:{spec.port}" for spec in specs))


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
