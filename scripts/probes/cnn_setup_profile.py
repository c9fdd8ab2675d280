#!/usr/bin/env python3
"""Where a cnn run's setup goes on the host: `run --preset speedrun --stage STAGE`'s stage set up
and trained under cProfile, in one process, twice (the second, warm, printed), the functions
with the largest cumulative time first.

    python3 scripts/probes/cnn_setup_profile.py [--stage graphs] [--top 40]

The setup is `Stage.setup` (the model's arena, kernels, library handles, uploads, warm-up, capture);
its wall is printed apart, then the profile of the same call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from graphtrain import data as data_mod
from graphtrain import stages
from graphtrain.config import preset
from graphtrain.training import plan_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", default="graphs")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    config = preset("speedrun")
    dataset = data_mod.load(config.dataset)
    stage_cls = stages.get_stage(args.stage, config.model)
    for attempt in ("cold", "warm"):
        plan = plan_for(config, dataset)
        stage = stage_cls(plan, dataset)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        stage.setup()
        profile.disable()
        print(f"{attempt}: setup {(time.perf_counter() - start) * 1e3:.1f} ms")
        stage.close()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
