"""torchrun --nproc_per_node=2 scratch/flag/probe.py: the push kernel publishing a READY flag that
the next GEMV spins on, against the kept path; bitwise check, then chains of 48 layers in a graph."""
import os, sys, torch, torch.distributed as dist
from longctx.kernels.gemv import gemv
from longctx.kernels.allreduce import push_all_reduce
from longctx.parallel.allreduce import PushAllReduce

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
dt, D, I, QKV, eps = torch.bfloat16, 8192, 22016 // 2 // world * 2, 5120 * 2 // world, 1e-5
Ah = 8192 // world
comm = PushAllReduce.symmetric(dist.group.WORLD, dev, dt, D, push_gemv=True)
B = comm.bufs
torch.manual_seed(rank)
NS = 8
def rnd(*s): return torch.randn(*s, device=dev, dtype=dt) / s[-1] ** 0.5
sets = [dict(o=rnd(D, Ah), gu=rnd(2 * I, D), down=rnd(D, I), qkv=rnd(QKV, D),
             n1=1 + 0.1 * rnd(D), n2=1 + 0.1 * rnd(D)) for _ in range(NS)]
torch.manual_seed(0)
res0 = torch.randn(1, D, device=dev, dtype=dt)
attn = rnd(1, Ah) * (rank + 1)

def make(early, flag, spin=0):
    def layer(res, W):
        p = gemv(attn, W["o"], push=B)
        res, y = push_all_reduce(p, B, residual=res, norm_weight=W["n1"], eps=eps, pushed=True,
                                 early=early, publish=flag)
        g = gemv(y, W["gu"], gated=True, ready=B if flag else None, _spin=spin)
        p = gemv(g, W["down"], push=B)
        res, y = push_all_reduce(p, B, residual=res, norm_weight=W["n2"], eps=eps, pushed=True,
                                 early=early, publish=flag)
        return res, gemv(y, W["qkv"], ready=B if flag else None, _spin=spin)
    return layer

def layer_floor(res, W):
    p = gemv(attn, W["o"]); g = gemv(p, W["gu"], gated=True); p = gemv(g, W["down"])
    return res, gemv(p, W["qkv"])

V = {"ref": make(False, False), "early": make(True, False), "flag": make(True, True), "flagwait": make(True, True, 3), "nofinal": make(True, True, 4), "pubonly": make(True, True, 5)}

def run(fn, L=48):
    res, outs = res0.clone(), []
    for l in range(L):
        res, q = fn(res, sets[l % NS]); outs.append(q)
    return res, outs

def same(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

for it in range(3):
    a = run(V["ref"], 16); b = run(V["flag"], 16); c = run(V["flagwait"], 16); d = run(V["pubonly"], 16)
    print(f"rank {rank} eager {it}: flag == ref {same(a, b)}, t0 {same(a, c)}, sleep {same(a, d)}", flush=True)

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

t, outs = {}, {}
order = ["floor", "ref", "early", "flag", "flagwait", "nofinal", "pubonly"] * 3
for name in order:
    us, g, out = graph_us(lambda: run(layer_floor if name == "floor" else V[name]))
    t.setdefault(name, []).append(us)
    if name != "floor":
        outs.setdefault(name, out)
        print(f"rank {rank} {name} graph == ref graph: {same(outs['ref'], out)}", flush=True)
    del g
if rank == 0:
    for k in ("floor", "ref", "early", "flag", "flagwait", "nofinal", "pubonly"):
        print(f"{k:6} µs per layer: {', '.join(f'{v:.2f}' for v in t[k])}")
dist.destroy_process_group()
