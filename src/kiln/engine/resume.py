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

from kiln.engine.checkpointer import ResumeError

log = logging.getLogger(__name__)

INCOMPATIBLE, CHANGES_RUN, HARMLESS = "incompatible", "changes the run", "harmless"
# Longest matching prefix wins; keys matching nothing change the run (the safe default).
RULES: dict[str, str] = {
    "model.": INCOMPATIBLE,
    "data.name": INCOMPATIBLE,
    "optimizer.name": INCOMPATIBLE,
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


def rule_for(key: str) -> str:
    matches = [p for p in RULES if key == p or (p.endswith(".") and key.startswith(p))]
    return RULES[max(matches, key=len)] if matches else CHANGES_RUN


def judge(saved: Contract, now: Contract, overrides: list[str]) -> Judgement:
    judgement = Judgement()

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
        old, new = saved.config.get(key, "<absent>"), now.config.get(key, "<absent>")
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
    """Raises ResumeError for incompatible or unapproved changes; logs the rest."""
    fresh = "or start a new run (drop resume=, or pass another hydra.run.dir)"
    if judgement.incompatible:
        lines = "; ".join(d.line() for d in judgement.incompatible)
        raise ResumeError(
            f"cannot resume {source} with this config: {lines}. These change what the saved "
            f"state means; resume with the run's values, {fresh}"
        )
    if judgement.refused_changes:
        lines = "; ".join(d.line() for d in judgement.refused_changes)
        keys = ",".join(d.key for d in judgement.refused_changes if not d.key.startswith("<"))
        raise ResumeError(
            f"resuming {source} with {lines} would change the run; to apply it, add "
            f"resume_override=[{keys}], {fresh}"
        )
    for difference in judgement.changes:
        log.warning("resume_override: applying %s", difference.line())
    if judgement.harmless:
        log.info(
            "resume: accepted harmless changes: %s",
            "; ".join(d.line() for d in judgement.harmless),
        )


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
