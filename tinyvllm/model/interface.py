"""What the model runner relies on in a model, whatever its family: CausalLM.

A family is one file (llama.py is the example) that subclasses CausalLM with its decoder: it builds its layers
from model/layers.py, sets `lm_head` (None when tied to the embedding) and `rotary`, names its embedding
(get_input_embeddings), maps its
checkpoint's names onto merged parameters (`packed_modules_mapping`), and implements forward(). The rest is here,
once: the logits and the greedy LM head, the attention layers the runner sizes and allocates the KV cache from,
and what happens after loading (folding norms where the family can, the rotary table). Its registry line
(model/registry.py) makes the engine load it by its config.json's architecture name."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from tinyvllm import ops
from tinyvllm.config import ModelConfig
from tinyvllm.distributed import TensorParallel, gather_last_dim
from tinyvllm.model.layers import Attention, ParallelLMHead, RotaryEmbedding, VocabParallelEmbedding
from tinyvllm.model.quantization import UNQUANTIZED, Fp8LinearMethod
from tinyvllm.ops import AttentionMetadata


class CausalLM(nn.Module):
    # checkpoint tensor name fragment -> (the merged parameter's name fragment, the shard it fills)
    packed_modules_mapping: dict[str, tuple[str, Any]] = {}
    # checkpoint tensors that have no parameter and need none (buffers some checkpoints carry)
    ignored_checkpoint_fragments: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.max_positions = max_positions
        self.lm_head: ParallelLMHead | None = None
        self.rotary: RotaryEmbedding | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for every token of the flat batch (after the final norm)."""
        raise NotImplementedError

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        """The token embedding (a tied LM head is its weight)."""
        raise NotImplementedError

    # ---- the KV cache: the runner's, sized and allocated from these ---------------------------------------
    def attention_layers(self) -> list[Attention]:
        return [module for module in self.modules() if isinstance(module, Attention)]

    @property
    def sliding_window(self) -> int | None:
        """The window that bounds every layer's attention (the widest, where layers differ), read from the layers
        themselves so that each family's rule stays in its file; None where some layer attends to its whole context
        (Gemma 2's alternate layers, Qwen2 below max_window_layers). The engine gives back the KV blocks that fell
        out of it (BlockManager.remove_skipped_blocks)."""
        windows = [layer.sliding_window for layer in self.attention_layers()]
        return None if not windows or None in windows else max(windows)

    # ---- loading ------------------------------------------------------------------------------------------
    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """A checkpoint tensor to skip: a buffer with no parameter, or the head of a tied model (some checkpoints
        carry a copy of the embedding there)."""
        return any(f in name for f in self.ignored_checkpoint_fragments) or (
            self.lm_head is None and name == "lm_head.weight")

    def fold_norms(self) -> None:
        """After loading: fold what the family can into its products (see LlamaForCausalLM.fold_norms). Nothing by
        default."""

    def finish_loading(self, device: torch.device) -> None:
        """Once the weights are in: fold what can be folded and build the rotary table on `device`."""
        self.fold_norms()
        if self.rotary is not None:
            self.rotary.build(device)

    # ---- from hidden states to tokens ---------------------------------------------------------------------
    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.get_input_embeddings().weight if self.lm_head is None else self.lm_head.weight

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row's logits (int64 [rows]) from the fused LM-head kernel, which writes no logits;
        None where it does not apply (the CPU, more rows than its crossover, a vocabulary split over ranks): then
        the caller computes the logits."""
        if self.tp.size > 1 or not ops.use_decode_kernel("lm_head", hidden):
            return None
        head = self.lm_head if self.lm_head is not None else self.get_input_embeddings()
        if head.method is UNQUANTIZED:
            return ops.linear_argmax(hidden, self.lm_head_weight)
        if isinstance(head.method, Fp8LinearMethod):  # (quantize_lm_head: the kernel reads float8 rows too)
            return ops.linear_argmax(hidden, head.weight, weight_scale=head.weight_scale)
        return None  # (a format whose products are its method's alone: the CPU's GGUF types)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab_size] for the rows given (only the positions that get sampled), in the model's dtype:
        the sampling kernel and argmax read them as they are (no float32 copy of the rows x 128k vocabulary). Split
        over ranks, every rank must call it; rank 0 gets the logits, the others None."""
        head = self.lm_head if self.lm_head is not None else self.get_input_embeddings()
        if head.method is UNQUANTIZED:
            logits = torch.matmul(hidden, self.lm_head_weight.t())
        else:  # a head kept in another format (model/quantization.py)
            logits = head.method.apply(head, hidden, None)
        if self.tp.size > 1:
            logits = gather_last_dim(logits, self.tp)
            if logits is None:
                return None
            return logits[:, : self.config.vocab_size].contiguous()  # the padding is never sampled
        return logits
