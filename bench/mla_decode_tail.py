"""mla_decode at B8 128k with a partial last tile (length 131,072 + 17: the tile loaded shifted back)
and with an in-order block table (as the engine allocates), against the bench's aligned, shuffled case.
    PYTHONPATH=. python bench/mla_decode_tail.py"""
import torch

from kernelgate.benchmark import graph_us
from kernelgate.ops.mla import mla_decode_triton as T
from kernelgate.ops.mla.mla_decode import bench_inputs

dev = torch.device("cuda")
print("| length | table | prefetch | µs |\n|---:|---|---:|---:|")
for ctx, order in ((131072, "shuffled"), (131072 + 17, "shuffled"), (131072 + 17, "in order")):
    q, cache, table, seq = bench_inputs(8, ctx, dev)
    if order == "in order":
        table = torch.arange(table.numel(), device=dev, dtype=torch.int32).view_as(table)
    for pf in (0, 2):
        cfg = {**T.config(), "prefetch": pf}
        print(f"| {ctx} | {order} | {pf} | {graph_us(lambda: T.launch(q, cache, table, seq, 576 ** -0.5, 512, cfg=cfg), dev):.1f} |",
              flush=True)
