"""The one error type of configuration: a file, override or value that cannot be used.

Its own module so that everything that checks a setting (`shared.config` loading, `shared.auth`
bind checks, `shared.run_config` validators, backends) can raise it without importing the loader.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file, override or value that cannot be used; the message names the key."""
