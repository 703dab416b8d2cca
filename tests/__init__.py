"""mtp-engine's tests; a package, so that their helpers import as `tests.<module>`."""
