"""The engine thread's feed (engine/vllm_engine.py): what it hands vLLM at once, counted by
page, and the pixels a page's later requests leave out (engine/vllm_frontend.py). A fake
LLMEngine records what it is handed; tests/test_e2e_vllm.py runs the same code on vLLM."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from PIL import Image

from conftest import job_fields
from vlbatch.engine.base import Request
from vlbatch.engine.vllm_frontend import PixelsOnce
from vlbatch.job import Job


class RecordingEngine:
    """Each step, every request it holds makes a token; the oldest finishes. A request with
    per-step outputs (params "each step", a page's lead) reports each token, the others
    only their end, as vLLM's output kinds do. Records how many requests and pages it held
    at once, and the order of what it was handed and reported."""

    def __init__(self, page_of: dict[str, int]):
        self.page_of = page_of
        self.held: list[str] = []
        self.each_step: set[str] = set()
        self.events: list[tuple[str, str]] = []  # ("added" | "output", request id)
        self.most_requests = self.most_pages = 0

    def add_request(self, request_id, prompt, params):
        self.held.append(request_id)
        self.events.append(("added", request_id))
        if params == "each step":
            self.each_step.add(request_id)
        self.most_requests = max(self.most_requests, len(self.held))
        self.most_pages = max(self.most_pages, len({self.page_of[r] for r in self.held}))

    def step(self):
        done = self.held.pop(0)
        outputs = [SimpleNamespace(finished=False, request_id=r) for r in self.held
                   if r in self.each_step]
        outputs.append(SimpleNamespace(
            finished=True, request_id=done, prompt_token_ids=[1, 2],
            outputs=[SimpleNamespace(text=f"answer {done}", token_ids=[3],
                                     finish_reason="stop")]))
        self.events += [("output", o.request_id) for o in outputs]
        return outputs


def feed_engine(max_in_flight: int, tasks: int, pages: int, share_image_prefix: bool = True,
                max_pages_starting: int = 32, requests_a_page: int | None = None):
    from vlbatch.engine.vllm_engine import VllmEngine

    job = Job.model_validate(job_fields("m", ["x/*"], tasks=[
        {"name": f"t{i}", "prompt": "p"} for i in range(tasks)]))
    job = job.model_copy(update={"engine": job.engine.model_copy(
        update={"frontend_threads": 0, "max_in_flight": max_in_flight,
                "share_image_prefix": share_image_prefix,
                "max_pages_starting": max_pages_starting})})
    requests, page_of = [], {}
    for p in range(pages):
        image = Image.new("RGB", (8, 8), (p, 0, 0))  # one image object a page, as the pipeline
        for task in job.tasks[:requests_a_page]:  # None: all the job's tasks
            requests.append(Request(f"{p}-{task.name}", image, "q", task,
                                    page_requests=requests_a_page or len(job.tasks)))
            page_of[f"{p}-{task.name}"] = p
    engine = object.__new__(VllmEngine)
    engine.job, engine.max_in_flight, engine._pixels = job, max_in_flight, None
    engine._thread_failures = {}
    engine.sampling_params = lambda task, retry=False, lead=False: \
        "each step" if lead else "at the end"
    engine.vllm_prompt = lambda request: {"prompt": request.text}
    fake = RecordingEngine(page_of)
    engine.llm = SimpleNamespace(llm_engine=fake)
    done = list(engine.generate(iter(requests)))
    return fake, done, requests


def test_max_in_flight_counts_a_page_once_however_many_tasks_ask_about_it():
    fake, done, requests = feed_engine(max_in_flight=2, tasks=4, pages=5,
                                       share_image_prefix=False)
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in requests)
    assert all(c.text == f"answer {c.request_id}" for c in done)
    assert fake.most_pages == 2  # the bound, in pages
    assert fake.most_requests == 8  # a page's four tasks together, not split by the bound
    fake, done, _ = feed_engine(max_in_flight=3, tasks=1, pages=6)
    assert (fake.most_pages, fake.most_requests, len(done)) == (3, 3, 6)


def test_a_pages_later_tasks_enter_once_its_first_task_has_an_output():
    """prefix_gate.py: a page's first request has outputs at each step; the page's other
    requests are handed to the engine only after its first output (its prefill done), in
    order, and every request still ends once."""
    fake, done, requests = feed_engine(max_in_flight=2, tasks=3, pages=4)
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in requests)
    assert all(c.text == f"answer {c.request_id}" for c in done)
    assert fake.each_step == {f"{p}-t0" for p in range(4)}  # the leads only
    assert fake.most_pages == 2
    added = [r for kind, r in fake.events if kind == "added"]
    for p in range(4):
        first_output = fake.events.index(("output", f"{p}-t0"))
        later = [fake.events.index(("added", f"{p}-t{t}")) for t in (1, 2)]
        assert all(at > first_output for at in later), (p, fake.events)
        assert added.index(f"{p}-t1") < added.index(f"{p}-t2")
    # a page with one request to generate (its other answers cached): no per-step outputs
    fake, done, _ = feed_engine(max_in_flight=2, tasks=3, pages=4, requests_a_page=1)
    assert len(done) == 4 and not fake.each_step
    # off (or one task a page): a page's requests go in together, none with per-step outputs
    fake, _, _ = feed_engine(max_in_flight=2, tasks=3, pages=4, share_image_prefix=False)
    assert not fake.each_step and fake.events[:3] == [("added", f"0-t{t}") for t in range(3)]


def test_a_new_page_waits_while_max_pages_starting_leads_have_no_output():
    """With the hold, at most max_pages_starting leads are in the engine without an output,
    so a page's later tasks queue behind few other pages; max_in_flight still bounds pages."""
    fake, done, requests = feed_engine(max_in_flight=8, tasks=2, pages=6, max_pages_starting=2)
    assert len(done) == len(requests) == 12
    leads = {f"{p}-t0" for p in range(6)}
    most, added, output = 0, set(), set()
    for kind, r in fake.events:
        (added if kind == "added" else output).add(r)
        most = max(most, len((added & leads) - output))
    assert most == 2
    # the bound is what held them: without it all six leads are in before any output
    fake, _, _ = feed_engine(max_in_flight=8, tasks=2, pages=6, max_pages_starting=32)
    assert [r for kind, r in fake.events[:6]] == [f"{p}-t0" for p in range(6)]


# the fields of vLLM's MultiModalFeatureSpec (a dataclass) that PixelsOnce reads
FeatureSpec = dataclasses.make_dataclass("FeatureSpec", ["data", "modality", "identifier",
                                                         "mm_hash"])


def make(key: str | None):
    """A processed request of the image `key` (None: text only)."""
    import torch

    data = {"pixel_values": SimpleNamespace(data=torch.zeros(4))}
    return SimpleNamespace(mm_features=[FeatureSpec(data, "image", key, key)] if key else None)


def test_pixels_are_left_out_only_right_after_the_core_received_that_image(monkeypatch):
    import vlbatch.engine.vllm_frontend as frontend

    monkeypatch.setattr(frontend, "_item_bytes", lambda item: 100)
    pixels = PixelsOnce(capacity=1000)

    def send(r):
        stripped = pixels.strip(r)
        pixels.added(r, stripped)
        return r.mm_features[0].data is None if r.mm_features else None

    assert send(make("a")) is False  # the first of a page carries its pixels
    assert send(make("a")) is True and send(make("a")) is True  # its later tasks do not
    assert send(make(None)) is None  # a text-only request leaves the core's cache as it was
    assert send(make("a")) is True
    # other pages' images in between: "a" is still held while the images since it and it
    # fit half the core's cache (a margin); the oldest go first, as in the core's LRU
    assert send(make("b")) is False and send(make("a")) is True  # "a" is newest again
    for key in "cde":
        assert send(make(key)) is False
    assert send(make("a")) is True  # b, c, d, e, a: 500 bytes, half of 1000
    assert send(make("f")) is False  # b leaves the mirror
    assert send(make("b")) is False and send(make("c")) is False  # c left when b came back
    assert send(make("a")) is True
    assert pixels.sent_without == 6
    # a failed add: the data is put back and nothing is assumed
    r = make("a")
    stripped = pixels.strip(r)
    assert stripped is not None and r.mm_features[0].data is None
    pixels.failed(r, stripped)
    assert r.mm_features[0].data is not None and send(make("a")) is False
    # vLLM processed a request itself (not seen here): the next one carries its pixels
    pixels.added(None, None)
    assert send(make("a")) is False
    # an image the core's cache would not keep (over half of it), or no such cache at all
    monkeypatch.setattr(frontend, "_item_bytes", lambda item: 600)
    assert send(make("c")) is False and send(make("c")) is False
    no_cache = PixelsOnce(capacity=0)
    r1, r2 = make("d"), make("d")
    no_cache.added(r1, no_cache.strip(r1))
    assert no_cache.strip(r2) is None


def test_feed_ramp_counts_requests_added_within_each_mark(monkeypatch):
    from vlbatch.engine import vllm_engine

    clock = [100.0]
    monkeypatch.setattr(vllm_engine.time, "monotonic", lambda: clock[0])
    ramp = vllm_engine.FeedRamp()
    assert ramp.describe() == "no request added"
    ramp.taken()
    for at in (100.3, 100.8, 101.5, 103.0):
        clock[0] = at
        ramp.added()
    assert ramp.by_mark == [1, 2, 3]
    assert ramp.describe().startswith("first request added 0.30 s after it was taken")
    clock[0] = 100.0
    ramp = vllm_engine.FeedRamp()
    ramp.taken()
    clock[0] = 100.2
    ramp.processed()  # by an input thread: before the engine thread adds it
    clock[0] = 100.25
    ramp.processed()  # later requests' processing is not the first's
    clock[0] = 100.3
    ramp.added()
    assert ramp.describe().startswith(
        "first request processed 0.20 s and added 0.30 s after it was taken; "
        "requests added: 1 by 0.5 s")


class ThreadRecordingProcessor:
    """vLLM's input processor, as InputFront calls it: records the thread of each request;
    `fail` requests raise, `stall` ones take `stall_s`."""

    def __init__(self, fail=(), stall=(), stall_s=0.0):
        import threading

        self.threads, self.fail, self.stall, self.stall_s = set(), fail, stall, stall_s
        self.lock = threading.Lock()

    def process_inputs(self, request_id, prompt, params, supported_tasks=None):
        import threading
        import time

        with self.lock:
            self.threads.add(threading.current_thread().name)
        if prompt["n"] in self.fail:
            raise ValueError("a bad page")
        if prompt["n"] in self.stall:
            time.sleep(self.stall_s)
        return SimpleNamespace(request_id=request_id, mm_features=None)


def input_front(processor, threads: int):
    from vlbatch.engine.vllm_frontend import InputFront

    engine = SimpleNamespace(input_processor=processor, get_supported_tasks=lambda: ("generate",),
                             get_tokenizer=lambda: None)
    return InputFront(engine, threads, torch_threads=1)


def test_the_input_threads_warm_up_each_thread_at_once_and_a_failure_costs_only_the_warm_up():
    import time

    processor = ThreadRecordingProcessor()
    front = input_front(processor, 4)
    try:
        front.warm_up([{"n": i} for i in range(4)], None, timeout_s=30)
        # one request a thread: every thread of the pool exists and has processed one
        assert front.warmed == 4 and len(processor.threads) == 4
    finally:
        front.close()
    processor = ThreadRecordingProcessor(fail={1}, stall={2}, stall_s=2.0)
    front = input_front(processor, 3)
    try:
        started = time.monotonic()
        front.warm_up([{"n": i} for i in range(3)], None, timeout_s=0.5)
        assert time.monotonic() - started < 1.5  # bounded: the stalled one is not waited for
        assert front.warmed == 1  # the failed and the stalled one did not warm
    finally:
        front.close()
