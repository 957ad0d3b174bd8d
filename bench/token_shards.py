"""Writes llm.c token shards of random GPT-2 ids (uint16, below 50,257) for the loading
benchmark: `python3 bench/token_shards.py DIR SHARDS [TOKENS_PER_SHARD]`, 100M a shard as
llm.c's FineWeb shards."""
import os
import struct
import sys

out, shards = sys.argv[1], int(sys.argv[2])
per_shard = int(sys.argv[3]) if len(sys.argv) > 3 else 100_000_000
# Each id's high byte taken mod 196: ids stay below 196 * 256 = 50,176.
high = bytes(b % 196 for b in range(256))
os.makedirs(out, exist_ok=True)
for k in range(shards):
    header = [20240520, 1, per_shard] + [0] * 253
    ids = bytearray(os.urandom(2 * per_shard))
    ids[1::2] = ids[1::2].translate(high)
    with open(os.path.join(out, f"fineweb_train_{k:06d}.bin"), "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(ids)
