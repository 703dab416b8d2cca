"""The installed distribution's version (pyproject.toml), one source of truth."""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("mtp-engine")
except _metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
