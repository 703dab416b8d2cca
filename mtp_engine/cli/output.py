"""What the commands print about a run: the one-line statistics and a model's name."""
from __future__ import annotations

import os


def format_stats(s: dict) -> str:
    """A generation's statistics (the `stats` of its last chunk) as one line for stderr."""
    cached = f" ({s['cached_prompt_tokens']} cached)" if s.get("cached_prompt_tokens") else ""
    line = (f"prompt: {s['prompt_tokens']} tok{cached}, {s['prompt_tokens_per_second']:.1f} tok/s | "
            f"decode: {s['generated_tokens']} tok, {s['decode_tokens_per_second']:.1f} tok/s | "
            f"peak memory: {s['peak_memory_bytes'] / 2**20:.1f} MiB")
    if "time_to_first_token_seconds" in s:
        line += f" | first token after {s['time_to_first_token_seconds']:.2f} s"
        if s.get("load_seconds"):
            line += f" (load {s['load_seconds']:.2f} s)"
        if s.get("compile_seconds"):
            line += f", compiling {s['compile_seconds']:.2f} s"
    if "rounds" in s and not s["drafted"]:  # "0/0 accepted (0.0%)" reads like a failure
        line += " | draft-mtp: no drafts"
    elif "rounds" in s:
        line += (f" | draft-mtp: {s['accepted']}/{s['drafted']} accepted ({s['acceptance_rate']:.1%}), "
                 f"{s['tokens_per_round']:.2f} tok/round")
    if s.get("auto_message"):  # why n-max auto did not draft, once per run
        line += f" | {s['auto_message']}"
    return line


def model_label(path: str | None) -> str:
    """How progress lines and messages name a model: its file or folder name."""
    return os.path.basename(os.path.normpath(path)) if path else "the model in models/"
