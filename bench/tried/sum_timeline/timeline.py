"""torchrun --nproc_per_node=2 bench/tried/sum_timeline/timeline.py: %globaltimer stamps through the kept path
(pushing GEMV -> push all-reduce + norm -> GEMV), chains of 48 layers in one CUDA graph."""
import os, torch, torch.distributed as dist
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
dbg = torch.zeros(256, 16, dtype=torch.int64, device=dev)
BIG = 2 ** 62
def reset():
    dbg.zero_(); dbg[:, [0, 1, 8, 9]] = BIG

def layer(res, W, tl):
    p = gemv(attn, W["o"], push=B, _dbg=(dbg, B.flags, 1) if tl else None)
    res, y = push_all_reduce(p, B, residual=res, norm_weight=W["n1"], eps=eps, pushed=True,
                             _dbg=dbg if tl else None)
    g = gemv(y, W["gu"], gated=True, _dbg=(dbg, B.flags, 2) if tl else None)
    p = gemv(g, W["down"], push=B, _dbg=(dbg, B.flags, 1) if tl else None)
    res, y = push_all_reduce(p, B, residual=res, norm_weight=W["n2"], eps=eps, pushed=True,
                             _dbg=dbg if tl else None)
    return res, gemv(y, W["qkv"], _dbg=(dbg, B.flags, 2) if tl else None)

def run(tl, L=48):
    res, outs = res0.clone(), []
    for l in range(L):
        res, q = layer(res, sets[l % NS], tl); outs.append(q)
    return res, outs

a = run(False, 8); b = run(True, 8)
print(f"rank {rank} timeline run == plain run: {torch.equal(a[0], b[0])}", flush=True)

def graph(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g

def time_graph(g, reps=10):
    ts = []
    for _ in range(reps):
        dist.barrier(); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / 48)
    return sorted(ts)[len(ts) // 2]

g0 = graph(lambda: run(False)); g1 = graph(lambda: run(True))
print(f"rank {rank}: µs a layer plain {time_graph(g0):.2f}, with stamps {time_graph(g1):.2f}", flush=True)
rows, bnd = [], []
for rep in range(6):
    reset(); dist.barrier(); torch.cuda.synchronize()
    g1.replay(); torch.cuda.synchronize()
    d = dbg.cpu()
    ok = (d[:, 3] > 0) & (d[:, 11] > 0) & (d[:, 7] > 0)
    rows.append(d[ok])
    nxt = torch.roll(d, -1, 0); okn = torch.roll(ok, -1, 0)
    bnd.append((nxt[:, 1] - d[:, 11])[ok & okn])
bnd = torch.cat(bnd).double()
d = torch.cat(rows).double()
names = {
    "pushing GEMV: program 0 start -> last program's PDL wait": d[:, 2] - d[:, 0],
    "pushing GEMV: last PDL wait -> last program end": d[:, 3] - d[:, 2],
    "push kernel start - pushing GEMV's last PDL wait": d[:, 4] - d[:, 2],
    "peer data in - pushing GEMV's last program end": d[:, 5] - d[:, 3],
    "push kernel: data in -> its PDL wait returns": d[:, 6] - d[:, 5],
    "push kernel: PDL wait -> row stored (add, norm, store)": d[:, 7] - d[:, 6],
    "next GEMV first program start - push kernel's data in": d[:, 8] - d[:, 5],
    "next GEMV first PDL wait return - push kernel's row stored": d[:, 9] - d[:, 7],
    "next GEMV: first -> last PDL wait return": d[:, 10] - d[:, 9],
    "pushing GEMV last end -> next GEMV first wait return": d[:, 9] - d[:, 3],
    "GEMV -> GEMV (no sum): last program end -> next first wait return": bnd,
}
out = [f"rank {rank}: {len(d)} sums; ns, median [p10, p90]"]
for k, v in names.items():
    q = torch.quantile(v, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    out.append(f"  {k:64} {q[1]:8.0f} [{q[0]:.0f}, {q[2]:.0f}]")
dist.barrier()
for r in range(world):
    if r == rank: print("\n".join(out), flush=True)
    dist.barrier()
dist.destroy_process_group()
