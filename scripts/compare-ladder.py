#!/usr/bin/env python3
"""Compare two ladder or sweep JSON files row by row: epoch time ratio and accuracy difference.

    python3 scripts/compare-ladder.py results/ladder-jhu.json /tmp/again/ladder-jhu.json
"""

import json
import sys


def rows(path):
    with open(path) as f:
        records = json.load(f)["records"]
    return {(r.get("hidden_size"), r["stage"]): r for r in records if "epoch_ms" in r}


def main(before_path, after_path):
    before, after = rows(before_path), rows(after_path)
    print(f"{'row':28} {'before ms':>10} {'after ms':>10} {'after/before':>12} {'Δ test acc':>11}")
    for key in before:
        if key not in after:
            print(f"{key[1]:28} missing from {after_path}")
            continue
        a, b = before[key], after[key]
        label = key[1] if key[0] is None else f"H={key[0]} {key[1]}"
        print(f"{label:28} {a['epoch_ms']:10.2f} {b['epoch_ms']:10.2f} {b['epoch_ms'] / a['epoch_ms']:12.3f} "
              f"{100 * (b['test_accuracy'] - a['test_accuracy']):+10.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip())
    main(sys.argv[1], sys.argv[2])
