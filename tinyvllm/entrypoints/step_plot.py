"""A picture of a benchmark run from the engine's per-step statistics: `tinyvllm bench throughput --plot FILE`,
benchmarks/throughput.py and benchmarks/shared_prefix.py record the steps with one StepRecorder and draw them with
plot_steps. matplotlib is imported only when a figure is drawn, so nothing else needs it."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from tinyvllm.contract import StepStats

StepRecord = tuple[float, StepStats]  # (time.perf_counter() when the step's callback ran, its stats)

INSTALL_HINT = "drawing the steps needs matplotlib: pip install matplotlib (or pip install 'tinyvllm[plot]')"


class StepRecorder:
    """A step callback (LLMEngine.add_step_callback, with the steps' GPU time) that keeps each step's stats and
    the time its callback ran. It appends one tuple per step and does nothing else, so that watching the steps
    costs the engine next to nothing; everything else is computed afterwards from the records."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.start = time.perf_counter()  # where the first step's wall period begins (see clear)

    @classmethod
    def attach(cls, llm: Any) -> StepRecorder:
        """A recorder watching every step of `llm` (an LLM, whose engine core runs in this process)."""
        recorder = cls()
        llm.llm_engine.add_step_callback(recorder, record_gpu_time=True)
        return recorder

    def __call__(self, stats: StepStats) -> None:
        self.records.append((time.perf_counter(), stats))

    def clear(self) -> None:
        """Forget the steps so far (a warm-up's): the clock of the measured run starts now."""
        self.records.clear()
        self.start = time.perf_counter()

    def steps(self) -> list[tuple[StepStats, float]]:
        """Each step's stats with its wall period in seconds (wall_periods)."""
        return list(zip((stats for _, stats in self.records), wall_periods(self.records, self.start)))


def wall_periods(records: list[StepRecord], start: float | None = None) -> list[float]:
    """Each step's wall-clock period, in seconds: from the callback of the step before (or from `start`, for the
    first step) to its own. Without `start` the first step has no period (NaN)."""
    times = [t for t, _ in records]
    if not times:
        return []
    first = float("nan") if start is None else times[0] - start
    return [first] + [b - a for a, b in zip(times, times[1:])]


def plot_path(path: str, name: str, only: bool) -> str:
    """The file for one of several runs drawn by one `--plot FILE`: FILE itself if the run is the only one, else
    FILE with the run's name before the extension (steps.png -> steps-static.png)."""
    if only:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-').lower()}{ext or '.png'}"


def import_matplotlib() -> Any:
    """matplotlib's Figure class, or an ImportError that says how to install it (the benchmarks call this before
    they run, so that a missing matplotlib does not cost a whole run)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return Figure


def plot_steps(records: list[StepRecord], path: str, title: str, start: float | None = None) -> None:
    """Draws the steps of one run into a PNG at `path`: five panels over the wall time (seconds since `start`,
    or since the first step), the step number along the top: the tokens each step computes, the requests running
    and waiting, the KV blocks in use, the preemptions, and the step's time (host, GPU, wall period). A step is
    drawn over its wall period, which ends when its callback ran.

    It draws on a bare Figure (the Agg canvas, no pyplot), so that it needs no display and leaves the caller's
    matplotlib backend alone."""
    if not records:
        raise ValueError(f"no steps were recorded: nothing to draw into {path}")
    Figure = import_matplotlib()
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    first_time, first = records[0]
    # Without `start` the first step is taken to begin its own host time and wait before its callback (a lower
    # bound of its period), so that it is drawn at all.
    t0 = first_time - (first.host_ms + first.wait_ms) / 1e3 if start is None else start
    ends = np.array([t - t0 for t, _ in records])
    edges = np.concatenate([[0.0], ends])  # step i: from edges[i] to edges[i + 1]
    stats = [s for _, s in records]

    def field(name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in stats], dtype=float)

    def stacked(ax: Any, layers: list[tuple[np.ndarray, str, str]]) -> None:
        base = np.zeros(len(stats))
        for values, color, label in layers:
            ax.stairs(base + values, edges, baseline=base, fill=True, color=color, alpha=0.7, lw=0, label=label)
            base = base + values

    def line(ax: Any, values: Any, color: str, label: str, **kwargs: Any) -> None:
        ax.stairs(values, edges, baseline=None, color=color, label=label, **kwargs)

    fig = Figure(figsize=(12, 10), dpi=100, layout="constrained")
    axes = fig.subplots(5, 1, sharex=True, height_ratios=[1.2, 1, 1, 0.8, 1.4])
    fig.suptitle(title, fontsize=12)
    tokens, requests, blocks, preempt, timing = axes

    prefill, decode = field("num_prefill_tokens"), field("num_decode_tokens")
    stacked(tokens, [(decode, "tab:blue", "decode tokens"), (prefill, "tab:orange", "prefill tokens (stacked)")])
    tokens.set_title(f"tokens per step: {int(prefill.sum()):,} prefill, {int(decode.sum()):,} decode "
                     f"over {len(stats):,} step{'' if len(stats) == 1 else 's'}", fontsize=10, loc="left")
    tokens.set_ylabel("tokens")

    line(requests, field("num_running"), "tab:green", "running")
    line(requests, field("num_waiting"), "tab:red", "waiting")
    requests.set_title("requests", fontsize=10, loc="left")
    requests.set_ylabel("requests")

    used, pool = field("num_blocks_used"), field("num_blocks")
    stacked(blocks, [(used, "tab:purple", "in use")])
    most, size = int(used.max()), int(pool.max())
    if most * 4 >= size:  # else the pool would flatten what is used into the axis
        line(blocks, pool, "black", "pool", lw=1, ls="--")
        blocks.set_ylim(0, size * 1.08)
        scale = ""
    else:
        blocks.set_ylim(0, max(most, 1) * 1.2)
        scale = " (the pool is off the scale)"
    blocks.set_title(f"KV cache blocks: at most {most:,} of {size:,} in use{scale}", fontsize=10, loc="left")
    blocks.set_ylabel("blocks")

    per_step = field("num_preemptions")
    total = np.cumsum(per_step)
    line(preempt, total, "tab:brown", "cumulative")
    hit = per_step > 0
    if hit.any():
        preempt.scatter(ends[hit], total[hit], s=12, color="tab:red", zorder=3, label="steps that preempt")
    preempt.set_ylim(0, max(total[-1], 1) * 1.15)
    preempt.set_title(f"preemptions: {int(total[-1]):,} in all", fontsize=10, loc="left")
    preempt.set_ylabel("preemptions")

    stacked(timing, [(field("schedule_ms"), "tab:cyan", "host: schedule"), (field("launch_ms"), "tab:blue",
                      "host: launch"), (field("update_ms"), "tab:olive", "host: update"),
                     (field("wait_ms"), "lightgrey", "waiting for the tokens")])
    gpu = np.array([np.nan if s.gpu_ms is None else s.gpu_ms for s in stats])
    timed = bool(np.isfinite(gpu).any())
    if timed:
        line(timing, gpu, "tab:red", "GPU", lw=1)
    period = np.array(wall_periods(records, start)) * 1e3
    line(timing, period, "black", "wall period", lw=0.8, alpha=0.7)
    median = f" (median {np.nanmedian(period):.2f} ms)" if np.isfinite(period).any() else ""
    timing.set_title(f"step time (ms): host (schedule + launch + update) and its wait for the tokens, stacked; "
                     f"{'GPU; ' if timed else ''}wall period{median}" + ("" if timed else "; no GPU time on CPU"),
                     fontsize=10, loc="left")
    timing.set_ylabel("ms")
    since = "the run started" if start is not None else "the first step began"
    timing.set_xlabel(f"wall time (s) since {since}")

    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.margins(x=0)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if len(edges) >= 3 and np.all(np.diff(edges) > 0):  # the step number along the top: step i ends at i
        numbers = np.arange(len(edges), dtype=float)
        top = tokens.secondary_xaxis("top", functions=(lambda v: _interp(v, edges, numbers),
                                                       lambda n: _interp(n, numbers, edges)))
        top.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
        top.set_xlabel("step", fontsize=9)
    fig.savefig(path, format="png")


def _interp(v: Any, xp: Any, fp: Any) -> Any:
    """np.interp, continued past both ends along the end segments (np.interp would clamp there, and the axis
    ticks outside the data would land on its ends)."""
    import numpy as np

    v = np.asarray(v, dtype=float)
    out = np.interp(v, xp, fp)
    low, high = v < xp[0], v > xp[-1]
    out = np.where(low, fp[0] + (v - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0]), out)
    return np.where(high, fp[-1] + (v - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2]), out)
