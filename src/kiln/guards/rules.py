"""The three rules every model is held to, by name: each guard message starts with its rule, so a
user can find it in the README ("### The antibodies")."""

RULE_1 = "rule 1 (shapes come from inputs)"
RULE_2 = "rule 2 (every optional loss branch has a flag and must work)"
RULE_3 = "rule 3 (train and eval must agree)"
DEVICES = "devices (one model, one device)"
LOGITS = "logits (the criterion takes raw scores, not probabilities)"
