"""The state gate: one holder at a time, nobody between closing and open()."""

import asyncio

from rollout_bus.streams.state_gate import StateGate


def test_closing_waits_for_the_holder_and_keeps_later_holders_out_until_open():
    async def go():
        gate, order = StateGate(), []
        release = asyncio.Event()

        async def holder(name, wait=None):
            async with gate.hold():
                order.append(f"{name} in")
                if wait is not None:
                    await wait.wait()
                order.append(f"{name} out")

        async def close():
            async with gate.closing():
                order.append("closed")

        first = asyncio.create_task(holder("a", release))
        await asyncio.sleep(0)
        closer = asyncio.create_task(close())
        await asyncio.sleep(0)
        late = asyncio.create_task(holder("b"))
        for _ in range(3):
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, closer)
        for _ in range(3):
            await asyncio.sleep(0)
        held_while_closed = late.done()
        async with gate.closing():  # closing a closed gate is harmless
            pass
        gate.open()
        await late
        return order, held_while_closed, gate.is_open

    order, held_while_closed, is_open = asyncio.run(asyncio.wait_for(go(), 10))
    assert order == ["a in", "a out", "closed", "b in", "b out"]
    assert not held_while_closed and is_open
