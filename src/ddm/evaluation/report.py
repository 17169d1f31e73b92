"""``ddm report``: the DDM paper's Table 1 at small scale (docs/quality.md for the MNIST DDM,
docs/quality-digits.md for the digits one).

Every row samples the same labels from the same noise (seeds ``SEEDS``, same steps and
solver), so rows differ only in the model and the routing strategy; each seed is scored
against its own class-matched real subset (``ddm.evaluation.scoring``), whose real-vs-real
score is the first row.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ddm.checkpoints.format import load_checkpoint, read_meta
from ddm.evaluation.commands import load_judge, score_runs
from ddm.evaluation.runcache import RunCache, SampledRun
from ddm.data.partition import Partition, partition_from_dict
from ddm.sampling_params import DEFAULT_SOLVER
from ddm.evaluation.scoring import METRICS, SEEDS, Judge, cluster_agreement, summarise
from ddm.fileio import atomic_path, check_output
from ddm.checkpoints.discovery import default_checkpoints, discover
from ddm.models.ddm import DDM, load_ddm
from ddm.models.loading import expert_velocity
from ddm.progress import JobProgress
from ddm.sampling.pipeline import generate
from ddm.sampling.routing import routes_by_label

#: The DDM's rows; ``random`` (an expert per sample and step, drawn uniformly) is the paper's
#: disaster baseline (FID 157 on ImageNet).
STRATEGIES = ("oracle", "top1", "top2", "ensemble", "random")
PARITY_BATCH = 64
COLUMNS = ("accuracy", *METRICS)


@dataclass(frozen=True)
class Row:
    """One configuration: ``summary[metric]`` is ``{"mean", "std", "values"}`` over seeds."""

    model: str
    strategy: str
    summary: dict[str, dict[str, Any]]
    expert_calls: float
    sample_cpu_seconds: float
    eval_cpu_seconds: float
    compared: bool = False  # a DDM of ``--compare``, shown in its own section
    #: top-1 rows of a routed DDM: ``{step: fraction}``, the router's choice at that step
    #: (1-based) equal to the partition cluster of the finished image, mean over seeds
    agreement: dict[int, float] | None = None


def quality_rows(checkpoints: Path, judge: Judge, n_per_label: int, steps: int,
                 solver: str, compare: Sequence[tuple[Path, DDM]],
                 cache: RunCache) -> list[Row]:
    """Real-vs-real floor, the monoliths (most trained first), the DDM per strategy, then
    each DDM of ``compare`` at top-1 (e.g. the same partition with experts of other
    objectives: the homogeneous vs heterogeneous comparison). ``cache``: where sampled runs
    are kept and reused."""
    found = discover(checkpoints)
    labels = np.repeat(np.arange(judge.classifier.config.num_classes), n_per_label)
    started = time.process_time()
    floor = summarise(judge.floor(labels))
    floor["accuracy"] = _accuracy_summary(judge, labels)
    rows = [Row("real test digits (disjoint subsets)", "-", floor, 0.0, 0.0,
                time.process_time() - started)]
    ddm = load_ddm(checkpoints)
    strategies = strategies_for(ddm)
    cache.expect(len(SEEDS) * (len(found.get("monolith", [])) + len(strategies) + len(compare)),
                 len(labels))
    for path in sorted(found.get("monolith", []),
                       key=lambda p: -int(read_meta(p).training.get("steps", 0))):
        trained = read_meta(path).training.get("steps", "?")
        rows.append(_sampled_row(load_ddm(path), f"monolith ({trained} steps)", "single model",
                                 judge, labels, steps, solver, cache))
    trained = sorted({read_meta(p).training.get("steps", "?") for p in found["expert"]})
    model = f"DDM ({len(found['expert'])} experts, {'/'.join(map(str, trained))} steps each)"
    partition = shared_partition(found["expert"]) if ddm.router is not None else None
    for strategy in strategies:
        rows.append(_sampled_row(ddm, model, strategy, judge, labels, steps, solver, cache,
                                 partition if strategy == "top1" else None))
    for path, other in compare:
        row = _sampled_row(other, str(path), "top1", judge, labels, steps, solver, cache)
        rows.append(dataclasses.replace(row, compared=True))
    return rows


def strategies_for(ddm: DDM) -> tuple[str, ...]:
    """:data:`STRATEGIES` less ``oracle`` where a label is not owned by exactly one expert
    (a k-means partition: every expert learns every digit, and only the image decides)."""
    by_label = routes_by_label(ddm.expert_classes, ddm.num_classes)
    return STRATEGIES if by_label else STRATEGIES[1:]


def shared_partition(experts: Sequence[Path]) -> Partition | None:
    """The partition the experts were trained on (None where they record none)."""
    schemes = {json.dumps(read_meta(p).partition.get("scheme"), sort_keys=True)
               for p in experts}
    if len(schemes) != 1 or schemes == {"null"}:
        return None
    return partition_from_dict(json.loads(schemes.pop()))


def agreement_steps(steps: int) -> tuple[int, ...]:
    """The steps (1-based) whose routing is compared with the finished image's cluster:
    the first, each quarter, the last."""
    return tuple(sorted({1, *(max(1, round(steps * q)) for q in (0.25, 0.5, 0.75)), steps}))


def describe_experts(checkpoints: Path) -> str:
    """``epsilon 0-4 (2000 steps) + velocity 5-9 (4000 steps)``: each expert's objective,
    classes and training, in partition order."""
    metas = sorted((read_meta(p) for p in discover(checkpoints)["expert"]),
                   key=lambda m: m.partition.get("index", 0))
    return " + ".join(
        f"{m.objective.prediction} {_classes(m.classes)} ({m.training.get('steps', '?')} steps)"
        for m in metas)


def _classes(classes: Sequence[int]) -> str:
    ordered = sorted(classes)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def compare_fd(a: Row, b: Row, a_name: str, b_name: str) -> str:
    """Which of two rows has the lower Frechet distance, judged run by run: the rows share
    each run's labels, noise and real subset, so the per-run difference cancels the subset's
    noise (the floor's spread) that a comparison of the two means would carry."""
    return paired_verdict(a.summary["fd"]["values"], b.summary["fd"]["values"], a_name, b_name)


def paired_verdict(a: Sequence[float], b: Sequence[float], a_name: str, b_name: str,
                   lower_is_better: bool = True, digits: int = 2) -> str:
    """Which of two configurations scores better, run by run (``a[i]`` and ``b[i]`` share
    run ``i``'s inputs): better only where it is so in every run."""
    differences = np.subtract(a, b)
    word = "lower" if lower_is_better else "higher"
    better = int(((differences < 0) if lower_is_better else (differences > 0)).sum())
    worse = int(((differences > 0) if lower_is_better else (differences < 0)).sum())
    runs = len(differences)
    spread = float(differences.std(ddof=1)) if runs > 1 else 0.0
    paired = f"per run {differences.mean():+.{digits}f} +/- {spread:.{digits}f}"
    if better == runs:
        return f"{a_name} is better, {word} in all {runs} runs ({paired})"
    if worse == runs:
        return f"{b_name} is better, {word} in all {runs} runs ({paired})"
    return f"no consistent difference, {a_name} {word} in {better} of {runs} runs ({paired})"


def expert_parity(checkpoints: Path, seed: int = 0) -> dict[str, float]:
    """Max |v_torch - v_jax| per shipped expert on random ``x_t``, ``t`` and owned labels."""
    result = {}
    for path in discover(checkpoints).get("expert", []):
        ckpt = load_checkpoint(path)
        arch = ckpt.meta.architecture
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((PARITY_BATCH, arch["in_channels"], arch["image_size"],
                                 arch["image_size"]), dtype=np.float32)
        t = rng.random(PARITY_BATCH, dtype=np.float32)
        y = rng.choice(np.asarray(ckpt.meta.classes), PARITY_BATCH)
        v_torch = expert_velocity(ckpt, "torch")(x, t, y)
        v_jax = expert_velocity(ckpt, "jax")(x, t, y)
        result[ckpt.meta.name] = float(np.max(np.abs(v_torch - v_jax)))
    return result


def render(rows: Sequence[Row], parity: dict[str, float], settings: dict[str, Any]) -> str:
    top1 = next((r for r in rows if r.model.startswith("DDM") and r.strategy == "top1"), None)
    header = ("| model | routing | " + " | ".join(COLUMNS) + " | expert passes / image | "
              "sampling CPU s | eval CPU s |")
    rule = "|---|---|" + "---:|" * (len(COLUMNS) + 3)
    monoliths = [r for r in rows if r.model.startswith("monolith")]
    lines = [
        "# Generation quality: monolith vs DDM routing strategies",
        "",
        "Generated by `ddm report` (do not edit by hand). The DDM paper's Table 1 at small scale:",
        f"the DDM in `{settings['checkpoints']}` against monoliths trained on all the data.",
        "Training steps are in each model's row. Every row uses the same labels, noise, solver",
        "and sampling steps.",
        "",
        f"Settings: {settings['n_per_label']} images per digit ({settings['n']} per run), "
        f"{len(SEEDS)} runs (seeds {', '.join(map(str, SEEDS))}), {settings['steps']} "
        f"{settings['solver']} steps, {settings['machine']}. Values are mean +/- standard "
        "deviation over the runs."
        + (f" {settings['reused']} of the {settings['runs']} runs were reused from an "
           "earlier `ddm report --cache` with the same models and settings (their sampling "
           "CPU is as measured then)." if settings["reused"] else ""),
        "",
        f"Reference: the held-out split of `{settings['reference']}`; the classifier learned "
        f"the `{settings['classifier_split']}` split"
        + (" (the same images: this judge has seen its reference)."
           if settings["classifier_split"] == "heldout" else ", so it never saw the reference."),
        "Each run is scored against its own real subset of the reference with the run's class",
        "counts. Accuracy: the fraction the classifier reads as the asked digit. FD: Frechet",
        "distance in the classifier's feature space (lower is better; the first row is its",
        "floor at this size: two disjoint real subsets). Precision / recall (k=3) and density /",
        "coverage (k=5): how much of the generated set lies on the real manifold and how much",
        "of the real manifold it covers; blur lowers precision and density, dropped modes lower",
        "recall and coverage. CPU seconds per run: sampling, and the evaluation itself.",
        "Routing `random` (evaluation only, never served): one expert per sample and step,",
        "drawn uniformly among those trained on the label, the DDM paper's FID-157 baseline.",
        "Which expert ran each step of a few samples: `python scripts/routing_figure.py "
        f"--checkpoints {settings['checkpoints']}` draws it; the API reports it per image as",
        "`routing`.",
        "",
        header, rule,
    ]
    compared = [r for r in rows if r.compared]
    lines += [_table_row(r) for r in rows if not r.compared]
    if top1 and top1.agreement:
        lines += ["", "Router top-1 agreement: the fraction of images whose top-1 expert at a "
                  "step is the partition cluster of the finished image (mean over the runs; "
                  f"a uniform guess among the {settings['experts']} experts scores "
                  f"{1 / settings['experts']:.2f}):", "",
                  "| step | " + " | ".join(map(str, top1.agreement)) + " |",
                  "|---|" + "---:|" * len(top1.agreement),
                  "| agreement | " + " | ".join(f"{v:.3f}" for v in top1.agreement.values())
                  + " |"]
    if top1:
        lines += ["", f"DDM top-1 accuracy {top1.summary['accuracy']['mean']:.3f}."]
        lines += [f"DDM top-1 FD / {m.model} FD = "
                  f"{top1.summary['fd']['mean'] / m.summary['fd']['mean']:.3f}: "
                  f"{compare_fd(top1, m, 'the DDM', 'the monolith')}."
                  for m in monoliths]
        lines += [f"Random expert per step FD / DDM top-1 FD = "
                  f"{r.summary['fd']['mean'] / top1.summary['fd']['mean']:.3f}: "
                  f"{compare_fd(r, top1, 'random routing', 'top-1')}; accuracy "
                  f"{r.summary['accuracy']['mean']:.3f}."
                  for r in rows if r.model == top1.model and r.strategy == "random"]
    if compared and top1:
        lines += ["", "## Homogeneous vs heterogeneous experts", "",
                  "The same partition, router and settings with experts of other training "
                  "objectives (converted to our velocity, docs/objectives.md), at top-1:", "",
                  *[f"- `{path}`: {describe_experts(Path(path))}"
                    for path in (settings["checkpoints"], *(r.model for r in compared))],
                  "", header, rule, _table_row(top1), *map(_table_row, compared), "",
                  f"One image is {1 / settings['n']:.3f} of a run's accuracy; compare the "
                  "differences with the spreads.", ""]
        lines += [f"`{r.model}` top-1 accuracy - DDM top-1 accuracy = "
                  f"{r.summary['accuracy']['mean'] - top1.summary['accuracy']['mean']:+.3f}."
                  for r in compared]
    lines += ["", "## PyTorch <-> Flax parity of the shipped experts", "",
              f"Max absolute velocity difference over {PARITY_BATCH} random `(x_t, t, y)`, float32 "
              "on CPU, same canonical weights run by both frameworks (target: <= 1e-4):", ""]
    lines += [f"- `{name}`: {value:.2e}" for name, value in parity.items()]
    return "\n".join(lines) + "\n"


def write_report(checkpoints: Path | None, n_per_label: int, steps: int, out: Path,
                 solver: str = DEFAULT_SOLVER, data: str | None = None,
                 compare: Sequence[Path] = (), cache: Path | None = None,
                 progress: JobProgress | None = None) -> Path:
    """Sample every row ``len(SEEDS)`` times, score, and write the table to ``out``.
    ``compare``: other DDM directories judged by the same classifier, at top-1. ``cache``:
    a directory keeping each sampled run, so a stopped report resumes (``RunCache``);
    ``progress`` hears the whole report's samples, then each run."""
    if n_per_label < 1:
        raise ValueError(f"--n-per-label must be >= 1, got {n_per_label}")
    check_output(out, ".md", "--out")  # before an hour of sampling, not after
    source = checkpoints or default_checkpoints()
    classifier = discover(source)["classifier"][0]
    judge = load_judge(classifier, data)
    compared = [(shown_path(path), load_ddm(path)) for path in compare]  # fail before sampling
    runs = RunCache(cache, progress)
    rows = quality_rows(source, judge, n_per_label, steps, solver, compared, runs)
    recorded = read_meta(classifier).data
    settings = {"checkpoints": shown_path(source), "n_per_label": n_per_label,
                "reference": data or recorded.get("source", "digits"),
                "classifier_split": recorded.get("split", "heldout"),
                "n": judge.classifier.config.num_classes * n_per_label, "steps": steps,
                "solver": solver, "experts": len(discover(source).get("expert", [])) or 1,
                "machine": f"{platform.machine()} CPU, {platform.python_implementation()} "
                           f"{platform.python_version()}",
                "reused": runs.reused, "runs": runs.reused + runs.sampled}
    text = render(rows, expert_parity(source), settings)
    with atomic_path(out) as tmp:
        tmp.write_text(text)
    return out


def shown_path(path: Path) -> Path:
    """``path`` relative to the working directory when inside it: the report is committed,
    and the machine's absolute paths say nothing to its readers."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def _table_row(r: Row) -> str:
    calls = "-" if r.expert_calls == 0 else f"{r.expert_calls:.1f}"
    cells = [_cell(r.summary[c], 2 if c == "fd" else 3) for c in COLUMNS]
    sampling = "-" if r.sample_cpu_seconds == 0 else f"{r.sample_cpu_seconds:.1f}"
    return (f"| {r.model} | {r.strategy} | {' | '.join(cells)} | {calls} | {sampling} | "
            f"{r.eval_cpu_seconds:.1f} |")


def _cell(summary: dict[str, Any], digits: int) -> str:
    return f"{summary['mean']:.{digits}f} +/- {summary['std']:.{digits}f}"


def _accuracy_summary(judge: Judge, labels: np.ndarray) -> dict[str, Any]:
    """The classifier's accuracy on the floor's real subsets (its ceiling on samples)."""
    values = []
    for seed in SEEDS:
        images = judge.real_images(labels, labels, seed)
        values.append(float((judge.classifier.predict(images) == np.sort(labels)).mean()))
    spread = np.array(values)
    return {"mean": float(spread.mean()), "std": float(spread.std(ddof=1)), "values": values}


def _sampled_row(ddm: DDM, model: str, strategy: str, judge: Judge, labels: np.ndarray,
                 steps: int, solver: str, cache: RunCache,
                 partition: Partition | None = None) -> Row:
    """``partition`` (top-1 only): also measure the router's agreement with it."""
    routing = "top1" if strategy == "single model" else strategy
    runs, calls, cpu, agreements = [], [], [], []
    for seed in SEEDS:
        out = cache.run(ddm, routing, solver, steps, seed, labels,
                        partial(_sample, ddm, labels, steps, seed, routing, solver))
        cpu.append(out.cpu_seconds)
        runs.append((out.images, out.labels))
        calls.append(float(out.expert_calls.mean()))
        if partition is not None:
            chosen = _first_expert(out.step_masks)
            agreements.append({step: cluster_agreement(partition, out.images, out.labels,
                                                       chosen[:, step - 1])
                               for step in agreement_steps(steps)})
    scored = score_runs(judge, runs, with_floor=False)
    summary = {c: scored[c] for c in COLUMNS}
    agreement = ({step: float(np.mean([a[step] for a in agreements]))
                  for step in agreements[0]} if agreements else None)
    return Row(model, strategy, summary, float(np.mean(calls)), float(np.mean(cpu)),
               scored["cpu_seconds"] / len(SEEDS), agreement=agreement)


def _sample(ddm: DDM, labels: np.ndarray, steps: int, seed: int, routing: str,
            solver: str) -> SampledRun:
    started = time.process_time()
    out = generate(ddm, labels, steps, seed, routing, solver)
    return SampledRun(out.images, out.labels, out.expert_calls, out.usage.step_masks(steps),
                      time.process_time() - started)


def _first_expert(masks: np.ndarray) -> np.ndarray:
    """Index of the lowest set bit of each ``(N, steps)`` expert mask (top-1: the expert)."""
    return np.log2(masks & -masks).astype(np.int64)
