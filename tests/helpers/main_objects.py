"""Run as __main__ by tests/test_launch.py: a script's own lambda, closure and class in fn.

Everything below lives in ``__main__``, which a rank cannot import: cloudpickle must carry
it by value, as it does for notebook code.
"""

import json
import os
import sys

import nbtrain
from nbtrain.kernel.launcher_connection import get_client


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, value):
        return value * self.factor

    def __repr__(self):
        return f"Scaler({self.factor})"


def make_adder(n):
    def add(value):
        return value + n

    return add


square = lambda value: value * value


def fn(adder, scaler):
    r = nbtrain.rank()
    values = {"square": square(r + 2), "add": adder(r), "scaled": scaler(r + 1)}
    print(f"rank {r}: " + " ".join(f"{k}={v}" for k, v in values.items()))
    label = f"{type(scaler).__name__}:{type(scaler).__module__}"
    return {"rank": r, "world": nbtrain.world_size(), **values, "label": label, "back": Scaler(9)}


if __name__ == "__main__":
    # First, every pid this script is responsible for, so the test can clean up after it.
    print(json.dumps({"caller": os.getpid(), "launcher": get_client().process.pid}), flush=True)
    result = nbtrain.launch(fn, make_adder(100), Scaler(3), devices=2, timeout=120)
    assert type(result["back"]) is Scaler, type(result["back"])  # the caller's own class again
    keys = ("rank", "world", "square", "add", "scaled", "label", "back")
    print("RESULT " + " ".join(f"{k}={result[k]}" for k in keys))
    sys.stdout.flush()
