"""StepBatch.build's metadata against the definition, written out position by position: the
padded block table and each new token's cache row (block_table[i, p // block_size] * block_size
+ p % block_size), for decodes, chunks after a prefix, fresh prompts, empty chunks and sequences
of very different table lengths (a server's step: a few 32k-token sequences among short ones)."""
import pytest
import torch

from kernelgate.models.batch import StepBatch, padded_rows


def _expected(lengths, starts, tables, bs):
    width = max((len(t) for t in tables), default=0)
    table = [list(t) + [0] * (width - len(t)) for t in tables]
    mapping = [t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, lengths) for p in range(s, s + n)]
    return table, mapping


@pytest.mark.parametrize("seed", range(4))
def test_build_matches_the_definition(seed):
    g = torch.Generator().manual_seed(seed)
    bs = 16
    lengths = [1] * 9 + [0, 37, 300, 1, 5]
    starts = [int(x) for x in torch.randint(0, 600, (len(lengths),), generator=g)]
    starts[-1], starts[11] = 0, 4100            # a fresh prompt; a chunk after a long prefix
    tables = [torch.randperm(4000, generator=g)[:-(-(s + n) // bs)].tolist() for s, n in zip(starts, lengths)]
    b = StepBatch.build(lengths, list(range(len(lengths))), starts, "cpu", tables, bs)
    table, mapping = _expected(lengths, starts, tables, bs)
    assert b.block_table.tolist() == table and b.slot_mapping.tolist() == mapping
    assert b.cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert b.seq_lens.tolist() == [s + n for s, n in zip(starts, lengths)] and b.slots.tolist() == list(range(14))


def test_build_without_tables_and_with_a_short_table():
    b = StepBatch.build([3, 1], [0, 1], [0, 5], "cpu")
    assert b.block_table.shape == (2, 0) and b.slot_mapping.numel() == 0
    with pytest.raises(ValueError, match="does not cover 40 positions"):
        StepBatch.build([8], [0], [32], "cpu", [[1, 2]], 16)


def test_padded_rows_pads_and_cuts():
    assert padded_rows([[5, 6, 7], [], [8]], 4, 2).tolist() == [[5, 6], [0, 0], [8, 0], [0, 0]]
    assert padded_rows([], 2, 3).tolist() == [[0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("N", range(1, 10))
def test_every_index_array_starts_16_byte_aligned(N):
    """Triton specializes kernels on 16-byte pointer alignment: the arrays of one upload must each
    be aligned whatever the batch size, or a batch of another size builds another kernel while
    serving (serving/late_compiles.py saw `slots` and `seq_lens` change alignment with N)."""
    lengths, starts = [1] * (N - 1) + [3], list(range(5, 5 + N))
    tables = [[i, i + 20] for i in range(N)]
    b = StepBatch.build(lengths, [7 * i for i in range(N)], starts, "cpu", tables, 16)
    arrays = {"cu_seqlens": b.cu_seqlens, "slots": b.slots, "starts": b.starts_dev, "seq_lens": b.seq_lens,
              "block_table": b.block_table, "slot_mapping": b.slot_mapping}
    assert {k: v.data_ptr() % 16 for k, v in arrays.items()} == dict.fromkeys(arrays, 0)
    assert b.slots.tolist() == [7 * i for i in range(N)] and b.seq_lens.tolist() == [s + n for s, n in zip(starts, lengths)]
    assert b.block_table.tolist() == tables and b.cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
