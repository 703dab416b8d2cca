"""Kernel source as MLX receives it: comments and indentation stripped.

Why: `mx.fast.cuda_kernel` hashes a kernel's whole source on every launch to find its compiled
module (`std::hash` of the string: 3-8% of the host's time in a decode step on the H200, measured
with py-spy in docs/bench/host_profile_h200.txt), so every byte of commentary is paid per launch.
The sources in the modules stay commented; only what is handed to MLX is compacted.
"""
from __future__ import annotations


def compact(source: str) -> str:
    """`source` without `//` comments, leading/trailing blanks and empty lines (line structure is
    kept: preprocessor lines such as `#pragma unroll` stay lines). The sources have no string or
    character literals, which this would not respect."""
    lines = []
    for line in source.splitlines():
        code = line.split("//", 1)[0].strip()
        if '"' in code or "'" in code:
            raise ValueError(f"compact() does not parse literals; keep them out of kernel sources: {code}")
        if code:
            lines.append(code)
    return "\n".join(lines) + "\n"
