"""`trainer tokenize`'s work in Python, as llm.c's dev/data/fineweb.py does it: tiktoken's GPT-2
encoding with <|endoftext|> before each document, uint16 ids in llm.c's format, one process
a file (a pool of 2, this machine's cores). For time side by side with trainer:

python3 bench/tokenize_python.py OUT_DIR TEXT...   (pip install tiktoken numpy)

Without network, TIKTOKEN_R50K names a local r50k_base.tiktoken (tiktoken-rs's crate carries
one under assets/): the same ranks as tiktoken's "gpt2".
"""
import multiprocessing as mp
import os
import sys

import numpy as np
import tiktoken

if "TIKTOKEN_R50K" in os.environ:
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    enc = tiktoken.Encoding(
        name="r50k_base",
        pat_str=r50k_pat_str,
        mergeable_ranks=load_tiktoken_bpe(os.environ["TIKTOKEN_R50K"]),
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )
else:
    enc = tiktoken.get_encoding("gpt2")


def tokenize(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return np.array([enc._special_tokens["<|endoftext|>"]] + enc.encode_ordinary(text),
                    dtype=np.uint16)


if __name__ == "__main__":
    out, paths = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    with mp.Pool(2) as pool:
        ids = np.concatenate(pool.map(tokenize, paths))
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, len(ids)]
    with open(os.path.join(out, "train_000000.bin"), "wb") as f:
        f.write(header.tobytes())
        f.write(ids.tobytes())
    print(f"{len(ids)} tokens")
