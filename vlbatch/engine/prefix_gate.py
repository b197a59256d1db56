"""A page's later tasks enter vLLM once the page's first task has begun to decode.

Several questions about one page share its image in vLLM's prefix cache only if a later
task's request is scheduled after the first task's image tokens hold KV blocks: vLLM looks
the prefix up once, when a request leaves its waiting queue. Added together, a page's
requests can leave the queue before any of the page's image blocks exists: when a step's
encoder budget or cache has no room for an image, vLLM admits a waiting request with only
the few tokens before its image, and once running it never looks again, so it computes the
page's whole image prefix itself. Measured on vLLM's CPU build (60 pages of 1,280 image
tokens, four tasks a page, added at once): 28% of prompt tokens came from the prefix
cache, against the 74% that sharing gives (every later task's image); on an H100 with W3
(400 pages), 8% (docs/benchmarks.md).

So the page's first request (its lead) goes in alone, with per-step outputs (vLLM's
CUMULATIVE kind, not FINAL_ONLY); its first output means its prefill is done and its blocks
are cached, held by a running request. Only then do the page's other requests enter, and
each finds the image's blocks. The engine stays busy meanwhile with other pages.

A new page waits while `engine.max_pages_starting` leads are in vLLM without an output.
Unbounded, every page's lead queued at once ahead of all later tasks (vLLM schedules first
come, first served): the KV cache filled with leads, each holding a whole image, and a
page's later tasks could wait until its lead had finished, its blocks evicted or not.

On an H100 (2026-12-07, W3: 400 pages, four questions, 256 tokens each, fp8 KV cache of
218,768 tokens) it ran 28.32 requests/s with at most 64 leads starting, against 23.56 with a
page's tasks together (1.20x); vLLM served 1,448,544 prompt tokens from its prefix cache
against 193,392. The bound matters: 32 gave 26.40, 128 gave 18.22 (327 later tasks sent
their pixels again: their image had left the mirrored half of vLLM's receiver cache while
they waited, PixelsOnce), and with no bound (a session before) it ran 0.92x of together.
"""

from __future__ import annotations


class PrefixGate:
    """Which requests lead their page, and the requests held back until their lead's first
    output. Used on the thread that adds requests and steps the engine."""

    def __init__(self, enabled: bool, max_starting: int):
        self.enabled = enabled
        self.max_starting = max_starting
        self.starting = 0  # leads taken from the feed whose first output has not come
        # a lead in the engine, not yet decoding: its page and the page's requests held back
        self._held: dict[str, tuple[int, list]] = {}
        self._lead_of: dict[int, str] = {}  # page: its lead while that lead is in _held
        self.held_total = 0  # requests that waited for their lead

    def leads(self, joins_last_page: bool, page_requests: int) -> bool:
        """Whether a request taken from the feed leads its page: the first of a page with
        others to follow (a page's only request needs no per-step outputs)."""
        lead = self.enabled and not joins_last_page and page_requests > 1
        self.starting += lead
        return lead

    def full(self) -> bool:
        """Whether a new page waits: max_starting pages' leads are not yet decoding. Few
        leads queue in vLLM ahead of a page's later tasks, so those are scheduled while the
        lead still holds its image's blocks, and they take little KV cache of their own."""
        return self.enabled and self.starting >= self.max_starting

    def refused(self) -> None:
        """The engine refused a lead: its page's later tasks enter as they come."""
        self.starting -= 1

    def lead_added(self, request_id: str, page: int) -> None:
        """The lead is in the engine: its page's next requests wait for its first output."""
        self._held[request_id] = (page, [])
        self._lead_of[page] = request_id

    def hold(self, page: int, item) -> bool:
        """Keeps `item` (a later request of `page`) back while the page's lead is not yet
        decoding; False when it may enter now."""
        lead = self._lead_of.get(page)
        if lead is None:
            return False
        self._held[lead][1].append(item)
        self.held_total += 1
        return True

    def is_waited_on(self, request_id: str) -> bool:
        return request_id in self._held

    def started(self, request_id: str) -> list:
        """The lead gave an output (its prefill is done) or ended: what its page held back,
        in the order it was taken, to enter now."""
        if request_id not in self._held:
            return []
        page, held = self._held.pop(request_id)
        self.starting -= 1
        del self._lead_of[page]
        return held
