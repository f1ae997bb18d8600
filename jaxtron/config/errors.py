"""The one exception every layer raises for bad user input; commands turn it into one line and exit
status 2 (jaxtron/lifecycle.py)."""


class ConfigError(ValueError):
    """A problem with the user's configuration; the message says what to change."""
