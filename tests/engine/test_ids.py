"""Request ids and default seeds."""

from __future__ import annotations

import os
import re

from nanoserve.engine.ids import new_id, new_seed


def test_ids_look_like_uuid_hex_and_do_not_repeat() -> None:
    ids = [new_id() for _ in range(20000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_seeds_are_non_negative_int64_and_vary() -> None:
    seeds = [new_seed() for _ in range(1000)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == len(seeds)


def test_a_forked_child_draws_its_own_ids() -> None:
    # Without the re-seed after fork, the child's first draw is the parent's next one: two
    # worker processes would hand out the same request ids.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one id and leave at once
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert status == 0 and len(child) == 32
    assert new_id() != child
