"""A finding is data, not prose. What a check found is a record -- its kind, the evidence, the
module, the fix for this very case -- that the run directory keeps (`findings.json`) and `kiln
triage` ranks from; nothing is recovered from a message's wording, so rewording a message loses
no advice. KINDS is the one table of what each kind of finding means and what to do about it:
the [FAIL] line's `<what>`, triage's titles and advice and docs/checks.md all read it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FINDINGS_FILE = "findings.json"


@dataclass(frozen=True)
class Kind:
    title: str  # what it means, as triage says it
    advice: str  # what to do, where a finding brings no fix of its own
    section: str  # where docs/antibodies.md explains it


KINDS: dict[str, Kind] = {
    "shapes": Kind(
        "a size that does not follow the input, or train and eval disagreeing",
        "read sizes from the input (x.shape) or the data spec, never literals in forward; "
        "return the same structure in both modes",
        "rule 1 / rule 3",
    ),
    "memory layout": Kind(
        "a .view of memory it cannot view",
        "use .reshape(...) (or .contiguous().view(...)) where the message says",
        "checks of what a model computes",
    ),
    "loss branches": Kind(
        "a loss branch that does not work",
        "fix or switch off the branch the message names (its loss.<flag>)",
        "rule 2",
    ),
    "probabilities": Kind(
        "a softmax head: the model returns probabilities where the criterion expects logits",
        "remove the final softmax: kiln's cross-entropy applies log_softmax itself, and "
        "inference turns logits into probabilities",
        "logits, not probabilities",
    ),
    "batch dependence": Kind(
        "samples leak across the batch",
        "make each sample's output depend on that sample alone: transpose/permute where a .view "
        "regrouped the batch, batch_first=True for a recurrent layer fed (N, L, D), statistics "
        "over features instead of dim 0, no state kept on self",
        "batch dependence",
    ),
    "determinism": Kind(
        "evaluation is not deterministic",
        "switch randomness off in eval mode (F.dropout(..., training=self.training), noise only "
        "under self.training) and keep no state on self that forward updates",
        "determinism",
    ),
    "purity": Kind(
        "the forward changes the batch in place",
        "work on copies in forward and in the loss (x = x / s, not x /= s; clone() a target "
        "before rescaling it)",
        "purity",
    ),
    "dead gradients": Kind(
        "dead gradients",
        "reconnect what the message names: a zero that never learns, a detached tensor, an "
        "initialisation that keeps every ReLU off",
        "dead gradients",
    ),
    "conditional parameters": Kind(
        "parameters used only in some steps",
        "trainer.find_unused_parameters=true (DDP then looks for unused parameters in every "
        "step), or compute the module in every step and let the condition weight its output",
        "dead gradients",
    ),
    "cannot learn": Kind(
        "the model cannot lower the loss of one batch",
        "fix what the learn probe saw (its message says what moved and what did not)",
        "cannot learn",
    ),
    "learning rate diverges": Kind(
        "the learning rate diverges on one batch",
        "lower optimizer.lr (the finding's fix is one the learn probe's steps lowered the loss "
        "with, where it found one)",
        "cannot learn",
    ),
    "device": Kind(
        "a tensor a GPU run would have on the CPU",
        "create it with device=x.device (or x.new_zeros), or register it as a buffer",
        "device",
    ),
    "numerics": Kind(
        "non-finite values before step 1",
        "fix the module the message names (a division by a value that can be 0, a constant "
        "beyond the dtype's range)",
        "numerics",
    ),
    "fp16 overflow": Kind(
        "fp16 overflow (found by the fp16 probe)",
        "precision=bf16 (fp32's range, no loss scaling), or keep that module in fp32",
        "fp16",
    ),
    "padding": Kind(
        "the output depends on padding: the same text alone and padded beside a longer one "
        "give different outputs",
        "leave padding out of every sum and mean (sum(h * mask) / mask.sum(), mask = ids != "
        "pad_id), pass key_padding_mask True where a token is padding, and take softmaxes over "
        "the sequence, never over the batch",
        "batch dependence",
    ),
    "split leak": Kind(
        "the same examples in the training split and in the validation or test split",
        "give each split examples of its own (another file or folder, or deduplicate before "
        "splitting); data.max_split_overlap sets how much overlap beyond the data's own "
        "repetition stops a run",
        "split hygiene",
    ),
    "class map": Kind(
        "the splits map the classes to different indices",
        "build every split's labels from the training split's class-to-index map",
        "split hygiene",
    ),
    "box convention": Kind(
        "detection targets in another box or label convention than the detectors take",
        "give boxes as (x1, y1, x2, y2) pixels of their image and labels 1..C (0 is the "
        "background)",
        "box conventions",
    ),
    "box predictions": Kind(
        "the first evaluation's boxes are degenerate, or fit the targets better flipped or "
        "converted",
        "check the dataset's transforms move boxes with their images (a flip flips both) and "
        "that boxes are (x1, y1, x2, y2) pixels everywhere",
        "box conventions",
    ),
    "schedule": Kind(
        "the learning-rate schedule does not fit the run",
        "fit the warm-up and decay to the planned steps (scheduler.warmup_steps, "
        "trainer.max_epochs), or early stopping's patience to the warm-up",
        "schedule sanity",
    ),
    "optimizer coverage": Kind(
        "parameters the optimizer never updates",
        "create every layer in __init__ (nn.LazyLinear where a size is known only at the first "
        "call), never replace a parameter once the optimizer is built, and tie weights by "
        "sharing one nn.Parameter, not a clone",
        "the optimizer sees every parameter",
    ),
}


@dataclass(frozen=True)
class Finding:
    kind: str  # a key of KINDS
    evidence: str  # what was seen: the check's message
    module: str = ""  # the module it names ("" for none)
    fix: str = ""  # the fix for this case (an override where there is one); "" -> the advice
    fatal: bool = True  # it stopped the run (else it was said and the run went on)
    step: int = 0  # the step it was found at (0: before step 1)

    @property
    def title(self) -> str:
        return KINDS[self.kind].title if self.kind in KINDS else self.kind

    @property
    def advice(self) -> str:
        return self.fix or (KINDS[self.kind].advice if self.kind in KINDS else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**fields)


def finding_of(err: BaseException, step: int = 0) -> Finding | None:
    """The finding a check's error carries (a ProbeFailure's kind, module and fix: a check's
    errors have a `what` for the [FAIL] line and a `kind`); None for an error that is no
    check's."""
    kind = getattr(err, "kind", None)
    if not isinstance(getattr(err, "what", None), str) or not isinstance(kind, str) or not kind:
        return None
    return Finding(
        kind=kind,
        evidence=str(err),
        module=getattr(err, "module", "") or "",
        fix=getattr(err, "fix", "") or "",
        step=step,
    )


def write_findings(run_dir: Path, findings: list[Finding]) -> None:
    from kiln.atomic import write_json

    write_json(Path(run_dir) / FINDINGS_FILE, [f.to_dict() for f in findings], indent=1)


def read_findings(run_dir: Path) -> list[Finding]:
    """The run's findings; none where it has no (readable) file."""
    try:
        data = json.loads((Path(run_dir) / FINDINGS_FILE).read_text())
        return [Finding.from_dict(item) for item in data if isinstance(item, dict)]
    except (OSError, ValueError, TypeError, KeyError):
        return []
