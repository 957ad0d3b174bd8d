#!/usr/bin/env bash
# Per-kernel GPU time of a few training steps (ncu, no CUDA graphs so each kernel is seen),
# trainer against PyTorch (torch.profiler), for the MLP 784-4096x3-10 batch 4096 in the
# precision given ($1: fp32 | bf16). Run on the GPU machine from the bundle (.gpu/).
set -uo pipefail
mode=${1:-bf16}
out="${OUT:-/tmp}/profile-$mode.txt"
runs=$(mktemp -d)
ncu --clock-control none --metrics gpu__time_duration.sum --launch-skip 400 --launch-count 200 \
  --csv --page raw --log-file "$runs/ncu.csv" \
  .gpu/trainer run bench/mlp4096.toml --set device.type=\"cuda\" --set precision.mode=\"$mode\" \
  --set device.cuda_graphs=false --set data.samples=61440 --runs-dir "$runs" --quiet > /dev/null
python3 - "$runs/ncu.csv" "$mode" <<'PY' | tee "$out"
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
# ncu writes its ==PROF== lines into the log before the table.
rows = rows[next(i for i, r in enumerate(rows) if "Kernel Name" in r):]
head = rows[0]; name_i = head.index("Kernel Name"); t_i = head.index("gpu__time_duration.sum")
unit = rows[1][t_i]
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in rows[2:]:
    t = float(r[t_i].replace(",", "")) * (1e-3 if unit in ("ns", "nsecond") else 1.0)  # -> us
    tot[r[name_i][:90]] += t; cnt[r[name_i][:90]] += 1
all_ = sum(tot.values())
print(f"== trainer {sys.argv[2]}: {sum(cnt.values())} kernels, {all_:.0f} us ({unit})")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
    print(f"{v:10.0f} us {cnt[k]:4d}x  {k}")
print("-- in launch order (grid, block):")
for r in rows[2:]:
    t = float(r[t_i].replace(",", "")) * (1e-3 if unit in ("ns", "nsecond") else 1.0)
    print(f"{t:8.1f} us  {r[name_i][:60]:60s} {r[head.index('Grid Size')]} {r[head.index('Block Size')]}")
PY
[ "${2:-}" = trainer-only ] && exit 0
python3 - "$mode" <<'PY' | tee -a "$out"
import sys, torch
from torch import nn
mode = sys.argv[1]
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(784,4096), nn.ReLU(), nn.Linear(4096,4096), nn.ReLU(), nn.Linear(4096,4096), nn.ReLU(), nn.Linear(4096,10)).cuda()
opt = torch.optim.Adam(m.parameters(), 1e-3)
x = torch.randn(4096, 784, device="cuda"); y = torch.randint(0, 10, (4096,), device="cuda")
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=(mode == "bf16")):
        loss = nn.functional.cross_entropy(m(x), y)
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
for _ in range(5): step()
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(2): step()
    torch.cuda.synchronize()
print(f"== pytorch {mode}: 2 steps")
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
PY
