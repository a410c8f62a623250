"""What is alive at a profiled region's memory peak, grouped by the op that allocated it.

Reads a finished ``torch.profiler.profile(profile_memory=True)`` and replays its allocation
events in time order. Only blocks allocated inside the profiled region count (frees of older
blocks are ignored), so the peak is the region's own, above what was live when it started.
Each live block is labelled by the innermost ``phase:*`` record_function around it, whether
autograd's engine ran it (backward) or not (forward), and the aten op that allocated it.
"""

from __future__ import annotations

from collections import Counter


def _allocations(prof, device_type: str) -> list[tuple[int, int, int, str]]:
    """``(time ns, ptr, signed bytes, label)`` of every allocation/free on ``device_type``."""
    found = []

    def walk(event, chain: tuple[str, ...]) -> None:
        fields = event.typed[1]
        if type(fields).__name__ == "_ExtraFields_Allocation":
            if fields.device.type == device_type:
                found.append((event.start_time_ns, fields.ptr, fields.alloc_size, _label(chain)))
            return
        for child in event.children:
            walk(child, chain + (event.name,))

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    found.sort(key=lambda a: a[0])
    return found


def _label(chain: tuple[str, ...]) -> str:
    phase = next((name[len("phase:"):] for name in reversed(chain) if name.startswith("phase:")), "-")
    direction = "backward" if any(name.startswith("autograd::engine") for name in chain) else "forward"
    op = next((name for name in chain if name.startswith("aten::")), chain[-1] if chain else "?")
    return f"{phase} {direction} {op}"


def live_at_peak(prof, device_type: str = "cpu") -> tuple[int, list[tuple[str, int]]]:
    """Peak bytes allocated within the region and, at that moment, live bytes per label (largest first)."""
    events = _allocations(prof, device_type)
    live: dict[int, int] = {}
    total = peak = peak_at = 0
    for i, (_, ptr, size, _) in enumerate(events):
        if size > 0:
            live[ptr] = size
            total += size
        elif ptr in live:
            total -= live.pop(ptr)
        if total > peak:
            peak, peak_at = total, i
    by_label: dict[int, tuple[int, str]] = {}
    for _, ptr, size, label in events[: peak_at + 1]:
        if size > 0:
            by_label[ptr] = (size, label)
        else:
            by_label.pop(ptr, None)
    groups = Counter()
    for size, label in by_label.values():
        groups[label] += size
    return peak, groups.most_common()


def format_live_at_peak(peak: int, groups: list[tuple[str, int]], *, rows: int = 20) -> str:
    lines = [f"peak {peak / 2**20:.1f} MiB allocated within the region; live at the peak, by allocating op:"]
    for label, size in groups[:rows]:
        lines.append(f"  {size / 2**20:9.2f} MiB  {100 * size / max(peak, 1):5.1f}%  {label}")
    rest = sum(size for _, size in groups[rows:])
    if rest:
        lines.append(f"  {rest / 2**20:9.2f} MiB  {100 * rest / max(peak, 1):5.1f}%  ({len(groups) - rows} more)")
    return "\n".join(lines)


if __name__ == "__main__":  # a library of tools/bench_dpo.py: say so instead of exiting silently
    print(f"{__doc__.strip()}\n\nThis file is a library of tools/bench_dpo.py, which prints these figures beside the "
          "measured ones; run: python tools/bench_dpo.py --help")
