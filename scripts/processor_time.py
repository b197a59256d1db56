"""The host's one-thread time for the model's HF processor on one W1 page (resize, normalise,
patchify), the figure raw vLLM's pace follows: `python scripts/processor_time.py MODEL PDF`."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(model: str, pdf: str) -> None:
    import torch

    from vlbatch.engine.prompts import PromptBuilder
    from vlbatch.job import Render
    from vlbatch.pipeline import ingest

    torch.set_num_threads(1)
    settings = Render(dpi=150, max_pixels=1280 * 32 * 32)
    image = ingest.render(pdf, "pdf", 1, settings).image()
    prompts = PromptBuilder(model)
    text = prompts.chat_prompt("Convert this page to Markdown.")
    times = []
    for _ in range(12):
        started = time.perf_counter()
        prompts.processor(images=[image], text=[text], return_tensors="pt")
        times.append(time.perf_counter() - started)
    print(json.dumps({"processor_ms_one_thread": round(1000 * statistics.median(times[2:]), 1),
                      "page": f"{image.width}x{image.height}"}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
