#!/usr/bin/env python3
"""Issue 5's figures from a GPU benchmark log (bench/gpu.sh's or bench/gpu-quick.sh's
gpu-bench.txt): the MLP 784-4096x3-10 at batch 4096 in each precision, trainer (with and
without cuBLASLt's epilogues) beside PyTorch, as a Markdown table for BENCHMARKS.md.

    python3 bench/issue5_summary.py $OUT/gpu-bench.txt

Per precision: steady samples/s (the mean over the log's repeats), the ratio to PyTorch in
the same precision (fp32 eager, or autocast), the ratio to trainer's own fp32, achieved
TFLOP/s, planned and measured device memory, and the activation memory `trainer check`
planned (when the log has gpu.sh's "check" lines).
"""
import json
import re
import sys

SIZES = [784, 4096, 4096, 4096, 10]
BATCH = 4096


def step_flops(sizes, batch):
    """Multiply-adds × 2 of a training step: the forward products, the weight gradients,
    and the input gradients of every layer but the first (the data needs none)."""
    products = sum(a * b for a, b in zip(sizes, sizes[1:]))
    return 2 * batch * (3 * products - sizes[0] * sizes[1])


def parse(lines):
    """{precision: {"trainer": [...], "unfused": [...], "pytorch": [...], "check": str}}"""
    runs, mode = {}, None
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith("== "):
            mode = None
            if "784-4096x3-10" in line or line.startswith("== the same in"):
                found = re.search(r"\b(fp32|bf16|fp16)\b", line)
                mode = found.group(1) if found else None
            continue
        check = re.match(r"check (fp32|bf16|fp16) 4096: (.*)", line)
        if check:
            runs.setdefault(check.group(1), {})["check"] = check.group(2)
            continue
        if mode is None or ": {" not in line:
            continue
        label, text = line.split(": {", 1)
        key = {"trainer": "trainer", "pytorch": "pytorch"}.get(label)
        if label.startswith("trainer, bias and ReLU"):
            key = "unfused"
        if key:
            runs.setdefault(mode, {}).setdefault(key, []).append(json.loads("{" + text))
    return runs


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def main():
    with open(sys.argv[1]) as f:
        runs = parse(f)
    flops = step_flops(SIZES, BATCH)
    sps = lambda rows, key: mean([r.get(key) for r in rows or []])
    fp32 = sps(runs.get("fp32", {}).get("trainer"), "steady_sps")
    print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}: {flops / 1e9:.1f} GFLOP a step\n")
    print("| precision | trainer samples/s | without epilogues | PyTorch samples/s | "
          "ratio (x) | against trainer fp32 (x) | trainer TFLOP/s | PyTorch TFLOP/s | "
          "memory planned / peak | PyTorch peak |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for mode in ["fp32", "bf16", "fp16"]:
        r = runs.get(mode)
        if not r:
            continue
        ours = sps(r.get("trainer"), "steady_sps")
        unfused = sps(r.get("unfused"), "steady_sps")
        theirs = sps(r.get("pytorch"), "samples_per_sec")
        ratio = ours / theirs if ours and theirs else None
        own = ours / fp32 if ours and fp32 else None
        tflops = lambda s: s / BATCH * flops / 1e12 if s else None
        planned = sps(r.get("trainer"), "memory_planned_bytes")
        peak = sps(r.get("trainer"), "device_memory_peak_bytes")
        torch_peak = sps(r.get("pytorch"), "device_memory_peak_bytes")
        memory = "-" if planned is None else f"{planned / 2**30:.3f} / {peak / 2**30:.3f} GiB"
        print(f"| {mode} | {fmt(ours, ',.0f')} | {fmt(unfused, ',.0f')} | {fmt(theirs, ',.0f')} | "
              f"{fmt(ratio, '.2f')} | {fmt(own, '.2f')} | {fmt(tflops(ours), '.0f')} | "
              f"{fmt(tflops(theirs), '.0f')} | {memory} | "
              f"{'-' if torch_peak is None else f'{torch_peak / 2**30:.3f} GiB'} |")
    for mode in ["fp32", "bf16"]:
        if "check" in runs.get(mode, {}):
            print(f"\nplanned by `trainer check`, {mode}: {runs[mode]['check']}")


if __name__ == "__main__":
    main()
