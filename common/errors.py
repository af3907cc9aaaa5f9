"""The one family of user-facing errors.

Everything a user can fix (a config key, a sharding plan, a malformed data line, a damaged
or missing checkpoint, an unreachable stream, a dense file with the wrong sha256) raises a
subclass of `DeltarecError` whose message is one actionable line. The entry points catch
this base class once and print the line; anything else is a bug and keeps its traceback.
Internal invariants are asserts, never these.

It lives below every other package (trainer, sharding, ckpt, launch all import it), so no
layer has to import another just to name an error.
"""

from __future__ import annotations


class DeltarecError(Exception):
    """A user-facing error; `str(exc)` is the one line to print."""


class ConfigError(DeltarecError, ValueError):
    """A config file or override that cannot be used: names the key and the file."""
