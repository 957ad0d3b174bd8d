"""A trained MLP's accuracy on a CSV file, from the run directory alone, in plain Python.

Usage: accuracy_without_trainer.py RUN_DIR DATA.csv
Prints "correct/total". It reads model.safetensors and preprocess.json the way any other
tool would: no trainer code, no numpy, no torch. It supports nn.Sequential-style MLPs
(linear layers named "<index>.weight"/"<index>.bias" with ReLU between them).
"""

import csv
import json
import struct
import sys


def read_safetensors(path):
    data = open(path, "rb").read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    body = data[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", info
        start, end = info["data_offsets"]
        values = struct.unpack(f"<{(end - start) // 4}f", body[start:end])
        tensors[name] = (info["shape"], values)
    return tensors


def main(run, data_path):
    prep = json.load(open(f"{run}/preprocess.json"))
    tensors = read_safetensors(f"{run}/model.safetensors")
    layers = sorted({int(name.split(".")[0]) for name in tensors})
    names = prep.get("class_names")
    correct = total = 0
    for row in csv.DictReader(open(data_path)):
        x = [float(row[c]) for c in prep["feature_columns"]]
        if prep["shift"]:
            x = [(v - s) * k for v, s, k in zip(x, prep["shift"], prep["scale"])]
        for i, layer in enumerate(layers):
            (rows, cols), w = tensors[f"{layer}.weight"]
            _, b = tensors[f"{layer}.bias"]
            x = [b[r] + sum(w[r * cols + c] * x[c] for c in range(cols)) for r in range(rows)]
            if i + 1 < len(layers):
                x = [max(v, 0.0) for v in x]
        label = row[prep["label_column"]]
        truth = names.index(label) if names else int(float(label))
        correct += max(range(len(x)), key=x.__getitem__) == truth
        total += 1
    print(f"{correct}/{total}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
