"""A tensor-parallel rank past 0 as a process of its own: `python -m actors.worker.tp_rank SPEC_JSON`.

It loads its shard of the model (the ModelRunner arguments in SPEC_JSON) and runs every step rank 0
broadcasts until rank 0 stops the group. Any failure ends the process with a non-zero status: the
engine watches its ranks and fails as a whole, so no step ever waits on a rank that is not there.
"""
from __future__ import annotations

import sys

import msgspec

from actors.worker.tensor_parallel import RankSpec
from runtime import get_logger


class RankLaunch(msgspec.Struct, frozen=True):
    rank: RankSpec
    runner: dict   # ModelRunner's keyword arguments, as the engine built them


def main(argv: list[str]) -> int:
    from actors.worker.model_runner import ModelRunner

    launch = msgspec.json.decode(argv[1], type=RankLaunch)
    log = get_logger(component="tp-rank", rank=launch.rank.rank)
    runner = ModelRunner(**launch.runner, tensor_parallel=launch.rank)
    log.info("tensor-parallel rank ready", size=launch.rank.size, weight_bytes=runner.weight_bytes,
             all_reduce=runner.tp.all_reduce_via)
    try:
        runner.follow()
    finally:
        runner.close()
    log.info("tensor-parallel rank stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
