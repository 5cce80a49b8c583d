"""`tinyvllm bench throughput --plot FILE` and tinyvllm/entrypoints/step_plot.py: the steps of a run are recorded
by a callback that only appends, and drawn into a PNG that matplotlib reads back, with and without GPU times."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.utils import save_tiny_llama
from tinyvllm.contract import StepStats
from tinyvllm.entrypoints.step_plot import StepRecorder, plot_path, plot_steps, wall_periods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=3)


def assert_png(path: str) -> None:
    """A PNG that matplotlib reads back as a picture of the size plot_steps draws (12 x 10 inches at 100 dpi)."""
    from matplotlib.image import imread

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    image = imread(path)
    assert image.shape[:2] == (1000, 1200) and image.size > 0


def stats(step: int, gpu_ms: float | None) -> StepStats:
    prefill = 64 if step == 0 else 0
    return StepStats(num_seqs=4, num_prefill_tokens=prefill, num_decode_tokens=0 if prefill else 4,
                     num_inputs_in_flight=0, num_running=4 - step // 4, num_waiting=max(0, 2 - step), num_blocks_used=8,
                     num_blocks=32, num_preemptions=int(step == 5), schedule_ms=0.2, launch_ms=1.0, wait_ms=0.1,
                     update_ms=0.3, gpu_ms=gpu_ms)


@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu-time", "gpu-time"])
def test_plot_steps_draws_hand_made_records(tmp_path, gpu):
    records = [(10.0 + 0.002 * (i + 1), stats(i, 1.5 + i if gpu else None)) for i in range(12)]
    path = str(tmp_path / "steps.png")
    plot_steps(records, path, "hand-made: 12 steps, 1,234 output tok/s", start=10.0)
    assert_png(path)
    plot_steps(records[:1], path, "one step, no start")  # the first step alone is drawn over its own time
    assert_png(path)


def test_plot_steps_refuses_no_steps(tmp_path):
    with pytest.raises(ValueError, match="no steps"):
        plot_steps([], str(tmp_path / "steps.png"), "nothing")


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_steps([(1.0, stats(0, None))], str(tmp_path / "steps.png"), "no matplotlib")


def test_recorder_periods_and_clear():
    recorder = StepRecorder()
    recorder(stats(0, None))
    recorder.clear()  # a warm-up's steps are forgotten and the clock restarts
    assert recorder.records == []
    for i in range(3):
        recorder(stats(i, None))
    steps = recorder.steps()
    assert [s for s, _ in steps] == [s for _, s in recorder.records]
    times = [t for t, _ in recorder.records]
    assert [p for _, p in steps] == [times[0] - recorder.start, times[1] - times[0], times[2] - times[1]]
    assert all(p >= 0 for _, p in steps)
    first, *_ = wall_periods(recorder.records)  # without a start the first step has no period
    assert math.isnan(first)


def test_plot_path_names_each_run():
    assert plot_path("out/steps.png", "continuous", only=True) == "out/steps.png"
    assert plot_path("out/steps.png", "static (run 2)", only=False) == "out/steps-static-run-2.png"
    assert plot_path("steps", "caching on", only=False) == "steps-caching-on.png"


def test_bench_throughput_plot_writes_a_png(checkpoint, tmp_path):
    path = str(tmp_path / "steps.png")
    proc = subprocess.run([sys.executable, "-m", "tinyvllm", "bench", "throughput", "--model", checkpoint,
                           "--device", "cpu", "--num-prompts", "4", "--max-input-len", "24", "--max-output-len", "6",
                           "--plot", path], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "output tok/s" in proc.stdout and f"steps drawn in {path}" in proc.stdout
    assert_png(path)
