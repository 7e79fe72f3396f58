"""The resume contract. A checkpoint records what its training state depends on (the config, the
planned optimizer steps, the batch per rank and in all, the world size, a fingerprint of the
data); on resume every difference from the new command line is judged:

- incompatible: the state cannot continue under it (another model, optimizer or scheduler kind,
  other data, a schedule of another length). Refused, naming each key, both values, and how to
  start fresh instead.
- changes the run: it could continue, but not as the original run would have (a new learning
  rate, another batch size, clipping, precision). Refused unless `resume_override=[keys]` lists
  it; then it is logged and applied for real.
- harmless: logging, loaders, checkpoint cadence. Accepted and listed in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from kiln.config import schema_defaults
from kiln.config.overrides import override_value
from kiln.engine.checkpointer import Fix, ResumeError

log = logging.getLogger(__name__)

INCOMPATIBLE, CHANGES_RUN, HARMLESS = "incompatible", "changes the run", "harmless"
# Longest matching prefix wins; keys matching nothing change the run (the safe default).
RULES: dict[str, str] = {
    "model.": INCOMPATIBLE,
    "data.name": INCOMPATIBLE,
    "optimizer.name": INCOMPATIBLE,
    # the parameter groups' layout: the saved moments belong to other groups
    "optimizer.layer_decay": INCOMPATIBLE,
    "optimizer.decay_bias_and_norm": INCOMPATIBLE,
    "scheduler.name": INCOMPATIBLE,
    "seed": INCOMPATIBLE,  # the shuffle order of every epoch follows it
    "optimizer.": CHANGES_RUN,
    "scheduler.": CHANGES_RUN,
    "precision.": CHANGES_RUN,
    "loss.": CHANGES_RUN,
    "data.": CHANGES_RUN,
    "trainer.": CHANGES_RUN,
    "logger.": HARMLESS,
    "env.": HARMLESS,
    "debug.": HARMLESS,
    "data.num_workers": HARMLESS,
    "data.pin_memory": HARMLESS,
    "data.persistent_workers": HARMLESS,
    "data.prefetch_factor": HARMLESS,
    # How long to train: a schedule that depends on it is judged by planned_steps below.
    "trainer.max_epochs": HARMLESS,
    "trainer.max_steps": HARMLESS,
    "trainer.limit_train_batches": HARMLESS,
    "trainer.log_every_n_steps": HARMLESS,
    "trainer.checkpoint_every_n_steps": HARMLESS,
    "trainer.checkpoint_every_epoch": HARMLESS,
    "trainer.keep_last_k": HARMLESS,
    "trainer.limit_val_batches": HARMLESS,
    "trainer.shape_check": HARMLESS,
    "trainer.check_inputs": HARMLESS,
    "trainer.monitor": HARMLESS,
    "trainer.monitor_mode": HARMLESS,
    "trainer.deterministic": HARMLESS,
    "trainer.log_activations": HARMLESS,
    "trainer.host_malloc": HARMLESS,  # where freed host memory goes, not what is computed
    "trainer.threads": HARMLESS,  # how many threads compute the step, not what
    "trainer.early_stopping": HARMLESS,  # how long to train, as trainer.max_epochs
    "trainer.name": HARMLESS,
    "trainer.distributed": HARMLESS,
    "trainer.backend": HARMLESS,
    "device": HARMLESS,
    "name": HARMLESS,
    "resume": HARMLESS,
    "resume_override": HARMLESS,
    "output_root": HARMLESS,
    "plugins": HARMLESS,
    "init_from": HARMLESS,  # not applied on resume: the checkpoint's weights win
    "extra": HARMLESS,
    # model=hf's limits on what its folder may ask for: checked at start-up, never trained on
    "model.max_params": HARMLESS,
    "model.max_config_bytes": HARMLESS,
    "model.max_tokenizer_bytes": HARMLESS,
    "data.baseline_rows": HARMLESS,  # the linear baseline beside the report, never trained on
}


@dataclass(frozen=True)
class Contract:
    """What a checkpoint's training state depends on."""

    config: dict[str, Any]  # flattened: {"optimizer.lr": 0.003, ...}
    planned_steps: int  # the optimizer steps the LR schedule spans
    batch_size: int  # per rank
    world_size: int
    accumulate: int
    data_fingerprint: str  # of the data the run trained on (spec, recipe, split sizes)
    has_schedule: bool = True

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.accumulate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Contract:
        return cls(**data)


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any
    now: Any
    verdict: str

    def line(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.now!r}"


@dataclass
class Judgement:
    incompatible: list[Difference] = field(default_factory=list)
    changes: list[Difference] = field(default_factory=list)  # allowed by resume_override
    refused_changes: list[Difference] = field(default_factory=list)
    harmless: list[Difference] = field(default_factory=list)
    saved: Contract | None = None
    now: Contract | None = None

    def changed(self, key: str) -> bool:
        return any(d.key == key for d in self.changes)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): tree}


def data_fingerprint(spec: dict, recipe: dict, sizes: tuple[int, int]) -> str:
    """A hash of what the data tells the model and how it was prepared: class names, shapes,
    vocabulary (the tokenizer), normalisation statistics and the split sizes."""
    text = json.dumps({"spec": spec, "recipe": recipe, "sizes": list(sizes)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# A key added after a checkpoint was saved is read as its schema default (the dataclass's value,
# which keeps what runs did before the key: kiln.config.schema_defaults), except the keys here,
# whose default changed what a run does: the value that reproduces such a checkpoint's run.
# Judged so, resuming "as it was" names it (and a run that sets it resumes as it always did).
ABSENT_MEANS: dict[str, Any] = {
    "data.min_token_count": 1,  # 2026-12-03: before it, every word seen in training was learned
}


def absent_means(key: str, saved: dict[str, Any]) -> Any:
    """What a checkpoint whose flattened config `saved` lacks `key` ran with: ABSENT_MEANS, else
    the schema default of the key's group option as the checkpoint named it, else '<absent>'."""
    if key in ABSENT_MEANS:
        return ABSENT_MEANS[key]
    group = key.split(".")[0]
    try:
        defaults = flatten(schema_defaults(group, saved.get(f"{group}.name")), f"{group}.")
    except LookupError:
        return "<absent>"
    return defaults.get(key, "<absent>")


def rule_for(key: str) -> str:
    matches = [p for p in RULES if key == p or (p.endswith(".") and key.startswith(p))]
    return RULES[max(matches, key=len)] if matches else CHANGES_RUN


def judge(saved: Contract, now: Contract, overrides: list[str]) -> Judgement:
    judgement = Judgement(saved=saved, now=now)

    def add(key: str, old: Any, new: Any, verdict: str) -> None:
        difference = Difference(key, old, new, verdict)
        if verdict == INCOMPATIBLE:
            judgement.incompatible.append(difference)
        elif verdict == HARMLESS:
            judgement.harmless.append(difference)
        elif _overridden(key, overrides):
            judgement.changes.append(difference)
        else:
            judgement.refused_changes.append(difference)

    same_global_batch = saved.global_batch == now.global_batch
    for key in sorted(set(saved.config) | set(now.config)):
        old = saved.config[key] if key in saved.config else absent_means(key, saved.config)
        new = now.config.get(key, "<absent>")
        if old == new:
            continue
        verdict = rule_for(key)
        if key in BATCH_SPLIT_KEYS and same_global_batch:
            verdict = HARMLESS  # the same global batch, split another way across ranks/steps
        add(key, old, new, verdict)
    if saved.data_fingerprint != now.data_fingerprint:
        add("<data fingerprint>", saved.data_fingerprint, now.data_fingerprint, INCOMPATIBLE)
    if saved.has_schedule and now.has_schedule and saved.planned_steps != now.planned_steps:
        add("<planned optimizer steps>", saved.planned_steps, now.planned_steps, INCOMPATIBLE)
    if not same_global_batch:
        add("<global batch>", saved.global_batch, now.global_batch, CHANGES_RUN)
    return judgement


BATCH_SPLIT_KEYS = ("data.batch_size", "trainer.accumulate_grad_batches")


def _overridden(key: str, overrides: list[str]) -> bool:
    if key == "<global batch>":  # follows from the batch keys the user named
        return any(k in overrides for k in BATCH_SPLIT_KEYS)
    return any(key == o or key.startswith(o.rstrip(".") + ".") for o in overrides)


def check(judgement: Judgement, source: str) -> None:
    """Raises ResumeError for incompatible or unapproved changes, naming the keys the user
    changed (old -> new) and the command lines that would work; logs the rest."""
    if judgement.incompatible:
        lines = explained(judgement.incompatible, judgement)
        what = (
            f"cannot resume {source} with this config: {lines}. These change what the saved "
            "state means"
        )
        raise refusal(what, incompatible_fixes(judgement, source))
    if judgement.refused_changes:
        lines = explained(judgement.refused_changes, judgement)
        what = f"resuming {source} with {lines} would change the run"
        raise refusal(what, change_fixes(judgement))
    for difference in judgement.changes:
        log.warning("resume_override: applying %s", difference.line())
    if judgement.harmless:
        log.info(
            "resume: accepted harmless changes: %s",
            "; ".join(d.line() for d in judgement.harmless),
        )


def refusal(what: str, fixes: list[Fix]) -> ResumeError:
    todo = "; ".join(f"{fix.purpose}: {fix.fragment()}" for fix in fixes)
    return ResumeError(f"{what}: {todo}", fixes, what=what)


# What the derived quantities follow: a refusal names the user's keys, not only `<...>`.
PLAN_KEYS = (
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.limit_train_batches",
    *BATCH_SPLIT_KEYS,
)
RANKS = "nproc_per_node"  # the world size, as torchrun's flag names it


def user_differences(judgement: Judgement) -> list[Difference]:
    """Every config key that differs, whatever its verdict, plus the number of ranks."""
    found = [
        d
        for d in (
            *judgement.incompatible,
            *judgement.changes,
            *judgement.refused_changes,
            *judgement.harmless,
        )
        if not d.key.startswith("<")
    ]
    saved, now = judgement.saved, judgement.now
    if saved is not None and now is not None and saved.world_size != now.world_size:
        found.append(Difference(RANKS, saved.world_size, now.world_size, CHANGES_RUN))
    return found


def _line(d: Difference) -> str:
    return f"{RANKS} {d.saved} -> {d.now}" if d.key == RANKS else d.line()


def causes(derived: Difference, judgement: Judgement) -> list[Difference]:
    """The user's changes a derived difference (`<planned optimizer steps>`, ...) follows."""
    users = user_differences(judgement)
    if derived.key == "<planned optimizer steps>":
        return [d for d in users if d.key in (*PLAN_KEYS, RANKS)]
    if derived.key == "<global batch>":
        return [d for d in users if d.key in (*BATCH_SPLIT_KEYS, RANKS)]
    if derived.key == "<data fingerprint>":
        return [d for d in users if d.key.startswith("data.")]
    return []


def explained(differences: list[Difference], judgement: Judgement) -> str:
    """Each difference as the user's keys old -> new, a derived one with what it follows."""
    shown, lines = set(), []
    for d in differences:
        if not d.key.startswith("<"):
            continue
        found = causes(d, judgement)
        shown |= {c.key for c in found}
        keys = "; ".join(_line(c) for c in found)
        if d.key == "<planned optimizer steps>":
            schedule = judgement.now.config.get("scheduler.name", "lr") if judgement.now else "lr"
            why = f"the {schedule} schedule would span {d.now} optimizer steps, not {d.saved}"
        elif d.key == "<global batch>":
            why = (
                f"the global batch (data.batch_size x ranks x trainer.accumulate_grad_batches) "
                f"{d.saved} -> {d.now}"
            )
        else:
            why = "the data the weights were trained on changed"
        lines.append(f"{keys} ({d.key}: {why})" if keys else f"{d.key}: {why}")
    plain = [_line(d) for d in differences if not d.key.startswith("<") and d.key not in shown]
    return "; ".join(plain + lines)


def override_key(key: str) -> str:
    """The command-line key that sets a config key: a group's option for `<group>.name`."""
    group, _, leaf = key.partition(".")
    return group if leaf == "name" and group in GROUP_OPTIONS else key


GROUP_OPTIONS = (
    "data",
    "model",
    "optimizer",
    "scheduler",
    "precision",
    "trainer",
    "logger",
    "env",
    "debug",
)


def _as_saved(found: list[Difference], judgement: Judgement) -> Fix | None:
    """Every changed key back to the checkpoint's value (and the ranks it ran on)."""
    keys = [d for d in found if d.key != RANKS and d.saved != "<absent>"]
    ranks = next((d.saved for d in found if d.key == RANKS), None)
    if not keys and ranks is None:
        return None
    values = tuple((override_key(d.key), override_value(d.saved)) for d in keys)
    return Fix("to resume it as it was", values, world_size=ranks)


def _same_global_batch(judgement: Judgement) -> Fix | None:
    """On another number of ranks: the per-rank data.batch_size that keeps the global batch
    (and with it the schedule's length and the position in the epoch)."""
    saved, now = judgement.saved, judgement.now
    if saved is None or now is None or saved.world_size == now.world_size:
        return None
    per_rank, left = divmod(saved.global_batch, now.world_size * now.accumulate)
    if left or per_rank == now.batch_size:
        return None
    return Fix(
        f"to keep the global batch of {saved.global_batch} on {now.world_size} rank(s)",
        (("data.batch_size", str(per_rank)),),
    )


def incompatible_fixes(judgement: Judgement, source: str) -> list[Fix]:
    found = []
    for d in judgement.incompatible:
        found += causes(d, judgement) if d.key.startswith("<") else [d]
    fixes = [fix] if (fix := _same_global_batch(judgement)) is not None else []
    if (fix := _as_saved(found, judgement)) is not None:
        fixes.append(fix)
    new_run = ("resume", "resume_override")
    if any(d.key.startswith("model.") for d in found) or any(
        d.key == "<data fingerprint>" for d in judgement.incompatible
    ):  # the weights would not fit another model (or data): a fresh start
        fixes.append(Fix("for a new run", drop=new_run, same_run=False))
    else:  # init_from: the weights only, a new run (schedule, optimizer and steps start anew)
        fixes.append(
            Fix(
                "for a new run from these weights",
                (("init_from", override_value(source)),),
                new_run,
                None,
                False,
            )
        )
    return fixes


def change_fixes(judgement: Judgement) -> list[Fix]:
    refused = judgement.refused_changes
    keys = [d.key for d in refused if not d.key.startswith("<")]
    batch = next((d for d in refused if d.key == "<global batch>"), None)
    if batch is not None and not any(k in BATCH_SPLIT_KEYS for k in keys):
        keys.append("data.batch_size")  # approves the new global batch (other ranks)
    given = judgement.now.config.get("resume_override", []) if judgement.now else []
    listed = list(dict.fromkeys([*given, *keys]))
    fixes = [Fix("to apply it", (("resume_override", override_value(listed)),))]
    if batch is not None and (fix := _same_global_batch(judgement)) is not None:
        fixes.insert(0, fix)
    found = []
    for d in refused:
        found += causes(d, judgement) if d.key.startswith("<") else [d]
    if (fix := _as_saved(list({d.key: d for d in found}.values()), judgement)) is not None:
        fixes.append(fix)
    return fixes


def map_position(batch_in_epoch: int, saved: Contract, now: Contract, source: str) -> int:
    """The position inside an epoch in this run's batches, when the batch size or the number of
    ranks changed. Every epoch's order is one permutation, dealt to the ranks in turn, so what W
    ranks consumed after k batches of B is its first k*B*W samples: resumed on W' ranks with
    batches of B', each rank skips k*B*W / W' samples, which must be a whole number of B'
    batches, or the resume is refused (never a sample skipped or repeated)."""
    samples = batch_in_epoch * saved.batch_size * saved.world_size
    per_batch = now.batch_size * now.world_size
    if samples % per_batch:
        raise ResumeError(
            f"cannot resume {source} mid-epoch with {now.world_size} rank(s) x data.batch_size="
            f"{now.batch_size}: the checkpoint is {samples} samples into the epoch "
            f"({batch_in_epoch} batches of {saved.batch_size} on {saved.world_size} rank(s)), "
            "which is not a whole "
            f"number of batches of {per_batch} in all; use a batch size and rank count whose "
            f"product divides {samples}, or resume from an epoch-N.pt checkpoint"
        )
    return samples // per_batch
