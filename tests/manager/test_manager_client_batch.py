"""ManagerClient.take_batch checks its stamp and rank before it drains: no event lost."""

from __future__ import annotations

import math

import pytest

from kvpool import InvalidArgumentError, open_manager

BAD = [
    ("ts", math.nan),
    ("ts", math.inf),
    ("ts", "now"),
    ("ts", True),
    ("rank", -1),
    ("rank", 1.5),
    ("rank", "0"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("field", "value"), BAD)
async def test_a_bad_stamp_or_rank_is_refused_and_every_event_stays(
    field: str, value: object
) -> None:
    async with open_manager(8, block_size=4) as kv:
        await kv.add_request("r", list(range(9)))
        assert await kv.allocate("r", 9, cache=True) is not None  # two full blocks stored
        name = "ts" if field == "ts" else "data_parallel_rank"
        kwargs: dict[str, object] = {"ts": 1.0, "data_parallel_rank": 0, name: value}
        with pytest.raises(InvalidArgumentError, match=name):
            await kv.take_batch(**kwargs)  # type: ignore[arg-type]
        batch = await kv.take_batch(ts=2.0, data_parallel_rank=3)
        assert batch is not None
        assert (batch.ts, batch.data_parallel_rank, len(batch.events)) == (2.0, 3, 1)
        await kv.free("r")
