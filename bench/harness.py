"""The benchmark (moving into modules)."""

from bench.end_to_end import *  # noqa: F403
from bench.end_to_end import _preload_events, _vacuum  # noqa: F401
