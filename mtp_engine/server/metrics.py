"""`GET /metrics` (serve --metrics, as llama-server's flag): Prometheus text from
`prometheus_client`, the format every scraper parses. One registry per server (not the library's
global one): two servers in one process count apart.

What is counted, when a request ends: requests by endpoint and status, prompt and generated
tokens, time to first token and time per output token, draft-mtp's drafts, drafted and accepted
tokens (also per draft position) and the draft lengths n-max auto chose; sampled when scraped: the
queue's depth and the busy slots.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ServerMetrics:
    """The counters of one server (see the module docstring)."""

    def __init__(self, waiting: Callable[[], int], running: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mtp_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mtp_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter("mtp_prompt_cached_tokens", "Prompt tokens taken from the prompt cache",
                                     registry=r)
        self.generated_tokens = Counter("mtp_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("mtp_time_to_first_token_seconds", "Time to first token per request",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("mtp_time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per request", buckets=_TPOT_BUCKETS, registry=r)
        self.drafts = Counter("mtp_spec_decode_drafts", "Speculative rounds that drafted", registry=r)
        self.draft_tokens = Counter("mtp_spec_decode_draft_tokens", "Tokens the MTP head drafted", registry=r)
        self.accepted_tokens = Counter("mtp_spec_decode_accepted_tokens", "Drafted tokens the trunk accepted",
                                       registry=r)
        self.position_drafted = Counter("mtp_spec_decode_draft_tokens_per_pos", "Drafted tokens by draft position",
                                        ["position"], registry=r)
        self.position_accepted = Counter("mtp_spec_decode_accepted_tokens_per_pos",
                                         "Accepted tokens by draft position", ["position"], registry=r)
        self.draft_length = Counter("mtp_spec_decode_auto_rounds", "Rounds by the draft length n-max auto chose",
                                    ["k"], registry=r)
        Gauge("mtp_queue_depth", "Requests waiting for a slot", registry=r).set_function(waiting)
        Gauge("mtp_busy_slots", "Slots generating now", registry=r).set_function(running)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def generation(self, stats: dict, prompt_tokens: int, completion_tokens: int) -> None:
        """A finished generation's figures (its `stats`, as the response's usage reads them)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(stats.get("cached_prompt_tokens", 0) or 0)
        self.generated_tokens.inc(completion_tokens)
        if completion_tokens:
            self.ttft.observe(stats.get("time_to_first_token_seconds", 0.0) or 0.0)
        tps = stats.get("decode_tokens_per_second") or 0.0
        if completion_tokens > 1 and tps > 0:
            self.tpot.observe(1.0 / tps)
        if "drafted" in stats:
            self.drafts.inc(stats.get("drafting_rounds", 0))
            self.draft_tokens.inc(stats["drafted"])
            self.accepted_tokens.inc(stats["accepted"])
            for i, (d, a) in enumerate(zip(stats.get("drafted_per_position", []),
                                           stats.get("accepted_per_position", []))):
                self.position_drafted.labels(str(i)).inc(d)
                self.position_accepted.labels(str(i)).inc(a)
            for k, n in (stats.get("draft_length_histogram") or {}).items():
                self.draft_length.labels(str(k)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
