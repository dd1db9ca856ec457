"""AsyncEngine over a stand-in engine: outputs reach the right request, only the loop thread
touches the engine, cancel aborts, a full queue refuses at once, a failing step fails its
requests and the loop goes on, shutdown ends everything."""
import asyncio
import os
import threading

import pytest
from helpers import fake_engine
from helpers.fake_engine import FakeEngine

from kernelgate.serving.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestRejected
from kernelgate.serving.core_process import EngineProcess
from kernelgate.errors import KernelgateError
from kernelgate.engine.params import SamplingParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def tokens(stream):
    out, last = [], None
    async for o in stream:
        out += o.new_token_ids
        last = o
    return out, last


def test_outputs_per_request_and_engine_thread_only():
    fake = FakeEngine(slots=2)
    ae = AsyncEngine(fake).start()

    async def main():
        streams = [await ae.add_request(f"r{i}", [10 * i + 1], SamplingParams(max_new_tokens=3 + i)) for i in range(5)]
        res = await asyncio.gather(*(tokens(s) for s in streams))
        await ae.shutdown(1)
        return res
    res = run(main())
    for i, (toks, last) in enumerate(res):
        assert toks == [10 * i + 2 + k for k in range(3 + i)]
        assert last.finished and last.finish_reason == "length"
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids and len(fake.thread_ids) == 1


def test_cancel_aborts_and_frees():
    fake = FakeEngine(slots=1)
    ae = AsyncEngine(fake).start()

    async def main():
        s = await ae.add_request("long", [1], SamplingParams(max_new_tokens=10_000))
        await s.__anext__()
        task = asyncio.create_task(tokens(s))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):                  # the abort lands at the next step boundary
            if not fake.running and ae.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        # the slot serves the next request
        nxt = await ae.add_request("next", [5], SamplingParams(max_new_tokens=2))
        toks, _ = await tokens(nxt)
        await ae.shutdown(1)
        return toks
    assert run(main()) == [6, 7]
    assert not fake.running and not fake.waiting


def test_queue_full_then_admits_again():
    fake = FakeEngine(slots=1)
    fake.gate.clear()                        # hold every step
    ae = AsyncEngine(fake, max_queued=2).start()

    async def main():
        admitted = [asyncio.create_task(ae.add_request(f"r{i}", [1], SamplingParams(max_new_tokens=1)))
                    for i in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            await ae.add_request("r2", [1], SamplingParams(max_new_tokens=1))
        fake.gate.set()
        streams = [await t for t in admitted]
        outs = [await tokens(s) for s in streams]
        s = await ae.add_request("r3", [1], SamplingParams(max_new_tokens=1))
        outs.append(await tokens(s))
        await ae.shutdown(1)
        return outs
    assert [o[0] for o in run(main())] == [[2], [2], [2]]


def test_rejected_request_and_failing_step_keep_loop_alive():
    fake = FakeEngine(slots=4, poison=99)
    ae = AsyncEngine(fake).start()

    async def main():
        with pytest.raises(RequestRejected, match=r"token ids outside \[0, 512\)"):
            await ae.add_request("bad", [600], SamplingParams(max_new_tokens=1))
        ok = await ae.add_request("ok", [1], SamplingParams(max_new_tokens=10**9))
        await ok.__anext__()
        bad = await ae.add_request("poison", [99], SamplingParams(max_new_tokens=5))
        (_, last_bad), (_, last_ok) = await tokens(bad), await tokens(ok)
        after = await ae.add_request("after", [3], SamplingParams(max_new_tokens=2))
        res = await tokens(after)
        await ae.shutdown(1)
        return last_bad, last_ok, res
    last_bad, last_ok, (toks, last) = run(main())
    # the failing step ran both: both fail with the step's message; the next request is fine
    for o in (last_bad, last_ok):
        assert o.finished and o.finish_reason == "error" and "RuntimeError: poisoned batch" in o.error
    assert toks == [4, 5] and last.finish_reason == "length" and ae.dead is None


def test_shutdown_aborts_running_and_refuses_new():
    fake = FakeEngine(slots=2)
    ae = AsyncEngine(fake).start()

    async def main():
        s = await ae.add_request("r", [1], SamplingParams(max_new_tokens=10_000_000))
        await s.__anext__()
        await ae.shutdown(0.1)
        _, last = await tokens(s)
        with pytest.raises(EngineStopped):
            await ae.add_request("late", [1], SamplingParams(max_new_tokens=1))
        return last
    last = run(main())
    assert last.finished and last.finish_reason == "abort"
    assert not ae.core._thread.is_alive() and not fake.running


def test_a_client_that_falls_behind_reads_the_missed_steps_as_one_output():
    """The engine steps on while a client is busy: its next read is one output holding every
    token queued for it, in order, with the last step's finish; nothing lost or repeated."""
    fake = FakeEngine(slots=1)
    ae = AsyncEngine(fake).start()

    async def main():
        s = await ae.add_request("r", [1], SamplingParams(max_new_tokens=40))
        first = await s.__anext__()
        for _ in range(200):                   # let the engine finish while nobody reads
            if ae.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        rest = [o async for o in s]
        await ae.shutdown(1)
        return first, rest
    first, rest = run(main())
    toks = first.new_token_ids + [t for o in rest for t in o.new_token_ids]
    assert toks == [2 + k for k in range(40)]                 # 40 engine steps, every token once
    outs = [first] + rest
    assert len(outs) <= 2 and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 40


def test_engine_in_its_own_process_serves_fails_and_dies_cleanly():
    """The same front end over an engine process: outputs per request, a refusal with the
    engine's message, a failing step fails its requests only; then the process dies mid-step
    (exit code 7): every open request ends with an error naming the exit, the engine is dead,
    new requests are refused."""
    proc = EngineProcess(fake_engine.build, None, {"slots": 2, "poison": 99, "die": 77}).spawn()
    info = proc.ready()
    assert info["pid"] != os.getpid() and proc.proc.is_alive()
    ae = AsyncEngine(proc).start()

    async def main():
        streams = [await ae.add_request(f"r{i}", [10 * i + 1], SamplingParams(max_new_tokens=3 + i)) for i in range(3)]
        res = await asyncio.gather(*(tokens(s) for s in streams))
        with pytest.raises(RequestRejected, match=r"token ids outside \[0, 512\)"):
            await ae.add_request("bad", [600], SamplingParams(max_new_tokens=1))
        _, failed = await tokens(await ae.add_request("poison", [99], SamplingParams(max_new_tokens=5)))
        long = await ae.add_request("long", [1], SamplingParams(max_new_tokens=10**9))
        await long.__anext__()
        await ae.add_request("die", [77], SamplingParams(max_new_tokens=5))
        _, last = await tokens(long)
        with pytest.raises(EngineStopped, match=r"engine process exited \(rc 7\)"):
            await ae.add_request("late", [1], SamplingParams(max_new_tokens=1))
        return res, failed, last
    res, failed, last = run(main())
    for i, (toks, out) in enumerate(res):
        assert toks == [10 * i + 2 + k for k in range(3 + i)] and out.finish_reason == "length"
    assert failed.finish_reason == "error" and "RuntimeError: poisoned batch" in failed.error
    assert last.finished and last.finish_reason == "error" and last.error == "engine process exited (rc 7)"
    assert ae.dead == "engine process exited (rc 7)" and ae.num_unfinished == 0
    proc.join(5)
    assert proc.proc.exitcode == 7


def test_engine_process_that_fails_to_build_raises_its_message():
    with pytest.raises(KernelgateError, match=r"^no such checkpoint: /nowhere$"):
        EngineProcess(fake_engine.build, "no such checkpoint: /nowhere", {}).spawn().ready()
