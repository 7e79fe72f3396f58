"""UserError marks the mistakes a user can fix (a config value, a CSV row, a checkpoint path):
the command line prints them as one line, `error: <what> (<where>): <what to do>`, with exit code
2 and no traceback. Anything else is a bug in kiln or in a model, and keeps its traceback."""


class UserError(Exception):
    """Base of every user-fixable error class (mixed in beside ValueError, RuntimeError...)."""
