"""Shared test setup.

TRITON_INTERPRET must be decided before triton is first imported (a test module's import does that, at
collection). The rule, applied in pytest_configure, before any test module is imported:
- TRITON_INTERPRET set in the environment (to anything, "0" included) is left as it is;
- otherwise it is set to "1", so that the Triton kernels run on CPU tensors under the interpreter, unless the
  `-m` expression (command line, PYTEST_ADDOPTS or addopts) selects the `cuda` marker: it names `cuda` other
  than as `not cuda`, as in `pytest -m cuda` on a GPU machine. Then it is left unset and the kernels of
  tests/gpu run for real. (Those tests skip themselves under the interpreter.)
So the default run (`pytest`, `pytest -m "not slow"`, ...) is the CPU suite as before, and on a GPU machine
`pytest -m cuda` runs the GPU checks."""

import os
import re

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def selects_cuda_marker(markexpr: str | None) -> bool:
    """Whether a `-m` expression names the cuda marker other than negated (`cuda`, `cuda and not slow`,
    `slow or cuda`: yes; `not cuda`, `not (cuda or slow)`, `not slow`, none: no)."""
    return any(not re.search(r"\bnot[\s(]*$", (markexpr or "")[: m.start()])
               for m in re.finditer(r"\bcuda\b", markexpr or ""))


def pytest_configure(config: pytest.Config) -> None:
    if "TRITON_INTERPRET" not in os.environ and not selects_cuda_marker(config.getoption("markexpr", None)):
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.empty (the kernels' wrappers allocate their outputs so) returns NaN, or -1 for integers: an
    element a kernel does not write shows. Kernel test modules use it for every test:
    `pytestmark = pytest.mark.usefixtures("poison_outputs")`."""
    import torch

    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


@pytest.fixture
def fp8_casts_as_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversions to and from float8 e4m3 (kv_cache_dtype="fp8") under the Triton interpreter as the GPU makes them.
    The interpreter's own (triton 3.9, runtime/interpreter.py's _convert_float) loses the carry of a rounding into
    the exponent (7.8 becomes 4.0, not 8.0), flushes subnormals to zero and reads e4m3fn's NaN as 480. Here they
    round to nearest even (PTX's cvt.rn) and read NaN as NaN, through torch; a value beyond +-448 becomes NaN, as a
    cast that does not saturate makes it, so a kernel that forgets its clamp (rotary.cast_for_store) fails.
    float32 to bfloat16, which the interpreter rounds toward zero, rounds to nearest even here too: a bfloat16 k
    rounded the other way lands on the other side of an e4m3 rounding tie often enough to make a bit-for-bit
    comparison with the reference flaky."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    types = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
             tl.float8e4nv: torch.float8_e4m3fn}

    def convert(data, input_dtype, output_dtype, rounding_mode):  # (data: the values' bits, as numpy uints)
        ours = tl.float8e4nv in (input_dtype, output_dtype) or (input_dtype, output_dtype) == (tl.float32, tl.bfloat16)
        if not ours or input_dtype not in types or output_dtype not in types:
            return original(data, input_dtype, output_dtype, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy()).view(types[input_dtype])
        if output_dtype == tl.float8e4nv:
            x = x.float()
            x = x.masked_fill(x.abs() > 448, float("nan"))
        out = x.to(types[output_dtype]).view(torch.uint8).numpy()
        return out.view(f"uint{output_dtype.primitive_bitwidth}").reshape(data.shape)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory):
    """The embedded SmolLM2 tokenizer saved as a Hugging Face tokenizer directory, to give small
    random-weight models a real tokenizer."""
    from tinyvllm.model.loader import embedded_model_path
    from tinyvllm.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("smol-tokenizer")
    load_tokenizer(embedded_model_path()).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_text_checkpoint(tmp_path_factory, smol_tokenizer_dir):
    """A random-weight Llama with SmolLM2's vocabulary and tokenizer: text in, text out, fast."""
    from tests.utils import save_tiny_llama

    path = str(tmp_path_factory.mktemp("tiny-text"))
    return save_tiny_llama(path, seed=7, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                           tokenizer_dir=smol_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_text_llm(tiny_text_checkpoint):
    from tinyvllm import LLM

    return LLM(tiny_text_checkpoint, device="cpu", num_kv_blocks=128)
