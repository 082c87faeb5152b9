"""The GPU's side of the host handshake (`kernels.host_flags`): `signal` stores the device's
sequence number into a flag, `wait` returns once a flag holds it (counting whether it had to
wait) or gives up after its limit and says so. On CUDA the flags are mapped host memory and the
host sets them while the kernel spins; under TRITON_INTERPRET=1 they are CPU tensors."""

import time

import pytest
import torch

from tests.triton_env import CUDA, DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


def _flags(n):
    if not CUDA:
        flags = torch.zeros(n, dtype=torch.int32)
        return flags, flags
    from localllm.offload.mapped import host_view, map_empty

    flags = map_empty({"f": ((n,), torch.int32)}, DEVICE)["f"]
    host_view(flags).zero_()
    return flags, host_view(flags)


def _counters(n):
    return torch.zeros(n, dtype=torch.int32, device=DEVICE), torch.zeros(1, dtype=torch.int32)


def test_signal_stores_the_number_and_wait_passes_a_flag_that_holds_it():
    from localllm.kernels import host_flags

    flags, host = _flags(3)
    seq = torch.tensor([41], dtype=torch.int32, device=DEVICE)
    waits, _ = _counters(3)
    errors, err_host = _flags(1)
    host_flags.signal(flags, 1, seq)
    host_flags.wait(flags, 1, seq, waits, errors, limit=4)
    if CUDA:
        torch.cuda.synchronize()
    assert host.tolist() == [0, 41, 0]
    assert waits.tolist() == [0, 0, 0] and err_host.tolist() == [0]


def test_wait_gives_up_after_its_limit_and_says_so():
    from localllm.kernels import host_flags

    flags, _ = _flags(2)
    seq = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    waits, _ = _counters(2)
    errors, err_host = _flags(1)
    host_flags.wait(flags, 0, seq, waits, errors, limit=16)
    if CUDA:
        torch.cuda.synchronize()
    assert waits.tolist() == [1, 0] and err_host.tolist() == [1]


@pytest.mark.skipif(not CUDA, reason="the host sets the flag while the kernel spins: CUDA")
def test_wait_holds_the_stream_until_the_host_sets_the_flag():
    from localllm.kernels import host_flags

    flags, host = _flags(2)
    seq = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    waits, _ = _counters(2)
    errors, err_host = _flags(1)
    after = torch.zeros(1, device=DEVICE)
    host_flags.wait(flags, 1, seq, waits, errors)
    after.fill_(1.0)  # stream order: runs once the wait is over
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query()  # still spinning: the flag does not hold 9
    host[1] = 9
    done.synchronize()
    assert after.item() == 1.0 and waits.tolist() == [0, 1] and err_host.tolist() == [0]
