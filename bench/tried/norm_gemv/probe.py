"""torchrun --nproc_per_node=2 bench/tried/norm_gemv/probe.py: the fused norm-GEMV against
push all-reduce + gemv; bitwise check, then chains of 48 layers in one CUDA graph."""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.path.dirname(__file__))
from norm_gemv import norm_gemv
from longctx.kernels.gemv import gemv
from longctx.parallel.allreduce import PushAllReduce

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
dt, D, I, QKV, eps = torch.bfloat16, 8192, 22016 // 2 // world * 2, 5120 * 2 // world, 1e-5
Ah = 8192 // world
comm = PushAllReduce.symmetric(dist.group.WORLD, dev, dt, D, push_gemv=True)
ready = torch.zeros(1, dtype=torch.int32, device=dev)
local = torch.full((D,), -32768, dtype=torch.int16, device=dev)
torch.manual_seed(rank)
NS = 8  # weight sets cycled (no L2 reuse)
def rnd(*s): return torch.randn(*s, device=dev, dtype=dt) / s[-1] ** 0.5
sets = [dict(o=rnd(D, Ah), gu=rnd(2 * I, D), down=rnd(D, I), qkv=rnd(QKV, D),
             n1=1 + 0.1 * rnd(D), n2=1 + 0.1 * rnd(D)) for _ in range(NS)]
torch.manual_seed(0)
res0 = torch.randn(1, D, device=dev, dtype=dt)
attn = rnd(1, Ah) * (rank + 1)

def layer_ref(res, W):
    p = gemv(attn, W["o"], push=comm.bufs)
    res, y = comm.add_rms_norm(res, p, W["n1"], eps, pushed=True)
    g = gemv(y, W["gu"], gated=True)
    p = gemv(g, W["down"], push=comm.bufs)
    res, y = comm.add_rms_norm(res, p, W["n2"], eps, pushed=True)
    return res, gemv(y, W["qkv"])

SPIN = [0]; FL = [0]; P0 = [False]; CK = [0]
def layer_fused(res, W):
    gemv(attn, W["o"], push=comm.bufs)
    res, g = norm_gemv(res, W["gu"], W["n1"], eps, comm.bufs, local, gated=True, sleep=bool(SPIN[0]), flag=bool(FL[0]), ready=ready, pid0=P0[0], check=CK[0])
    gemv(g, W["down"], push=comm.bufs)
    res, q = norm_gemv(res, W["qkv"], W["n2"], eps, comm.bufs, local, sleep=bool(SPIN[0]), flag=bool(FL[0]), ready=ready, pid0=P0[0], check=CK[0])
    return res, q
def fused_spin(k, tk=0, pid0=False, ck=0):
    def f(res, W):
        SPIN[0] = k; FL[0] = tk; P0[0] = pid0; CK[0] = ck
        return layer_fused(res, W)
    return f

def layer_floor(res, W):
    p = gemv(attn, W["o"]); g = gemv(p, W["gu"], gated=True); p = gemv(g, W["down"])
    return res, gemv(p, W["qkv"])

def run(fn, L=48):
    res, outs = res0.clone(), []
    for l in range(L):
        res, q = fn(res, sets[l % NS]); outs.append(q)
    return res, outs

# Correctness: eager, then mixed, then graph replays, bitwise.
for it in range(3):
    FL[0] = 1; P0[0] = it > 0; r1, o1 = run(layer_ref, 16); r2, o2 = run(layer_fused, 16)
    same = torch.equal(r1, r2) and all(torch.equal(a, b) for a, b in zip(o1, o2))
    print(f"rank {rank} eager round {it}: bitwise equal {same}; max |diff| "
          f"{max((a.float() - b.float()).abs().max().item() for a, b in zip(o1, o2)):.3g}", flush=True)

def graph_us(fn, reps=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        dist.barrier(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / 48)
    return sorted(ts)[len(ts) // 2], g, out

t = {}
for name, fn in (("ref", layer_ref), ("floor", layer_floor),
                 ("pid0", fused_spin(0, 1, True)), ("noreduce_cg", fused_spin(0, 1, True, 3)),
                 ("ref", layer_ref), ("noreduce_plain", fused_spin(0, 1, True, 4)), ("pid0", fused_spin(0, 1, True)), ("noreduce_cg", fused_spin(0, 1, True, 3))):
    us, g, out = graph_us(lambda: run(fn))
    t.setdefault(name, []).append(us)
    if name != "floor":
        t.setdefault(name + "_out", out)
        if name != "ref" and "noreduce" not in name:
            r1, o1 = t["ref_out"]; r2, o2 = out
            print(f"rank {rank} {name} graph outputs bitwise equal: {torch.equal(r1, r2) and all(torch.equal(a, b) for a, b in zip(o1, o2))}", flush=True)
# replayed outputs equal?
r1, o1 = t["ref_out"]; r2, o2 = t["pid0_out"]
print(f"rank {rank} graph outputs bitwise equal: {torch.equal(r1, r2) and all(torch.equal(a, b) for a, b in zip(o1, o2))}", flush=True)
if rank == 0:
    nbytes = sum(sets[0][k].numel() * 2 for k in ("o", "gu", "down", "qkv"))
    for k in ("floor", "ref", "pid0", "noreduce_cg", "noreduce_plain"):
        print(f"{k:6} µs per layer: {', '.join(f'{v:.2f}' for v in t[k])}  "
              f"({nbytes / min(t[k]) / 1e6:.0f} GB/s of weights)")
dist.destroy_process_group()
