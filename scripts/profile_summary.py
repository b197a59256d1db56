"""Where a process's time went, from py-spy's collapsed stacks (`--format raw`, as
scripts/gpu_frontend.sh's w3-profile / w1-profile stages write them): per thread, the
share of samples in each function as the innermost frame (self) and anywhere on the stack
(inclusive).

    python3 scripts/profile_summary.py OUT/profile-core.txt [--top 25]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
FRAME_LINE = re.compile(r":\d+\)$")


def summarize(path: Path, top: int) -> str:
    per_thread: dict[str, tuple[Counter, Counter]] = defaultdict(lambda: (Counter(), Counter()))
    totals: Counter = Counter()
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        frames = m["stack"].split(";")
        # py-spy --threads puts "thread (0x...)" or "process ..." first
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "all"
        frames = frames[1:] if thread != "all" else frames
        frames = [FRAME_LINE.sub(")", f) for f in frames]  # a function, whatever its line
        count = int(m["count"])
        totals[thread] += count
        selfs, inclusive = per_thread[thread]
        if frames:
            selfs[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    out = []
    for thread, total in totals.most_common():
        selfs, inclusive = per_thread[thread]
        out.append(f"== {thread}: {total} samples")
        out.append("  self:")
        out += [f"    {100 * n / total:5.1f}%  {frame[:150]}" for frame, n in selfs.most_common(top)]
        out.append("  inclusive:")
        out += [f"    {100 * n / total:5.1f}%  {frame[:150]}"
                for frame, n in inclusive.most_common(top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(summarize(args.profile, args.top))


if __name__ == "__main__":
    main()
