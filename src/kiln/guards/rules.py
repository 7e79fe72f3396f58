"""The rules and checks every model is held to, by name: each guard message starts with its rule
or check, so a user can find it in docs/antibodies.md, and the run's [FAIL] line
names the check that stopped it (`<what>`: shapes, numerics, batch dependence, ...)."""

RULE_1 = "rule 1 (shapes come from inputs)"
RULE_2 = "rule 2 (every optional loss branch has a flag and must work)"
RULE_3 = "rule 3 (train and eval must agree)"
DEVICES = "devices (one model, one device)"
LOGITS = "logits (the criterion takes raw scores, not probabilities)"
NUMERICS = "numerics (every value the probes meet is finite)"
BATCH = "batch dependence (a sample's output depends on that sample alone)"
DETERMINISM = "determinism (an eval forward is a function of its batch)"
PURITY = "purity (forward and loss leave the batch as they found it)"
DEAD = "dead gradients (every trainable parameter gets a gradient, in every step)"
LEARN = "cannot learn (a few steps on one fixed batch must lower its loss)"
LAYOUT = "memory layout (.view needs memory it can view)"
PADDING = "padding (a text's output does not depend on its padding)"
COVERAGE = "optimizer coverage (every trainable parameter is one the optimizer holds)"


class ProbeFailure(RuntimeError):
    """A check before step 1 (or a guard during the run) refused the model. `what` is the
    check's name in the run's [FAIL] line; `module` the module path it names ("" for none);
    `kind` the finding's kind (kiln.findings.KINDS: what it means, what to do; `what`
    where not given) and `fix` the fix for this very case, where the check knows one (an
    override): what `kiln triage` reads, never the message's wording."""

    what = "probe"
    kind = ""

    def __init__(
        self,
        message: str,
        module: str = "",
        what: str | None = None,
        *,
        kind: str | None = None,
        fix: str = "",
    ):
        super().__init__(message)
        self.module = module
        if what is not None:
            self.what = what
        self.kind = kind or type(self).kind or self.what
        self.fix = fix
