#!/usr/bin/env python3
"""Write 65536 seeded random token ids below VOCAB as a 1-D int64 .npy (the token shards
the benchmark scripts train on), with the standard library only.

    python3 tools/random_tokens.py OUT.npy VOCAB
"""
import random
import struct
import sys

out, vocab = sys.argv[1], int(sys.argv[2])
random.seed(0)
n = 1 << 16
header = "{'descr': '<i8', 'fortran_order': False, 'shape': (%d,), }" % n
header += " " * (63 - (10 + len(header)) % 64) + "\n"
with open(out, "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    f.write(struct.pack("<%dq" % n, *[random.randrange(vocab) for _ in range(n)]))
