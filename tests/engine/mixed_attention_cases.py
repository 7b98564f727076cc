"""Mixed-step attention cases shared by the CPU test (decodes through torch) and its Triton
interpreter run (decodes through the split-KV kernel, in a subprocess with TRITON_INTERPRET=1,
which must be set before Triton's kernels are defined):

    TRITON_INTERPRET=1 python -m tests.engine.mixed_attention_cases
"""

from __future__ import annotations

import itertools
import zlib

import torch

from pdserve.engine.kernels.attention import AttentionMetadata, TorchAttention

# Sequences as (cached tokens, new tokens) in step order: one new token is a decode row.
DECODES = [(0, 1), (15, 1), (16, 1), (17, 1), (100, 1), (299, 1)]
CHUNKS = [(0, 37), (48, 16), (5, 130)]
LAYOUTS = {
    "decodes first": DECODES + CHUNKS[:1],
    "decodes last": CHUNKS[:1] + DECODES,
    "decodes between chunks": CHUNKS[:1] + DECODES[:3] + CHUNKS[1:2],
    "interleaved": [DECODES[0], CHUNKS[0], DECODES[4], DECODES[1], CHUNKS[1], DECODES[5], CHUNKS[2], DECODES[2]],
}
BLOCK_SIZES = (16, 128)
HEADS = [(4, 2, 16), (8, 2, 32), (6, 1, 16)]  # (query heads, KV heads, head dim): GQA groups 2, 4, 6


def paged_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    hq: int,
    hk: int,
    d: int,
    seed: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """q [T, hq, d], this layer's K/V views of a block-major pool with random contents (other
    layers' blocks in between, as the engine lays it out), and the step's metadata; shuffled
    block tables padded with 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [c + n for c, n in seqs]
    need = [-(-n // block_size) for n in lens]
    pool = torch.randn(sum(need) + 3, 2, 2, block_size, hk, d, generator=gen, device=device).to(dtype)
    perm = (torch.randperm(sum(need) + 2, generator=gen, device=device) + 1).tolist()
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    query_lens = [n for _, n in seqs]
    cu = torch.tensor(list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32)
    t = int(cu[-1])
    meta = AttentionMetadata(
        slot_block=torch.zeros(t, dtype=torch.int64, device=device),
        slot_offset=torch.zeros(t, dtype=torch.int64, device=device),
        cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), max_query_len=max(query_lens), max_seq_len=max(lens),
        query_lens=query_lens, seq_lens_host=lens,
    )  # fmt: skip
    q = torch.randn(t, hq, d, generator=gen, device=device).to(dtype)
    return q, pool[:, 1, 0], pool[:, 1, 1], meta


def reference(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Per sequence, in float64: keys gathered through the block table, bottom-right causal mask
    (query j of n sees keys up to k_len - n + j). Independent of the engine's backends."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    start = 0
    for i, (n, kl) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
        table = meta.block_tables[i, : -(-kl // bs)].long()
        k = k_cache[table].flatten(0, 1)[:kl].double().repeat_interleave(group, dim=1)  # [kl, Hq, D]
        v = v_cache[table].flatten(0, 1)[:kl].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].double(), k) * scale
        visible = torch.arange(kl - n, kl, device=q.device)[:, None] >= torch.arange(kl, device=q.device)[None, :]
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", p, v)
        start += n
    return out


class TorchDecodes:
    """The torch backend's decode path as a `DecodeAttend`: the reference the CPU test splits to."""

    name = "torch"

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, scale, out=None):
        lens = seq_lens.tolist()
        b = len(lens)
        meta = AttentionMetadata(
            slot_block=seq_lens, slot_offset=seq_lens, cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
            seq_lens=seq_lens, block_tables=block_tables, max_query_len=1, max_seq_len=max(lens),
            query_lens=[1] * b, seq_lens_host=lens,
        )  # fmt: skip
        o = TorchAttention().attend(q, k_cache, v_cache, meta, scale)
        return o if out is None else out.copy_(o)


def check(decode, layout: str, block_size: int, hq: int, hk: int, d: int) -> None:
    """The split backend's output for one mixed step matches the float64 reference, row for row."""
    from pdserve.engine.kernels.mixed_attention import MixedDecodeAttention

    seed = zlib.crc32(f"{layout} {block_size} {hq} {hk} {d}".encode())
    q, k_cache, v_cache, meta = paged_case(LAYOUTS[layout], block_size, hq, hk, d, seed)
    scale = d**-0.5
    want = reference(q, k_cache, v_cache, meta, scale).to(q.dtype)
    split = MixedDecodeAttention(TorchAttention(), decode)
    got = split.attend(q, k_cache, v_cache, meta, scale)
    assert split.mixed_steps == 1, "the step was not split"
    again = split.attend(q, k_cache, v_cache, meta, scale)  # the next layer: the kept plan
    assert split.mixed_steps == 1 and torch.equal(again, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{layout}, block {block_size}: {m}")


def main() -> None:
    from pdserve.engine.kernels.decode_kernels import SplitKVDecodes

    # 16 SMs: 1 or 2 splits for these batches (each split is one more interpreted program).
    decode = SplitKVDecodes(torch.device("cpu"), num_sms=16)
    cases = [("decodes last", 16, *HEADS[0]), ("interleaved", 16, *HEADS[1]), ("decodes between chunks", 128, *HEADS[2]),
             ("decodes first", 128, *HEADS[1])]  # fmt: skip
    for case in cases:
        check(decode, *case)
    print(f"{len(cases)} mixed steps through the split-KV kernel match the reference")
    check_warm_up()


def check_warm_up() -> None:
    """The warm-up launches the kernel once per split count that mixed steps can take (the tile is
    the same for all), with inputs laid out as theirs are."""
    from pdserve.engine.kernels import decode_kernels
    from pdserve.engine.kernels.decode_tiles import attention_splits
    from pdserve.engine.kernels.mixed_attention import MixedDecodeAttention

    launched: list[tuple[int, int]] = []

    class Recording(decode_kernels.SplitKVDecodes):
        def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, scale, out=None):
            assert block_tables.shape[1] % 16 == 0 and block_tables.is_contiguous()
            launched.append((q.shape[0], attention_splits(q.shape[0], k_cache.shape[2], self.num_sms)))
            return super().__call__(q, k_cache, v_cache, block_tables, seq_lens, scale, out)

    _, k_cache, v_cache, _ = paged_case([(0, 3)], 16, 4, 2, 16, seed=3)
    MixedDecodeAttention(TorchAttention(), Recording(torch.device("cpu"), num_sms=16)).warm_up(k_cache, v_cache, 4, 8)
    assert launched == [(1, 32), (2, 16), (3, 8), (5, 4)], launched
    # 4 SMs: batches 5 to 10 share one split count, so one launch covers them
    MixedDecodeAttention(TorchAttention(), Recording(torch.device("cpu"), num_sms=4)).warm_up(k_cache, v_cache, 4, 10)
    assert launched[4:] == [(1, 8), (2, 4), (3, 2), (5, 1)], launched
    print(f"warm-up: {len(launched)} launches")


if __name__ == "__main__":
    main()
