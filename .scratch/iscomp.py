import time, torch, torch.distributed as dist
from trainwright.testing import run_workers
def w(rank, world):
    t = torch.ones(1000)
    if rank == 0:
        work = dist.isend(t, 1)
        time.sleep(1.0)
        print("send completed?", work.is_completed(), flush=True)
        work.wait()
        print("after wait", work.is_completed(), flush=True)
    else:
        r = dist.irecv(t, 0); r.wait()
        print("recv done", flush=True)
        time.sleep(1.5)
if __name__ == "__main__":
    run_workers(w, 2)
