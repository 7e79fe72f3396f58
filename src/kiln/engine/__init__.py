"""The training engine: a small Trainer class with explicit calls, plus the pieces it is made of."""
