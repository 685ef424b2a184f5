"""A lost peer or a timed-out collective as one line: the backends' real wordings, and the roll call that names the
ranks that are gone (the child-process cases, a stalled rank, are in test_stopping.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.training.failures import RollCall, backend_words, failure_kind, failure_line, rank_ranges

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:15263. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "3000ms for recv operation to complete")


@pytest.mark.parametrize("text, kind", [
    (GLOO_CLOSED, "peer lost"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:50110: Connection reset by peer",
     "peer lost"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Write error [10.0.0.2]:50110: Broken pipe", "peer lost"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version "
     "2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
     "prematurely.\nLast error:\nsocketProgress: Connection closed by remote peer node1<43982>", "peer lost"),
    (GLOO_TIMEOUT, "timed out"),
    ("[PG ID 2 PG GUID 3(tensor) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, "
     "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600011 milliseconds before timing out.",
     "timed out"),
    ("CUDA error: an illegal memory access was encountered", None),
])
def test_failure_kind_reads_gloo_and_nccl_wordings(text, kind):
    assert failure_kind(RuntimeError(text)) == kind


def test_backend_words_drop_the_source_location_and_the_advice():
    assert backend_words(RuntimeError(GLOO_CLOSED)) == "Connection closed by peer [127.0.0.1]:15263"
    assert rank_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_roll_call_names_the_rank_that_does_not_answer(monkeypatch):
    monkeypatch.setattr("megalite.training.failures.ROLL_CALL_POLL_S", 0.01)
    store = dist.HashStore()
    survivors = [RollCall(dist.PrefixStore("call", store), rank, 3) for rank in (0, 1)]   # rank 2 is gone
    line = failure_line(RuntimeError(GLOO_CLOSED), 0, 10, survivors[0])
    assert line == ("megalite: error: rank 0: lost a peer: another rank died or its node went down; rank(s) 2 did not "
                    "answer a roll call through torchrun's store: see their logs (Connection closed by peer "
                    "[127.0.0.1]:15263)")
    # A later failure in the cascade names the same rank, not the survivor that already answered.
    assert survivors[1].missing(wait_s=0.2) == [2]
    assert failure_line(RuntimeError("CUDA error"), 0, 10, survivors[0]) is None


def test_a_stopped_roll_call_leaves_no_thread_behind():
    # A daemon thread still inside a store request when Python finalizes aborts the process (SIGABRT after a run
    # that succeeded): pretrain_gpt stops its roll call before returning.
    roll_call = RollCall(dist.PrefixStore("call", dist.HashStore()), 0, 2)   # never called
    assert roll_call._thread.is_alive()
    roll_call.stop()
    assert not roll_call._thread.is_alive()


def test_nccl_gets_the_flight_recorder_unless_the_user_set_it():
    from megalite.training.failures import nccl_flight_recorder_defaults
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert nccl_flight_recorder_defaults(environ) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
