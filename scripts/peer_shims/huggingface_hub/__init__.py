"""Stand-in for `huggingface_hub` (see ../README.md): nothing may download here anyway."""


def snapshot_download(*a, **k):
    raise RuntimeError("huggingface_hub is not installed here (a benchmark stand-in was imported)")


def scan_cache_dir(*a, **k):
    raise RuntimeError("huggingface_hub is not installed here (a benchmark stand-in was imported)")
