"""Generated text corpora, so text training, tests and benchmarks work offline.

`demo_corpus`: 576 one-line sentences in four topics (data=csv_text with train_path=null).

`ticket_rows` / `write_ticket_csv`: a realistic stand-in for a real corpus -- short, technical,
multi-line issue-tracker tickets in 12 components. Components come in confusable pairs that share
their words (database/storage, networking/api, ...): within a pair single words say little, the
word pairs ("replica lag" vs "lag replica" are different tickets) say more, and every ticket also
mentions phrases of other components and carries a few mislabelled rows. So no classifier reaches
100%, a bag of words is beaten by word n-grams, and the texts need cleaning (HTML, entities,
irregular whitespace). Paths, hosts, request ids, stack frames and module names give the long
tail of distinct tokens a real tracker has (tens of thousands in 30,000 tickets)."""

from __future__ import annotations

import csv
import itertools
import random
from collections.abc import Iterator
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# The small demo corpus

_DEMO_TOPICS: dict[str, tuple[list[str], list[str], list[str]]] = {
    # topic: (templates, subjects, details); every sentence is template.format(s=..., d=...)
    "sports": (
        [
            "the {s} won the match {d}",
            "fans cheered as the {s} scored {d}",
            "the coach said the {s} trained hard {d}",
            "a late goal by the {s} {d}",
        ],
        ["home team", "striker", "goalkeeper", "visiting side", "captain", "young midfielder"],
        [
            "in the final minute",
            "after a long season",
            "at the stadium",
            "before the break",
            "despite the rain",
            "in extra time",
        ],
    ),
    "weather": (
        [
            "heavy {s} is expected {d}",
            "the forecast warns of {s} {d}",
            "residents prepared for {s} {d}",
            "a band of {s} moved north {d}",
        ],
        ["rain", "snow", "wind", "fog", "thunder storms", "sunshine"],
        [
            "over the weekend",
            "along the coast",
            "in the mountains",
            "by the evening",
            "across the valley",
            "until tuesday",
        ],
    ),
    "cooking": (
        [
            "stir the {s} slowly {d}",
            "season the {s} with salt {d}",
            "bake the {s} in a hot oven {d}",
            "the recipe calls for fresh {s} {d}",
        ],
        ["onions", "tomato sauce", "bread dough", "garlic", "chicken", "mushrooms"],
        [
            "for ten minutes",
            "until golden",
            "with a little butter",
            "before serving",
            "in a heavy pan",
            "over low heat",
        ],
    ),
    "technology": (
        [
            "the new {s} ships {d}",
            "engineers updated the {s} {d}",
            "users reported a bug in the {s} {d}",
            "the company released a faster {s} {d}",
        ],
        ["laptop", "phone app", "graphics card", "database", "web browser", "compiler"],
        [
            "next month",
            "with better battery life",
            "after the security review",
            "for developers",
            "in the latest release",
            "on every platform",
        ],
    ),
}
DEMO_SHUFFLE_SEED = 1234  # the demo corpus never changes between runs


def demo_corpus() -> tuple[list[str], list[str]]:
    """576 short sentences, 144 for each of four topics: (texts, labels), deterministic."""
    rows = []
    for topic, (templates, subjects, details) in _DEMO_TOPICS.items():
        for template, subject, detail in itertools.product(templates, subjects, details):
            rows.append((template.format(s=subject, d=detail), topic))
    rng = random.Random(DEMO_SHUFFLE_SEED)
    rng.shuffle(rows)
    texts, labels = zip(*rows, strict=True)
    return list(texts), list(labels)


# ---------------------------------------------------------------------------------------------
# Issue-tracker tickets


def _words(text: str) -> list[str]:
    return text.split()


# Each pair of components shares one word pool; a component's phrases are word pairs drawn from
# its pair's pool, disjoint from the partner's phrases.
_PAIR_WORDS: dict[tuple[str, str], list[str]] = {
    ("database", "storage"): _words(
        "disk query index table volume snapshot replica backup lock quota write read block "
        "shard compaction vacuum"
    ),
    ("networking", "api"): _words(
        "dns route socket gateway proxy endpoint request header payload latency packet port "
        "retry handshake schema version"
    ),
    ("authentication", "security"): _words(
        "token session password login certificate key audit permission role policy secret "
        "scan rotation expiry mfa cookie"
    ),
    ("frontend", "mobile"): _words(
        "button layout screen render font scroll tap gesture page view theme modal keyboard "
        "image widget navigation"
    ),
    ("build", "deployment"): _words(
        "pipeline artifact image container release rollout cache dependency compile test "
        "manifest helm cluster stage tag runner"
    ),
    ("performance", "monitoring"): _words(
        "cpu memory latency alert dashboard metric trace heap spike threshold profile sample "
        "graph leak throughput percentile"
    ),
}
TICKET_CLASSES: tuple[str, ...] = tuple(c for pair in _PAIR_WORDS for c in pair)
PHRASES_PER_CLASS = 40

_TITLES = [
    "{p} fails after upgrade to {ver}",
    "{p} broken on {env}",
    "intermittent {p} errors",
    "{p} times out under load",
    "cannot {verb} the {p}",
    "{p} regression since {ver}",
    "unexpected {p} behaviour in {env}",
    "{p} not working for some users",
]
_DETAILS = [
    "Steps to reproduce: {verb} the {p} and wait a few minutes.",
    "Seen in {env} since {ver}; the {p} returns {err}.",
    "Logs show {err} right after the {p} starts.",
    "Expected the {p} to finish, but it hangs at {pct}%.",
    "Workaround: restart the {p}, then {verb} it again.",
    "Happens about {pct}% of the time when the {p} is busy.",
    "The {p} worked in {ver} and broke in the next build.",
    "Customer reports the {p} is slow; {err} appears in the console.",
    "Related to the {p} change from last sprint?",
    "Could be the {p}. We also saw {err} on {env}.",
]
_VERBS = ["open", "update", "restart", "configure", "reload", "check", "rebuild", "reset"]
_ENVS = ["staging", "prod-eu", "prod-us", "k8s 1.29", "ubuntu 22.04", "windows 11", "macos 14"]
_ERRORS = [
    "HTTP 500",
    "HTTP 503",
    "ECONNRESET",
    "NullPointerException",
    "TimeoutError",
    "exit code 137",
    "OOMKilled",
    "permission denied",
    "ValueError: bad input",
]


# The long tail real tickets have: identifiers, paths, hosts, request ids, stack frames. Names
# are built from syllables, so a corpus has tens of thousands of distinct tokens (as a real one
# does); each component also has its own module names, which a classifier can learn.
_SYLLABLES = _words(
    "ac al an ar as at ba be bi bo ca ce ci co da de di do el em en er es et fa fe fi fo ga ge "
    "gi go ha he hi ho ib ic id il im in io ir is it ka ke ki ko la le li lo lu ma me mi mo mu "
    "na ne ni no nu ob oc od ol om on op or os ot pa pe pi po pu ra re ri ro ru sa se si so su "
    "ta te ti to tu ub ul um un ur us va ve vi vo za ze zi zo"
)
_LONG_TAIL = [
    "see {path}:{n}",
    "request id {rid}, host {host}",
    "at {pkg}.{Ident}.{ident}({Ident}.java:{n})",
    "{ident}() raised {Ident}Error: {ident} is None",
    "cc @{user} who touched {path} last week",
    "log: {ts} {host} {Ident}Worker {ident} took {n} ms",
]
MODULES_PER_CLASS = 40


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts))


def _identifier(rng: random.Random) -> str:
    return "_".join(_name(rng, rng.randint(1, 3)) for _ in range(rng.randint(1, 3)))


def _long_tail_line(rng: random.Random, modules: list[str]) -> str:
    module = rng.choice(modules)
    return rng.choice(_LONG_TAIL).format(
        path=f"src/{module}/{_identifier(rng)}.py",
        n=rng.randint(1, 2000),
        rid=f"{rng.getrandbits(32):08x}",
        host=f"{_name(rng, 2)}-{rng.randint(1, 40)}.{rng.choice(_ENVS).split()[0]}.internal",
        pkg=f"com.acme.{module}",
        Ident=_name(rng, 3).capitalize(),
        ident=_identifier(rng),
        user=_name(rng, 2),
        ts=f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
        f"{rng.randint(0, 59):02d}Z",
    )


def _class_phrases(seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    phrases = {}
    for (a, b), words in _PAIR_WORDS.items():
        pairs = [f"{x} {y}" for x, y in itertools.permutations(words, 2)]
        rng.shuffle(pairs)
        phrases[a] = pairs[:PHRASES_PER_CLASS]
        phrases[b] = pairs[PHRASES_PER_CLASS : 2 * PHRASES_PER_CLASS]
    return phrases


def _partner(label: str) -> str:
    for a, b in _PAIR_WORDS:
        if label in (a, b):
            return b if label == a else a
    raise KeyError(label)


def _html(lines: list[str], rng: random.Random) -> str:
    """About one ticket in six is pasted from a web form: tags, <br>, entities."""
    style = rng.random()
    if style < 0.08:
        return "<p>" + "</p>\n<p>".join(lines) + "</p>"
    if style < 0.14:
        return "<br>".join(line.replace(" and ", " &amp; ") for line in lines)
    return "\n".join(lines)


def ticket_rows(
    num_rows: int,
    seed: int = 0,
    *,
    own_share: float = 0.8,
    partner_share: float = 0.12,
    label_noise: float = 0.03,
) -> Iterator[tuple[str, str]]:
    """(text, label) rows: a title line and 1-4 detail lines. Each phrase comes from the ticket's
    own component with probability own_share, from its confusable partner with partner_share,
    from any component otherwise; label_noise of the rows carry a random label."""
    phrases = _class_phrases(seed)
    rng = random.Random(seed)
    modules = {c: [_identifier(rng) for _ in range(MODULES_PER_CLASS)] for c in TICKET_CLASSES}
    for _ in range(num_rows):
        label = rng.choice(TICKET_CLASSES)

        def phrase(label=label) -> str:
            draw = rng.random()
            if draw < own_share:
                source = label
            elif draw < own_share + partner_share:
                source = _partner(label)
            else:
                source = rng.choice(TICKET_CLASSES)
            return rng.choice(phrases[source])

        fill = {
            "verb": rng.choice(_VERBS),
            "env": rng.choice(_ENVS),
            "err": rng.choice(_ERRORS),
            "ver": f"v{rng.randint(1, 4)}.{rng.randint(0, 12)}.{rng.randint(0, 9)}",
            "pct": rng.randint(2, 95),
        }
        lines = [rng.choice(_TITLES).format(p=phrase(), **fill).capitalize()]
        for template in rng.sample(_DETAILS, rng.randint(1, 4)):
            lines.append(template.format(p=phrase(), **fill))
        for _ in range(rng.choice((0, 1, 1, 2))):  # module names: mostly the ticket's own
            owner = label if rng.random() < own_share else rng.choice(TICKET_CLASSES)
            lines.insert(rng.randint(1, len(lines)), _long_tail_line(rng, modules[owner]))
        if rng.random() < label_noise:
            label = rng.choice(TICKET_CLASSES)
        yield _html(lines, rng), label


def write_ticket_csv(path: str | Path, num_rows: int, seed: int = 0, **kwargs) -> Path:
    """Writes `text,label` rows (multi-line texts quoted, as any CSV writer does)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(ticket_rows(num_rows, seed, **kwargs))
    return path
