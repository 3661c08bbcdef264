"""The trainer's error for settings a user must fix (below every other trainer module, so that the
config, the families and the objectives can all raise it)."""


class ConfigError(ValueError):
    """A config problem the user must fix (the message lists every problem found)."""
