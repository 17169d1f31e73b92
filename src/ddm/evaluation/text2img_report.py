"""``ddm report`` of the text-to-image DDM (docs/quality-text2img.md).

Every run asks for the same prompts: "a {thick|thin} {colour} {digit}" for each digit and
named colour, the thick and the thin prompt of a pair from the same noise, so a pair differs
only in its stroke word. Rows differ only in the model, the routing (the router network alone,
``p(k | x_t, t)``, or with its text prior, ``p(k | x_t, t, c)``) and the guidance scale;
each is run for every seed of ``SEEDS`` (noise and, for FD, the real subset), and compared
run by run (paired verdicts). The first row is the real coloured test digits: the judges'
ceiling and the FD floor at this size.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ddm.data.colored_mnist import COLOUR_NAMES, DIGIT_WORDS, ColoredDigits, load_colored_mnist
from ddm.checkpoints.format import read_meta
from ddm.evaluation.classifier import Classifier, load_classifier
from ddm.evaluation.report import agreement_steps, paired_verdict, shown_path
from ddm.evaluation.runcache import configs_fingerprint
from ddm.evaluation.scoring import SEEDS, Judge, matched_subsets
from ddm.evaluation.text2img_judges import ClipJudge, grey, ink_colours, ink_mass
from ddm.fileio import atomic_path, check_output
from ddm.models.paris_loading import read_component_config
from ddm.models.ddm import DDM, load_ddm
from ddm.models.stages import DDM_KEY
from ddm.models.text_prior import TEXT_PRIOR_KEY
from ddm.models.text2img import DEFAULT_GUIDANCE, DEFAULT_STRATEGY
from ddm.progress import JobProgress
from ddm.sampling.pipeline import generate_text

#: Guidance scales of the sweep, and the routings compared at the default scale (``random``:
#: an expert per sample and step, drawn uniformly: the DDM paper's disaster baseline; it uses
#: no router, so it has no text-prior row).
SWEEP = (1.0, 2.0, 4.0, 7.5)
ROUTINGS = ("top1", "top2", "ensemble", "random")
#: How a routing's name says it weighs in the router's text prior (Bayes' rule,
#: ``ddm.models.text_prior``); without it the router network alone routes.
WITH_PRIOR = " + text prior"
STROKES = ("thick", "thin")
#: The monolith's routing column: one network, nothing to route.
SINGLE_MODEL = "single model"
COLUMNS = ("digit", "colour", "stroke", "fd", "clip_match", "clip_score")
HEADINGS = ("digit acc.", "colour acc.", "thick > thin", "FD", "CLIP match", "CLIP score")


@dataclass(frozen=True)
class Prompts:
    """The report's prompts, thick then thin of each (digit, colour) pair."""

    text: tuple[str, ...]
    digits: np.ndarray
    colours: np.ndarray

    @classmethod
    def make(cls) -> Prompts:
        rows = [(d, c, s) for d in range(len(DIGIT_WORDS)) for c in range(len(COLOUR_NAMES))
                for s in STROKES]
        return cls(tuple(f"a {s} {COLOUR_NAMES[c]} {DIGIT_WORDS[d]}" for d, c, s in rows),
                   np.array([r[0] for r in rows]), np.array([r[1] for r in rows]))

    def noise(self, shape: tuple[int, ...], seed: int) -> np.ndarray:
        """``(N, *shape)`` float32: one draw per pair, shared by its thick and thin prompt."""
        pairs = np.random.default_rng((seed, 23)).standard_normal((len(self.text) // 2,
                                                                   *shape), np.float32)
        return np.repeat(pairs, 2, axis=0)


@dataclass
class Row:
    """One configuration: ``values[metric]`` has one entry per seed."""

    model: str
    routing: str
    guidance: float | None
    values: dict[str, list[float]] = field(default_factory=dict)
    expert_calls: float = 0.0
    cpu_seconds: float = 0.0
    #: ``(steps, K)``: the fraction of images each expert ran for at each step (mean of runs)
    usage: np.ndarray | None = None

    def mean(self, metric: str) -> float:
        return float(np.mean(self.values[metric]))


@dataclass(frozen=True)
class Judges:
    classifier: Classifier
    fd: Judge  # the classifier's features of the grey real test digits
    clip: ClipJudge
    real: ColoredDigits


def score(judges: Judges, images: np.ndarray, prompts: Prompts, seed: int) -> dict[str, float]:
    """Every metric of one run's images."""
    greys = grey(images)
    mass = ink_mass(images)
    clip_score, clip_match = judges.clip.agreement(images, prompts.text, prompts.digits,
                                                   prompts.colours)
    return {"digit": float((judges.classifier.predict(greys) == prompts.digits).mean()),
            "colour": float((ink_colours(images) == prompts.colours).mean()),
            "stroke": float((mass[0::2] > mass[1::2]).mean()),
            "fd": judges.fd.score(greys, prompts.digits, seed).fd,
            "clip_match": clip_match, "clip_score": clip_score}


def real_row(judges: Judges, prompts: Prompts) -> Row:
    """Real test digits with the prompts' digit counts (FD: disjoint from the reference)."""
    row = Row("real coloured test digits", "-", None)
    started = time.process_time()
    for seed in SEEDS:
        real, _ = matched_subsets(judges.real.labels, prompts.digits, seed)
        images = judges.real.images[real].transpose(0, 2, 3, 1)
        colours, digits = judges.real.colours[real], judges.real.labels[real]
        asked = [f"a {COLOUR_NAMES[c]} {DIGIT_WORDS[d]}" for d, c in zip(digits, colours)]
        clip_score, clip_match = judges.clip.agreement(images, asked, digits, colours)
        values = {"digit": float((judges.classifier.predict(grey(images)) == digits).mean()),
                  "colour": float((ink_colours(images) == colours).mean()),
                  "stroke": float("nan"), "fd": judges.fd.floor(prompts.digits, (seed,))[0].fd,
                  "clip_match": clip_match, "clip_score": clip_score}
        for metric, value in values.items():
            row.values.setdefault(metric, []).append(value)
    row.cpu_seconds = (time.process_time() - started) / len(SEEDS)
    return row


@dataclass(frozen=True)
class Config:
    """One sampled row: the DDM, its name, strategy and guidance; ``prior``: whether its router
    weighs in its text prior (the routing's name says so)."""

    ddm: DDM
    model: str
    strategy: str
    guidance: float
    prior: bool = False

    @property
    def routing(self) -> str:
        return self.strategy + (WITH_PRIOR if self.prior else "")


class RunStore:
    """Where each sampled run's scores are kept (``--cache DIR``; None: nowhere): a stopped
    report resumes, and reports started together on one DIR share the work, each run claimed
    by the first to reach it (an exclusive create of a file naming its host and process),
    the others reading its result. A claim whose process is gone (a stopped report) is taken
    over; one from another host is trusted."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self.kept: dict[str, dict[str, Any]] = {}

    def run(self, key: str, compute: Callable[[], dict[str, Any]]) -> bool:
        """Compute ``key`` unless it is kept, or claimed by another report; whether it was
        computed here."""
        if self.directory is None:
            self.kept[key] = compute()
            return True
        path = self.directory / f"{key}.json"
        claim = path.with_suffix(".claim")
        if path.is_file() or not _claim(claim):
            return False
        try:
            result = compute()
        except BaseException:  # stopped or failed: the run is free for the next report
            claim.unlink(missing_ok=True)
            raise
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(result))
        return True

    def result(self, key: str, wait_s: float = 3600.0) -> dict[str, Any]:
        """``key``'s result, waiting up to ``wait_s`` for another report computing it."""
        if key in self.kept:
            return self.kept[key]
        assert self.directory is not None, "without a directory every run is kept"
        path, deadline = self.directory / f"{key}.json", time.monotonic() + wait_s
        while not path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear: remove its .claim and rerun")
            time.sleep(2.0)
        return json.loads(path.read_text())


def _claim(path: Path) -> bool:
    """Claim a run for this process; False when a live report holds it."""
    for _ in range(2):
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _held(path):
                return False
            path.unlink(missing_ok=True)  # its report was stopped: take the run over
            continue
        with os.fdopen(descriptor, "w") as claim:
            claim.write(f"{socket.gethostname()} {os.getpid()}")
        return True
    return False


def _held(path: Path) -> bool:
    """Whether the claim's process still runs (a claim being written, or another host's,
    counts as held)."""
    try:
        host, _, pid = path.read_text().partition(" ")
    except FileNotFoundError:
        return False
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_key(config: Config, seed: int, steps: int) -> str:
    return re.sub(r"[^a-zA-Z0-9._-]+", "_", f"{config.model}-{config.routing}-"
                                           f"g{config.guidance:g}-s{seed}-{steps}steps")


def sample_run(config: Config, judges: Judges, prompts: Prompts, steps: int,
               seed: int) -> dict[str, Any]:
    """One run of ``config``: its scores, expert usage per step, calls and CPU seconds."""
    ddm = config.ddm
    routing = "top1" if config.strategy == SINGLE_MODEL else config.strategy
    started = time.process_time()
    out = generate_text(ddm, prompts.text, steps=steps, seed=seed, strategy=routing,
                        guidance_scale=config.guidance,
                        latents=prompts.noise(ddm.latent_shape, seed))
    cpu = time.process_time() - started
    masks = out.usage.step_masks(steps)  # (N, steps) bit k: expert k ran
    bits = np.left_shift(1, np.arange(len(ddm.expert_names)))
    return {"values": score(judges, out.images, prompts, seed),
            "usage": ((masks[:, :, None] & bits) > 0).mean(axis=0).tolist(),
            "calls": float(out.expert_calls.mean()), "cpu": cpu}


def sampled_rows(configs: Sequence[Config], judges: Judges, prompts: Prompts, steps: int,
                 store: RunStore, progress: JobProgress | None = None) -> list[Row]:
    """Every run of every config (those not kept or claimed elsewhere), then the rows."""
    samples = len(prompts.text)
    if progress is not None:
        progress.plan(len(configs) * len(SEEDS) * samples)
    for config in configs:
        for seed in SEEDS:
            sampled = store.run(run_key(config, seed, steps),
                                lambda: sample_run(config, judges, prompts, steps, seed))
            if progress is not None:
                progress.done(samples, f"{config.model} {config.routing} guidance "
                                       f"{config.guidance:g} seed {seed}: "
                                       f"{'sampled' if sampled else 'reused'}",
                              reused=not sampled)
    rows = []
    for config in configs:
        runs = [store.result(run_key(config, seed, steps)) for seed in SEEDS]
        row = Row(config.model, config.routing, config.guidance,
                  values={m: [r["values"][m] for r in runs] for m in runs[0]["values"]},
                  expert_calls=float(np.mean([r["calls"] for r in runs])),
                  cpu_seconds=float(np.mean([r["cpu"] for r in runs])),
                  usage=np.mean([r["usage"] for r in runs], axis=0))
        rows.append(row)
    return rows


def quality_rows(root: Path, judges: Judges, steps: int, backends: Sequence[str],
                 store: RunStore, progress: JobProgress | None = None) -> list[Row]:
    """The floor; the guidance sweep at the default routing and each routing at the default
    guidance, with the router network alone and (where the router declares one) with its text
    prior; then the monolith (where ``root/monolith`` exists) at the default guidance."""
    prompts = Prompts.make()
    alone = load_ddm(root, backends=backends, text_prior=False)
    name = f"DDM ({len(alone.expert_names)} experts)"
    variants = [(alone, False)]
    if (root / "router").is_dir() and read_component_config(root / "router").get(
            DDM_KEY, {}).get(TEXT_PRIOR_KEY) is not None:
        variants.append((load_ddm(root, backends=backends), True))
    configs = []
    for ddm, prior in variants:
        configs += [Config(ddm, name, DEFAULT_STRATEGY, g, prior) for g in SWEEP]
        configs += [Config(ddm, name, r, DEFAULT_GUIDANCE, prior) for r in ROUTINGS
                    if r != DEFAULT_STRATEGY and not (prior and r == "random")]
    if (root / "monolith").is_dir():
        configs.append(Config(load_ddm(root, experts=("monolith",)),
                              monolith_name(root / "monolith"), SINGLE_MODEL,
                              DEFAULT_GUIDANCE))
    return [real_row(judges, prompts), *sampled_rows(configs, judges, prompts, steps, store,
                                                     progress)]


def monolith_name(directory: Path) -> str:
    """``monolith (12000 steps)``, or ``monolith (4700 of 12000 steps)`` for a snapshot of an
    unfinished training (its config.json declares ``trained_steps``)."""
    declared = read_component_config(directory).get(DDM_KEY, {})
    planned = declared.get("train", {}).get("steps", "?")
    trained = declared.get("trained_steps", planned)
    return f"monolith ({trained} steps)" if trained == planned else (
        f"monolith ({trained} of {planned} steps)")


def load_judges(classifier: Path, mnist: Path, clip: Path, tokenizer: Path) -> Judges:
    real = load_colored_mnist(mnist, "t10k")
    judge = load_classifier(classifier)
    return Judges(judge, Judge(judge, grey(real.images.transpose(0, 2, 3, 1)), real.labels),
                  ClipJudge.load(clip, tokenizer), real)


def render(rows: Sequence[Row], settings: dict[str, Any]) -> str:
    header = ("| model | routing | guidance | " + " | ".join(HEADINGS)
              + " | expert passes / image | sampling CPU s |")
    lines = [
        "# Generation quality of the text-to-image DDM (coloured MNIST)", "",
        "Generated by `ddm report` (do not edit by hand). The DDM in "
        f"`{settings['checkpoints']}` (experts {settings['backends']}) against its real test "
        "digits and, where trained, the monolith: the experts' architecture trained on all the "
        "data for the experts' total steps (equal training compute).", "",
        f"Settings: {settings['n']} prompts per run, \"a {{thick|thin}} {{colour}} {{digit}}\" "
        "for each digit (as a word) and each of the seven colours, the thick and thin prompt "
        f"of a pair from the same noise; {len(SEEDS)} runs (seeds "
        f"{', '.join(map(str, SEEDS))}), {settings['steps']} Euler steps, "
        f"{settings['machine']}. Values are mean +/- standard deviation over the runs.", "",
        f"Digit acc.: our MNIST classifier (`{settings['classifier']}`) reads the grey "
        "image (each pixel's brightest channel) as the asked digit. Colour acc.: the named "
        "colour nearest the mean chromaticity of the ink (pixels at half brightness or more) "
        "is the asked one. Thick > thin: the fraction of pairs whose thick image has more ink "
        "than its thin twin. FD: Frechet distance of the classifier's features (a space no "
        "text2img model trained in) to a real subset of the coloured test digits with the "
        "same digit counts; the first row is its floor (two disjoint real subsets). CLIP "
        "match: the fraction of images whose nearest of the 70 prompts \"a {colour} {digit}\" "
        "(the small CLIP's two towers) is the asked pair; CLIP score: the mean cosine of "
        "image and prompt.", "",
        "Routing: `top2` etc. weigh the experts by the router network alone, p(k | x_t, t), "
        f"which sees no prompt; `top2{WITH_PRIOR}` etc. by p(k | x_t, t, c), the network's "
        "probabilities times the router's text prior p(k | c) / p(k) (Bayes' rule; "
        "docs/text2img.md), as the DDM is served.", "",
        header, "|---|---|---:|" + "---:|" * (len(COLUMNS) + 2)]
    lines += [_table_row(r) for r in rows]
    ddm_rows = [r for r in rows if r.model.startswith("DDM")]
    prior = WITH_PRIOR if any(r.routing.endswith(WITH_PRIOR) for r in ddm_rows) else ""

    def ddm_row(strategy: str, suffix: str, guidance: float = DEFAULT_GUIDANCE) -> Row:
        return next(r for r in ddm_rows if r.routing == strategy + suffix
                    and r.guidance == guidance)

    default = ddm_row(DEFAULT_STRATEGY, prior)
    unguided = ddm_row(DEFAULT_STRATEGY, prior, 1.0)
    lines += ["", "## Verdicts (paired: each run's rows share prompts and noise)", "",
              f"- Guidance ({default.routing}): digit accuracy {unguided.mean('digit'):.3f} at "
              "guidance 1 -> "
              f"{default.mean('digit'):.3f} at the default {DEFAULT_GUIDANCE:g}, "
              f"{_verdict(default, unguided, 'digit', 'guided', 'unguided')}; colour "
              f"accuracy {unguided.mean('colour'):.3f} -> {default.mean('colour'):.3f}, "
              f"{_verdict(default, unguided, 'colour', 'guided', 'unguided')}."]
    if prior:
        lines += [f"- The text prior ({strategy}{prior} vs {strategy}): digit accuracy "
                  f"{ddm_row(strategy, '').mean('digit'):.3f} -> "
                  f"{ddm_row(strategy, prior).mean('digit'):.3f}, " + _verdict(
                      ddm_row(strategy, prior), ddm_row(strategy, ""), "digit",
                      "with the prior", "the network alone") + "."
                  for strategy in ("top2", "top1", "ensemble")]
    monolith = next((r for r in rows if r.model.startswith("monolith")), None)
    for routing in [s + suffix for suffix in dict.fromkeys((prior, "")) for s in ("top2", "top1")]:
        ddm = next(r for r in ddm_rows if r.routing == routing
                   and r.guidance == DEFAULT_GUIDANCE)
        if monolith is None:
            lines.append(f"- DDM {routing} vs monolith: the monolith is not trained yet.")
            continue
        lines.append(f"- DDM {routing} vs the {monolith.model}: " + "; ".join(
            f"{HEADINGS[COLUMNS.index(m)]} {ddm.mean(m):.3f} vs {monolith.mean(m):.3f}, "
            f"{_verdict(ddm, monolith, m, 'the DDM', 'the monolith')}"
            for m in ("fd", "digit", "colour", "clip_match")) + ".")
    lines += ["", f"One image is {1 / settings['n']:.4f} of a run's accuracy; the FD floor "
              "row gives the spread of FD between real subsets of this size.", "",
              "## Expert usage per step", "",
              "The fraction of images each expert ran for at a step (mean of the runs), at "
              f"guidance {DEFAULT_GUIDANCE:g}:", ""]
    for row in (r for r in ddm_rows if r.guidance == DEFAULT_GUIDANCE and r.usage is not None
                and r.routing.split(" ")[0] in ("top1", "top2")):
        shown = agreement_steps(len(row.usage))
        lines += [f"{row.routing}:", "", "| step | " + " | ".join(map(str, shown)) + " |",
                  "|---|" + "---:|" * len(shown)]
        lines += [f"| expert_{k} | " + " | ".join(f"{row.usage[s - 1, k]:.2f}" for s in shown)
                  + " |" for k in range(row.usage.shape[1])]
        lines.append("")
    return "\n".join(lines) + "\n"


def is_text2img(root: Path) -> bool:
    """Whether ``root`` is an imported text2img DDM (``ddm import text2img``)."""
    return (root / "text_encoder").is_dir() and (root / "clip").is_dir()


def mnist_directory(classifier: Path, data: str | None) -> Path:
    """The MNIST IDX directory of ``data`` (``mnist:DIR``), else the one the classifier
    learned from; the coloured test digits are built from its test part."""
    source = data or read_meta(classifier).data.get("source", "")
    if not source.startswith("mnist:"):
        raise ValueError(f"the text2img report needs MNIST's IDX files: pass --data mnist:DIR "
                         f"(the classifier recorded {source!r})")
    return Path(source.removeprefix("mnist:"))


def write_text2img_report(root: Path, out: Path, classifier: Path, mnist: Path,
                          clip: Path | None = None, steps: int = 30,
                          backends: Sequence[str] = ("torch", "jax"),
                          cache: Path | None = None,
                          progress: JobProgress | None = None) -> Path:
    """Sample every row, score it, and write the Markdown table to ``out``. ``cache``: runs
    are kept under a directory of it named after the DDM's checkpoints (their configs record
    their weights' sha256: a retrained DDM never reuses another's runs)."""
    check_output(out, ".md", "--out")  # before the sampling, not after
    judges = load_judges(classifier, mnist, clip or root / "clip", root / "text_encoder")
    store = RunStore(None if cache is None else cache / "text2img" / configs_fingerprint(
        [p.parent for p in root.rglob("config.json")])[:16])
    rows = quality_rows(root, judges, steps, backends, store, progress)
    settings = {"checkpoints": shown_path(root), "backends": " / ".join(
                    f"expert_{k}: {backends[k % len(backends)]}" for k in range(4)),
                "n": len(Prompts.make().text), "steps": steps,
                "classifier": shown_path(classifier),
                "machine": f"{platform.machine()} CPU, {platform.python_implementation()} "
                           f"{platform.python_version()}"}
    with atomic_path(out) as tmp:
        tmp.write_text(render(rows, settings))
    return out


def _verdict(a: Row, b: Row, metric: str, a_name: str, b_name: str) -> str:
    return paired_verdict(a.values[metric], b.values[metric], a_name, b_name,
                          lower_is_better=metric == "fd", digits=2 if metric == "fd" else 3)


def _table_row(r: Row) -> str:
    cells = []
    for metric in COLUMNS:
        values = np.asarray(r.values[metric], dtype=np.float64)
        if np.isnan(values).all():
            cells.append("-")
            continue
        digits = 2 if metric == "fd" else 3
        cells.append(f"{values.mean():.{digits}f} +/- {values.std(ddof=1):.{digits}f}")
    guidance = "-" if r.guidance is None else f"{r.guidance:g}"
    calls = "-" if not r.expert_calls else f"{r.expert_calls:.1f}"
    cpu = "-" if r.guidance is None else f"{r.cpu_seconds:.1f}"
    return (f"| {r.model} | {r.routing} | {guidance} | {' | '.join(cells)} | {calls} | "
            f"{cpu} |")
