"""KV-cache shapes of real models, from their published configs (``config.json`` on the Hugging
Face hub), per GPU rank, as vLLM lays them out:

=====================  ======  =========  =================  ==========  =====  ===========
model                  layers  layout     KV heads x dim     block       dtype  page
=====================  ======  =========  =================  ==========  =====  ===========
Llama-3.1-8B           32      kv_split   8 x 128            16 tokens   bf16   32 KiB
Llama-3.1-70B, TP=4    80      kv_split   2 x 128 per rank   16 tokens   bf16   8 KiB
Qwen2.5-7B             28      kv_split   4 x 128            16 tokens   bf16   16 KiB
Mistral-7B-v0.3        32      kv_split   8 x 128            16 tokens   bf16   32 KiB
DeepSeek-V3 (MLA)      61      mla        latent 512 + 64    64 tokens   bf16   72 KiB
gpt-oss-120b           36      kv_split   8 x 64             16 tokens   bf16   16 KiB
=====================  ======  =========  =================  ==========  =====  ===========

"page" is one segment of one block of one layer (a K or a V page for ``kv_split``, the whole
latent page for MLA): the size one copy moves. gpt-oss-120b alternates sliding-window (128
tokens) and full-attention layers, which vLLM keeps as two KV-cache groups of 18 layers each: a
hybrid cache, one block-id array per group. DeepSeek-V3's latent cache is not split by tensor
parallelism (every rank holds all of it); its block of 64 tokens is FlashMLA's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blockswap.layout import Layout

KiB = 1024


@dataclass(frozen=True)
class KVModel:
    key: str
    name: str
    config: str
    """Where the shape comes from: the config's fields."""
    layers: int
    layout: Layout
    """``"kv_split"`` ([2, blocks, block_size, kv_heads, head_dim] per layer) or ``"mla"``
    ([blocks, block_size, head_dim] per layer)."""
    kv_heads: int
    """Per rank."""
    head_dim: int
    block_size: int
    groups: int = 1
    dtype_bytes: int = 2

    @property
    def pages_per_layer(self) -> int:
        return 2 if self.layout == "kv_split" else 1

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self, layers: int | None = None) -> int:
        """Bytes one block holds over every layer (what moving one block moves)."""
        return (layers or self.layers) * self.pages_per_layer * self.page_bytes

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.layout == "kv_split":
            return (2, num_blocks, self.block_size, self.kv_heads, self.head_dim)
        return (num_blocks, self.block_size, self.kv_heads * self.head_dim)

    def make_cache(self, num_blocks: int, device: Any, layers: int | None = None) -> Any:
        """Uninitialised bf16 KV-cache tensors: a list of per-layer tensors, or for a hybrid
        model a list of groups, each a list of its layers' tensors (layers split evenly)."""
        import torch

        n = layers or self.layers
        shape = self.layer_shape(num_blocks)
        ts = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(n)]
        if self.groups == 1:
            return ts
        per = max(1, n // self.groups)
        return [ts[g * per : (g + 1) * per] for g in range(self.groups)]


MODELS: tuple[KVModel, ...] = (
    KVModel(
        "llama-3.1-8b",
        "Llama-3.1-8B",
        "num_hidden_layers 32, num_key_value_heads 8, head_dim 4096/32 = 128",
        layers=32,
        layout="kv_split",
        kv_heads=8,
        head_dim=128,
        block_size=16,
    ),
    KVModel(
        "llama-3.1-70b-tp4",
        "Llama-3.1-70B TP=4",
        "num_hidden_layers 80, num_key_value_heads 8 / TP 4 = 2, head_dim 8192/64 = 128",
        layers=80,
        layout="kv_split",
        kv_heads=2,
        head_dim=128,
        block_size=16,
    ),
    KVModel(
        "qwen2.5-7b",
        "Qwen2.5-7B",
        "num_hidden_layers 28, num_key_value_heads 4, head_dim 3584/28 = 128",
        layers=28,
        layout="kv_split",
        kv_heads=4,
        head_dim=128,
        block_size=16,
    ),
    KVModel(
        "mistral-7b",
        "Mistral-7B-v0.3",
        "num_hidden_layers 32, num_key_value_heads 8, head_dim 128",
        layers=32,
        layout="kv_split",
        kv_heads=8,
        head_dim=128,
        block_size=16,
    ),
    KVModel(
        "deepseek-v3",
        "DeepSeek-V3 (MLA)",
        "num_hidden_layers 61, kv_lora_rank 512 + qk_rope_head_dim 64 = 576 per token",
        layers=61,
        layout="mla",
        kv_heads=1,
        head_dim=576,
        block_size=64,
    ),
    KVModel(
        "gpt-oss-120b",
        "gpt-oss-120b",
        "num_hidden_layers 36 (18 sliding-window + 18 full attention: 2 groups), "
        "num_key_value_heads 8, head_dim 64",
        layers=36,
        layout="kv_split",
        kv_heads=8,
        head_dim=64,
        block_size=16,
        groups=2,
    ),
)

BY_KEY = {m.key: m for m in MODELS}


def select(keys: str | None) -> list[KVModel]:
    """Models named by a comma-separated list of keys (all where ``keys`` is empty)."""
    if not keys:
        return list(MODELS)
    out = []
    for k in keys.split(","):
        k = k.strip()
        if k not in BY_KEY:
            raise ValueError(f"unknown model {k!r}; known: {', '.join(BY_KEY)}")
        out.append(BY_KEY[k])
    return out
