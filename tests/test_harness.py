"""The test harness itself: a hung multi-process test fails, naming where it hangs."""

import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_utils import run_distributed


def _one_rank_never_joins(rank, world):
    if rank == 0:
        dist.barrier()  # waits for rank 1, which never comes
    else:
        time.sleep(3600)


def test_a_hung_rank_fails_its_test_with_the_stacks(capfd):
    start = time.monotonic()
    with pytest.raises(mp.ProcessExitedException):
        run_distributed(_one_rank_never_joins, 2, timeout=5.0)
    assert time.monotonic() - start < 60
    err = capfd.readouterr().err
    assert "Timeout (0:00:05)" in err and "_one_rank_never_joins" in err, err[-3000:]
