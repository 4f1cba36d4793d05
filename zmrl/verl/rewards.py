"""zmrl's reward functions for verl (`reward.custom_reward_function.path=pkg://zmrl.verl.rewards`).

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` per sample. The
data file `zmrl train` writes for verl (zmrl.verl.launch) carries, in each row's extra_info, the
recipe's reward function ("module:function"), its keyword arguments and the dataset row, so the
score is exactly what `zmrl train` computes for the same completion: RewardFn(completion, row).
"""
from __future__ import annotations

import functools
import json

from zmrl.data.rewards import RewardFn


@functools.lru_cache(maxsize=8)
def _reward_fn(path: str, kwargs_json: str) -> RewardFn:
    return RewardFn(path, json.loads(kwargs_json))


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    if not extra_info or "zmrl_reward" not in extra_info:
        raise ValueError(f"sample of {data_source!r} has no zmrl_reward in extra_info: the data file was not "
                         f"written by zmrl.verl.launch")
    fn = _reward_fn(extra_info["zmrl_reward"], extra_info.get("zmrl_reward_kwargs") or "{}")
    return fn(solution_str, json.loads(extra_info["zmrl_row"]))
