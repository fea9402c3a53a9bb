"""Reward functions written as verl users write them (used by tests/test_reward_fns.py)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's per-response signature, returning a dict: ``score`` plus extra metrics."""
    exact = solution_str.strip() == str(ground_truth).strip()
    return {"score": 1.0 if exact else 0.0, "acc": float(exact), "length": len(solution_str)}


def compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos):
    """verl's batch reward manager signature: one result per response."""
    return [float(s.strip() == str(g).strip()) for s, g in zip(solution_strs, ground_truths)]


def compute_score_slowly(data_sources, solution_strs, ground_truths, extra_infos):
    """The batch signature, taking 0.8 s a batch: a step long enough to signal a run in the middle of it."""
    import time

    time.sleep(0.8)
    return compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos)
