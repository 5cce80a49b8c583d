"""The scripts in benchmarks/ start and run as a user runs them (`python benchmarks/NAME.py`, from the repository
root), on the CPU at a tiny size where they can, and with --help where they need a GPU.

Why: benchmarks/kernels.py once shadowed Hugging Face's `kernels` package, which transformers imports when it loads
a model; running a script puts its folder first on sys.path, so every benchmark died at start-up and no test
noticed. So the module names of the scripts' and the tests' folders are also checked against what is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Folders whose files are imported by bare module name: a script's own folder is sys.path[0] when it runs, pytest
# puts tests/ (and tests/gpu/) on sys.path.
MODULE_FOLDERS = ("benchmarks", "tests", os.path.join("tests", "gpu"))

# Each runnable script with arguments that make it small: a full run's code path (the engine, and the transformers
# peer where the script has one), in seconds on a CPU.
SMALL_RUNS = {
    "cpu_embedded.py": ["--tokens", "4", "--batch-sizes", "1"],
    "latency.py": ["--small"],
    "throughput.py": ["--small"],
    "serve.py": ["--small"],
    "serve_floor.py": ["--requests", "20", "--repeat", "1"],
    "structured_output.py": ["--small", "--num-prompts", "4", "--max-tokens", "8", "--mask-rows", "8", "--repeat", "1"],
    "prompt_logprobs.py": ["--small", "--num-prompts", "4", "--prompt-len", "32", "--repeat", "1", "--peer-batch", "2"],
    "host_overhead.py": ["--num-seqs", "8", "--prompt-len", "8", "--output-len", "8", "--repeats", "1"],
    "spec_decode.py": ["--small", "--num-prompts", "1", "--max-tokens", "8", "--repeat", "1"],
    "shared_prefix.py": ["--small", "--num-requests", "4", "--prefix-len", "64", "--question-len", "8",
                         "--output-len", "4"],
}
# The scripts that take --plot FILE, with the files a --plot steps.png run of SMALL_RUNS draws (one per run).
PLOTS = {"throughput.py": ["steps-continuous.png", "steps-static.png"],
         "shared_prefix.py": ["steps-caching-on.png", "steps-caching-off.png"]}
# --help only: they time CUDA kernels and graphs
GPU_ONLY = {"bench_attention.py", "bench_cascade.py", "bench_elementwise.py", "bench_fp8.py", "bench_fused.py",
            "bench_gemv.py", "bench_sampling.py", "profile_step.py"}
NOT_SCRIPTS = {"common.py", "kernels_common.py"}

# Looks each name up as an import would with none of MODULE_FOLDERS on sys.path, so that what is found is what the
# folder's file of that name hides. Prints {name: what provides it}.
SHADOW_PROBE = """
import importlib.metadata, importlib.util, json, os, sys
names, folders = json.loads(sys.argv[1]), {os.path.realpath(f) for f in json.loads(sys.argv[2])}
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) not in folders]
distributions = importlib.metadata.packages_distributions()
found = {}
for name in names:
    spec = importlib.util.find_spec(name)
    if spec is not None:
        owner = ("the standard library" if name in getattr(sys, "stdlib_module_names", ())
                 else "package " + ", ".join(distributions.get(name, ["?"])))
        found[name] = f"{owner}, at {spec.origin or list(spec.submodule_search_locations or [])}"
print(json.dumps(found))
"""

# Runs a script as `python SCRIPT --help` does (its folder first on sys.path, as __main__), then, in the same
# process with whatever the script did to sys.path, imports what the benchmarks import only later: transformers'
# model code (which imports Hugging Face's `kernels`) and the engine. So a GPU-only script, which gets no further
# than --help here, still shows that it would get past its imports.
HELP_THEN_IMPORTS = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = [script, "--help"]
sys.path[0] = os.path.dirname(os.path.abspath(script))
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    if e.code not in (None, 0):
        raise
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401
from tinyvllm import LLM  # noqa: F401
"""


def python(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """The venv's python, from the repository root, in the environment a user has (not the tests' TRITON_INTERPRET,
    which conftest.py sets for in-process kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def scripts() -> list[str]:
    return sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py") and f not in NOT_SCRIPTS)


def failure(proc: subprocess.CompletedProcess, what: str) -> str:
    return f"{what} exited {proc.returncode}\n--- stderr (last lines) ---\n{proc.stderr[-6000:]}\n" \
           f"--- stdout (last lines) ---\n{proc.stdout[-2000:]}"


def test_module_names_shadow_nothing_installed():
    modules: dict[str, list[str]] = {}
    for folder in MODULE_FOLDERS:
        for file in sorted(os.listdir(os.path.join(ROOT, folder))):
            if file.endswith(".py"):
                modules.setdefault(file[:-3], []).append(os.path.join(folder, file))
    proc = python("-c", SHADOW_PROBE, json.dumps(sorted(modules)),
                  json.dumps([os.path.join(ROOT, f) for f in MODULE_FOLDERS]), timeout=120)
    assert proc.returncode == 0, failure(proc, "the probe")
    shadowed = json.loads(proc.stdout)
    problems = [f"{file} shadows the installed module {name!r} ({shadowed[name]}): with its folder on sys.path, "
                f"`import {name}` (by transformers, say) gets this file; rename it"
                for name, files in modules.items() if name in shadowed for file in files]
    problems += [f"{' and '.join(files)} have the same module name: whichever folder is first on sys.path hides the "
                 f"other" for files in modules.values() if len(files) > 1]
    assert not problems, "\n".join(problems)


def test_every_benchmark_script_is_run_here():
    """A new script must get a tiny CPU run in SMALL_RUNS (or, if it needs a GPU, a place in GPU_ONLY)."""
    assert set(scripts()) == set(SMALL_RUNS) | GPU_ONLY, "add the new script to SMALL_RUNS or GPU_ONLY"


@pytest.mark.parametrize("script", scripts())
def test_starts_with_help_and_leaves_transformers_importable(script):
    path = os.path.join("benchmarks", script)
    proc = python("-c", HELP_THEN_IMPORTS, path, timeout=120)
    what = f"python {path} --help, then importing transformers' model code and tinyvllm"
    assert proc.returncode == 0 and "usage:" in proc.stdout, failure(proc, what)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALL_RUNS))
def test_runs_small_on_the_cpu(script, tmp_path):
    path = os.path.join("benchmarks", script)
    args = SMALL_RUNS[script] + (["--plot", str(tmp_path / "steps.png")] if script in PLOTS else [])
    command = f"python {path} {' '.join(args)}"
    proc = python(path, *args, timeout=300)
    assert proc.returncode == 0, failure(proc, command)
    # latency.py and throughput.py report a transformers peer that fails, and go on: here that is a failure.
    assert "failed" not in proc.stdout, failure(proc, f"{command} (a peer failed)")
    for name in PLOTS.get(script, ()):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{command} drew no {name}"


@pytest.mark.parametrize("script", sorted(GPU_ONLY | {"latency.py", "throughput.py"}))
def test_gpu_benchmarks_refuse_a_cpu_and_point_to_small(script):
    """Without a GPU, the 1B workload would run on the CPU for a long while without a word (and latency.py wrote its
    2.5 GB model first), and a kernel benchmark would fail on its first tensor: each says what it needs instead, and
    where it can, that --small runs on a CPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the scripts would run")
    proc = python(os.path.join("benchmarks", script), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "CUDA GPU" in proc.stderr
    assert ("--small" in proc.stderr) == (script not in GPU_ONLY), proc.stderr
