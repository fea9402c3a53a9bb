"""The reward, in your own file: verl's ``compute_score`` signature, called once per response.

The graph names it as ``fn: my_reward:compute_score`` (a module beside the graph file is importable).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the answer's words right from the start, less 0.1 for each word past its length.

    ``solution_str`` is the decoded response, ``ground_truth`` the row's ``reward_model.ground_truth``;
    a float is the score (a dict with a ``score`` key would log its other keys as metrics too).
    """
    said, want = solution_str.split(), ground_truth.split()
    right = 0
    for a, b in zip(said, want):
        if a != b:  # credit stops at the first wrong word: "6 6" for "8 6" must not earn half
            break
        right += 1
    extra = max(0, len(said) - len(want))
    return right / len(want) - 0.1 * extra
