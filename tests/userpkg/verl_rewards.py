"""Reward functions written as verl users write them (used by tests/test_reward_fns.py)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's per-response signature, returning a dict: ``score`` plus extra metrics."""
    exact = solution_str.strip() == str(ground_truth).strip()
    return {"score": 1.0 if exact else 0.0, "acc": float(exact), "length": len(solution_str)}


def compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos):
    """verl's batch reward manager signature: one result per response."""
    return [float(s.strip() == str(g).strip()) for s, g in zip(solution_strs, ground_truths)]
