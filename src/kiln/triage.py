"""`kiln triage <run dir>`: read a failed or suspicious run's own files (summary.json,
metrics.jsonl, nan_batch_stats.json, .hydra/config.yaml) and rank the likely causes, each with
its evidence and the override to try. A run that failed on a non-finite loss or evaluation, or
in a probe before step 1, is also replayed (kiln.engine.replay): the failing step again from
the last good checkpoint with the saved batch, bisected, and its findings rank first."""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln.errors import UserError, attempt
from kiln.findings import Finding, read_findings
from kiln.logging.jsonl import read_jsonl
from kiln.logging.summary import read_summary

log = logging.getLogger(__name__)


@dataclass
class Cause:
    score: float  # higher: more likely
    title: str
    evidence: str
    try_: str  # the override (or action) to try


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]]  # logged training intervals
    evals: list[dict[str, Any]]  # logged evaluations
    config: dict[str, Any]
    batch_stats: dict[str, Any] | None
    replay: Any = None  # kiln.engine.replay.Replay, for a failed run
    findings: list[Finding] = field(default_factory=list)  # findings.json: what checks found

    @classmethod
    def read(cls, path: Path) -> Run:
        """The run's files, checked to be what train.py writes: a damaged or foreign file
        (a metrics.jsonl line cut off or without its step, another tool's summary.json) is a
        TriageError naming it, not a guess built on it."""
        metrics_file = path / "metrics.jsonl"
        metrics = read_jsonl(metrics_file) if metrics_file.is_file() else []
        for number, record in enumerate(metrics, start=1):
            if not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
                raise TriageError(
                    f"{metrics_file}: record {number} has no integer 'step' "
                    f"({', '.join(list(record)[:6]) or 'no keys'}): not a kiln metrics record; "
                    "kiln triage reads the run directories train.py writes"
                )
        stats_file = path / "nan_batch_stats.json"
        return cls(
            path=path,
            summary=kiln_summary(path),
            steps=[m for m in metrics if "loss" in m],
            evals=[m for m in metrics if any(k.startswith("val_") for k in m)],
            config=run_config(path) or {},
            batch_stats=_json_object(stats_file) if stats_file.is_file() else None,
            findings=read_findings(path),
        )

    def key(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(m["step"], float(m[name])) for m in self.steps if _finite(m.get(name))]

    @property
    def error(self) -> str:
        return self.summary.get("error") or ""

    @property
    def went_nonfinite(self) -> bool:
        return (
            "loss NaN" in self.error
            or "loss Inf" in self.error
            or bool(self.summary.get("nonfinite_skipped"))
        )


class TriageError(UserError, ValueError):
    """A run directory whose files are damaged or not kiln's; the message names the file."""


STATUSES = ("ok", "failed", "interrupted", "preempted", "at_chance")


def kiln_summary(path: Path) -> dict[str, Any]:
    """summary.json as train.py writes it (a status, an error string or null); none at all is
    a run killed before its end (status failed); anything else is a TriageError."""
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        return read_summary(path)
    summary = _json_object(summary_file)
    status, error = summary.get("status"), summary.get("error")
    if status not in STATUSES or not isinstance(error, str | None):
        raise TriageError(
            f"{summary_file} is not a kiln run summary (status {status!r}, expected one of "
            f"{', '.join(STATUSES)}; error {type(error).__name__}): kiln triage reads the run "
            "directories train.py writes"
        )
    return summary


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as err:
        raise TriageError(f"{path} cannot be read as JSON ({err}): is the run damaged?") from None
    if not isinstance(data, dict):
        raise TriageError(f"{path} holds a JSON {type(data).__name__}, not kiln's object")
    return data


def run_config(path: Path) -> dict[str, Any]:
    """The run's config: Hydra's copy, or (for runs started in-process) the checkpoint's."""
    config_file = path / ".hydra" / "config.yaml"
    if config_file.is_file():
        try:
            config = yaml.safe_load(config_file.read_text(encoding="utf-8", errors="replace"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or type(err).__name__
            raise TriageError(
                f"{config_file} cannot be read as YAML ({problem}{where}): is the run damaged?"
            ) from None
        if not isinstance(config, dict | None):
            raise TriageError(f"{config_file} holds a YAML {type(config).__name__}, not a config")
        return config or {}
    from kiln.checkpoint import CheckpointError, candidates, load_checkpoint

    for candidate in candidates(path / "checkpoints"):
        try:
            return load_checkpoint(candidate).get("config", {})
        except CheckpointError:
            continue
    return {}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def exploding_gradients(run: Run) -> Cause | None:
    norms = run.series("grad_norm_max") or run.series("grad_norm")
    if not run.went_nonfinite or len(norms) < 2:
        return None
    then = f", then: {run.error or 'non-finite steps were skipped'}"
    return explosion(run, norms[0], norms[-1], "grad norm", then)


def explosion(run: Run, first, last, what: str, then: str) -> Cause | None:
    """The exploding-gradients cause when the (step, norm) `last` is 5x or more `first`."""
    growth = last[1] / max(first[1], 1e-12)
    if growth < 5:
        return None
    lr = run.key("optimizer.lr", 0.0)
    return Cause(
        3 + min(math.log10(growth), 5),
        "exploding gradients before the loss went non-finite",
        f"{what} rose from {first[1]:.3g} (step {first[0]}) to {last[1]:.3g} (step {last[0]}), "
        f"x{growth:.3g}{then}",
        f"optimizer.lr={lr / 10:g} trainer.gradient_clip_val=1.0",
    )


def fp16_overflow(run: Run) -> Cause | None:
    skipped = run.series("scaler_skipped")
    total = run.summary.get("scaler_skipped") or (skipped[-1][1] if skipped else 0)
    if not total:
        return None
    growing = len(skipped) >= 2 and skipped[-1][1] > skipped[0][1]
    return Cause(
        4 if growing else 2,
        "fp16 overflow: GradScaler keeps skipping steps",
        f"scaler_skipped reached {int(total)}"
        + (f" (from {int(skipped[0][1])} at step {skipped[0][0]})" if growing else ""),
        "precision=bf16 (fp32's range, no scaler)",
    )


def nonfinite_inputs(run: Run) -> Cause | None:
    if not run.batch_stats:
        return None
    bad = {
        name: stats
        for name, stats in run.batch_stats.get("batch", {}).items()
        if stats.get("nan") or stats.get("inf")
    }
    if not bad:
        return None
    shown = "; ".join(f"{n}: {s.get('nan', 0)} NaN, {s.get('inf', 0)} Inf" for n, s in bad.items())
    return Cause(
        6,
        "non-finite values in the input batch",
        f"the batch of the failing step holds {shown} ({run.path / 'nan_batch_stats.json'})",
        "fix the data; trainer.check_inputs=true stops at the first bad batch, naming the tensor",
    )


def data_bottleneck(run: Run) -> Cause | None:
    frac = run.summary.get("data_time_frac")
    if not _finite(frac) or frac < 0.3:
        return None
    workers = run.summary.get("num_workers")  # data.num_workers=auto: the count it resolved to
    workers = run.key("data.num_workers", 0) if workers is None else workers
    workers = workers if isinstance(workers, int) else 0
    return Cause(
        1 + 3 * frac,
        "data loading is the bottleneck",
        f"data_time_frac {frac:.0%}: the model waited for batches that long (num_workers "
        f"{workers})",
        f"data.num_workers={max(2, 2 * workers)} data.pin_memory=true (on CUDA)",
    )


def train_eval_disagreement(run: Run) -> Cause | None:
    if "rule 3" not in run.error and "ShapeContractError" not in run.error:
        return None
    return Cause(
        7,
        "the model's train and eval modes disagree (rule 3)",
        run.error.splitlines()[0][:300],
        "fix the model's eval path (branches on self.training, modules forced into train mode)",
    )


def flat_loss(run: Run) -> Cause | None:
    losses = [v for _, v in run.series("loss")]
    if len(losses) < 5:
        return None
    change = abs(losses[-1] - losses[0]) / max(abs(losses[0]), 1e-12)
    if change > 0.02:
        return None
    lr = run.key("optimizer.lr", 0.0)
    return Cause(
        5,
        "the loss is flat from the first step",
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} logged intervals "
        f"({change:.2%} change) at optimizer.lr={lr:g}",
        f"optimizer.lr={lr * 100:g} (and check the labels: shuffled or constant labels "
        "look like this too)",
    )


def validation_far_below_training(run: Run) -> Cause | None:
    if not run.evals or not run.steps:
        return None
    val = run.evals[-1].get("val_loss")
    train = statistics.fmean(v for _, v in run.series("loss")[-3:]) if run.series("loss") else None
    if not (_finite(val) and _finite(train)) or val < 2 * train + 0.1:
        return None
    return Cause(
        4,
        "validation far below training",
        f"val_loss {val:.3f} against a training loss of {train:.3f} at step "
        f"{run.steps[-1]['step']}: the model does much worse on data it did not train on",
        "check the split for leakage or mismatched labels, and the eval path (BatchNorm or "
        "dropout behaving differently in eval mode); trainer.overfit_batches=1 shows whether "
        "the model can fit at all",
    )


# ------------------------------------------------------------------ from the replayed step


def _stats(inputs: list[dict]) -> str:
    shown = []
    for t in inputs[:2]:
        bits = [f"{tuple(t['shape'])} {t['dtype']}"]
        if "min" in t:
            bits.append(f"min {t['min']:.3g} max {t['max']:.3g}")
        if t.get("zeros"):
            bits.append(f"{t['zeros']} zero(s)")
        shown.append(", ".join(bits))
    return "; ".join(shown)


def _replayed(r) -> str:
    if r.what == "probe":
        return "replayed the probes before step 1, then their batch traced"
    return f"replayed step {r.failing_step}"


def replayed_inputs(run: Run) -> Cause | None:
    r = run.replay
    if r is None or not r.nonfinite_inputs:
        return None
    shown = "; ".join(f"{n}: {c['nan']} NaN, {c['inf']} Inf" for n, c in r.nonfinite_inputs.items())
    return Cause(
        10,
        "non-finite values in the input batch",
        f"{_replayed(r)}: its batch holds {shown}, before any module ran",
        "fix the data; trainer.check_inputs=true stops at the first bad batch, naming the tensor",
    )


def lr_too_high_at_the_first_update(run: Run) -> Cause | None:
    r = run.replay
    if r is None or not r.steps or r.steps[0].step != 1 or not r.steps[0].update:
        return None
    group = max(r.steps[0].update, key=lambda g: g["ratio"])
    if not group["ratio"] >= FIRST_UPDATE_RATIO:
        return None
    lr = group["lr"]
    # The configured lr scaled so that step 1 would move the weights by HEALTHY_UPDATE (a
    # schedule's warm-up has step 1 at a fraction of it).
    configured = run.key("optimizer.lr", lr)
    suggested = float(f"{configured * HEALTHY_UPDATE / group['ratio']:.0e}")
    return Cause(
        9 + min(math.log10(group["ratio"]), 10) / 10,
        "learning rate too high at the first update",
        f"replayed: the update at step 1 was lr·|g|/|w| = {group['ratio']:.3g} of the weights "
        f"(group {group['group']}: lr {lr:g}, |g| {group['grad_norm']:.3g}, |w| "
        f"{group['weight_norm']:.3g}); a healthy update is about {HEALTHY_UPDATE:g} of them; "
        f"{r.what} followed at step {r.failing_step}",
        f"optimizer.lr={suggested:g} (an update of about {HEALTHY_UPDATE:g} at step 1), or a "
        "warm-up (scheduler=onecycle)",
    )


FIRST_UPDATE_RATIO = 1.0  # an update as large as the weights themselves
HEALTHY_UPDATE = 1e-3


def replayed_explosion(run: Run) -> Cause | None:
    r = run.replay
    norms = [(s.step, s.grad_norm) for s in r.steps if _finite(s.grad_norm)] if r else []
    if len(norms) < 3:
        return None
    last = max(norms[1:], key=lambda n: n[1])
    then = f"; {r.what} at step {r.failing_step}"
    return explosion(run, norms[0], last, "replayed: the grad norm", then)


def replayed_first_op(run: Run) -> Cause | None:
    """What made the first NaN/Inf out of finite values: log(0), a division by zero, an fp16
    overflow, or another operation."""
    r = run.replay
    op = r.first_op if r is not None else None
    if op is None or r.nonfinite_inputs or r.what.startswith("val_"):
        return None
    name, where = op.op.split(".")[0], op.where
    evidence = f"{_replayed(r)}: {op.op} in {where} ({op.dtype}) made NaN/Inf "
    evidence += f"out of finite inputs ({_stats(op.inputs)})"
    terms = f" (term {', '.join(repr(t) for t in r.bad_terms)})" if r.bad_terms else ""
    if op.backward:
        return Cause(
            6,
            "a non-finite gradient from a finite forward",
            f"{evidence} in the backward pass; the first parameter with a non-finite gradient: "
            f"{r.first_bad_grad}",
            "an operation whose derivative is infinite where it is evaluated (sqrt or pow(x, "
            "0.5) at 0, the norm of a zero vector): add an eps inside it",
        )
    if op.dtype == "float16" and r.fp32_finite:
        biggest = max((t.get("abs_max", 0.0) for t in op.inputs), default=0.0)
        return Cause(
            9.5,
            f"fp16 overflow in {where}",
            f"{evidence}: float16's largest value is 65504 (inputs up to {biggest:.3g}); the "
            "same forward in fp32 is finite",
            "precision=bf16 (fp32's range, no loss scaling), or keep that module in fp32",
        )
    if name in ("log", "log2", "log10") and any(t.get("zeros") for t in op.inputs[:1]):
        in_loss = bool(r.bad_terms) and (not op.module)
        place = f"the loss{terms}, computed in {where}" if in_loss else where
        return Cause(
            9,
            f"log(0) in {place}",
            evidence,
            "take log-probabilities with log_softmax (F.cross_entropy on logits) or clamp "
            "first: torch.log(p.clamp_min(1e-12))",
        )
    divisor = op.inputs[0] if name == "reciprocal" else (op.inputs[1] if len(op.inputs) > 1 else {})
    if name in ("div", "true_divide", "reciprocal") and divisor.get("zeros"):
        return Cause(
            9,
            f"division by zero in {where}",
            f"{evidence}: the divisor holds {divisor['zeros']} zero(s)",
            f"guard the division in {op.kind or 'that'}.forward: x / y.clamp_min(eps), or leave "
            "out what has nothing to divide by",
        )
    return Cause(
        5,
        f"NaN/Inf first appears in {where}",
        evidence,
        "look at that operation's inputs (a weight or activation grown too large, an "
        "out-of-range argument)",
    )


def replayed_eval_only(run: Run) -> Cause | None:
    r = run.replay
    if r is None or not r.what.startswith("val_") or r.first_module is None:
        return None
    path, kind = r.first_module
    where = f"{path or '<model>'} ({kind})"
    buffers = "; ".join(f"{n}: {v}" for n, v in r.buffers.items())
    op = f" ({r.first_op.op})" if r.first_op else ""
    mode = (
        "while the same batch in train mode is finite"
        if r.train_mode_finite
        else "and in train mode too"
    )
    return Cause(
        9 if r.train_mode_finite else 6,
        f"NaN in evaluation only: {where}" if r.train_mode_finite else f"NaN in {where}",
        f"replayed the evaluation after step {r.failing_step} from {r.start}: validation batch "
        f"{r.eval_batch} is non-finite in eval mode, first in {where}{op}, {mode}"
        + (f"; its buffers: {buffers}" if buffers else ""),
        f"fix what {kind} uses only in eval mode (running statistics, buffers never updated); "
        "trainer.shape_check=true refuses such a model before step 1",
    )


def replayed_probe(run: Run) -> Cause | None:
    r = run.replay
    if r is None or not r.probe_error:
        return None
    finding, _ = stopping_finding(run)
    if finding is not None and finding.kind in NAMED_BY_FINDING:
        return None  # named by its own cause (found_by_a_check)
    return Cause(
        7,
        "a probe before step 1 refused the model",
        f"replayed the probes: {r.probe_error.splitlines()[0][:400]}",
        "fix what the message names (docs/antibodies.md: rule 1, 2 or 3)",
    )


# --------------------------------------------------------------------- from the checks' findings

# The kinds of finding named as a cause of their own (kiln.findings.KINDS says what each
# means and what to do); the rest (shapes, loss branches) by the replayed probe's message.
NAMED_BY_FINDING = {
    "probabilities",
    "batch dependence",
    "determinism",
    "purity",
    "dead gradients",
    "conditional parameters",
    "cannot learn",
    "learning rate diverges",
    "device",
    "memory layout",
    "numerics",
    "fp16 overflow",
    "padding",
    "split leak",
    "class map",
    "box convention",
    "box predictions",
    "schedule",
    "optimizer coverage",
}
# What a check said while the run went on (findings.json, fatal: false), ranked as causes of a
# run that ended at chance or suspiciously well: above the bare symptom (at_chance, 3).
SAID_SCORE = {
    "split leak": 8,
    "box predictions": 7,
    "conditional parameters": 5,
    "dead gradients": 4,
}


def stopping_finding(run: Run) -> tuple[Finding | None, bool]:
    """The check's finding that stopped the run, and whether the replay found it: the replayed
    probes' (where the replay ran), else the run's own (findings.json), else summary.json's
    failed_check (a run from before findings.json)."""
    r = run.replay
    if r is not None and getattr(r, "probe_finding", None) is not None:
        return r.probe_finding, True
    fatal = [f for f in run.findings if f.fatal]
    if fatal:
        return fatal[-1], False
    check = run.summary.get("failed_check") or {}
    kind = check.get("kind") or check.get("what") or ""
    if not kind:
        return None, False
    evidence = run.error.split(": ", 1)[-1]  # without the exception's class name
    return Finding(kind, evidence, check.get("module") or "", check.get("fix") or ""), False


def found_by_a_check(run: Run) -> Cause | None:
    """A check stopped the run: its finding is the cause, titled and advised by its kind
    (kiln.findings.KINDS), with the fix it found for this case where it found one."""
    finding, replayed = stopping_finding(run)
    if finding is None or finding.kind not in NAMED_BY_FINDING:
        return None
    r = run.replay
    numerics = finding.kind in ("numerics", "fp16 overflow")
    if numerics and r is not None and (r.first_op or r.nonfinite_inputs):
        return None  # the replay's op-level causes name it (log(0), fp16 overflow, the data)
    where = f" in {finding.module}" if finding.module else ""
    source = "replayed the probes: " if replayed else "the run's checks: "
    score = 9 if finding.kind == "probabilities" else 9.6
    return Cause(score, f"{finding.title}{where}", source + finding.evidence[:600], finding.advice)


def said_by_the_checks(run: Run) -> list[Cause]:
    """What the checks said without stopping the run (a split overlap within
    data.max_split_overlap, boxes that fit better flipped, ...): each a cause, titled and
    advised by its kind."""
    causes = []
    for finding in run.findings:
        if finding.fatal:
            continue
        where = f" in {finding.module}" if finding.module else ""
        title = f"{finding.title}{where}"
        evidence = "the run's checks said: " + finding.evidence[:600]
        causes.append(Cause(SAID_SCORE.get(finding.kind, 3.5), title, evidence, finding.advice))
    return causes


def at_chance(run: Run) -> Cause | None:
    """A run that ended at chance: its best evaluation said no more than always answering the
    most frequent class would."""
    if run.summary.get("status") != "at_chance":
        return None
    return Cause(
        3,  # the symptom: a cause that explains it (a flat loss, ...) ranks above
        "the run learned nothing: its best evaluation is at chance",
        run.summary.get("at_chance") or "summary.json: status at_chance",
        "the causes below; a learning rate off by orders of magnitude is the usual one "
        "(the learn probe, on by default, stops a run that cannot lower one batch's loss)",
    )


CHECKS = (
    found_by_a_check,
    at_chance,
    replayed_inputs,
    lr_too_high_at_the_first_update,
    replayed_explosion,
    replayed_first_op,
    replayed_eval_only,
    replayed_probe,
    exploding_gradients,
    fp16_overflow,
    nonfinite_inputs,
    data_bottleneck,
    train_eval_disagreement,
    flat_loss,
    validation_far_below_training,
)


def triage(path: Path, replay: bool = True) -> tuple[Run, list[Cause]]:
    """The run's causes, most likely first. A failed run is replayed first (`replay`)."""
    run = Run.read(Path(path))
    if replay and run.summary.get("status") == "failed" and run.config:
        run.replay = replayed(run)
    causes = [cause for check in CHECKS if (cause := check(run)) is not None]
    causes += said_by_the_checks(run)
    kept: dict[str, Cause] = {}
    for cause in sorted(causes, key=lambda c: c.score, reverse=True):
        kept.setdefault(cause.title, cause)  # the same cause from the replay and the files
    ranked = list(kept.values())
    if replay and run.config:
        check_first_fix(run, ranked)
    return run, ranked


def check_first_fix(run: Run, causes: list[Cause]) -> None:
    """The first override the report would suggest that changes learning (optimizer.lr, ...)
    is tried before it is suggested: the learn probe's steps with it must lower the loss. One
    that does not is not suggested; one that could not be tried says so."""
    from kiln.engine.replay import changes_learning

    tries = 2  # a rejected fix lets the next cause's be tried, once
    for cause in causes:
        overrides = overrides_in(cause.try_)
        if not overrides:
            continue
        if not changes_learning(overrides) or tries == 0:
            return
        tries -= 1
        if _checked(run, cause, overrides):
            return


def _checked(run: Run, cause: Cause, suggested: list[str]) -> bool:
    """Try the suggestion; where it does not lower the loss and sets optimizer.lr, try the lr
    whose first step would be a healthy size (measured on the way), then its tenth. The first
    that lowers the loss replaces the suggestion. Returns whether one did (or none could be
    tried: the suggestion then stands, unchecked, and says so)."""
    from kiln.engine.replay import check_override

    saw, candidates, tried = [], [suggested], set()
    while candidates and len(tried) < 3:
        overrides = candidates.pop(0)
        tried.add(" ".join(overrides))
        checked, err = attempt(check_override, run.path, run.config, overrides)
        if err is not None:  # said, and the suggestion stands unchecked
            cause.evidence += (
                f"; could not check {' '.join(overrides)} ({type(err).__name__}: {err})"
            )
            return True
        lowered, what, healthy = checked
        saw.append(what)
        if lowered:
            cause.evidence += f"; checked: {what}" + (
                f" (before it: {'; '.join(saw[:-1])}: the loss does not fall)"
                if overrides != suggested
                else ""
            )
            cause.try_ = cause.try_.replace(" ".join(suggested), " ".join(overrides), 1)
            return True
        lr = [o for o in overrides if o.startswith("optimizer.lr=")]
        if lr and healthy is not None:
            rest = [o for o in overrides if o != lr[0]]
            for value in (healthy, healthy / 10):
                candidate = [f"optimizer.lr={float(f'{value:.1g}'):g}", *rest]
                if " ".join(candidate) not in tried:
                    candidates.append(candidate)
    cause.evidence += "; checked and not suggested: " + "; ".join(saw) + ": the loss does not fall"
    cause.try_ = (
        f"(not {' '.join(suggested)}: it did not lower the loss) "
        + cause.try_.split(" ", len(suggested))[-1]
    )
    return False


def replayed(run: Run):
    """The replay of the failing step, or None (with why in the log) when it cannot run."""
    from kiln.engine.replay import replay

    try:
        return replay(run.path, run.summary, run.config)
    except Exception as err:  # triage reads what it can; the files' causes still stand
        log.warning("could not replay %s: %s: %s", run.path, type(err).__name__, err)
        return None


def replay_lines(run: Run) -> list[str]:
    r = run.replay
    if r is None or r.failing_step is None:
        return []
    if r.what == "probe":
        lines = ["replay: the probes before step 1, run again"]
    else:
        lines = [f"replay: {r.what} at step {r.failing_step}, from {r.start}"]
    if r.steps:
        first, last = r.steps[0].step, r.steps[-1].step
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        lines.append(f"  re-ran {steps} through the run's loader")
    if r.batch_matches is not None:
        same = "equals" if r.batch_matches else "DIFFERS FROM"
        lines.append(f"  the loader's batch at step {r.failing_step} {same} the saved one")
    if r.reproduced is not None:
        lines.append(f"  the failure {'reproduced' if r.reproduced else 'did not reproduce'}")
    if r.update:
        shown = ", ".join(f"group {g['group']}: {g['ratio']:.3g}" for g in r.update)
        lines.append(f"  update lr·|g|/|w| at the failing step: {shown}")
    if r.first_module is not None:
        lines.append(
            f"  first non-finite module output: {r.first_module[0] or '<model>'} "
            f"({r.first_module[1]})"
        )
    if r.first_bad_grad:
        lines.append(f"  first non-finite gradient: {r.first_bad_grad}")
    lines += [f"  note: {note}" for note in r.notes]
    return lines


def report(path: Path) -> str:
    run, causes = triage(path)
    status = run.summary.get("status", "unknown")
    lines = [f"triage of {path}: status {status}" + (f" ({run.error})" if run.error else "")]
    if not causes:
        lines.append("no known cause found in the run's files; see train.log")
    for rank, cause in enumerate(causes, start=1):
        lines += [
            f"{rank}. {cause.title}",
            f"   evidence: {cause.evidence}",
            f"   try: {cause.try_}",
        ]
    fixes = [(rank, found) for rank, c in enumerate(causes, 1) if (found := overrides_in(c.try_))]
    if fixes:  # the run's own command line (plugins and search path included) with the fix
        from kiln.commands import RunCommand

        rank, fix = fixes[0]
        command = RunCommand.of_run(path).train(*fix)
        lines += replay_lines(run)
        lines.append(f"next: {command}   # a new run with the override of cause {rank}")
        return "\n".join(lines)
    return "\n".join(lines + replay_lines(run))


def overrides_in(advice: str) -> list[str]:
    """The key=value overrides an advice starts with ("optimizer.lr=0.001 (and ...)")."""
    found = []
    for word in advice.split():
        if not re.fullmatch(r"[a-z_][\w.]*=[^\s;,()]+", word):
            break
        found.append(word)
    return found
